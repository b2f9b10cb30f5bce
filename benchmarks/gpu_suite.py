"""Every GPU figure the README and BENCHMARKS.md state, measured by one command within its budget.

    python benchmarks/gpu_suite.py                     # on the GPU machine: writes its rows into BENCHMARKS.md
    python benchmarks/gpu_suite.py --dry-run           # CPU: the stand-in device, toy shapes, every branch: CI

A GPU is lent to a session rarely and for ~15 minutes of device time, start-up included, so the suite runs its
parts **in order of value**, each within its **share** of seconds (its workers are stopped at the share's end,
so a part can never eat the next one's time), and writes each part's rows into BENCHMARKS.md (the section between
the ``GPU-SUITE`` markers, with date, device, torch/CUDA versions and commit) as soon as the part ends: a run cut
off by the lease still records what it measured. A part whose share no longer fits what is left of the budget
(``--budget-s``, default 540 s) is skipped and its row says so. The shares add to :data:`SHARES_TOTAL_S` = 470 s,
13 % under the budget (the margin covers start-up, imports and writing rows); ``--share part=SECONDS`` changes one.
The shares are estimates for an H100/H200 made without one (no GPU has been lent since 2026-11-25): the first
GPU run's per-part seconds (printed) are what to set them from. Parts:

a. ``step`` (130 s): stock vs hf_ddpfix seconds per step through the Trainer, a Llama-3.2-1B LoRA (text) and
   a Qwen2.5-VL-3B LoRA with the tower (mixed image/text ranks), two DDP ranks sharing the GPU over gloo (one GPU
   cannot hold two NCCL ranks; the ratio is honest, the absolute seconds include the other rank's kernels).
b. ``long`` (130 s): Llama-8B LoRA at 8K and 32K tokens, stock vs ``auto`` (every memory option ``auto``:
   features only where the memory plan needs them; target <= 1.05x where stock fits), plus every long-context
   feature on at 32K with a torch.profiler trace of its last step (where the extra seconds go).
c. ``ladder`` (110 s): the longest LoRA sequence under an 80 GB cap (``set_per_process_memory_fraction``), Llama-8B
   then Qwen3-8B with every feature: the ladder climbs from 32K tokens, doubling, until the first OOM (the row
   says the longest that trained, its peak, and the first that did not) or until its share is spent (the next
   rung is started only when the time left exceeds 2.5x the last rung's; the row says so).
d. ``offload`` (40 s): activation offload vs checkpointing alone at 2K and 16K tokens (``benchmarks/offload.py``).
e. ``fsdp`` (60 s): one FSDP2 step of a Llama-3.2-11B-Vision-shaped LoRA model, rank 0 of 8 (torch's fake process
   group: collectives no-ops, every buffer real), with the **plan's** units (``hf-ddpfix plan``'s computation and
   its layout model, ``fsdp_skippable`` forced to fold, then to shard) and mixed batches (an image step, then a
   text-only step that runs the cross-attention dummy): units, the plan's projected peak and the measured one.

Every memory read, cap and OOM goes through ``benchmarks/stand_in_device.py``: CUDA here, and in ``--dry-run`` a
stand-in device on the CPU that reports modelled memory and raises OOM where told, so the budget skip, the share
stop, the ladder's OOM stop, the memory cap and the peak reads all run in CI (tests/test_gpu_suite.py checks every
branch of this file runs, with coverage). ``--dry-run`` writes the rows to ``--md`` (default: a temporary file)
instead of BENCHMARKS.md; no figure of a dry run means anything and none is written to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
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
sys.path.insert(0, str(BENCH))
from stand_in_device import DRY_RUN_SPEC, ENV, device  # noqa: E402

BEGIN, END = "<!-- GPU-SUITE-BEGIN -->", "<!-- GPU-SUITE-END -->"
#: What differs between the GPU run and the dry run: data, not branches (the dry run takes every branch).
#: ``time_scale``: the dry run's shares and budget are the GPU's x 3 (toy trials on a shared 2-core CPU take
#: longer than their GPU share would allow; the stand-in reports memory, not time). ``growth``: the ladder starts
#: a rung only with ``growth`` x the last rung's seconds left (a doubled sequence costs >= 2x; the dry run's CPU
#: seconds predict nothing, so its ladder stops on OOM or an exhausted share only).
SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"time_scale": 1.0, "growth": 2.5, "trial": "--trial", "seq_div": 1, "step": [], "step_cases": ("text", "vlm"),
            "long": {8192: ("stock", "auto"), 32768: ("stock", "auto", "hf_ddpfix")},
            "ladder": (("llama", "Llama-8B"), ("qwen3", "Qwen3-8B")), "offload": ["2048", "16384"], "fsdp": []},
    # the dry run keeps one case of each code path (CPU-seconds: tests/test_gpu_suite.py)
    "dry": {"time_scale": 3.0, "growth": 0.0, "trial": "--tiny-trial", "seq_div": 64,
            "step": ["--dry", "--steps", "3", "--warmup", "1", "--pairs", "1"], "step_cases": ("vlm",),
            "long": {32768: ("stock", "hf_ddpfix")}, "ladder": (("llama", "Llama-8B"),), "offload": ["64"],
            "fsdp": ["--dry"]},
}


@dataclass
class Ctx:
    """What every part gets: its sizes (a key of :data:`SIZES`), the budget's and its share's deadlines
    (``time.monotonic()``) and where results go."""

    size: str
    deadline: float
    results: Path
    part_deadline: float = 0.0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def part_left(self) -> float:
        return min(self.part_deadline, self.deadline) - time.monotonic()

    def timeout(self) -> float:
        """A worker's timeout: what is left of the part's share (at least 1 s)."""
        return max(1.0, self.part_left())


@dataclass(frozen=True)
class Part:
    key: str
    title: str
    share_s: float  # seconds on an H100/H200 (an estimate until a GPU run measures it); workers stop at its end
    run: Callable[[Ctx], list[str]]  # markdown lines (a table) for BENCHMARKS.md


def _git(*args: str) -> str:
    git = shutil.which("git") or "true"  # no git (a copied tree): the commit is "unknown"
    return subprocess.run([git, *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _env(dev: Any) -> dict[str, str]:
    import torch
    import transformers

    commit = (_git("rev-parse", "--short", "HEAD") or "unknown") + (
        "+local changes" if _git("status", "--porcelain", "--untracked-files=no") else "")
    return {"date": dt.date.today().isoformat(), "device": dev.name(), "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "transformers": transformers.__version__, "commit": commit,
            "host": platform.machine()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], ctx: Ctx, env: dict[str, str] | None = None) -> str:
    """Run one worker; its output (stdout + stderr). At the end of the part's share it is killed."""
    timeout = ctx.timeout()
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false",
            "PYTORCH_ALLOC_CONF": os.environ.get("PYTORCH_ALLOC_CONF", "expandable_segments:True"), **(env or {})}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full, cwd=ROOT)
        return p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return out + f"\nTIMEOUT after {timeout:.0f}s"


