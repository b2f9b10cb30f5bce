"""2-process FSDP2 (fully_shard, gloo, CPU) against stock DDP on the same data, for every VLM of the zoo.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/usage_fsdp.py [--families gemma3,llava] [--report out.json]

Per family, in one process group, from the same initial weights and on the same batches:
- FSDP2: no dummy image, no family adapter: ``fsdp_wrap_plan(fold_skippable=True)`` keeps possibly-skipped
  subtrees out of their own units and ``ParameterUsage(units=...)`` ties each unit's unused parameters in;
  non-reentrant checkpointing.
- stock: ``DistributedDataParallel(find_unused_parameters=True)`` with non-reentrant checkpointing (what
  stock trains these models with; reentrant + find_unused fails, see tests/test_matrix.py).
Steps: rank 0 only has an image, rank 1 only, no rank, both; sequence lengths vary; AdamW(weight_decay=0.1)
and clip_grad_norm_(1.0), so a zero gradient and a missing one end in different weights.

FSDP2 reduce-scatters where DDP all-reduces: the sums are the same up to float rounding, so the weights
agree to a tolerance (``TOL``) set a small multiple above the spread measured on this zoo (see ``TOL``). Each
family's verdict (``max_dw <= TOL``) goes to ``--report`` (rank 0), which tests/test_usage.py compares with the
committed tests/results/fsdp2_parity.json, from which scripts/supported_models.py renders docs/models.md
column. The script itself fails only on a crash or a hang (the launcher's timeout). Prints ``USAGE_FSDP_OK``.
"""

from __future__ import annotations

import argparse
import gc
import json
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
from usage_zoo import LR, enable_checkpointing  # noqa: E402
from zoo import ZOO, seq_len  # noqa: E402

from hf_ddpfix.integrations.fsdp.units import fsdp_wrap_plan  # noqa: E402
from hf_ddpfix.integrations.usage import ParameterUsage  # noqa: E402

PATTERN = [(True, False), (False, True), (False, False), (True, True)]  # step -> (rank 0, rank 1) has image

# Measured max |W_fsdp2 - W_stock| over the zoo's VLMs (CPU, 2 cores, torch 2.13, transformers 5.23,
# 2026-11-25): see tests/results/fsdp2_parity.json. TOL is a small multiple of the largest, far below what a
# missing gradient, a skipped step or a wrong reduction leaves (one AdamW step moves a weight ~LR = 1e-3).
TOL = 2e-7

SETUP = ("FSDP2 (fully_shard, folded skippable subtrees, ParameterUsage ties, non-reentrant ckpt) vs stock DDP "
         "(find_unused_parameters=True, non-reentrant ckpt), same data: 4 steps, image on rank 0 / rank 1 / "
         "none / both, AdamW wd 0.1, clip 1.0")


def train(name: str, fsdp: bool) -> tuple[dict[str, torch.Tensor], list[str], int]:
    """Train the family ``name`` on PATTERN: FSDP2 + ParameterUsage, or stock DDP(fu=True); returns
    (trainable weights gathered on every rank, FSDP2 unit names, ties made)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    entry = ZOO[name]
    model = entry.model(0)
    enable_checkpointing(model, reentrant=False)
    units: list[str] = []
    usage: ParameterUsage | None = None
    if fsdp:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        plan = fsdp_wrap_plan(model, fold_skippable=True)
        for _, mod in plan:
            fully_shard(mod, mesh=mesh)
        units = [n for n, _ in plan]
        usage = ParameterUsage(model, units=[m for _, m in plan]).attach()
        wrapped: nn.Module = model
    else:
        # Stock DDP as the Trainer builds it for a PeftModel, except the buffer sync: the ranks built the same
        # model from one seed, and DDP broadcasts buffers by position in `named_buffers()` order, which
        # transformers 5.0-5.15 make per process (Gemma 3 registers its RoPE tables in `list(set(layer_types))`
        # order; 5.18 sorts it) while every torchrun worker has its own hash seed: rank 1 then ran with rank
        # 0's sliding and global RoPE tables swapped. FSDP2 syncs no buffers either.
        wrapped = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True, init_sync=False,
                                                      forward_sync_buffers=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    for step, images in enumerate(PATTERN):
        batch = entry.batch(images[rank], 1000 * step + rank, seq_len(step, 0, rank))
        wrapped(**batch).loss.backward()
        if usage is not None:
            usage.finalize()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = trainable_weights(model)
    ties = 0
    if usage is not None:
        usage.remove()
        ties = usage.ties
    del wrapped
    return weights, units, ties


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(n for n, e in ZOO.items() if e.vlm))
    ap.add_argument("--report", default="",
                    help="JSON {measured_on, families: {name: {setup, max_dw, tol, pass}}} (rank 0 writes)")
    a = ap.parse_args()
    rank, _ = init_gloo()
    t0 = time.time()
    report: dict[str, dict] = {}
    for name in a.families.split(","):
        fsdp_w, units, ties = train(name, fsdp=True)
        stock_w, _, _ = train(name, fsdp=False)
        assert stock_w.keys() == fsdp_w.keys(), name
        diff = max((stock_w[n] - fsdp_w[n]).abs().max().item() for n in stock_w)
        report[name] = {"setup": SETUP, "max_dw": float(f"{diff:.2e}"), "tol": TOL, "pass": diff <= TOL}
        print(f"[rank {rank} {time.time() - t0:5.1f}s] {name}: FSDP2 {len(units)} units, {ties} ties, "
              f"max |FSDP2 - stock DDP| = {diff:.2e} (tol {TOL:.0e}: {'pass' if diff <= TOL else 'FAIL'})", flush=True)
        gc.collect()
    if a.report and rank == 0:
        import transformers

        stack = {"torch": torch.__version__, "transformers": transformers.__version__,
                 "date": time.strftime("%Y-%m-%d", time.gmtime())}
        with open(a.report, "w") as f:
            json.dump({"measured_on": stack, "families": report}, f, indent=1, sort_keys=True)
            f.write("\n")
    print(f"[rank {rank} {time.time() - t0:5.1f}s] USAGE_FSDP_OK", flush=True)
    teardown()


if __name__ == "__main__":
    main()
