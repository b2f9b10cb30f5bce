"""examples/long_context_lora.py fails early with the budget error when it cannot fit (one process, before any
training); its 2-process training run is tests/test_examples_launched.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.mark.timeout(300)
def test_example_stops_before_training_when_the_budget_cannot_hold_the_sequence(tmp_path):
    p = subprocess.run([sys.executable, "examples/long_context_lora.py", "--tiny", "--seq", "4000000000",
                        "--output-dir", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=280)
    assert p.returncode != 0
    assert "OffloadBudgetError" in p.stderr and "device memory budget too small" in p.stderr, p.stderr[-3000:]
    assert "Longest sequence that fits" in p.stderr
