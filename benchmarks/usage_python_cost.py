"""Python time hf_ddpfix's parameter-usage machinery adds per micro-batch, on a 32-layer LoRA Llama (CPU).

    python benchmarks/usage_python_cost.py [--layers 32] [--steps 30] [--ga 2] [--out FILE]

One process, the Trainer's wiring by hand: the plan's non-reentrant checkpoint function, the usage observer
(`ParameterUsage`, loss routed through `tie_loss` as `accelerator.backward` does), the plan's
checkpoint-function check (`runtime._keep_plan_checkpointing`), the token counter. Every forward (pre-)hook
hf_ddpfix registered on any module is wrapped with `time.perf_counter`, and so are the calls the Trainer
makes (`tie_loss`, `finalize`); the total per optimizer step is the Python time hf_ddpfix adds there
(steady state: the first `--warmup` steps are dropped), as this thread's CPU time (`time.thread_time`: a
busy shared machine's preemption is not Python cost; the wall figure is printed too), in total and per
hook. Prints a JSON record; `--out` writes it too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ga", type=int, default=1)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import torch
    from fixtures import lora_llama
    from transformers import TrainingArguments

    from hf_ddpfix.callbacks import MemoryThroughputCallback
    from hf_ddpfix.integrations.checkpointing import apply_checkpointing
    from hf_ddpfix.integrations.usage import ParameterUsage, UsageChanged
    from hf_ddpfix.plan.types import Decision
    from hf_ddpfix.runtime import attach as runtime

    torch.set_num_threads(1)
    model = lora_llama(targets=tuple(a.targets.split(",")), checkpointing="non_reentrant", num_hidden_layers=a.layers,
                       hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    apply_checkpointing(model, use_reentrant=False)
    stack = ExitStack()
    args = TrainingArguments(output_dir="/tmp/usage_python_cost", use_cpu=True, report_to=[])
    runtime._keep_plan_checkpointing(SimpleNamespace(args=args), model, SimpleNamespace(
        checkpointing=Decision("non_reentrant", "")), None, stack)
    usage = ParameterUsage(model).attach()
    usage.at_loss = usage.backward_retries = True  # accelerator.backward's wiring: retried on UsageChanged
    mem = MemoryThroughputCallback()
    mem._hook = model.register_forward_pre_hook(mem._count, with_kwargs=True)

    spent = [0.0, 0.0]  # thread CPU time (what the Python costs), wall time (adds preemption on a busy machine)
    by_hook: dict[str, float] = {}

    def timed(fn: Any, label: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu = time.thread_time() - t0
                spent[0] += cpu
                spent[1] += time.perf_counter() - w0
                by_hook[label] = by_hook.get(label, 0.0) + cpu
        return wrapper

    hooks = 0
    for m in model.modules():
        for d in (m._forward_pre_hooks, m._forward_hooks):
            for k, fn in list(d.items()):
                if "hf_ddpfix" in (getattr(fn, "__module__", "") or "") or "hf_ddpfix" in repr(fn):
                    d[k] = timed(fn, getattr(fn, "__qualname__", repr(fn)).split(".<locals>")[0])
                    hooks += 1
    tie_loss, finalize = timed(usage.tie_loss, "tie_loss"), timed(usage.finalize, "finalize")
    n_params = sum(1 for q in model.parameters() if q.requires_grad)
    ids = torch.randint(1, 60, (1, 24))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    per_step, per_step_wall, walls = [], [], []
    for _step in range(a.steps):
        if _step == a.warmup:
            by_hook.clear()
        spent[0] = spent[1] = 0.0
        w0 = time.perf_counter()
        check0 = usage.no_walk.check_seconds
        for _ in range(a.ga):
            out = model(**batch)
            try:
                tie_loss(out.loss).backward()
            except UsageChanged:  # what _compat.around_backward does: the retry walks
                tie_loss(out.loss).backward()
        finalize()
        checked = usage.no_walk.check_seconds - check0  # the no-walk check runs inside backward, timed by the tracker
        spent[0] += checked
        spent[1] += checked
        by_hook["no-walk check (in backward)"] = by_hook.get("no-walk check (in backward)", 0.0) + checked
        for q in model.parameters():
            q.grad = None
        walls.append(time.perf_counter() - w0)
        per_step.append(spent[0])
        per_step_wall.append(spent[1])
    steady = per_step[a.warmup:]
    n_steady = a.steps - a.warmup
    rec = {"layers": a.layers, "targets": a.targets, "ga": a.ga, "trainable_tensors": n_params, "hooks_timed": hooks,
           "python_cpu_ms_per_step_median": round(statistics.median(steady) * 1e3, 3),
           "python_cpu_ms_per_step_min": round(min(steady) * 1e3, 3),
           "python_wall_ms_per_step_median": round(statistics.median(per_step_wall[a.warmup:]) * 1e3, 3),
           "cpu_ms_per_step_by_hook": {k: round(v / n_steady * 1e3, 3) for k, v in sorted(by_hook.items())},
           "step_wall_ms_median": round(statistics.median(walls[a.warmup:]) * 1e3, 2),
           "forwards": usage.forwards, "walks": usage.walks, "no_walk_checks": usage.no_walk.checks, "torch": torch.__version__}
    stack.close()
    print(json.dumps(rec))
    if a.out:
        Path(a.out).write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