def _json_line(out: str, prefix: str) -> dict[str, Any] | None:
    for line in out.splitlines()[::-1]:
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    return None


def _why(out: str) -> str:
    low = out.lower()
    kinds = (("out of memory", "OOM"), ("timeout after", "cut off (its share)"))
    return next((why for key, why in kinds if key in low),
                "failed: " + (out.strip().splitlines() or ["no output"])[-1][:120])


# ----------------------------------------------------------------------------------------------- parts


def part_step(ctx: Ctx) -> list[str]:
    rows = ["| case | ranks | stock s/step | hf_ddpfix s/step | ratio | stock DDP | hf_ddpfix DDP |",
            "|---|---|---:|---:|---:|---|---|"]
    for case in SIZES[ctx.size]["step_cases"]:
        port = str(_free_port())
        args = [sys.executable, str(BENCH / "gpu_parts.py"), "ddp-step", "--case", case, *SIZES[ctx.size]["step"]]
        procs = []
        for rank in (0, 1):  # both ranks on GPU 0 over gloo (REFERENCES §8)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                          cwd=ROOT, start_new_session=True))
        outs = []
        for p in procs:
            timeout = ctx.timeout()
            try:
                outs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outs.append(p.communicate()[0] + f"\nTIMEOUT after {timeout:.0f}s")
        r = _json_line(outs[0], "RESULT ")
        if r is None:
            rows.append(f"| {case} | 2 | - | - | {_why(''.join(outs))} | | |")
            continue
        (ctx.results / f"gpu_suite_step_{case}.json").write_text(json.dumps(r, indent=1))
        s, h = r["pairs"][0]["stock"], r["pairs"][0]["hf_ddpfix"]
        rows.append(f"| {case} | 2 on one GPU (gloo) | {r['stock_s']:.3f} | {r['hf_ddpfix_s']:.3f} | "
                    f"**{r['ratio']:.3f}×** | fu={s['find_unused_parameters']}, static={s['static_graph']} | "
                    f"fu={h['find_unused_parameters']}, static={h['static_graph']} |")
    return rows


