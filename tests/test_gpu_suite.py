"""The GPU suite before a GPU comes (issue 48 item 4): benchmarks/gpu_suite.py runs every branch on the CPU against
its stand-in device (benchmarks/stand_in_device.py: a fake CUDA that reports memory and raises OOM where told), so
the branches most likely to rot (the budget skip, a share running out, the ladder's OOM stop, the memory cap, the
peak reads) have run before the rare session that has a GPU. No figure of a dry run means anything.

One test, five invocations of the suite (under ``python -m coverage`` where coverage is installed):

1. the dry run (every part, toy sizes): each part reaches its rows, the rows show the set-ups they claim (stock
   DDP ``find_unused_parameters=True`` vs hf_ddpfix's fast path; the stand-in's peak read for a trial of the
   32K tokens it stands for, 36.00 GiB; the ladder climbing 32K -> its OOM at 64K; the FSDP part with the plan's units: more units sharded than folded, the dummy run on the
   text-only step only when sharded); its CPU-seconds (suite + workers) and wall time are printed, not asserted
   (89 CPU-seconds, 80 s wall on an idle 2-core machine, 2026-12-02);
2. a starved run (``--budget-s 60 --share step=0,ladder=0,offload=0,fsdp=0``): the part whose share no longer fits
   is skipped (``long``), every other part's workers are stopped at the end of their share (1 s) and their rows say
   so, the ladder stops on its share before its first rung;
3-5. refusals: an unknown part, no CUDA device without ``--dry-run``, the stand-in without ``--dry-run``.

With coverage installed, the combined report of benchmarks/gpu_suite.py must show every line and every branch run
(100 %). Shown failing (2026-12-02): with the budget skip back under ``not a.dry_run`` (the old dry run) a starved
``--parts offload --budget-s 1`` run ran the part instead of skipping it (no "Not run" row: the assertion on
``long``'s row fails); the first coverage run reported one partial branch (``__main__``'s import arc, now excluded
with a pragma) and the check failed on it.
The budget holds the parts' shares with a margin (:data:`gpu_suite.SHARES_TOTAL_S` <= 0.9 x the default budget).
"""

from __future__ import annotations

import importlib.util
import os
import re
import resource
import subprocess
import sys
import time

import pytest
from launch import ROOT

pytestmark = pytest.mark.multiprocess
SUITE = str(ROOT / "benchmarks" / "gpu_suite.py")
HAS_COVERAGE = importlib.util.find_spec("coverage") is not None


def _suite(args: list[str], data: str, env: dict[str, str] | None = None, timeout: float = 900) -> tuple[int, str]:
    cov = [sys.executable, "-m", "coverage", "run", "--branch", "-p", f"--data-file={data}", f"--include={SUITE}"]
    cmd = (cov if HAS_COVERAGE else [sys.executable]) + [SUITE, *args]
    base = {k: v for k, v in os.environ.items() if k != "GPU_SUITE_STAND_IN"}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**base, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})})
    return p.returncode, p.stdout + p.stderr


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def test_budget_holds_the_shares_with_a_margin():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_suite

    assert gpu_suite.SHARES_TOTAL_S <= 0.9 * gpu_suite.DEFAULT_BUDGET_S, (gpu_suite.SHARES_TOTAL_S,
                                                                        gpu_suite.DEFAULT_BUDGET_S)


