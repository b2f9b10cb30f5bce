"""Two gloo processes: DDP or FSDP2 + apply_long_context("all") equals a single-process stock reference.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/long_context_ddp.py --out /tmp/long_context_ddp.json

For DDP (find_unused_parameters=False, static_graph=True) and FSDP2 (``fully_shard`` per decoder layer
and the root, tile count all-reduced), all with non-reentrant checkpointing, every rank trains a tiny
fp64 Llama (and, under FSDP2, a Gemma 3 text model) with LoRA on every linear layer for 3 AdamW steps (weight_decay 0.1, gradients clipped to
norm 0.5) on its own rows of a global batch whose sequence
length differs per rank and per step, with the decoder layers patched (rms_norm, grouped attention,
tiled layer with 5-token tiles, so every call runs several tiles). The loss uses ``num_items_in_batch`` =
global label-token count x world size, so DDP's average equals the gradient of the global loss. Each
rank also trains the unpatched, uncheckpointed model in one process on all ranks' rows (the
reference). Checks: trainable weights equal across ranks (bitwise) and equal the reference (1e-9),
the patched forward ran (``patched calls`` > 0), and weights moved. Rank 0 writes one JSON record per setting.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import (  # noqa: E402
    Verdicts,
    flat_trainable,
    init_gloo,
    lora_llama,
    masked_labels,
    max_diff_across_ranks,
    shard_decoder,
)

from hf_ddpfix.integrations.long_context.long_context import apply_long_context  # noqa: E402

STEPS, ROWS, LR, CLIP = 3, 2, 0.05, 0.5
# find_unused_parameters=False (every hook must fire exactly once) and static graph (the hook order of
# step 1 is replayed); fu=True is stock's own setting for PEFT models and is covered by the single-process tests.
SETTINGS = [
    ("fu_false_ckpt", {"find_unused_parameters": False}, "llama"),
    ("static_graph_ckpt", {"static_graph": True}, "llama"),
    ("fsdp2_ckpt", None, "llama"),  # fully_shard per decoder layer + root; tile count synchronised across ranks
    # another family under FSDP2: Gemma 3's sandwich layer, (1 + w) RMSNorm and q/k norms, read by structure
    ("fsdp2_ckpt_gemma3", None, "gemma3_text"),
]


def build(ckpt: bool, family: str = "llama"):
    if family == "llama":
        return lora_llama(targets="all-linear", dtype=torch.float64, checkpointing="non_reentrant" if ckpt else None,
                          vocab_size=101, num_attention_heads=8, attn_implementation="sdpa")
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                           attn_implementation="sdpa", pad_token_id=0)
    model = get_peft_model(Gemma3ForCausalLM(cfg).to(torch.float64),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    for m in model.modules():  # Gemma initialises its norms' w to 0 (a scale of 1): random so their grads matter
        if type(m).__name__ == "Gemma3RMSNorm":
            torch.nn.init.normal_(m.weight, std=0.2)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def batches(world: int):
    """Per step: one (ids, labels) per rank, lengths differing per rank and step; the global count."""
    gen = torch.Generator().manual_seed(1234)
    for step in range(STEPS):
        parts = []
        for r in range(world):
            seq = 9 + 4 * step + 3 * r
            ids = torch.randint(0, 101, (ROWS, seq), generator=gen)
            parts.append((ids, masked_labels(ids, gen)))
        count = sum(int((lab[:, 1:] != -100).sum()) for _, lab in parts)
        yield parts, torch.tensor(count)


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def reference(world: int, family: str = "llama") -> torch.Tensor:
    model = build(False, family)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params)
    for parts, count in batches(world):
        for ids, labels in parts:
            model(input_ids=ids, labels=labels, num_items_in_batch=count).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return flat_trainable(model)


def run(ddp_kwargs: dict | None, rank: int, world: int, family: str = "llama") -> tuple[torch.Tensor, dict]:
    model = build(True, family)
    fsdp = ddp_kwargs is None
    handle = apply_long_context(model, "all", tokens_per_tile=5, norm_chunk_tokens=7, sync=fsdp)
    if fsdp:
        ddp = shard_decoder(model)
    else:
        ddp = DDP(model, **ddp_kwargs)
    params = [p for p in ddp.parameters() if p.requires_grad]
    opt = optimizer(params)
    for parts, count in batches(world):
        ids, labels = parts[rank]
        out = ddp(input_ids=ids, labels=labels, num_items_in_batch=count)
        (out.loss * world).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return flat_trainable(model), {"patched": len(handle.patched), **{k: int(v) for k, v in handle.stats.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rank, world = init_gloo()
    verdicts = Verdicts("LONG_CONTEXT_DDP", args.out)
    for name, kwargs, family in SETTINGS:
        ref = reference(world, family)
        start = flat_trainable(build(False, family))
        w, info = run(kwargs, rank, world, family)
        rec = {
            "setting": name, "ddp_kwargs": kwargs, "family": family,
            "max_diff_vs_reference": float((w - ref).abs().max()),
            "max_diff_across_ranks": max_diff_across_ranks(w),
            "weights_moved": float((w - start).abs().max()),
            **info,
        }
        rec["ok"] = bool(rec["max_diff_vs_reference"] < 1e-9 and rec["max_diff_across_ranks"] == 0.0
                         and rec.get("patched calls", 0) == 2 * 2 * STEPS and rec["weights_moved"] > 1e-3
                         and not any(k.startswith("stock:") for k in info))
        verdicts.add(rec)
    verdicts.finish()


if __name__ == "__main__":
    main()
