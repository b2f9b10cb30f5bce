"""Two gloo processes: DDP + non-reentrant checkpointing + ActivationOffload gives stock weights.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/offload_ddp.py --out /tmp/offload_ddp.json

Each rank trains a tiny LoRA Llama for 4 steps on its own data (a different sequence length every step
and on every rank; AdamW with weight decay, gradients clipped) three times: stock checkpointing, offload
with simulated copies (every checkpoint input but the last goes through a host buffer and back), and
offload in CPU accounting mode. Checks: simulated copies give weights bit-identical to stock and across
ranks; the accounting mode hands back the saved tensors themselves (so its training equals stock by
construction) and counts exactly ``(layers - 1) x batch x seq x hidden x 4`` bytes per step, as does
the copying mode, which also restores each of them. Rank 0 writes the verdict as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import init_gloo, lora_llama, teardown  # noqa: E402

from hf_ddpfix.integrations.checkpointing import apply_checkpointing  # noqa: E402
from hf_ddpfix.ops.offload import ActivationOffload  # noqa: E402

STEPS, BATCH, HIDDEN, LAYERS = 4, 2, 64, 2


def seq_len(step: int, rank: int) -> int:
    return 32 - 3 * step + 5 * rank


def train(offload: ActivationOffload | None) -> tuple[torch.Tensor, list[str]]:
    model = lora_llama(targets=("q_proj", "v_proj"), random_lora=False, checkpointing="non_reentrant",
                       num_hidden_layers=LAYERS, hidden_size=HIDDEN)
    apply_checkpointing(model, use_reentrant=False, offload=offload)
    ddp = DDP(model)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
    errors = []
    for step in range(STEPS):
        ids = torch.randint(0, 256, (BATCH, seq_len(step, rank)), generator=gen)
        if offload is not None:
            with offload.step():
                ddp(input_ids=ids, labels=ids).loss.backward()
            s = offload.stats
            layer_input = BATCH * seq_len(step, rank) * HIDDEN * 4
            copied = s.offloaded_bytes if offload.simulate else 0
            expected = {
                "would_offload_bytes": (LAYERS - 1) * layer_input,
                "offloaded_bytes": (LAYERS - 1) * layer_input if offload.simulate else 0,
                "restored_tensors": (LAYERS - 1) if offload.simulate else 0,
                "kept_bytes": layer_input,
                "in_flight": 0,
            }
            got = {k: getattr(s, k) for k in expected}
            if got != expected or (offload.simulate and copied != s.would_offload_bytes):
                errors.append(f"step {step}: {got} != {expected}")
        else:
            ddp(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, errors


def accounting_hands_back_the_tensor() -> bool:
    """Accounting mode (CPU, no ``simulate``): the unpack hook returns the very tensor that was packed."""
    off = ActivationOffload(min_bytes=0)
    with off.step(), off.pack_scope():
        x = torch.randn(8, 8)
        handle = off._pack(x)
        return handle is not x and off._unpack(handle) is x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_gloo()
    try:
        stock, _ = train(None)
        simulate, sim_errors = train(ActivationOffload(min_bytes=0, simulate=True))
        accounting, acc_errors = train(ActivationOffload(min_bytes=0))
        same = {
            "simulate_weights_equal_stock": torch.equal(stock, simulate),
            "accounting_weights_equal_stock": torch.equal(stock, accounting),  # by construction; see below
            "accounting_hands_back_the_tensor": accounting_hands_back_the_tensor(),
            "simulate_counts_exact": not sim_errors,
            "accounting_counts_exact": not acc_errors,
        }
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, sim_errors + acc_errors)
        gathered = [torch.empty_like(stock) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, stock)
        ranks_equal = all(torch.equal(gathered[0], g) for g in gathered)
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, same)
        if dist.get_rank() == 0:
            result = {
                "checks": {k: all(v[k] for v in verdicts) for k in same},
                "errors": [e for per_rank in errors for e in per_rank],
                "ranks_equal": ranks_equal,
                "world_size": dist.get_world_size(),
            }
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
            print(json.dumps(result))
    finally:
        teardown()


if __name__ == "__main__":
    main()
