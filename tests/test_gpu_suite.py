"""The GPU suite's CPU dry run (benchmarks/gpu_suite.py --dry-run): every part, every branch, toy sizes, so the
suite cannot rot between the rare sessions that have a GPU. No figure of it means anything; the test checks
that every part ran to its rows and that the set-ups compared are the ones the rows claim."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from launch import ROOT

pytestmark = pytest.mark.multiprocess


def test_dry_run_takes_every_part_to_its_rows(tmp_path):
    md = tmp_path / "rows.md"
    p = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--md", str(md)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    text = md.read_text()
    assert "DRY RUN on CPU" in text and "<!-- GPU-SUITE-BEGIN -->" in text
    for title in ("a. Stock vs hf_ddpfix", "b. Long context", "c. Longest LoRA", "d. Activation offload",
                  "e. FSDP2 VLM units"):
        assert f"### {title}" in text, title
    assert not re.search(r"\| (failed:|OOM|cut off)|Not run:|not measured", text), text
    # a: stock DDP is find_unused_parameters=True; hf_ddpfix's fast path ran (fu=False, static graph)
    step = [ln for ln in text.splitlines() if ln.startswith(("| text |", "| vlm |"))]
    assert len(step) == 2 and all("fu=True, static=False | fu=False, static=True" in ln for ln in step), step
    # b: the three modes at 32K (the dry run skips the 8K rows: the same branches); the all-features trial profiled
    assert len(re.findall(r"^\| 32768 \| (stock|auto|hf_ddpfix) \|", text, re.M)) == 3
    assert "long_context" in text and "top ops" in text
    # c: the family the dry run takes (one: the second takes the same branches) ran both rungs
    assert text.count("| 80 GB | ran (no GPU peak on CPU) | ran (no GPU peak on CPU) |") == 1
    # e: sharding the tower and cross-attention makes more units than folding them
    units = dict(re.findall(r"^\| (folded|sharded) \| (\d+) \|", text, re.M))
    assert int(units["sharded"]) > int(units["folded"]), units
