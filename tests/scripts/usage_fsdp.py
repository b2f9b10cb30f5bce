"""2-process FSDP2 (fully_shard, gloo, CPU): mixed image/text ranks for every VLM of the zoo, no dummy
image, no family adapter: ``fsdp_wrap_plan(fold_skippable=True)`` keeps possibly-skipped subtrees out
of their own units and ``ParameterUsage(units=...)`` ties each unit's unused parameters in.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/usage_fsdp.py [--families gemma3,llava]

Steps: rank 0 only has an image, rank 1 only, no rank, both. Each family finishes (no hang: the
launcher's timeout would kill it) with trainable weights equal to the DDP + ParameterUsage run (itself
bit-equal to stock DDP fu=True: usage_zoo.py) within 1e-5. Prints ``USAGE_FSDP_OK``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from fixtures import init_gloo, teardown, trainable_weights  # noqa: E402
from usage_zoo import LR  # noqa: E402
from zoo import ZOO, seq_len  # noqa: E402

from hf_ddpfix.integrations.usage import ParameterUsage  # noqa: E402
from hf_ddpfix.integrations.vision.fsdp_wrap import fsdp_wrap_plan  # noqa: E402

PATTERN = [(True, False), (False, True), (False, False), (True, True)]  # step -> (rank 0, rank 1) has image


def train(name: str, fsdp: bool) -> tuple[dict[str, torch.Tensor], list[str], int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    entry = ZOO[name]
    model = entry.model(0)
    units: list[str] = []
    if fsdp:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        plan = fsdp_wrap_plan(model, fold_skippable=True)
        for _, mod in plan:
            fully_shard(mod, mesh=mesh)
        units = [n for n, _ in plan]
        usage = ParameterUsage(model, units=[m for _, m in plan]).attach()
        wrapped: nn.Module = model
    else:
        usage = ParameterUsage(model).attach()
        # No buffer sync: the ranks built the same model from one seed, and DDP broadcasts buffers by
        # position in `named_buffers()` order, which transformers 5.0-5.15 make per process (Gemma 3 registers
        # its RoPE tables in `list(set(layer_types))` order; 5.18 sorts it) while every torchrun worker has
        # its own hash seed: rank 1 then ran with rank 0's sliding and global RoPE tables swapped (about
        # half the launches). FSDP2 syncs no buffers.
        wrapped = nn.parallel.DistributedDataParallel(model, find_unused_parameters=False, static_graph=True,
                                                      init_sync=False, forward_sync_buffers=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    for step, images in enumerate(PATTERN):
        batch = entry.batch(images[rank], 1000 * step + rank, seq_len(step, 0, rank))
        wrapped(**batch).loss.backward()
        usage.finalize()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = trainable_weights(model)
    usage.remove()
    return weights, units, usage.ties


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(n for n, e in ZOO.items() if e.vlm))
    a = ap.parse_args()
    rank, _ = init_gloo()
    t0 = time.time()
    for name in a.families.split(","):
        fsdp_w, units, ties = train(name, fsdp=True)
        ddp_w, _, _ = train(name, fsdp=False)
        assert ddp_w.keys() == fsdp_w.keys()
        diff = max((ddp_w[n] - fsdp_w[n]).abs().max().item() for n in ddp_w)
        bad = [n for n in ddp_w if not torch.allclose(ddp_w[n], fsdp_w[n], atol=1e-5, rtol=0)]
        assert not bad, f"{name}: FSDP2 vs DDP differ (max {diff:.1e}): {bad[:3]}"
        print(f"[rank {rank} {time.time() - t0:5.1f}s] {name}: FSDP2 {len(units)} units, {ties} ties, "
              f"max |FSDP2 - DDP| = {diff:.1e}", flush=True)
        gc.collect()
    print(f"[rank {rank} {time.time() - t0:5.1f}s] USAGE_FSDP_OK", flush=True)
    teardown()


if __name__ == "__main__":
    main()
