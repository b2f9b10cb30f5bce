"""What hf_ddpfix adds to a DDP training step, counted exactly: collectives (by kind and bytes) and host
reads (by kind), stock Trainer vs the patched Trainer; and seconds per step (median of interleaved pairs).

    python benchmarks/step_overhead.py [--steps 6] [--pairs 5] [--cases text,text_ga2,vlm]
                                       [--out benchmarks/results/step_overhead.json]

Re-launches itself under torchrun (2 gloo processes on the CPU; ``--engine fsdp``: ``accelerate launch`` with
accelerate_configs/fsdp.yaml through the FSDP test device, hf_ddpfix/rehearse/device; ``zero2`` / ``zero3``:
``TrainingArguments(deepspeed=...)``, ``DS_ACCELERATOR=cpu``). Cases, each through the HF Trainer
(`Trainer` stock: a PeftModel gets `find_unused_parameters=True`; patched: `patch_trainer()`, whose plan
builds DDP with `find_unused_parameters=False`, static graph at accumulation 1):

- `text`: tiny Llama LoRA, non-reentrant checkpointing, variable lengths with an attention mask, GA 1;
- `text_ga2`: the same with gradient accumulation 2;
- `vlm`: tiny Qwen2.5-VL with LoRA on the vision tower too, rank 0 always an image, rank 1 never (mixed ranks);
  under FSDP2 the tower in units of its own with the dummy image (``fsdp_skippable="shard"``); stock FSDP2 fails on
  mixed ranks, so its reference gives rank 1 images too (rank 1's figure: hf_ddpfix's text rank with the dummy vs
  stock's image rank), and its weights are compared with stock DDP's on the same mixed ranks (the DDP run's
  ``--save-reference`` folder given as ``--reference``; "not compared" without it);
- `eval`: the `text` model's ``evaluate()`` (with ``compute_metrics``, so predictions are gathered) then
  ``predict()``, counted per evaluation step (between two ``on_prediction_step`` callbacks: one forward and the
  Trainer's gathers of its outputs).

Counting (one run each, separate from the timed runs): a `TorchDispatchMode` sees every c10d collective,
Python's or DDP's reducer's (`c10d.allreduce_` ...; bytes = the input tensors'), and a `TorchFunctionMode`
every host read of a tensor (`item`, `tolist`, `cpu`, `numpy`, `__bool__`, `__int__`, `__float__`,
`__index__`: on a GPU each waits for the queued work). A read of a **host copy** (the result of a counted `.cpu()`,
or a tensor computed from host copies alone: stock accelerate's `max(s[dim] for s in gather(size).cpu())`) waits
for nothing, the `.cpu()` did: it is counted apart (`copyread:<kind>`), not as a host read. DDP's C++ reducer reads
on the host too, where no Python mode sees it: with `find_unused_parameters=True` a rank that left a parameter
unused waits for the used map's all-reduce and copies it to the host once per step; that read is counted from
torch's rule on the step's facts (`read:reducer_used_map`, `Counts.reducer_waits`). Each optimizer step is counted between the
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
ENGINES = ("ddp", "fsdp", "zero2", "zero3")


def launch(argv: list[str], timeout: float | None = None, engine: str = "ddp") -> int:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    if engine == "fsdp":  # accelerate's FSDP2 path on the CPU: the FSDP test device first on the path
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "hf_ddpfix" / "rehearse" / "device"), env["PYTHONPATH"]])
        accel = Path(sys.executable).with_name("accelerate")
        cmd = [str(accel) if accel.exists() else "accelerate", "launch", "--config_file",
               str(ROOT / "accelerate_configs" / "fsdp.yaml"), "--mixed_precision", "no", __file__, "--worker", *argv]
    else:
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
                if not outer.on:
                    return func(*args, **(kwargs or {}))
                copy = outer.host_copy(args, kwargs)
                if name in HOST_READS:
                    outer.now[f"{'copyread' if copy else 'read'}:{name}"] += 1
                out = func(*args, **(kwargs or {}))
                if name == "__iter__" and copy:  # the rows of a host copy (stock's `for s in sizes`)
                    rows = list(out)
                    outer.mark(rows)
                    return iter(rows)
                if name == "cpu" or copy:
                    outer.mark(out)
                return out

        self.modes = (Collectives(), Reads())
        self._copies: dict[int, Any] = {}
        self.steps: list[dict[str, int]] = []
        self.wrapped_of: Any = None  # () -> the Trainer's wrapped model (run_once sets it): the reducer's rule
        self._used: set[int] = set()
        self._hooked: list[Any] = []

    def watch_usage(self, model: Any) -> None:
        """Note which trainable parameters receive a gradient in this process (a hook on each, once): the input of
        :meth:`reducer_waits`."""
        if self._hooked:
            return
        for i, p in enumerate(p for p in model.parameters() if p.requires_grad):
            self._hooked.append(p)
            p.register_hook(lambda g, i=i: self._used.add(i))

    def reducer_waits(self) -> bool:
        """Whether DDP's C++ reducer read the all-reduced used-parameter map on the host in this optimizer step.

        torch's rule (``Reducer::finalize_bucket_dense``, torch/csrc/distributed/c10d/reducer.cpp, 2.13-2.15): with
        ``find_unused_parameters=True``, when a parameter this rank left unused over the step's micro-batches comes
        up, the reducer waits for the used map's all-reduce and copies it to the host ("Blocking copy, if
        local_used_map_dev_ is cuda"), once per step; a rank that used every parameter never does. The counting
        modes above see Python's reads only, so this one is derived from the rule, on the facts of the step (the
        wrapped model's setting, the parameters whose gradient hook ran), and counted as ``read:reducer_used_map``.
        """
        from torch.nn.parallel import DistributedDataParallel

        wrapped = self.wrapped_of() if self.wrapped_of else None
        if not isinstance(wrapped, DistributedDataParallel) or not wrapped.find_unused_parameters:
            return False
        return len(self._used) < len(self._hooked)

    def mark(self, out: Any) -> None:
        """Note every tensor of ``out`` as a host copy (a ``.cpu()`` result, or computed from such copies alone)."""
        import weakref

        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._copies[id(t)] = weakref.ref(t)

    def host_copy(self, args: tuple, kwargs: dict | None) -> bool:
        """Whether every tensor among ``args`` / ``kwargs`` (at least one) is a host copy: a read of one waits for
        nothing on a GPU (the counted ``.cpu()`` that made it did)."""
        import torch
        from torch.utils._pytree import tree_leaves

        tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        return bool(tensors) and all(
            (ref := self._copies.get(id(t))) is not None and ref() is t for t in tensors)

    def callback(self) -> Any:
        from transformers import TrainerCallback

        counts = self

        class PerStep(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
                counts.watch_usage(model)
                counts._used = set()
                counts.now = Counter()
                counts.on = True

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                counts.on = False
                if counts.reducer_waits():
                    counts.now["read:reducer_used_map"] += 1
                counts.steps.append(dict(counts.now))

        return PerStep()


    def eval_callback(self) -> Any:
        """Windows between consecutive ``on_prediction_step`` calls: one evaluation step each (its forward and the
        Trainer's gathers of its outputs); a new loop (``evaluate`` then ``predict``) starts its own windows."""
        from transformers import TrainerCallback

        counts = self

        class PerEvalStep(TrainerCallback):
            def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if counts.on:
                    counts.steps.append(dict(counts.now))
                counts.now = Counter()
                counts.on = True

            def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                counts.on = False  # the loop's last step: its window would hold the metrics' computation

            def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                counts.on = False

        return PerEvalStep()


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


def build(case: str, steps: int, rank: int, out: str, patched: bool, callbacks: list[Any], engine: str = "ddp") -> Any:
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

        def _get_eval_sampler(self, eval_dataset: Any) -> Any:
            return SequentialSampler(eval_dataset)

    ga = 2 if case == "text_ga2" else 1
    kw = checkpointing_training_args(True, {"use_reentrant": False})
    if case == "vlm":
        model = add_lora(build_qwen2_5_vl(0))
        n = steps * 2 * ga
        data = Dataset.from_list([{"seed": i} for i in range(n)])
        image = rank == 0 or (engine == "fsdp" and not patched)  # stock FSDP2 fails on mixed ranks

        def collate(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
            return make_batch(image, seed=batch[0]["seed"])  # rank 0 an image, rank 1 text only
        batch_size = 1
    else:
        model = lora_llama(targets=("q_proj", "v_proj"), random_lora=False)
        n = steps * 2 * ga * 2
        data = Dataset.from_list([{"input_ids": ids} for ids in variable_length_ids(n, lengths=(12, 20, 16, 9))])
        collate = padded_collate
        batch_size = 2
    if engine.startswith("zero"):
        from fixtures import zero_config

        kw["deepspeed"] = zero_config(int(engine[-1]))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch_size, gradient_accumulation_steps=ga,
                             max_steps=steps, report_to=[], use_cpu=True, save_strategy="no",
                             learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, remove_unused_columns=False,
                             disable_tqdm=True, seed=0, logging_steps=10_000, per_device_eval_batch_size=batch_size,
                             **kw)
    extra: dict[str, Any] = {}
    if case == "eval":
        extra["compute_metrics"] = lambda pred: {"n": float(len(pred.label_ids))}  # predictions gathered
    if patched and engine == "fsdp" and case == "vlm":
        from hf_ddpfix import DDPFixConfig, DDPFixTrainer

        cls = type("InOrderFix", (DDPFixTrainer,), {k: v for k, v in vars(InOrder).items() if k.startswith("_get")})
        return cls(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=callbacks,
                   ddpfix_config=DDPFixConfig(fsdp_skippable="shard"))
    return InOrder(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=callbacks, **extra)


def run_once(case: str, steps: int, rank: int, out: str, patched: bool, callbacks: list[Any], engine: str = "ddp",
             counts: Counts | None = None) -> Any:
    from hf_ddpfix import patch_trainer, unpatch_trainer

    if patched and not (engine == "fsdp" and case == "vlm"):  # that one: DDPFixTrainer with its config
        patch_trainer()
    try:
        from transformers import TrainerCallback

        agreed: dict[str, int] = {}
        held: list[Any] = []

        class AtEnd(TrainerCallback):  # hf_ddpfix's callbacks are removed when train() returns
            def on_train_end(self, *args: Any, **kwargs: Any) -> None:
                agreed.update(_agreement_reads(held[0]))

        trainer = build(case, steps, rank, out, patched, [*callbacks, AtEnd()], engine)
        held.append(trainer)
        if counts is not None:
            counts.wrapped_of = lambda: held[0].model_wrapped if held else None
        if case == "eval":  # train a step first (the model wrapped as training wraps it), then count the loops
            trainer.args.max_steps = 1
            trainer.train()
            assert counts is not None
            trainer.add_callback(counts.eval_callback())
            trainer.evaluate(eval_dataset=trainer.train_dataset)
            trainer.predict(trainer.train_dataset)
            sync = getattr(trainer, "hf_ddpfix_eval_outputs", None)
            agreed["eval_exchanges"] = getattr(sync, "exchanges", None)
            agreed["eval_forwards"] = getattr(getattr(sync, "agreement", None), "forwards", None)
        else:
            trainer.train()
        wrapped = trainer.model_wrapped
        info = {"find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
                "static_graph": getattr(wrapped, "static_graph", None), "wrapped": type(wrapped).__name__,
                "fsdp": bool(getattr(trainer, "is_fsdp_enabled", False)),
                "deepspeed": bool(getattr(trainer, "is_deepspeed_enabled", False)), **agreed}
        info["weights"] = _local_weights(trainer.model)
        held.clear()
        del trainer, wrapped
        return info
    finally:
        if patched:
            unpatch_trainer()


def _local_weights(model: Any) -> dict[str, Any]:
    """Every trainable tensor as this rank holds it (an FSDP2 shard, a ZeRO-3 partition, a whole tensor), on the CPU:
    stock and patched shard the same way, so rank by rank they compare bit for bit."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad and getattr(p, "ds_tensor", None) is None:
            continue
        t = getattr(p, "ds_tensor", None)
        t = p.to_local() if t is None and hasattr(p, "to_local") else (p if t is None else t)
        out[name.replace("_fsdp_wrapped_module.", "")] = t.detach().float().cpu().clone()
    return out


def _shards(full: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This rank's FSDP2 shard of each whole tensor (dimension 0 in ``torch.chunk`` pieces, an empty one past the
    last piece), to compare with what ``_local_weights`` reads of a sharded model."""
    out = {}
    for name, t in full.items():
        pieces = t.chunk(world, 0)
        out[name] = pieces[rank] if rank < len(pieces) else t[:0]
    return out


def _agreement_reads(trainer: Any) -> dict[str, int]:
    """The usage agreement's own counters over the run (patched): ``issued`` all-reduces, ``reads`` at the step
    (device->host on a GPU, counted above too), ``late_reads`` (a rank that did not read at the step reads the
    trainable-set flags from host memory at ``on_step_end``, after the counting window) and ``late_waits`` (of
    those, how many had to wait for the all-reduce: a GPU whose host ran ahead)."""
    for cb in trainer.callback_handler.callbacks:  # hf_ddpfix's late read of the trainable-set flags holds it
        agreement = getattr(cb, "agreement", None) or getattr(getattr(cb, "usage", None), "agreement", None)
        if agreement is not None and hasattr(agreement, "late_reads"):
            return {"agreement_" + k: getattr(agreement, k) for k in ("issued", "reads", "late_reads", "late_waits")}
    return {}


#: Optimizer steps before the steady state: DDP rebuilds its buckets at its second iteration where
#: find_unused_parameters is off (two broadcasts, once) and hf_ddpfix's first step predicts from the output.
WARMUP_STEPS = 3


def steady(steps: list[dict[str, int]], what: str, warmup: int = WARMUP_STEPS) -> dict[str, int]:
    """The steady state: the count every step after ``warmup`` shows. One step may differ (a one-time cost that
    lands after the warm-up, e.g. ZeRO-3 evaluation's first step with an image on a rank, measured 2026-12-02:
    broadcasts and item reads once in 8 steps); it is printed, not counted. Two or more differing steps: no steady
    state, an error."""
    rest = steps[warmup:]
    keyed = Counter(json.dumps(s, sort_keys=True) for s in rest)
    common, n = keyed.most_common(1)[0]
    if n < len(rest) - 1 or (len(rest) > 1 and n == 1):
        raise SystemExit(f"{what}: steady-state steps differ: {rest}")
    if n < len(rest):
        odd = [(i + warmup, s) for i, s in enumerate(rest) if json.dumps(s, sort_keys=True) != common]
        print(f"{what}: one step off the steady state (a one-time cost, not counted): {odd}", flush=True)
    return dict(sorted(json.loads(common).items()))


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
    engines = a.engine.split(",")
    jobs = [(engine, case) for engine in engines for case in a.cases.split(",")
            if not (engine.startswith("zero") and case == "vlm")]  # ZeRO's VLM path: tests/test_usage.py's zoo
    for engine, case in jobs:
        key = case if engine == "ddp" else f"{engine}/{case}"
        per: dict[str, Any] = {}
        weights: dict[str, dict[str, Any]] = {}
        for mode in ("stock", "patched"):
            counts = Counts()
            with counts.modes[0], counts.modes[1]:
                info = run_once(case, a.count_steps, rank, out, mode == "patched",
                                [] if case == "eval" else [counts.callback()], engine, counts)
            weights[mode] = info.pop("weights")
            gathered: list[Any] = [None, None]
            dist.all_gather_object(gathered, counts.steps)
            infos: list[Any] = [None, None]
            dist.all_gather_object(infos, info)
            # eval: every window is steady (a loop's first step, which exchanges the output fields, ends before the
            # loop's first window opens)
            warmup = 0 if case == "eval" else WARMUP_STEPS
            per[mode] = {"ddp": info, "ddp_by_rank": infos, "per_step_by_rank": [
                steady(s, f"{case}/{mode}/rank{r}", warmup) for r, s in enumerate(gathered)]}
            gc.collect()
        per["added_by_rank"] = [diff(p, s) for p, s in zip(per["patched"]["per_step_by_rank"],
                                                            per["stock"]["per_step_by_rank"], strict=True)]
        stock_w, fixed_w = weights["stock"], weights["patched"]
        per["weights_vs"] = "stock"
        if engine == "ddp" and case == "vlm" and a.save_reference and rank == 0:  # stock DDP, mixed ranks
            Path(a.save_reference).mkdir(parents=True, exist_ok=True)
            torch.save(stock_w, Path(a.save_reference) / "vlm.pt")
        if engine == "fsdp" and case == "vlm":  # stock FSDP2 cannot train mixed ranks (its counts' reference above)
            stock_w, per["weights_vs"] = {}, None
            if a.reference:  # what stock trains on mixed ranks: DDP, find_unused_parameters=True (--save-reference)
                stock_w = _shards(torch.load(Path(a.reference) / "vlm.pt"), rank, dist.get_world_size())
                per["weights_vs"] = "stock DDP"
        mine = {"tensors": len(stock_w), "same_names": sorted(stock_w) == sorted(fixed_w),
                "max_diff": max(((stock_w[n] - fixed_w[n]).abs().max().item() for n in stock_w if n in fixed_w),
                                default=0.0) if stock_w else None}
        per["weights_by_rank"] = [None, None]
        dist.all_gather_object(per["weights_by_rank"], mine)
        result["counts"][key] = per
        if rank == 0:
            print("COUNTS", key, json.dumps(per["added_by_rank"]), json.dumps(per["weights_by_rank"]), flush=True)
        if a.pairs:
            seconds: dict[str, list[float]] = {"stock": [], "patched": []}
            for _ in range(a.pairs):
                for mode in ("stock", "patched"):
                    times = StepTimes()
                    run_once(case, a.steps, rank, out, mode == "patched", [times.callback()], engine)
                    mine = torch.tensor([times.steady_seconds()], dtype=torch.float64)
                    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # a DDP step ends when the slower rank ends it
                    seconds[mode].append(float(mine))
                    gc.collect()
            ratios = [p / s for p, s in zip(seconds["patched"], seconds["stock"], strict=True)]
            result["timing"][key] = {
                "stock_s_per_step": seconds["stock"], "patched_s_per_step": seconds["patched"],
                "patched_over_stock_median": round(statistics.median(ratios), 4),
                "stock_over_patched_median": round(statistics.median([1 / r for r in ratios]), 4)}
            if rank == 0:
                print("TIMING", key, json.dumps(result["timing"][key]), flush=True)
    if rank == 0:
        result["meta"] = {"date": str(date.today()), "device": "CPU, 2 gloo processes", "machine": platform.machine(),
                          "engine": a.engine,
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
    p.add_argument("--engine", default="ddp", help=f"one of {ENGINES}, or several but fsdp comma-separated "
                   "(fsdp needs its own launch: accelerate launch)")
    p.add_argument("--count-steps", type=int, default=6)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--save-reference", default="", help="a folder: the DDP run saves its stock VLM weights there")
    p.add_argument("--reference", default="", help="a folder: the FSDP2 VLM run compares its weights with the stock "
                   "DDP weights --save-reference wrote (stock FSDP2 cannot train mixed image/text ranks)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_overhead.json"))
    a = p.parse_args()
    bad = [e for e in a.engine.split(",") if e not in ENGINES]
    if bad or ("fsdp" in a.engine.split(",") and a.engine != "fsdp"):
        p.error(f"--engine {a.engine!r}: allowed {', '.join(ENGINES)}, several comma-separated but fsdp alone")
    if a.worker:
        worker(a)
    else:
        sys.exit(launch(sys.argv[1:], engine=a.engine))


if __name__ == "__main__":
    main()
