"""Two gloo processes: FSDP2 (``fully_shard``) + tiled MLP + tiled loss equals a single-process reference.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/tiled_fsdp.py --out /tmp/tiled_fsdp.json

Every rank builds the same tiny LoRA Llama (float64), tiles its MLPs ("auto" forced on with 10 tokens
per shard, ``sync=True`` as under FSDP) and its loss head, applies ``fully_shard`` to each decoder layer and to
the root, and trains 3 SGD steps on its part of a global batch. Ranks get different sequence lengths (48 vs 38
tokens: 5 vs 4 shards). Without and with non-reentrant checkpointing; and with each MLP a unit of its own
(``mlp_units``: every chunk all-gathers, so the shard count is all-reduced). The reference trains the untiled
model on the same global batch in one process. Checks: full (unsharded) trainable weights equal to the reference
(1e-6) on every rank; an MLP inside its layer's unit runs this rank's own shard count (5 and 4: no collective),
an MLP that is a unit the all-reduced one (5 on both).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import (  # noqa: E402
    Verdicts,
    flat_trainable,
    init_gloo,
    lora_llama,
    masked_labels,
    shard_decoder,
    tiled_stats,
)

from hf_ddpfix.integrations.long_context.loss_patch import patch_model_loss  # noqa: E402
from hf_ddpfix.integrations.long_context.tiled_mlp import apply_tiled_mlp  # noqa: E402

STEPS, ROWS_PER_RANK, LR = 3, 2, 0.5


def seq_len(rank: int) -> int:
    return 24 - 5 * rank


def build(ckpt: bool):
    return lora_llama(dtype=torch.float64, checkpointing="non_reentrant" if ckpt else None)


def batches(world: int):
    """Per step: one (ids, labels) part per rank, and the global label-token count."""
    gen = torch.Generator().manual_seed(4321)
    for _ in range(STEPS):
        parts = []
        for r in range(world):
            ids = torch.randint(0, 256, (ROWS_PER_RANK, seq_len(r)), generator=gen)
            parts.append((ids, masked_labels(ids, gen)))
        yield parts, sum(int((lab[:, 1:] != -100).sum()) for _, lab in parts)


def reference(world: int) -> torch.Tensor:
    model = build(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for parts, count in batches(world):
        for ids, labels in parts:
            model(input_ids=ids, labels=labels, num_items_in_batch=count).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return flat_trainable(model)


def run(ckpt: bool, rank: int, world: int, mlp_units: bool = False) -> tuple[torch.Tensor, dict]:
    model = build(ckpt)
    handle = apply_tiled_mlp(model, shards="auto", min_tokens=0, tokens_per_shard=10, sync=True)
    loss_handle = patch_model_loss(model, chunk_tokens=7)
    stats = tiled_stats(model)
    if mlp_units:
        from torch.distributed.fsdp import fully_shard

        for layer in model.get_base_model().model.layers:
            fully_shard(layer.mlp)
    shard_decoder(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for parts, count in batches(world):
        ids, labels = parts[rank]
        out = model(input_ids=ids, labels=labels, num_items_in_batch=count)
        assert out.logits is None, "tiled loss head not used"
        (out.loss * world).backward()  # FSDP averages gradients over ranks
        opt.step()
        opt.zero_grad(set_to_none=True)
    return flat_trainable(model), {"tiled_modules": len(handle.patched), "loss_calls": loss_handle.calls, **stats}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rank, world = init_gloo()
    ref = reference(world)
    verdicts = Verdicts("TILED_FSDP", args.out)
    for ckpt, mlp_units in ((False, False), (True, False), (True, True)):
        w, info = run(ckpt, rank, world, mlp_units)
        diff = torch.tensor([float((w - ref).abs().max())], dtype=torch.float64)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        chunks = [None] * world
        dist.all_gather_object(chunks, info.get("forward_chunks", 0))
        rec = {"setting": "fsdp2" + ("_ckpt" if ckpt else "") + ("_mlp_units" if mlp_units else ""),
               "max_diff_vs_reference_all_ranks": float(diff),
               "forward_chunks_per_rank": chunks, **info}
        rec["ok"] = bool(rec["max_diff_vs_reference_all_ranks"] < 1e-6 and rec["tiled_modules"] == 2
                         and chunks == [STEPS * 2 * 5, STEPS * 2 * (5 if mlp_units else 4)]
                         and rec["loss_calls"] == STEPS and rec.get("backward_tokens", 0) > 0)
        verdicts.add(rec)
    verdicts.finish()


if __name__ == "__main__":
    main()