def _trial(ctx: Ctx, mode: str, seq: int, steps: int, family: str = "llama", cap_gib: float | None = None,
           profile: bool = False) -> dict[str, Any]:
    """One ``benchmarks/long_context.py`` trial of ``seq`` tokens (the dry run: a toy trial of ``seq / 64``
    tokens that the stand-in device treats as ``seq``), with its wall seconds."""
    size = SIZES[ctx.size]
    cmd = [sys.executable, str(BENCH / "long_context.py"), size["trial"], "--mode", mode,
           "--seq", str(seq // size["seq_div"]), "--nominal-seq", str(seq), "--steps", str(steps), "--family", family]
    cmd += ["--cap-gib", str(cap_gib)] if cap_gib else []
    cmd += ["--profile", str(ctx.results / "gpu_suite_profile")] if profile else []
    t0 = time.monotonic()
    out = _run(cmd, ctx)
    r = _json_line(out, "TRIAL ") or {"mode": mode, "seq": seq, "ok": False, "error": _why(out)}
    return {**r, "wall_s": time.monotonic() - t0}


def _fmt(r: dict[str, Any], key: str, spec: str = ".2f") -> str:
    v = r.get(key)
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def part_long(ctx: Ctx) -> list[str]:
    rows = ["| tokens | mode | s/step | vs stock | peak GiB | features that ran |", "|---:|---|---:|---:|---:|---|"]
    record: list[dict[str, Any]] = []
    for seq, modes in SIZES[ctx.size]["long"].items():
        base = None
        for mode in modes:
            r = _trial(ctx, mode, seq, steps=3 if seq <= 8192 else 2, profile=mode == "hf_ddpfix")
            record.append(r)
            base = base or r
            ratio = (f"{r['step_s'] / base['step_s']:.2f}×" if r.get("ok") and base.get("ok") else "-")
            ran = ",".join(k for k, v in (r.get("feature_counts") or {}).items() if v.get("ran")) or "none"
            rows.append(f"| {seq} | {mode} | {_fmt(r, 'step_s', '.3f') if r.get('ok') else r.get('error')} | {ratio} | "
                        f"{_fmt(r, 'peak_gib')} | {ran} |")
    (ctx.results / "gpu_suite_long.json").write_text(json.dumps(record, indent=1))
    prof = next((r["profile_top_ops_ms"] for r in record if r.get("profile_top_ops_ms")), {})
    top = ", ".join(f"{k} {v:.0f} ms" for k, v in list(prof.items())[:6]) or "no profile recorded"
    return rows + ["", f"Where the all-features 32K step spends its time (profiler, top ops by device time): {top}; "
                   "trace: `benchmarks/results/gpu_suite_profile/`."]


#: the ladder starts here and doubles, under this cap
LADDER_START, LADDER_CAP_GIB = 32768, 80.0


def part_ladder(ctx: Ctx) -> list[str]:
    rows = ["| model | cap | longest that trained | its peak GiB | first that did not | stopped by |",
            "|---|---:|---:|---:|---:|---|"]
    record: dict[str, Any] = {}
    families, growth = SIZES[ctx.size]["ladder"], SIZES[ctx.size]["growth"]
    for i, (family, name) in enumerate(families):
        deadline = time.monotonic() + ctx.part_left() / (len(families) - i)  # the rest of the share, split
        seq, last, last_wall, rungs = LADDER_START, None, 0.0, []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or left < growth * last_wall:
                stop, failed = f"its share ({max(0.0, left):.0f} s left, the next rung needs ~{growth * last_wall:.0f} s)", "-"
                break
            r = _trial(ctx, "hf_ddpfix", seq, steps=1, family=family, cap_gib=LADDER_CAP_GIB)
            rungs.append({**r, "tokens": seq})
            if not r.get("ok"):
                stop, failed = r.get("error", "failed"), f"{seq:,}"
                break
            last, last_wall, seq = {**r, "tokens": seq}, r["wall_s"], seq * 2
        record[family] = rungs
        longest = f"{last['tokens']:,}" if last else "none"
        rows.append(f"| {name} LoRA r16, all features | {LADDER_CAP_GIB:g} GB | {longest} | "
                    f"{_fmt(last or {}, 'peak_gib')} | {failed} | {stop} |")
    (ctx.results / "gpu_suite_ladder.json").write_text(json.dumps(record, indent=1))
    return rows


def part_offload(ctx: Ctx) -> list[str]:
    out_json = ctx.results / "gpu_suite_offload.json"
    cmd = [sys.executable, str(BENCH / "offload.py"), "--out", str(out_json), "--steps", "3", "--seqs",
           *SIZES[ctx.size]["offload"]]
    out = _run(cmd, ctx)
    if not out_json.exists():
        return [f"offload: not measured ({_why(out)})"]
    md = out_json.with_suffix(".md")
    return md.read_text().strip().splitlines() if md.exists() else [f"see {out_json.name}"]


def part_fsdp(ctx: Ctx) -> list[str]:
    rows = ["| fsdp_skippable | units | root GiB | plan's peak GiB (params) | plan's rank GiB | measured peak GiB | "
            "dummy runs | s/step |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in ("fold", "shard"):
        out = _run([sys.executable, str(BENCH / "gpu_parts.py"), "fsdp-layout", "--skippable", mode,
                    *SIZES[ctx.size]["fsdp"]], ctx)
        r = _json_line(out, "RESULT ")
        if r is None:
            rows.append(f"| {mode} | {_why(out)} | | | | | | |")
            continue
        rows.append(f"| {r['skippable']} | {r['units']} | {r['root_gib']:.2f} | {r['plan_peak_gib']:.2f} | "
                    f"{r['plan_rank_gib']:.2f} | {_fmt(r, 'peak_gib')} | {r['dummy_runs']} | {r['step_s']:.2f} |")
    return rows


PARTS = [
    Part("step", "a. Stock vs hf_ddpfix seconds per DDP step (Trainer, LoRA)", 130, part_step),
    Part("long", "b. Long context at 8K / 32K: stock vs `auto` vs every feature (Llama-8B LoRA)", 130, part_long),
    Part("ladder", "c. Longest LoRA sequence under an 80 GB cap: climbed to the first OOM (Llama-8B, Qwen3-8B)",
         110, part_ladder),
    Part("offload", "d. Activation offload overhead at 2K / 16K (1.1B Llama)", 40, part_offload),
    Part("fsdp", "e. FSDP2 VLM units of the plan: tower + cross-attention folded vs sharded (11B Mllama, rank 0 of 8)",
         60, part_fsdp),
]
#: what the shares add to; the default budget holds it with a 13 % margin (tests/test_gpu_suite.py)
SHARES_TOTAL_S = sum(p.share_s for p in PARTS)
DEFAULT_BUDGET_S = 540.0


# ------------------------------------------------------------------------------------------------ output


def render(env: dict[str, str], done: dict[str, list[str]], skipped: dict[str, str], dry: bool) -> str:
    head = (f"## GPU suite — {env['device']}, {env['date']} ({'DRY RUN on CPU: no figure means anything' if dry else 'measured'}, "
            f"commit {env['commit']})\n\n`python benchmarks/gpu_suite.py` (docs/testing.md); torch {env['torch']} "
            f"(CUDA {env['cuda']}), transformers {env['transformers']}. Raw results: `benchmarks/results/gpu_suite_*`.")
    body = [head] + [line for p in PARTS if p.key in done or p.key in skipped
                     for line in ["", f"### {p.title}", "", *done.get(p.key, [f"Not run: {skipped.get(p.key)}."])]]
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
    ap.add_argument("--dry-run", action="store_true", help="CPU: the stand-in device, toy sizes, every branch; rows "
                    "to --md, not BENCHMARKS.md")
    ap.add_argument("--parts", default=",".join(p.key for p in PARTS), help="comma list, in this order of value: "
                    + ", ".join(p.key for p in PARTS))
    ap.add_argument("--budget-s", type=float, default=None, help=f"wall-clock budget (default {DEFAULT_BUDGET_S:.0f} "
                    "s; the dry run's x 3); parts whose share no longer fits are skipped")
    ap.add_argument("--share", default="", help="part=seconds[,part=seconds]: change parts' shares (defaults: "
                    + ", ".join(f"{p.key}={p.share_s:g}" for p in PARTS) + ")")
    ap.add_argument("--md", default=None, help="where the rows go (default BENCHMARKS.md; a temp file with --dry-run)")
    a = ap.parse_args(argv)
    wanted = a.parts.split(",")
    explicit = dict(item.split("=", 1) for item in a.share.split(",") if "=" in item)
    bad = [k for k in wanted + list(explicit) if k not in {p.key for p in PARTS}]
    if bad:
        ap.error(f"--parts / --share: unknown {bad}; allowed: {','.join(p.key for p in PARTS)}")
    if a.dry_run:
        os.environ[ENV] = json.dumps(DRY_RUN_SPEC)  # the workers see it too
    dev = device()
    if dev is None or dev.stand_in != a.dry_run:
        ap.error("no CUDA device: run with --dry-run on a CPU machine" if dev is None else
                 f"{ENV} is set: the stand-in device is for --dry-run only (its figures are not measurements)")
    size = "dry" if a.dry_run else "gpu"
    scale = SIZES[size]["time_scale"]
    shares = {**{p.key: p.share_s * scale for p in PARTS}, **{k: float(v) for k, v in explicit.items()}}
    budget = a.budget_s if a.budget_s is not None else DEFAULT_BUDGET_S * scale
    results = Path(tempfile.mkdtemp(prefix="gpu_suite_")) if a.dry_run else BENCH / "results"
    results.mkdir(parents=True, exist_ok=True)
    md = Path(a.md) if a.md else (results / "BENCHMARKS.dry.md" if a.dry_run else ROOT / "BENCHMARKS.md")
    ctx = Ctx(size=size, deadline=time.monotonic() + budget, results=results)
    env = _env(dev)
    done: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    print(f"gpu suite: {env}; parts {wanted}; budget {budget:.0f}s, shares {shares} (sum "
          f"{sum(shares[k] for k in wanted):.0f}s); rows -> {md}", flush=True)
    for p in [p for p in PARTS if p.key in wanted]:
        if ctx.left() < shares[p.key]:
            skipped[p.key] = f"{ctx.left():.0f}s of the budget left, the part's share is {shares[p.key]:.0f}s"
            print(f"[{p.key}] skipped: {skipped[p.key]}", flush=True)
            continue
        t0 = time.monotonic()
        ctx.part_deadline = t0 + shares[p.key]
        done[p.key] = p.run(ctx)
        print(f"[{p.key}] {time.monotonic() - t0:.0f}s of its {shares[p.key]:.0f}s share\n" + "\n".join(done[p.key]),
              flush=True)
        write_section(md, render(env, done, skipped, a.dry_run))  # a cut-off run keeps what it measured
    write_section(md, render(env, done, skipped, a.dry_run))
    print(f"gpu suite: rows written to {md}", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no branch - always run as a script (its false arc is an import)
    raise SystemExit(main())
