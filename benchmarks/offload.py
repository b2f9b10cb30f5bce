"""Benchmark: hf_ddpfix activation offload vs stock checkpointing modes, one run, same model and data.

Run (CPU, ~1-2 min; prints a markdown table and writes JSON, PNG and .md)::

    OMP_NUM_THREADS=1 python benchmarks/offload.py --quick \
        --out benchmarks/results/offload_cpu.json --png benchmarks/results/offload_cpu.png

Run on a GPU (a ~1B Llama-shaped model, bf16, sequence 2K upward until every mode is out of memory)::

    python benchmarks/offload.py --out benchmarks/results/offload_gpu.json --png benchmarks/results/offload_gpu.png

Modes: ``no_ckpt`` (no checkpointing), ``ckpt`` (non-reentrant checkpointing), ``ckpt+hf_offload``
(transformers' offload, switched on the way users do it: a ``Trainer`` with
``TrainingArguments(activation_checkpointing=True, activation_checkpointing_kwargs={"offload": True})``,
one real ``trainer.train()`` step; transformers 5.23 pops ``offload`` there and calls
``model.activation_checkpointing_enable(..., offload=True)``, which wraps every checkpoint in
``save_on_cpu(pin_memory=True)``, blocking copies; the benchmark then checks that wrapper is installed)
and ``ckpt+hf_ddpfix`` (``ActivationOffload``: async copies, last input kept, prefetch; every step copies,
``min_layer_bytes=0``, so the row shows the raw cost; ``auto copies`` says whether the default policy,
copying only checkpoint inputs >= 64 MiB, would copy at that length). Before 2026-11-23 this script put
``offload`` inside the checkpoint kwargs handed to the model, where transformers never looks: the
``ckpt+hf_offload`` rows of earlier runs were plain checkpointing.

``--profile DIR`` (GPU) also writes a torch.profiler Chrome trace of one ``ckpt`` and one
``ckpt+hf_ddpfix`` step per length (``DIR/<mode>_<seq>.json``): where the short-length overhead goes.

Measured: step time (median over timed steps, forward + backward + AdamW on the LoRA weights; ratio vs
``ckpt`` from the same run), peak memory (GPU: ``torch.cuda.max_memory_allocated``; CPU: exact live
tensor bytes from ``MemTracker``, one extra untimed step), the bytes the offload moves vs the theory
``(layers - 1) x batch x seq x hidden x bytes``, host memory (process RSS, offload pool bytes). On CPU
an offload frees nothing (tensors already live on the host): the CPU rows show its overhead and that
it moves exactly the theoretical bytes; the memory drop itself needs a GPU run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_ddpfix.integrations.checkpointing import apply_checkpointing  # noqa: E402
from hf_ddpfix.ops.offload import (  # noqa: E402
    DEFAULT_MIN_BYTES,
    ActivationOffload,
    accelerator_available,
)
from hf_ddpfix.plan.memory import offload_min_layer_bytes  # noqa: E402

MODES = ("no_ckpt", "ckpt", "ckpt+hf_offload", "ckpt+hf_ddpfix")
MIB = 1 << 20

# Small enough that 4 modes x several lengths finish in ~1-2 min on one CPU thread.
CPU_MODEL = dict(hidden=256, intermediate=688, layers=4, heads=4, kv_heads=2, vocab=1024, dtype="float32")
# ~1.1B parameters (TinyLlama-shaped): a realistic layer-input size per token (2048 x 2 bytes).
GPU_MODEL = dict(
    hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000, dtype="bfloat16"
)


def build_model(spec: dict[str, Any], device: torch.device) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=1 << 17,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).to(device=device, dtype=getattr(torch, spec["dtype"]))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    model.train()
    return model


def enable_like_trainer(model: nn.Module, device: torch.device, seq: int, vocab: int) -> None:
    """Switch on transformers' own offload exactly as a user does: a ``Trainer`` with
    ``activation_checkpointing_kwargs={"offload": True}`` and one ``train()`` step.

    Raises:
        RuntimeError: stock's offload is not installed afterwards (its wrapper not found on the layers),
            or the Trainer step failed (e.g. on a machine without an accelerator, where transformers'
            ``save_on_cpu(pin_memory=True)`` cannot pin memory), with the reason.
    """
    import tempfile

    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, vocab, (seq,))
    data = [{"input_ids": ids, "labels": ids}]
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(
            output_dir=tmp, max_steps=1, per_device_train_batch_size=1, report_to=[], save_strategy="no",
            activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False, "offload": True},
            use_cpu=device.type == "cpu", disable_tqdm=True, dataloader_num_workers=0, logging_strategy="no",
        )
        try:
            Trainer(model=model, args=args, train_dataset=data).train()
        except Exception as exc:  # noqa: BLE001 - report why the stock path cannot run here
            raise RuntimeError(f"transformers' offload through the Trainer failed: {exc}") from exc
    if not hf_offload_installed(model):
        raise RuntimeError("the Trainer step ran but transformers' offload wrapper is not on the checkpointed layers")


def hf_offload_installed(model: nn.Module) -> bool:
    """True when the checkpointed layers run transformers' ``save_on_cpu`` wrapper (5.23:
    ``functools.partial(checkpoint_func, ...)`` with ``checkpoint_func`` local to
    ``_activation_checkpointing_enable``)."""
    import functools

    funcs = [getattr(m, "_gradient_checkpointing_func", None) for m in model.modules()
             if getattr(m, "gradient_checkpointing", False)]
    names = {getattr(f.func if isinstance(f, functools.partial) else f, "__qualname__", "") for f in funcs if f}
    return bool(funcs) and all("checkpoint_func" in n for n in names)


def enable_mode(model: nn.Module, mode: str, spec: dict[str, Any], device: torch.device,
                seq: int = 256) -> ActivationOffload | None:
    if mode == "no_ckpt":
        return None
    if mode == "ckpt+hf_offload":
        enable_like_trainer(model, device, seq, spec["vocab"])
        return None
    kwargs: dict[str, Any] = {"use_reentrant": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if mode != "ckpt+hf_ddpfix":
        return None
    offload = ActivationOffload(module=model, min_layer_bytes=0)  # default min_bytes (1 MiB); always copies
    apply_checkpointing(model, use_reentrant=False, offload=offload)
    return offload


def rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB
    except OSError:
        return float("nan")


def live_bytes_snapshot(fn) -> dict[str, int]:
    """Peak live tensor bytes per category during ``fn()`` (CPU, exact; private torch API)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Tracker(MemTracker):
        # Stock MemTracker puts grad hooks on every parameter and fails on frozen (LoRA base) weights;
        # gradients are then counted as temporaries, which leaves the total unchanged.
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    tracker = _Tracker()
    with tracker:
        fn()
    total: dict[str, int] = {}
    for per_dev in tracker.get_tracker_snapshot("peak").values():
        for key, nbytes in per_dev.items():
            name = getattr(key, "value", key)  # _MemRefType members -> "Parameter", "Activation", ...
            total[name] = total.get(name, 0) + int(nbytes)
    return total


