"""Benchmark: long-context LoRA on a Llama-8B shape — the CPU ledger and the GPU longest-sequence search.

CPU ledger (a minute or two; fake tensors, no math)::

    OMP_NUM_THREADS=1 python benchmarks/long_context.py --ledger

prints the peak live activation bytes per token of ONE Llama-8B-shaped decoder layer (hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, bf16 weights, LoRA r=16 on every linear layer with peft's
default fp32 adapters, sdpa, autocast bf16, non-reentrant checkpointing) over forward + recompute +
backward, for stock and each hf_ddpfix feature (slope between 8K and 16K tokens; see
``hf_ddpfix.integrations.long_context.layer_ledger``), a whole-model projection (32 layers, offloaded layer inputs,
the budget check of ``hf_ddpfix.ops.offload.budget``), writes JSON/PNG/markdown under
``benchmarks/results/`` and ends with the line ``ledger: stock <N> KiB/token, hf_ddpfix <M> KiB/token``.

GPU (one process per trial; random bf16 weights; each trial 3 steps through the Trainer --
``transformers.Trainer`` for ``stock``, ``DDPFixTrainer`` otherwise -- with bf16, non-reentrant
checkpointing, AdamW on the LoRA weights, one sequence)::

    python benchmarks/long_context.py --gpu --out benchmarks/results/long_context_gpu.json \
        --png benchmarks/results/long_context_gpu.png [--modes stock,hf_ddpfix] [--seqs 32768,65536]

For every mode it reports the step time and ``torch.cuda.max_memory_allocated`` at 32K tokens (the
ratio vs stock from the same run) and the longest sequence of the ladder that trains (ascending until
the first failure: out of memory, a failed budget check, or ``--trial-timeout`` seconds). Modes:

- ``stock``: non-reentrant checkpointing, sdpa, HF's loss (full logits).
- ``offload_tiled``: stock + hf_ddpfix ``ActivationOffload`` + ``tiled_loss`` + ``tiled_mlp="auto"``
  (the set-up of the H100 figures in REFERENCES.md section 8).
- ``+rms_norm``, ``+attention``, ``+tiled_layer``: ``offload_tiled`` plus that long-context feature.
- ``hf_ddpfix``: ``offload_tiled`` plus every long-context feature; the offload keeps as many layer
  inputs on the device as fit (``keep_on_device="auto"``) and its host pool may use ``--host-gib`` GiB
  (pre-flight checked with ``plan_offload_budget``; a run that cannot fit fails before its first step
  with the numbers).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # stand_in_device

RESULTS = Path(__file__).resolve().parent / "results"
KIB, GIB = 1 << 10, 1 << 30
LADDER = [16384, 32768, 49152, 65536, 98304, 131072, 196608, 262144, 393216, 524288, 655360]
MODES = ["stock", "offload_tiled", "+rms_norm", "+attention", "+tiled_layer", "hf_ddpfix", "auto"]
LLAMA_8B = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, layers=32, vocab=128256, lora_r=16)
# Qwen3-8B (its public config.json: hidden 4096, intermediate 12288, 36 layers, 32 heads of 128, 8 KV heads)
QWEN3_8B = dict(hidden=4096, intermediate=12288, heads=32, kv_heads=8, layers=36, vocab=151936, lora_r=16, head_dim=128)
FAMILIES = {"llama": LLAMA_8B, "qwen3": QWEN3_8B}


def _env() -> dict[str, Any]:
    import transformers

    info = {"date": dt.date.today().isoformat(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "host": platform.node()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["device_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
    else:
        info["device"] = f"CPU ({platform.processor() or platform.machine()})"
    return info


# ------------------------------------------------------------------------------------------------ ledger


def run_ledger(args: argparse.Namespace) -> dict[str, Any]:
    from hf_ddpfix.integrations.long_context.layer_ledger import LEDGER_FEATURES, ledger_slope
    from hf_ddpfix.ops.offload.budget import OffloadBudgetError, max_tokens, plan_offload_budget

    rows = {}
    for name in LEDGER_FEATURES:
        t0 = time.perf_counter()
        r = ledger_slope(name, seqs=(args.seq1, args.seq2), tokens_per_tile=args.tokens_per_tile)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        rows[name] = r
        print(f"  {name:12s} {r['kib_per_token']:8.2f} KiB/token  (constant {r['constant_bytes'] / 2**20:7.1f} MiB, "
              f"peak in {r['peak_phase']} at {r['peak_op']})", flush=True)

    # Whole-model projection for the offloaded set-ups: one layer's working set (the ledger) + the
    # prefetched next layer input + the embedding output (2 x 8 KiB/token) + the tiled loss head's
    # input and its gradient (2 x 8 KiB/token); the stored layer inputs go where the budget puts them.
    # Stock is not projected: it also holds full-vocabulary logits (measured ~1.8 MiB/token, issue 14).
    # Calibration: "tiled_mlp" here is the set-up measured on an H100 (offload + tiled_mlp + tiled_loss):
    # its projection is compared with the measured 197 KiB/token (64.5 - 39.9 GiB over 128K -> 256K).
    m = LLAMA_8B
    layer_in = m["hidden"] * 2
    weights = _llama_weight_bytes(m)
    fixed = weights + int(args.fixed_slack_gib * GIB)
    device = int(args.device_gib * GIB)
    host = int(args.host_gib * GIB)
    proj = {}
    for name in ("tiled_mlp", "hf_ddpfix"):
        per_tok = rows[name]["bytes_per_token"] + 4 * layer_in
        fixed_total = fixed + int(rows[name]["constant_bytes"])
        t_max = max_tokens(layers=m["layers"], bytes_per_token_per_layer=layer_in, device_budget_bytes=device,
                           host_budget_bytes=host, fixed_device_bytes=fixed_total, working_bytes_per_token=per_tok)
        # max_tokens: ActivationOffload(keep_on_device="auto") (as many inputs as fit stay on the device,
        # exact-size host pool); below: keep_on_device=1, the offload of before keep-N.
        t_keep1 = max_tokens(layers=m["layers"], bytes_per_token_per_layer=layer_in, device_budget_bytes=device,
                             host_budget_bytes=host, fixed_device_bytes=fixed_total, working_bytes_per_token=per_tok,
                             max_keep=1)
        entry: dict[str, Any] = {"max_tokens": t_max, "max_tokens_keep_last_only": t_keep1, "bytes_per_token": per_tok}
        try:
            b = plan_offload_budget(layers=m["layers"], tokens=args.target_tokens, layer_bytes=args.target_tokens * layer_in,
                                    device_budget_bytes=device, host_budget_bytes=host, fixed_device_bytes=fixed_total,
                                    working_bytes_per_token=per_tok)
            entry["target"] = b.describe()
        except OffloadBudgetError as e:
            entry["target"] = f"{args.target_tokens} tokens do not fit: {e}"
        proj[name] = entry
    proj["tiled_mlp"]["measured_h100_bytes_per_token"] = 197 * KIB
    # Sequence parallelism (Ulysses, N GPUs share one sequence): each GPU at L/N tokens under the same budget,
    # plus the all-to-all buffers (hf_ddpfix.ops.sequence_parallel.memory; benchmarks/sequence_parallel.py)
    from hf_ddpfix.ops.sequence_parallel.memory import project_sequence_parallel

    for name in ("tiled_mlp", "hf_ddpfix"):
        proj[name]["sequence_parallel"] = {n: project_sequence_parallel(
            sp=n, layers=m["layers"], hidden=m["hidden"], heads=m["heads"], kv_heads=m["kv_heads"],
            working_bytes_per_token=proj[name]["bytes_per_token"], fixed_device_bytes=fixed + int(rows[name]["constant_bytes"]),
            device_budget_bytes=device, host_budget_bytes=host).sequence_tokens for n in (2, 4, 8)}
    return {"env": _env(), "shape": {k: v for k, v in m.items() if k != "vocab"}, "seqs": [args.seq1, args.seq2],
            "tokens_per_tile": args.tokens_per_tile, "rows": rows, "projection": proj,
            "projection_assumptions": {"device_gib": args.device_gib, "host_gib": args.host_gib,
                                       "weights_gib": round(weights / GIB, 2), "fixed_slack_gib": args.fixed_slack_gib}}


def _llama_weight_bytes(m: dict[str, int]) -> int:
    h, i, hk = m["hidden"], m["intermediate"], m["hidden"] * m["kv_heads"] // m["heads"]
    per_layer = h * h * 2 + h * hk * 2 + 3 * h * i + 2 * h
    return 2 * (m["layers"] * per_layer + 2 * m["vocab"] * h + h)


def write_ledger(res: dict[str, Any], stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    slim = {**res, "rows": {k: {kk: vv for kk, vv in v.items() if kk != "breakdown"} | {"breakdown": v["breakdown"][:16]}
                            for k, v in res["rows"].items()}}
    stem.with_suffix(".json").write_text(json.dumps(slim, indent=1))
    env = res["env"]
    lines = [f"Ledger of one Llama-8B-shaped decoder layer (fake tensors), {env['date']}, {env['device']}, "
             f"torch {env['torch']}, transformers {env['transformers']}; slope {res['seqs'][0]}->{res['seqs'][1]} tokens.",
             "", "| set-up | KiB/token | constant MiB | peak at |", "|---|---|---|---|"]
    for k, v in res["rows"].items():
        lines.append(f"| {k} | {v['kib_per_token']:.1f} | {v['constant_bytes'] / 2**20:.0f} | {v['peak_phase']} / {v['peak_op']} |")
    for k in ("stock", "hf_ddpfix"):
        lines += ["", f"Live at the peak, {k} ({res['seqs'][1]} tokens; bytes per token):", "",
                  "| phase | module | op | shape | dtype | B/token |", "|---|---|---|---|---|---|"]
        for e in res["rows"][k]["breakdown"][:12]:
            lines.append(f"| {e['phase']} | {e['module']} | {e['op']} | {e['shape']} | {e['dtype']} | "
                         f"{e['bytes'] / res['seqs'][1]:.0f} |")
    lines += ["", "Whole-model projection (assumptions: " + json.dumps(res["projection_assumptions"]) + "):", ""]
    for k, v in res["projection"].items():
        meas = v.get("measured_h100_bytes_per_token")
        lines.append(f"- {k}: longest sequence ~{v['max_tokens']} tokens ({v['bytes_per_token'] / KIB:.0f} KiB/token on "
                     f"the device{f', measured on an H100: {meas / KIB:.0f}' if meas else ''}; "
                     f"~{v['max_tokens_keep_last_only']} keeping only the last input on the device)"
                     f"{'; ' + v['target'] if 'target' in v else ''}")
        if "sequence_parallel" in v:
            lines.append("  - sequence parallel (Ulysses, per GPU as above at L/N tokens + all-to-all buffers): "
                         + ", ".join(f"N={n}: ~{t} tokens" for n, t in v["sequence_parallel"].items()))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(res["rows"])
        vals = [res["rows"][n]["kib_per_token"] for n in names]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar(names, vals, color=["grey"] + ["tab:blue"] * (len(names) - 2) + ["tab:green"])
        ax.axhline(100, color="red", ls="--", lw=1, label="target 100 KiB/token")
        ax.set_ylabel("KiB per token (one layer)")
        ax.set_title("Llama-8B layer: live bytes per token, fwd+recompute+bwd")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=120)
        plt.close(fig)
    except ImportError:
        pass


# ------------------------------------------------------------------------------------------------ GPU


def _trial(mode: str, seq: int, steps: int, host_gib: float, tiny: bool = False, family: str = "llama",
           cap_gib: float | None = None, profile: str | None = None, nominal_seq: int | None = None) -> dict[str, Any]:
    """One trial in this process: a LoRA Llama-8B (or Qwen3-8B: ``family``) trained ``steps`` steps at ``seq``
    tokens **through the Trainer** (``transformers.Trainer`` for ``stock``, ``DDPFixTrainer`` with the mode's
    options otherwise; ``auto``: every memory option ``auto``, so features run only where the memory plan needs
    them).

    ``tiny``: a 2-layer toy shape on the CPU (a smoke test of this code path; no timing meaning; on CPU the
    plan turns the offload off, which the result's ``feature_counts`` shows). ``cap_gib``: the process may
    allocate at most this much of the GPU (``torch.cuda.set_per_process_memory_fraction``: an 80 GB GPU on a
    larger one). ``profile``: a directory; the last step is recorded with ``torch.profiler`` (Chrome trace
    ``<mode>_<seq>.json``) and the result carries the 15 ops with the most device time.

    Memory reads, the cap and synchronisation go through ``benchmarks/stand_in_device.device()``: CUDA, or with
    ``GPU_SUITE_STAND_IN`` set the stand-in device (tiny shapes on the CPU, memory modelled for ``nominal_seq``
    tokens, OOM where told), so the GPU suite's dry run takes these branches too.
    """
    from peft import LoraConfig, get_peft_model
    from stand_in_device import device
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_ddpfix import DDPFixConfig, DDPFixTrainer
    from hf_ddpfix.ops import feature_counts
    from hf_ddpfix.ops.offload.budget import plan_offload_budget

    d = device()
    d = d if d is not None and (d.stand_in or not tiny) else None  # None: a plain CPU smoke run
    cuda = d is not None and not d.stand_in
    dev = d.torch_device if cuda else torch.device("cpu")
    m = dict(FAMILIES[family]) if not tiny else dict(hidden=64, intermediate=160, heads=8, kv_heads=2, layers=2,
                                                      vocab=256, lora_r=4)
    common = dict(hidden_size=m["hidden"], intermediate_size=m["intermediate"], num_attention_heads=m["heads"],
                  num_key_value_heads=m["kv_heads"], num_hidden_layers=m["layers"], vocab_size=m["vocab"],
                  max_position_embeddings=max(seq, 8192), attn_implementation="sdpa", use_cache=False)
    if family == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg, model_cls = Qwen3Config(**common, head_dim=m.get("head_dim", m["hidden"] // m["heads"])), Qwen3ForCausalLM
    else:
        cfg, model_cls = LlamaConfig(**common), LlamaForCausalLM
    if d is not None and cap_gib:
        d.cap(cap_gib)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with dev:
        model = model_cls(cfg)
    torch.set_default_dtype(old)
    model = get_peft_model(model, LoraConfig(r=m["lora_r"], lora_alpha=2 * m["lora_r"], target_modules="all-linear"))
    info: dict[str, Any] = {"mode": mode, "seq": seq, "via": "Trainer", "family": family, "cap_gib": cap_gib}
    feature_counts.reset()
    if mode not in ("stock", "auto"):
        total = d.total_bytes() if d is not None else 64 * GIB
        if d is not None and cap_gib:
            total = min(total, int(cap_gib * GIB))
        used = d.allocated_bytes() if cuda else sum(p.numel() * p.element_size() for p in model.parameters())
        budget = plan_offload_budget(layers=m["layers"], tokens=seq, layer_bytes=seq * m["hidden"] * 2,
                                     device_budget_bytes=int(0.97 * total), host_budget_bytes=int(host_gib * GIB),
                                     fixed_device_bytes=used, working_bytes_per_token=(53 + 32) * KIB * m["hidden"] // 4096)
        info["budget"] = budget.describe()  # pre-flight: raises OffloadBudgetError before any step
    feats = {"+rms_norm": "rms_norm", "+attention": "attention", "+tiled_layer": "tiled_layer", "hf_ddpfix": "all"}.get(mode)
    ids = torch.randint(0, m["vocab"], (seq,), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids}] * steps
    args = TrainingArguments(output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hf_ddpfix_long_context_trial"),
                             per_device_train_batch_size=1, max_steps=steps, learning_rate=1e-5, weight_decay=0.01,
                             max_grad_norm=1.0, bf16=cuda, gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": False}, report_to=[], save_strategy="no",
                             logging_steps=1, disable_tqdm=True, use_cpu=not cuda, dataloader_num_workers=0)
    times: list[float] = []
    seen: dict[str, Any] = {}

    class _Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):  # the runtime is attached by now
            seen["runtime"] = getattr(trainer, "hf_ddpfix_runtime", None)
            off = getattr(seen["runtime"], "offload", None)
            if off is not None:
                off.set_max_pool_bytes(int(host_gib * GIB))  # the host budget the pre-flight check used

        def on_step_begin(self, args, state, control, **kw):
            if d is not None:
                d.synchronize()
                d.step(family, nominal_seq or seq)  # the stand-in raises OOM here where told
            seen["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if d is not None:
                d.synchronize()
            times.append(time.perf_counter() - seen["t0"])
            if profile and state.global_step == steps - 1:  # record the last step
                seen["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if cuda else []))
                seen["prof"].__enter__()

    kwargs: dict[str, Any] = dict(model=model, args=args, train_dataset=data, callbacks=[_Clock()])
    if mode == "stock":
        trainer = Trainer(**kwargs)
    elif mode == "auto":
        trainer = DDPFixTrainer(**kwargs, ddpfix_config=DDPFixConfig(
            offload_activations="auto", tiled_mlp="auto", tiled_loss="auto", long_context="auto"))
    else:
        trainer = DDPFixTrainer(**kwargs, ddpfix_config=DDPFixConfig(
            offload_activations=True, offload_min_layer_mib=0, tiled_mlp="auto", tiled_loss="on", long_context=feats))
    if d is not None:
        d.reset_peak()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = trainer.train()
    if seen.get("prof") is not None:
        prof = seen.pop("prof")
        prof.__exit__(None, None, None)
        Path(profile).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(profile) / f"{family}_{mode}_{seq}.json"))
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        ops = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:15]
        info["profile_top_ops_ms"] = {e.key: round(getattr(e, key, 0) / 1000, 2) for e in ops}
    timed = sorted(times[1:] or times)
    info.update(ok=True, step_s=round(timed[len(timed) // 2], 3), loss=float(out.training_loss),
                peak_gib=round(d.peak_bytes() / GIB, 2) if d is not None else None)
    rt = seen.get("runtime")
    if rt is not None and getattr(rt, "offload", None) is not None:
        info["offload"] = {k: v for k, v in rt.offload.stats.as_dict().items()
                           if k in ("offloaded_bytes", "kept_bytes", "keep_on_device", "pool_bytes")}
    if rt is not None and getattr(rt, "long_context", None) is not None:
        info["long_context_patched"] = len(rt.long_context.patched)
        info["long_context_calls"] = int(rt.long_context.stats["patched calls"])
    info["feature_counts"] = {k: v.as_dict() for k, v in feature_counts.snapshot().items()}
    return info


def _spawn(mode: str, seq: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--trial", "--mode", mode, "--seq", str(seq), "--steps", str(args.steps),
           "--host-gib", str(args.host_gib)]
    env = {**os.environ, "PYTORCH_ALLOC_CONF": os.environ.get("PYTORCH_ALLOC_CONF", "expandable_segments:True")}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.trial_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "seq": seq, "ok": False, "error": f"timeout after {args.trial_timeout}s"}
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("TRIAL "):
            return json.loads(line[6:])
    tail = (p.stderr or p.stdout)[-600:]
    kind = "oom" if "out of memory" in tail.lower() else ("budget" if "OffloadBudgetError" in tail else "error")
    return {"mode": mode, "seq": seq, "ok": False, "error": kind, "tail": tail}


def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device (use --ledger on CPU)")
    modes = args.modes.split(",") if args.modes else MODES
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; allowed: {','.join(MODES)}")
    ladder = [int(s) for s in args.seqs.split(",")] if args.seqs else LADDER
    res: dict[str, Any] = {"env": _env(), "trials": [], "summary": {}}
    for mode in modes:
        longest = 0
        at32 = None
        for seq in sorted(set(ladder) | {32768}):
            r = _spawn(mode, seq, args)
            res["trials"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "tail"}), flush=True)
            if seq == 32768:
                at32 = r
            if not r.get("ok"):
                break
            longest = seq
        res["summary"][mode] = {"longest_tokens": longest, "at_32k": at32}
    base = (res["summary"].get("stock") or {}).get("at_32k") or {}
    for _mode, s in res["summary"].items():
        a = s.get("at_32k") or {}
        if a.get("ok") and base.get("ok"):
            s["step_ratio_vs_stock_32k"] = round(a["step_s"] / base["step_s"], 3)
    return res


def write_gpu(res: dict[str, Any], out: Path, png: Path | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    lines = [f"{res['env']['date']}, {res['env'].get('device')}, torch {res['env']['torch']}, "
             f"transformers {res['env']['transformers']}", "",
             "| mode | longest trainable | 32K step s | 32K peak GiB | ratio vs stock |", "|---|---|---|---|---|"]
    for mode, s in res["summary"].items():
        a = s.get("at_32k") or {}
        lines.append(f"| {mode} | {s['longest_tokens']} | {a.get('step_s', '-')} | {a.get('peak_gib', '-')} | "
                     f"{s.get('step_ratio_vs_stock_32k', '-')} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if png is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 3.5))
            for mode in res["summary"]:
                pts = [(t["seq"], t["peak_gib"]) for t in res["trials"] if t["mode"] == mode and t.get("ok")]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens")
            ax.set_ylabel("peak GiB")
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(png, dpi=120)
            plt.close(fig)
        except ImportError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ledger", action="store_true", help="CPU ledger (fake tensors)")
    ap.add_argument("--gpu", action="store_true", help="longest sequence + 32K step ratio, one process per trial")
    ap.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tiny-trial", action="store_true", help="smoke-test one GPU trial's code path on CPU, toy shape")
    ap.add_argument("--mode", default="stock", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=32768, help=argparse.SUPPRESS)
    ap.add_argument("--seq1", type=int, default=8192)
    ap.add_argument("--seq2", type=int, default=16384)
    ap.add_argument("--tokens-per-tile", type=int, default=2048)
    ap.add_argument("--device-gib", type=float, default=80.0, help="projection: device memory (H100 80GB)")
    ap.add_argument("--host-gib", type=float, default=100.0, help="host memory the offload pool may pin")
    ap.add_argument("--fixed-slack-gib", type=float, default=3.0,
                    help="projection: CUDA context, allocator slack, LoRA/optimizer state, loss chunk")
    ap.add_argument("--target-tokens", type=int, default=524288)
    ap.add_argument("--modes", default="")
    ap.add_argument("--seqs", default="")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trial-timeout", type=float, default=1800)
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama", help="trial: the 8B shape")
    ap.add_argument("--cap-gib", type=float, default=None, help="trial: cap the GPU memory this process may use")
    ap.add_argument("--profile", default=None, help="trial: write a torch.profiler trace of the last step here")
    ap.add_argument("--nominal-seq", type=int, default=None, help="trial: the tokens a tiny trial stands for "
                    "(the GPU suite's stand-in device models memory and OOM for them)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    if args.trial or args.tiny_trial:
        print("TRIAL " + json.dumps(_trial(args.mode, args.seq, args.steps, args.host_gib, tiny=args.tiny_trial,
                                           family=args.family, cap_gib=args.cap_gib, profile=args.profile,
                                           nominal_seq=args.nominal_seq)),
              flush=True)
        return
    if args.gpu:
        res = run_gpu(args)
        write_gpu(res, Path(args.out or RESULTS / "long_context_gpu.json"), Path(args.png) if args.png else None)
        return
    if not args.ledger:
        ap.error("choose --ledger (CPU) or --gpu")
    warnings.simplefilter("ignore", FutureWarning)
    print("Ledger: one Llama-8B-shaped decoder layer, live activation bytes per token (fwd + recompute + bwd):", flush=True)
    res = run_ledger(args)
    stem = Path(args.out).with_suffix("") if args.out else RESULTS / "long_context_ledger_cpu"
    write_ledger(res, stem)
    for k, v in res["projection"].items():
        print(f"  projection {k}: ~{v['max_tokens']} tokens on {args.device_gib:g} GiB + {args.host_gib:g} GiB host "
              f"with keep-N and the exact-size host pool (a projection; ~{v['max_tokens_keep_last_only']} "
              "keeping only the last input on the device)"
              f"{'; ' + v['target'] if 'target' in v else ''}")
        sp = v.get("sequence_parallel", {})
        print(f"  projection {k} with sequence parallelism (per GPU at L/N tokens, {args.host_gib:g} GiB host per GPU): "
              + ", ".join(f"N={n} ~{t} tokens" for n, t in sp.items()))
    print(f"ledger: stock {res['rows']['stock']['kib_per_token']:.1f} KiB/token, "
          f"hf_ddpfix {res['rows']['hf_ddpfix']['kib_per_token']:.1f} KiB/token")


if __name__ == "__main__":
    main()