@pytest.mark.timeout(1800)  # wall time on a shared CI machine; the CPU-seconds bound below is the 2-minute claim
def test_dry_run_takes_every_branch(tmp_path):
    data = str(tmp_path / ".coverage")
    md = tmp_path / "rows.md"
    t0, cpu0 = time.monotonic(), _children_cpu()
    rc, out = _suite(["--dry-run", "--md", str(md)], data)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    print(f"dry run: {wall:.0f} s wall, {cpu:.0f} CPU-seconds (the suite and every worker)")
    assert rc == 0, out[-6000:]
    text = md.read_text()
    assert "DRY RUN on CPU" in text and "<!-- GPU-SUITE-BEGIN -->" in text and "stand-in CUDA device" in text
    for title in ("a. Stock vs hf_ddpfix", "b. Long context", "c. Longest LoRA", "d. Activation offload",
                  "e. FSDP2 VLM units"):
        assert f"### {title}" in text, title
    assert not re.search(r"\| failed: |cut off \(|Not run:|offload: not measured", text), text
    # a (the dry run keeps the VLM case): stock DDP is find_unused_parameters=True; hf_ddpfix's fast path ran
    step = [ln for ln in text.splitlines() if ln.startswith(("| text |", "| vlm |"))]
    assert len(step) == 1 and all("fu=True, static=False | fu=False, static=True" in ln for ln in step), step
    # b: stock and every feature at 32K; the stand-in's peak read (20 GiB + 0.5 GiB per 1K of the 32K stood for)
    long_rows = re.findall(r"^\| 32768 \| (stock|auto|hf_ddpfix) \| [\d.]+ \| .* \| 36\.00 \|", text, re.M)
    assert sorted(long_rows) == ["hf_ddpfix", "stock"], text
    assert "long_context" in text and "top ops by device time)" in text and "no profile recorded" not in text
    # c: the climb to the first OOM under the cap: Llama trains 32K (its peak read), OOM at 64K
    assert "| Llama-8B LoRA r16, all features | 80 GB | 32,768 | 36.00 | 65,536 | OOM |" in text, text
    # e: the plan's units: sharding makes more units than folding, and only then the text-only step runs the dummy
    fsdp = {m[0]: (int(m[1]), int(m[2])) for m in
            re.findall(r"^\| (fold|shard) \| (\d+) \|(?: [\d.]+ \|){3} [\d.-]+ \| (\d+) \|", text, re.M)}
    assert fsdp["shard"][0] > fsdp["fold"][0] and fsdp["fold"][1] == 0 and fsdp["shard"][1] >= 1, fsdp

    starved = tmp_path / "starved.md"
    rc, out = _suite(["--dry-run", "--md", str(starved), "--budget-s", "60", "--share",
                      "step=0,ladder=0,offload=0,fsdp=0"], data, timeout=300)
    assert rc == 0, out[-6000:]
    text = starved.read_text()
    assert re.search(r"### b\. Long context.*\n\nNot run: \d+s of the budget left, the part's share is 390s", text), text
    assert "| vlm | 2 | - | - | cut off (its share) |" in text, text
    assert "offload: not measured (cut off (its share))" in text, text
    assert re.search(r"\| fold \| cut off \(its share\) \|", text), text
    assert "| Llama-8B LoRA r16, all features | 80 GB | none | - | - | its share" in text, text

    for args, env, said in ((["--parts", "nope"], {}, "unknown ['nope']"), ([], {}, "no CUDA device"),
                            ([], {"GPU_SUITE_STAND_IN": '{"name": "x", "total_gib": 80, "base_gib": 1, "gib_per_ktok": 0.1}'},
                             "the stand-in device is for --dry-run")):
        rc, out = _suite(args, data, env, timeout=120)
        assert rc == 2 and said in out, (args, out[-2000:])

    if HAS_COVERAGE:  # every line and branch of the suite file ran in the five invocations
        subprocess.run([sys.executable, "-m", "coverage", "combine", f"--data-file={data}"], cwd=tmp_path,
                       check=True, capture_output=True)
        rep = subprocess.run([sys.executable, "-m", "coverage", "report", f"--data-file={data}", "--show-missing"],
                             cwd=ROOT, capture_output=True, text=True)
        print(rep.stdout)
        assert re.search(r"gpu_suite\.py\s+\d+\s+0\s+\d+\s+0\s+100%", rep.stdout), rep.stdout
    # its cost is a figure, not a bound (speed targets live in benchmarks/, the guide): CPU-seconds rise with the
    # load too (89 on an idle 2-core machine, 170 in CI beside the other stacks, 2026-12-02), so a bound failed CI
    # for load, not for the suite; docs/testing.md keeps the idle measurement
    print(f"dry run cost: {cpu:.0f} CPU-seconds, {wall:.0f} s wall")
