"""Every GPU figure the README and BENCHMARKS.md state, measured by one command in under nine minutes.

    python benchmarks/gpu_suite.py                     # on the GPU machine: writes its rows into BENCHMARKS.md
    python benchmarks/gpu_suite.py --dry-run           # CPU, toy shapes, every branch once, ~1.5 min: CI runs this

A GPU is lent to a session rarely and for ~15 minutes of device time, start-up included, so the suite runs its
parts **in order of value** and writes each part's rows into BENCHMARKS.md (the section between the
``GPU-SUITE`` markers, with date, device, torch/CUDA versions and commit) as soon as the part ends: a run cut
off by the lease still records what it measured. A part whose estimate no longer fits the budget (``--budget-s``,
default 540 s) is skipped and its row says so. Parts (est. seconds on an H100/H200):

a. ``step`` (~150 s): stock vs hf_ddpfix seconds per step through the Trainer, a Llama-3.2-1B LoRA (text) and
   a Qwen2.5-VL-3B LoRA with the tower (mixed image/text ranks), two DDP ranks sharing the GPU over gloo (one GPU
   cannot hold two NCCL ranks; the ratio is honest, the absolute seconds include the other rank's kernels).
b. ``long`` (~170 s): Llama-8B LoRA at 8K and 32K tokens, stock vs ``auto`` (every memory option ``auto``:
   features only where the memory plan needs them; target <= 1.05x where stock fits), plus every long-context
   feature on at 32K with a torch.profiler trace of its last step (where the extra seconds go).
c. ``ladder`` (~120 s): Llama-8B and Qwen3-8B LoRA with every feature under an 80 GB cap
   (``set_per_process_memory_fraction``): peaks at 32K and 64K tokens, and the longest sequence projected from
   the measured slope (a projection, said so); ``--ladder-to N`` climbs for real until the first OOM (minutes per
   rung above 128K: not in the nine-minute run).
d. ``offload`` (~60 s): activation offload vs checkpointing alone at 2K and 16K tokens (``benchmarks/offload.py``).
e. ``fsdp`` (~80 s): peak memory of one FSDP2 step of a Llama-3.2-11B-Vision-shaped model, tower and
   cross-attention folded into the root unit vs sharded as units of their own, rank 0 of 8 simulated with torch's
   fake process group (collectives no-ops, every buffer real).

``--dry-run`` runs every part on the CPU at toy sizes (same scripts, same branches) and writes the rows it would
write to ``--md`` (default: a temporary file, printed) instead of BENCHMARKS.md; no figure of a dry run means
anything and none is written to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
BEGIN, END = "<!-- GPU-SUITE-BEGIN -->", "<!-- GPU-SUITE-END -->"


@dataclass
class Ctx:
    """What every part gets: the mode, the clock and where results go."""

    dry: bool
    deadline: float
    results: Path
    ladder_to: int

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class Part:
    key: str
    title: str
    est_s: float  # on an H100/H200 (the dry run is not budgeted)
    run: Callable[[Ctx], list[str]]  # markdown lines (a table) for BENCHMARKS.md


def _env() -> dict[str, str]:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        commit += "+local changes" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import transformers

    cuda = torch.cuda.is_available()
    return {"date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(0) if cuda else
            f"CPU ({platform.machine()})", "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "transformers": transformers.__version__, "commit": commit}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], ctx: Ctx, env: dict[str, str] | None = None) -> str:
    """Run one worker; its output (stdout + stderr). Past the suite's deadline it is killed (a dry run: 600 s)."""
    timeout = max(5.0, ctx.left()) if not ctx.dry else 600
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false",
            "PYTORCH_ALLOC_CONF": os.environ.get("PYTORCH_ALLOC_CONF", "expandable_segments:True"), **(env or {})}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full, cwd=ROOT)
        return p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return out + f"\nTIMEOUT after {timeout:.0f}s"


def _json_line(out: str, prefix: str) -> dict[str, Any] | None:
    for line in out.splitlines()[::-1]:
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    return None


