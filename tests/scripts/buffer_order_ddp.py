"""Buffer order across ranks under 2-process DDP (gloo), tiny Gemma 3 text model, 3 AdamW steps.

Rank 0 holds the rotary tables of `model.rotary_emb` sorted by name, rank 1 in reversed order - what
transformers 5.0-5.15 do in about half of the launches (`list(set(config.layer_types))` in hash-seed
order) - without relying on hash seeds (both orders are set explicitly, so the run is the same on 5.0 and
5.23). Each rank also trains a single-process reference on both ranks' batches (DDP's mean gradient:
each loss / 2, accumulated; AdamW weight_decay=0.1, clip_grad_norm 1.0, variable lengths with padding).

  STOCK:    DDP as built; prints "wrong" when this rank's losses or final weights differ from the reference.
  GUARDED:  `align_buffer_order` before wrapping; prints "exact" when every loss and weight is bit-equal.
  RAISED:   rank 1 renames a buffer; both ranks must raise `BufferLayoutError` (no hang).
"""

import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import init_gloo, teardown  # noqa: E402

from hf_ddpfix._compat import module_buffer_slots  # noqa: E402
from hf_ddpfix.ops.buffer_order import BufferLayoutError, align_buffer_order  # noqa: E402

rank, world = init_gloo()
STEPS, LENGTHS = 3, ((7, 12), (10, 5), (12, 9), (6, 11), (9, 12), (12, 4))


def say(msg: str) -> None:
    """One line on stdout in one write (the ranks share the pipe: no interleaving)."""
    os.write(1, (msg + "\n").encode())


def log(msg: str) -> None:
    say(f"[rank {rank}] {msg}")


def build(reverse: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"], pad_token_id=0)
    model = Gemma3ForCausalLM(cfg)
    # a fixed order first (5.0-5.15 would give this rank's hash-seed order), then the other rank's reversed:
    # its global-attention tables receive rank 0's sliding-window ones (and the other way round)
    slots = module_buffer_slots(model.model.rotary_emb)
    items = sorted(slots.items(), reverse=reverse)
    slots.clear()
    slots.update(items)
    return model


def batch(step: int, r: int) -> dict[str, torch.Tensor]:
    lengths = LENGTHS[step * world + r]
    gen = torch.Generator().manual_seed(100 * step + r)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, 64, (n,), generator=gen)
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference() -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Single process: every step, both ranks' losses and DDP's mean gradient."""
    model = build(reverse=False)
    opt, losses = optimizer(model), []
    for step in range(STEPS):
        opt.zero_grad()
        step_losses = []
        for r in range(world):
            loss = model(**batch(step, r)).loss
            (loss / world).backward()
            step_losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(step_losses)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(model) -> tuple[list[float], dict[str, torch.Tensor]]:
    ddp = DDP(model)  # broadcast_buffers=True (the default, as accelerate builds it)
    opt, losses = optimizer(ddp), []
    for step in range(STEPS):
        opt.zero_grad()
        loss = ddp(**batch(step, rank)).loss
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def same(losses, weights, ref) -> bool:
    ref_losses, ref_weights = ref
    return losses == [s[rank] for s in ref_losses] and all(torch.equal(weights[n], ref_weights[n]) for n in weights)


ref = reference()

losses, weights = train(build(reverse=rank == 1))
log(f"stock losses {losses} reference {[s[rank] for s in ref[0]]}")
say(f"STOCK rank={rank} {'exact' if same(losses, weights, ref) else 'wrong'}")

model = build(reverse=rank == 1)
fix = align_buffer_order(model)
say(f"REORDERED rank={rank} {' '.join(fix.modules)}")
log(fix.describe())
losses, weights = train(model)
say(f"GUARDED rank={rank} {'exact' if same(losses, weights, ref) else 'wrong'}")

model = build(reverse=False)
if rank == 1:
    slots = module_buffer_slots(model.model.rotary_emb)
    slots["renamed"] = slots.pop(next(iter(slots)))
try:
    align_buffer_order(model)
    say(f"NOT_RAISED rank={rank}")
except BufferLayoutError as err:
    log(str(err))
    say(f"RAISED rank={rank} BufferLayoutError")
teardown()
