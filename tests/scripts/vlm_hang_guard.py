"""2-process hang guard: stabiliser off, DDP(find_unused_parameters=False), LoRA Qwen2.5-VL.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/vlm_hang_guard.py --case mixed|none|ok

First a clean step (both ranks see images; plus a no_sync micro-batch with mixed ranks, which the
guard must not flag), then:
  mixed: rank 0 has an image, rank 1 not  -> every rank raises UnusedParametersError (stock: hang)
  none:  no rank has an image              -> every rank raises UnusedParametersError (stock: crash
                                             one step later with "Expected to have finished reduction")
  ok:    both ranks have images            -> trains, prints VLM_GUARD_OK
The error propagates, so the process exits non-zero within seconds instead of hanging.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import add_lora, build_qwen2_5_vl, make_batch, teardown  # noqa: E402

from hf_ddpfix.integrations.usage.hang_guard import HangGuard, UnusedParametersError  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=["mixed", "none", "ok"], required=True)
    case = ap.parse_args().case
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = add_lora(build_qwen2_5_vl(0))
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
    guard = HangGuard(model, ddp_module=ddp).attach()
    assert list(guard.groups) == ["model.visual"], guard.groups
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)

    # Clean step: a mixed no_sync micro-batch (not checked: only the syncing backward must use every
    # parameter), then a syncing micro-batch where both ranks see an image.
    with ddp.no_sync():
        ddp(**make_batch(rank == 0, seed=rank)).loss.backward()
    ddp(**make_batch(True, seed=10 + rank)).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"[rank {rank}] clean step done", flush=True)

    has_image = {"mixed": rank == 0, "none": False, "ok": True}[case]
    try:
        ddp(**make_batch(has_image, seed=20 + rank)).loss.backward()
    except UnusedParametersError as e:
        print(f"[rank {rank}] UnusedParametersError: {e}", flush=True)
        raise
    opt.step()
    print(f"[rank {rank}] VLM_GUARD_OK", flush=True)
    teardown()


if __name__ == "__main__":
    main()