def _why(out: str) -> str:
    low = out.lower()
    if "out of memory" in low:
        return "OOM"
    if "TIMEOUT" in out:
        return "cut off (budget)"
    return "failed: " + (out.strip().splitlines() or ["no output"])[-1][:120]


# ----------------------------------------------------------------------------------------------- parts


def part_step(ctx: Ctx) -> list[str]:
    rows = ["| case | ranks | stock s/step | hf_ddpfix s/step | ratio | stock DDP | hf_ddpfix DDP |",
            "|---|---|---:|---:|---:|---|---|"]
    for case in ("text", "vlm"):
        port = str(_free_port())
        args = [sys.executable, str(BENCH / "gpu_parts.py"), "ddp-step", "--case", case,
                *(["--dry", "--steps", "3", "--warmup", "1", "--pairs", "1"] if ctx.dry else [])]
        procs = []
        for rank in (0, 1):  # both ranks on GPU 0 over gloo (REFERENCES §8)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                          cwd=ROOT, start_new_session=True))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(5.0, ctx.left()) if not ctx.dry else 600)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outs.append(p.communicate()[0] + "\nTIMEOUT")
        r = _json_line(outs[0], "RESULT ")
        if r is None:
            rows.append(f"| {case} | 2 | - | - | {_why(outs[0] + outs[1])} | | |")
            continue
        (ctx.results / f"gpu_suite_step_{case}.json").write_text(json.dumps(r, indent=1))
        s, h = r["pairs"][0]["stock"], r["pairs"][0]["hf_ddpfix"]
        rows.append(f"| {case} | 2 on one GPU (gloo) | {r['stock_s']:.3f} | {r['hf_ddpfix_s']:.3f} | "
                    f"**{r['ratio']:.3f}×** | fu={s['find_unused_parameters']}, static={s['static_graph']} | "
                    f"fu={h['find_unused_parameters']}, static={h['static_graph']} |")
    return rows