class Case:
    """One mode's model, optimizer and offload, kept alive so timed steps can alternate between modes."""

    def __init__(self, mode: str, spec: dict[str, Any], device: torch.device) -> None:
        self.mode = mode
        self.device = device
        self.model = build_model(spec, device)
        self.offload = enable_mode(self.model, mode, spec, device)
        self.model.train()
        self.opt = torch.optim.AdamW([q for q in self.model.parameters() if q.requires_grad], lr=1e-4)

    def step(self, ids: torch.Tensor) -> tuple[float, float]:
        """Run one step; return (wall seconds, process CPU seconds)."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        with self.offload.step() if self.offload is not None else contextlib.nullcontext():
            self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0, time.process_time() - c0

    def step_peak_mib(self, ids: torch.Tensor) -> float:
        """Peak memory of one step above what stays resident (params, buffers, optimizer state)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            self.step(ids)
            return (torch.cuda.max_memory_allocated() - before) / MIB
        snap = live_bytes_snapshot(lambda: self.step(ids))
        resident = sum(v for k, v in snap.items() if k in ("Parameter", "Buffer", "Optstate"))
        return (snap["Total"] - resident) / MIB

    def offload_row(self) -> dict[str, Any]:
        if self.offload is None:
            return {}
        s = self.offload.stats
        return {
            "moved_mib": s.would_offload_bytes / MIB,
            "kept_mib": s.kept_bytes / MIB,
            "pool_mib": s.pool_bytes / MIB,
            "in_flight": s.in_flight,
        }


