"""What hf_ddpfix adds to a DDP training step, counted exactly: collectives (by kind and bytes) and host
reads (by kind), stock Trainer vs the patched Trainer; and seconds per step (median of interleaved pairs).

    python benchmarks/step_overhead.py [--steps 6] [--pairs 5] [--cases text,text_ga2,vlm]
                                       [--out benchmarks/results/step_overhead.json]

Re-launches itself under torchrun (2 gloo processes on the CPU). Cases, each through the HF Trainer
(`Trainer` stock: a PeftModel gets `find_unused_parameters=True`; patched: `patch_trainer()`, whose plan
builds DDP with `find_unused_parameters=False`, static graph at accumulation 1):

- `text`: tiny Llama LoRA, non-reentrant checkpointing, variable lengths with an attention mask, GA 1;
- `text_ga2`: the same with gradient accumulation 2;
- `vlm`: tiny Qwen2.5-VL with LoRA on the vision tower too, rank 0 always an image, rank 1 never (mixed ranks).

Counting (one run each, separate from the timed runs): a `TorchDispatchMode` sees every c10d collective,
Python's or DDP's reducer's (`c10d.allreduce_` ...; bytes = the input tensors'), and a `TorchFunctionMode`
every host read of a tensor (`item`, `tolist`, `cpu`, `numpy`, `__bool__`, `__int__`, `__float__`,
`__index__`: on a GPU each waits for the queued work). Each optimizer step is counted between the
Trainer's `on_step_begin` and `on_step_end`; steps after the first `WARMUP_STEPS` are the steady state
and must all be equal (the script fails otherwise). Log-time reads (every `logging_steps`) fall outside these windows,
and so does the trainable-set flags' late read of host memory (hf_ddpfix's `on_step_end`, after this script's):
the usage agreement's own counters report it (`agreement_*` in each run's `ddp_by_rank` entries).

Timing: `--pairs` pairs of runs (stock then patched, alternating, same weights and data), each `--steps`
optimizer steps without the counting modes; seconds per step = median over the steady steps of a run;
the figure is the median over pairs of patched / stock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # hf_ddpfix of this checkout, the tiny models (tests/fixtures.py)
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
CASES = ("text", "text_ga2", "vlm")


def launch(argv: list[str], timeout: float | None = None) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--worker", *argv]
    return subprocess.call(cmd, env=env, timeout=timeout)


class Counts:
    """Collectives and host reads seen while `on` is set, per optimizer step."""

    def __init__(self) -> None:
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        self.on = False
        self.now: Counter[str] = Counter()
        outer = self

        class Collectives(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                name = str(func)
                if outer.on and name.startswith("c10d."):
                    kind = name.split(".")[1]
                    inputs = args[1] if kind.startswith("allgather") and len(args) > 1 else args[0] if args else []
                    tensors = inputs if isinstance(inputs, (list, tuple)) else [inputs]
                    nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
                    outer.now[f"collective:{kind}"] += 1
                    outer.now[f"bytes:{kind}"] += nbytes
                return func(*args, **(kwargs or {}))

        class Reads(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                name = getattr(func, "__name__", "")
                if outer.on and name in HOST_READS:
                    outer.now[f"read:{name}"] += 1
                return func(*args, **(kwargs or {}))

        self.modes = (Collectives(), Reads())
        self.steps: list[dict[str, int]] = []

    def callback(self) -> Any:
        from transformers import TrainerCallback

        counts = self

        class PerStep(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                counts.now = Counter()
                counts.on = True

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                counts.on = False
                counts.steps.append(dict(counts.now))

        return PerStep()


class StepTimes:
    def __init__(self) -> None:
        self.ends: list[float] = []

    def callback(self) -> Any:
        from transformers import TrainerCallback

        times = self

        class Timer(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if not times.ends:
                    times.ends.append(time.perf_counter())

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                times.ends.append(time.perf_counter())

        return Timer()

    def steady_seconds(self) -> float:
        durations = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)][1:]  # the first step: warm-up
        return statistics.median(durations)


def build(case: str, steps: int, rank: int, out: str, patched: bool, callbacks: list[Any]) -> Any:
    """A Trainer for `case` (stock `Trainer` class; patched when `patch_trainer()` is in force)."""
    import torch
    from datasets import Dataset
    from fixtures import (
        add_lora,
        build_qwen2_5_vl,
        lora_llama,
        make_batch,
        padded_collate,
        variable_length_ids,
    )
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainingArguments

    from hf_ddpfix._compat import checkpointing_training_args

    class InOrder(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

    ga = 2 if case == "text_ga2" else 1
    kw = checkpointing_training_args(True, {"use_reentrant": False})
    if case == "vlm":
        model = add_lora(build_qwen2_5_vl(0))
        n = steps * 2 * ga
        data = Dataset.from_list([{"seed": i} for i in range(n)])

        def collate(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
            return make_batch(rank == 0, seed=batch[0]["seed"])  # rank 0 an image, rank 1 text only
        batch_size = 1
    else:
        model = lora_llama(targets=("q_proj", "v_proj"), random_lora=False)
        n = steps * 2 * ga * 2
        data = Dataset.from_list([{"input_ids": ids} for ids in variable_length_ids(n, lengths=(12, 20, 16, 9))])
        collate = padded_collate
        batch_size = 2
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch_size, gradient_accumulation_steps=ga,
                             max_steps=steps, report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3,
                             weight_decay=0.1, max_grad_norm=1.0, remove_unused_columns=False, disable_tqdm=True,
                             seed=0, logging_steps=10_000, **kw)
    return InOrder(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=callbacks)


def run_once(case: str, steps: int, rank: int, out: str, patched: bool, callbacks: list[Any]) -> Any:
    from hf_ddpfix import patch_trainer, unpatch_trainer

    if patched:
        patch_trainer()
    try:
        from transformers import TrainerCallback

        agreed: dict[str, int] = {}
        held: list[Any] = []

        class AtEnd(TrainerCallback):  # hf_ddpfix's callbacks are removed when train() returns
            def on_train_end(self, *args: Any, **kwargs: Any) -> None:
                agreed.update(_agreement_reads(held[0]))

        trainer = build(case, steps, rank, out, patched, [*callbacks, AtEnd()])
        held.append(trainer)
        trainer.train()
        wrapped = trainer.model_wrapped
        info = {"find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
                "static_graph": getattr(wrapped, "static_graph", None), **agreed}
        held.clear()
        del trainer, wrapped
        return info
    finally:
        if patched:
            unpatch_trainer()


def _agreement_reads(trainer: Any) -> dict[str, int]:
    """The usage agreement's own counters over the run (patched): ``issued`` all-reduces, ``reads`` at the step
    (device->host on a GPU, counted above too), ``late_reads`` (a rank that did not read at the step reads the
    trainable-set flags from host memory at ``on_step_end``, after the counting window) and ``late_waits`` (of
    those, how many had to wait for the all-reduce: a GPU whose host ran ahead)."""
    for cb in trainer.callback_handler.callbacks:
        agreement = getattr(getattr(cb, "usage", None), "agreement", None)
        if agreement is not None and hasattr(agreement, "late_reads"):
            return {"agreement_" + k: getattr(agreement, k) for k in ("issued", "reads", "late_reads", "late_waits")}
    return {}


#: Optimizer steps before the steady state: DDP rebuilds its buckets at its second iteration where
#: find_unused_parameters is off (two broadcasts, once) and hf_ddpfix's first step predicts from the output.
WARMUP_STEPS = 3


def steady(steps: list[dict[str, int]], what: str) -> dict[str, int]:
    rest = steps[WARMUP_STEPS:]
    if any(s != rest[0] for s in rest):
        raise SystemExit(f"{what}: steady-state steps differ: {rest}")
    return dict(sorted(rest[0].items()))


def diff(patched: dict[str, int], stock: dict[str, int]) -> dict[str, int]:
    keys = sorted(set(patched) | set(stock))
    return {k: patched.get(k, 0) - stock.get(k, 0) for k in keys if patched.get(k, 0) != stock.get(k, 0)}


def worker(a: argparse.Namespace) -> None:
    import gc

    import torch
    import torch.distributed as dist
    import transformers

    import hf_ddpfix

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    out = f"/tmp/step_overhead_{os.getpid()}"
    result: dict[str, Any] = {"counts": {}, "timing": {}}
    for case in a.cases.split(","):
        per: dict[str, Any] = {}
        for mode in ("stock", "patched"):
            counts = Counts()
            with counts.modes[0], counts.modes[1]:
                info = run_once(case, a.count_steps, rank, out, mode == "patched", [counts.callback()])
            gathered: list[Any] = [None, None]
            dist.all_gather_object(gathered, counts.steps)
            infos: list[Any] = [None, None]
            dist.all_gather_object(infos, info)
            per[mode] = {"ddp": info, "ddp_by_rank": infos, "per_step_by_rank": [steady(s, f"{case}/{mode}/rank{r}")
                                                                                  for r, s in enumerate(gathered)]}
            gc.collect()
        per["added_by_rank"] = [diff(p, s) for p, s in zip(per["patched"]["per_step_by_rank"],
                                                            per["stock"]["per_step_by_rank"], strict=True)]
        result["counts"][case] = per
        if rank == 0:
            print("COUNTS", case, json.dumps(per["added_by_rank"]), flush=True)
        if a.pairs:
            seconds: dict[str, list[float]] = {"stock": [], "patched": []}
            for _ in range(a.pairs):
                for mode in ("stock", "patched"):
                    times = StepTimes()
                    run_once(case, a.steps, rank, out, mode == "patched", [times.callback()])
                    mine = torch.tensor([times.steady_seconds()], dtype=torch.float64)
                    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # a DDP step ends when the slower rank ends it
                    seconds[mode].append(float(mine))
                    gc.collect()
            ratios = [p / s for p, s in zip(seconds["patched"], seconds["stock"], strict=True)]
            result["timing"][case] = {
                "stock_s_per_step": seconds["stock"], "patched_s_per_step": seconds["patched"],
                "patched_over_stock_median": round(statistics.median(ratios), 4),
                "stock_over_patched_median": round(statistics.median([1 / r for r in ratios]), 4)}
            if rank == 0:
                print("TIMING", case, json.dumps(result["timing"][case]), flush=True)
    if rank == 0:
        result["meta"] = {"date": str(date.today()), "device": "CPU, 2 gloo processes", "machine": platform.machine(),
                          "torch": torch.__version__, "transformers": transformers.__version__,
                          "hf_ddpfix": getattr(hf_ddpfix, "__version__", "?"), "count_steps": a.count_steps,
                          "steps": a.steps, "pairs": a.pairs, "commit": _commit()}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        print("WROTE", a.out, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--count-steps", type=int, default=6)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_overhead.json"))
    a = p.parse_args()
    if a.worker:
        worker(a)
    else:
        sys.exit(launch(sys.argv[1:]))


if __name__ == "__main__":
    main()
