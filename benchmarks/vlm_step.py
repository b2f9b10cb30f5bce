"""VLM DDP step time: hf_ddpfix's stabiliser (find_unused_parameters=False, static graph) vs the safe
fallback (find_unused_parameters=True), measured side by side in one run on 2 gloo processes.

    python benchmarks/vlm_step.py [--steps 20] [--out benchmarks/results/vlm_step_cpu.json]

Re-launches itself under torchrun (2 processes). Both DDP models are built from the same weights and
see the same batches (rank 0 images, rank 1 text-only: the mixed case); steps alternate between the
two set-ups so machine noise hits both alike. Reports the median step time of each and the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(argv: list[str]) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, *argv]
    return subprocess.call(cmd, env=env)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from fixtures import add_lora, build_qwen2_5_vl, make_batch
    from torch import nn

    from hf_ddpfix.integrations.vision.stabilizer import VisionStabilizer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    setups = {}
    for name, fix in (("fallback_fu_true", False), ("stabilizer_fu_false_static", True)):
        model = add_lora(build_qwen2_5_vl(0))
        stab = VisionStabilizer(model).attach() if fix else None
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=not fix, static_graph=fix)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        setups[name] = (ddp, stab, opt, [])

    def step(ddp, stab, opt, i):
        batch = make_batch(rank == 0, seed=i)
        ddp(**batch).loss.backward()
        if stab is not None:
            stab.finalize_vision_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(a.warmup + a.steps):
        for ddp, stab, opt, times in setups.values():
            dist.barrier()
            t0 = time.perf_counter()
            step(ddp, stab, opt, i)
            dist.barrier()
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
    if rank == 0:
        med = {name: statistics.median(s[3]) for name, s in setups.items()}
        result = {
            "date": date.today().isoformat(), "device": f"CPU ({platform.processor() or platform.machine()}), "
            "2 gloo processes", "torch": torch.__version__, "transformers": transformers.__version__,
            "steps": a.steps, "median_step_s": med,
            "ratio_stabilizer_vs_fallback": med["stabilizer_fu_false_static"] / med["fallback_fu_true"],
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vlm_step_cpu.json"))
    a = p.parse_args()
    if "RANK" not in os.environ:
        sys.exit(launch(sys.argv[1:]))
    worker(a)


if __name__ == "__main__":
    main()