def profile_steps(cases: list[Case], seq: int, batch: int, vocab: int, out: Path) -> None:
    """One profiled step per case (CUDA + CPU activity, stacks off), as Chrome traces."""
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(0, vocab, (batch, seq), device=cases[0].device)
    for case in cases:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            case.step(ids)
        prof.export_chrome_trace(str(out / f"{case.mode.replace('+', '_')}_{seq}.json"))


def run_seq(cases: list[Case], seq: int, batch: int, vocab: int, steps: int) -> dict[str, dict[str, Any]]:
    """Warm up each mode, then alternate timed steps between modes (a shared machine drifts; this keeps
    the ratios fair). A mode that runs out of memory is reported as such and left out of later lengths."""
    device = cases[0].device
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    out: dict[str, dict[str, Any]] = {}
    live = []
    for case in cases:
        try:
            case.step(ids)  # warm-up: kernels, allocator, pinned pool
            out[case.mode] = {"step_s_all": [], "cpu_s_all": [], "peak_mib": case.step_peak_mib(ids)}
            live.append(case)
        except torch.OutOfMemoryError:
            out[case.mode] = {"oom": True}
            case.opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
    for _ in range(steps):
        for case in live:
            wall, cpu = case.step(ids)
            out[case.mode]["step_s_all"].append(wall)
            out[case.mode]["cpu_s_all"].append(cpu)
    for case in live:
        row = out[case.mode]
        row["step_s"] = statistics.median(row["step_s_all"])
        row["cpu_s"] = statistics.median(row["cpu_s_all"])
        row.update(case.offload_row())
        row["rss_mib"] = rss_mib()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/offload_cpu.json")
    p.add_argument("--png", default=None)
    p.add_argument("--md", default=None, help="markdown table path (default: --out with .md)")
    p.add_argument("--quick", action="store_true", help="fewer lengths")
    p.add_argument("--seqs", type=int, nargs="*", default=None)
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode and length (median reported)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--profile", default=None, help="GPU: write a Chrome trace per mode and length into this dir")
    args = p.parse_args(argv)

    on_gpu = accelerator_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    spec = dict(GPU_MODEL if on_gpu else CPU_MODEL)
    if args.seqs:
        seqs = args.seqs
    elif on_gpu:
        seqs = [2048, 4096, 8192] if args.quick else [2048 << i for i in range(7)]  # 2K..128K or OOM
    else:
        seqs = [512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096]
    elem = torch.finfo(getattr(torch, spec["dtype"])).bits // 8
    skipped: dict[str, str] = {}
    cases = []
    for mode in MODES:
        try:
            cases.append(Case(mode, spec, device))
        except RuntimeError as exc:  # e.g. stock offload cannot pin memory without an accelerator
            skipped[mode] = str(exc).splitlines()[0][:300]
            print(f"{mode}: skipped: {skipped[mode]}", flush=True)
    rows: list[dict[str, Any]] = []
    for seq in seqs:
        live = [c for c in cases if not any(r["mode"] == c.mode and r.get("oom") for r in rows)]
        per_mode = run_seq(live, seq, args.batch, spec["vocab"], args.steps) if live else {}
        if args.profile and on_gpu:
            profile_steps([c for c in live if c.mode in ("ckpt", "ckpt+hf_ddpfix")], seq, args.batch,
                          spec["vocab"], Path(args.profile))
        for case in cases:
            row = per_mode.get(case.mode, {"oom": True})
            row.update(mode=case.mode, seq=seq)
            row["theory_mib"] = (spec["layers"] - 1) * args.batch * seq * spec["hidden"] * elem / MIB
            layer_bytes = args.batch * seq * spec["hidden"] * elem
            row["auto_copies"] = layer_bytes >= offload_min_layer_bytes(None)  # the plan's default policy
            rows.append(row)
            if "step_s" in row:
                print(
                    f"{case.mode:16s} seq={seq:6d} step={row['step_s']:.3f}s peak={row['peak_mib']:.1f}MiB",
                    flush=True,
                )
        if not live:
            break

    # On a shared CPU, process CPU time is not inflated by other processes; on a GPU, wall time is what counts.
    clock = "step_s" if on_gpu else "cpu_s"
    base = {r["seq"]: r[clock] for r in rows if r["mode"] == "ckpt" and clock in r}
    for r in rows:
        if clock in r and r["seq"] in base:
            r["time_vs_ckpt"] = r[clock] / base[r["seq"]]

    import transformers

    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if on_gpu else f"CPU ({platform.machine()})",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "model": {**spec, "lora": "r=16 q_proj,v_proj", "batch": args.batch},
        "steps_timed": args.steps,
        "ratio_clock": "wall time" if on_gpu else "process CPU time (shared machine)",
        "min_bytes": DEFAULT_MIN_BYTES,
        "memory_metric": ("torch.cuda.max_memory_allocated" if on_gpu else "MemTracker live tensor bytes")
        + ", peak of one step minus resident params/buffers/optimizer state",
        "skipped": skipped,
        "rows": rows,
        "notes": NOTES_GPU if on_gpu else NOTES_CPU,
    }
    table = markdown_table(result)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    Path(args.md or out.with_suffix(".md")).write_text(table + "\n")
    if args.png:
        plot(result, Path(args.png))
    return 0