def _trial(ctx: Ctx, mode: str, seq: int, steps: int, family: str = "llama", cap_gib: float | None = None,
           profile: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, str(BENCH / "long_context.py"), "--tiny-trial" if ctx.dry else "--trial", "--mode", mode,
           "--seq", str(seq // 64 if ctx.dry else seq), "--steps", str(steps), "--family", family]
    if cap_gib:
        cmd += ["--cap-gib", str(cap_gib)]
    if profile:
        cmd += ["--profile", str(ctx.results / "gpu_suite_profile")]
    out = _run(cmd, ctx)
    r = _json_line(out, "TRIAL ")
    return r if r is not None else {"mode": mode, "seq": seq, "ok": False, "error": _why(out)}


def _fmt(r: dict[str, Any], key: str, spec: str = ".2f") -> str:
    v = r.get(key)
    if isinstance(v, (int, float)):
        return format(v, spec)
    return "ran (no GPU peak on CPU)" if r.get("ok") and key == "peak_gib" else "-"


def part_long(ctx: Ctx) -> list[str]:
    rows = ["| tokens | mode | s/step | vs stock | peak GiB | features that ran |", "|---:|---|---:|---:|---:|---|"]
    record: list[dict[str, Any]] = []
    # the dry run takes every branch once: the 32K rows (stock, auto and the profiled all-features trial)
    for seq in (32768,) if ctx.dry else (8192, 32768):
        base = None
        for mode in ("stock", "auto") + (("hf_ddpfix",) if seq == 32768 else ()):
            r = _trial(ctx, mode, seq, steps=3 if seq <= 8192 else 2, profile=mode == "hf_ddpfix")
            record.append(r)
            if mode == "stock":
                base = r
            ratio = (f"{r['step_s'] / base['step_s']:.2f}×" if r.get("ok") and base and base.get("ok") else "-")
            ran = ",".join(k for k, v in (r.get("feature_counts") or {}).items() if v.get("ran")) or "none"
            rows.append(f"| {seq} | {mode} | {_fmt(r, 'step_s', '.3f') if r.get('ok') else r.get('error')} | {ratio} | "
                        f"{_fmt(r, 'peak_gib')} | {ran} |")
    (ctx.results / "gpu_suite_long.json").write_text(json.dumps(record, indent=1))
    prof = next((r.get("profile_top_ops_ms") for r in record if r.get("profile_top_ops_ms")), None)
    if prof:
        top = ", ".join(f"{k} {v:.0f} ms" for k, v in list(prof.items())[:6])
        rows += ["", f"Where the all-features 32K step spends its time (profiler, top ops by device time): {top}; trace: "
                 "`benchmarks/results/gpu_suite_profile/`."]
    return rows


def part_ladder(ctx: Ctx) -> list[str]:
    rows = ["| model | cap | 32K peak GiB | 64K peak GiB | GiB per 1K tokens | longest (projected) | climbed to |",
            "|---|---:|---:|---:|---:|---:|---|"]
    cap = 80.0
    record: dict[str, Any] = {}
    families = (("llama", "Llama-8B"), ("qwen3", "Qwen3-8B"))
    for family, name in families[:1] if ctx.dry else families:  # dry run: the branches once (one family)
        a = _trial(ctx, "hf_ddpfix", 32768, steps=1, family=family, cap_gib=cap)
        b = _trial(ctx, "hf_ddpfix", 65536, steps=1, family=family, cap_gib=cap) if a.get("ok") else {"ok": False}
        proj = climbed = "-"
        if a.get("ok") and b.get("ok") and a.get("peak_gib") is not None:
            slope = (b["peak_gib"] - a["peak_gib"]) / 32768  # GiB per token, from the two measured peaks
            proj = f"~{int(65536 + (cap - b['peak_gib']) / slope):,} (projection)" if slope > 0 else "-"
            per_k = f"{slope * 1024:.3f}"
        else:
            per_k = "-"
        seq, last_ok = 131072, None
        while ctx.ladder_to and seq <= ctx.ladder_to and not ctx.dry:  # the real climb, on request only
            r = _trial(ctx, "hf_ddpfix", seq, steps=1, family=family, cap_gib=cap)
            if not r.get("ok"):
                climbed = f"{last_ok or 65536:,} trains, {seq:,}: {r.get('error')}"
                break
            last_ok, seq = seq, seq * 2
        else:
            if last_ok:
                climbed = f"{last_ok:,} trains"
        record[family] = {"32k": a, "64k": b}
        rows.append(f"| {name} LoRA r16, all features | {cap:g} GB | "
                    f"{_fmt(a, 'peak_gib') if a.get('ok') else a.get('error')} | "
                    f"{_fmt(b, 'peak_gib') if b.get('ok') else b.get('error')} | {per_k} | {proj} | {climbed} |")
    (ctx.results / "gpu_suite_ladder.json").write_text(json.dumps(record, indent=1))
    return rows


def part_offload(ctx: Ctx) -> list[str]:
    out_json = ctx.results / "gpu_suite_offload.json"
    cmd = [sys.executable, str(BENCH / "offload.py"), "--out", str(out_json), "--steps", "3", "--seqs",
           *(["64", "256"] if ctx.dry else ["2048", "16384"])]
    out = _run(cmd, ctx)
    if not out_json.exists():
        return [f"offload: not measured ({_why(out)})"]
    md = out_json.with_suffix(".md")
    return md.read_text().strip().splitlines() if md.exists() else [f"see {out_json.name}"]


def part_fsdp(ctx: Ctx) -> list[str]:
    rows = ["| layout | units | model GiB (bf16) | root's own params GiB | resident GiB | step peak GiB | s/step |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for layout in ("folded", "sharded"):
        out = _run([sys.executable, str(BENCH / "gpu_parts.py"), "fsdp-layout", "--layout", layout,
                    *(["--dry"] if ctx.dry else [])], ctx)
        r = _json_line(out, "RESULT ")
        if r is None:
            rows.append(f"| {layout} | {_why(out)} | | | | | |")
            continue
        rows.append(f"| {layout} | {r['units']} | {r['model_gib']:.2f} | {r['root_own_gib']:.2f} | "
                    f"{_fmt(r, 'resident_gib')} | {_fmt(r, 'peak_gib')} | {r['step_s']:.2f} |")
    return rows


PARTS = [
    Part("step", "a. Stock vs hf_ddpfix seconds per DDP step (Trainer, LoRA)", 150, part_step),
    Part("long", "b. Long context at 8K / 32K: stock vs `auto` vs every feature (Llama-8B LoRA)", 170, part_long),
    Part("ladder", "c. Longest LoRA sequence under an 80 GB cap (Llama-8B, Qwen3-8B)", 120, part_ladder),
    Part("offload", "d. Activation offload overhead at 2K / 16K (1.1B Llama)", 60, part_offload),
    Part("fsdp", "e. FSDP2 VLM units: tower + cross-attention folded vs sharded (11B Mllama, rank 0 of 8)", 80,
         part_fsdp),
]


# ------------------------------------------------------------------------------------------------ output


def render(env: dict[str, str], done: dict[str, list[str]], skipped: dict[str, str], dry: bool) -> str:
    head = (f"## GPU suite — {env['device']}, {env['date']} ({'DRY RUN on CPU: no figure means anything' if dry else 'measured'}, "
            f"commit {env['commit']})\n\n`python benchmarks/gpu_suite.py` (docs/testing.md); torch {env['torch']} "
            f"(CUDA {env['cuda']}), transformers {env['transformers']}. Raw results: `benchmarks/results/gpu_suite_*`.")
    body = [head]
    for p in PARTS:
        if p.key in done:
            body += ["", f"### {p.title}", "", *done[p.key]]
        elif p.key in skipped:
            body += ["", f"### {p.title}", "", f"Not run: {skipped[p.key]}."]
    return "\n".join(body) + "\n"


def write_section(md: Path, text: str) -> None:
    """Replace the text between the GPU-SUITE markers of ``md`` (append the markers the first time)."""
    old = md.read_text() if md.exists() else ""
    block = f"{BEGIN}\n{text}{END}"
    if BEGIN in old and END in old:
        new = old[: old.index(BEGIN)] + block + old[old.index(END) + len(END):]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    md.write_text(new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes, every branch; rows to --md, not BENCHMARKS.md")
    ap.add_argument("--parts", default=",".join(p.key for p in PARTS), help="comma list, in this order of value: "
                    + ", ".join(p.key for p in PARTS))
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget; parts that no longer fit are skipped")
    ap.add_argument("--ladder-to", type=int, default=0, help="part c: climb for real up to this many tokens")
    ap.add_argument("--md", default=None, help="where the rows go (default BENCHMARKS.md; a temp file with --dry-run)")
    a = ap.parse_args(argv)
    wanted = a.parts.split(",")
    bad = [k for k in wanted if k not in {p.key for p in PARTS}]
    if bad:
        ap.error(f"--parts: unknown {bad}; allowed: {','.join(p.key for p in PARTS)}")
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --dry-run on a CPU machine")
    results = Path(tempfile.mkdtemp(prefix="gpu_suite_")) if a.dry_run else BENCH / "results"
    results.mkdir(parents=True, exist_ok=True)
    md = Path(a.md) if a.md else (results / "BENCHMARKS.dry.md" if a.dry_run else ROOT / "BENCHMARKS.md")
    ctx = Ctx(dry=a.dry_run, deadline=time.monotonic() + a.budget_s, results=results, ladder_to=a.ladder_to)
    env = _env()
    done: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    print(f"gpu suite: {env}; parts {wanted}; budget {a.budget_s:.0f}s; rows -> {md}", flush=True)
    for p in PARTS:
        if p.key not in wanted:
            continue
        if not ctx.dry and ctx.left() < p.est_s:
            skipped[p.key] = f"{ctx.left():.0f}s of the budget left, the part needs ~{p.est_s:.0f}s"
            print(f"[{p.key}] skipped: {skipped[p.key]}", flush=True)
            continue
        t0 = time.monotonic()
        done[p.key] = p.run(ctx)
        print(f"[{p.key}] {time.monotonic() - t0:.0f}s\n" + "\n".join(done[p.key]), flush=True)
        write_section(md, render(env, done, skipped, a.dry_run))  # a cut-off run keeps what it measured
    write_section(md, render(env, done, skipped, a.dry_run))
    print(f"gpu suite: rows written to {md}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
