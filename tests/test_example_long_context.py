"""examples/long_context_lora.py runs (tiny model, CPU) and fails early with the budget error when it cannot fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.mark.timeout(300)
def test_example_trains_tiny_model_with_every_long_context_feature(tmp_path):
    p = subprocess.run([sys.executable, "examples/long_context_lora.py", "--tiny", "--seq", "256", "--max-steps", "2",
                        "--output-dir", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=280)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "pre-flight:" in out and "long_context: 7 modules patched" in out
    assert "trained 2 steps of 256 tokens" in out
    # the patched code ran, by its counts: 2 layers x 2 steps x (forward + checkpoint recompute), no fallback
    counts = json.loads(next(line for line in out.splitlines() if line.startswith("feature counts:")).split(":", 1)[1])
    layers = 2
    assert counts["hf_ddpfix/long_context/ran"] == layers * 2 * 2, counts
    assert counts["hf_ddpfix/long_context/fell_back"] == 0, counts
    assert counts["hf_ddpfix/tiled_loss/ran"] == 2 and counts["hf_ddpfix/tiled_loss/fell_back"] == 0, counts


@pytest.mark.timeout(300)
def test_example_stops_before_training_when_the_budget_cannot_hold_the_sequence(tmp_path):
    p = subprocess.run([sys.executable, "examples/long_context_lora.py", "--tiny", "--seq", "4000000000",
                        "--output-dir", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=280)
    assert p.returncode != 0
    assert "OffloadBudgetError" in p.stderr and "device memory budget too small" in p.stderr, p.stderr[-3000:]
    assert "Longest sequence that fits" in p.stderr