NOTES_CPU = (
    "CPU: tensors already live on the host, so no offload frees memory here and the peaks of the "
    "checkpointed modes match; 'moves' is what hf_ddpfix would copy to the host on an accelerator "
    "(= device bytes freed), to compare with theory = (layers-1) x batch x seq x hidden x bytes. Layer "
    "inputs under min_bytes (1 MiB) are not moved. Timed steps alternate between modes (shared CPU)."
)
NOTES_GPU = "GPU: all four models stay resident; peaks are per step above that resident state."


def markdown_table(result: dict[str, Any]) -> str:
    head = (
        f"Device: {result['device']} ({result['threads']} thread(s)); torch {result['torch']}, transformers "
        f"{result['transformers']}; {result['date']}. Model: hidden {result['model']['hidden']}, "
        f"{result['model']['layers']} layers, {result['model']['dtype']}, LoRA {result['model']['lora']}, "
        f"batch {result['model']['batch']}. Peak = {result['memory_metric']}. Step time: median of "
        f"{result['steps_timed']} steps (wall); ratio vs ckpt from {result['ratio_clock']}.\n"
    )
    lines = [
        head,
        "| seq | mode | step wall (s) | step CPU (s) | time vs ckpt | step peak (MiB) | offload moves (MiB) | theory (MiB) "
        "| host pool (MiB) | auto copies |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(result["rows"], key=lambda r: (r["seq"], MODES.index(r["mode"]))):
        if r.get("oom"):
            lines.append(f"| {r['seq']} | {r['mode']} | OOM | | | | | | | |")
            continue
        moved = f"{r['moved_mib']:.1f}" if "moved_mib" in r else ""
        pool = f"{r['pool_mib']:.1f}" if "pool_mib" in r else ""
        theory = f"{r['theory_mib']:.1f}" if "moved_mib" in r else ""
        peak = f"{r['peak_mib']:.1f}" if "peak_mib" in r else ""
        lines.append(
            f"| {r['seq']} | {r['mode']} | {r['step_s']:.3f} | {r.get('cpu_s', float('nan')):.3f} "
            f"| {r.get('time_vs_ckpt', float('nan')):.2f}x "
            f"| {peak} | {moved} | {theory} | {pool} "
            f"| {('yes' if r.get('auto_copies') else 'no') if r['mode'] == 'ckpt+hf_ddpfix' else ''} |"
        )
    for mode, why in result["skipped"].items():
        lines.append(f"\n{mode} skipped: {why}")
    lines.append(f"\n{result['notes']}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        rs = [r for r in result["rows"] if r["mode"] == mode and "step_s" in r]
        if not rs:
            continue
        xs = [r["seq"] for r in rs]
        if all("peak_mib" in r for r in rs):
            ax_mem.plot(xs, [r["peak_mib"] for r in rs], marker="o", label=mode)
        ax_t.plot(xs, [r.get("time_vs_ckpt", float("nan")) for r in rs], marker="o", label=mode)
        if mode == "ckpt+hf_ddpfix":
            ax_mem.plot(
                xs, [r["moved_mib"] for r in rs], ls="--", color="gray", label="hf_ddpfix moves (MiB)"
            )
    ax_mem.set(xlabel="sequence length", ylabel="MiB", title="Step peak above resident params + optimizer")
    ax_t.set(
        xlabel="sequence length", ylabel="step time / ckpt step time", title="Step time vs checkpointing"
    )
    for ax in (ax_mem, ax_t):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Activation offload - {result['device']} - torch {result['torch']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
