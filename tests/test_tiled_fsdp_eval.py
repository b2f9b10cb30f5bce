"""Tiled MLP under FSDP2: the shard-count all-reduce runs only in training forwards, so evaluation and
generation on rank 0 alone after training finish (a synced collective under no_grad used to hang)."""

from __future__ import annotations

import json

import pytest
from launch import torchrun


@pytest.mark.multiprocess
def test_rank0_only_evaluation_and_generation_after_fsdp2_training_do_not_hang(tmp_path):
    out = tmp_path / "eval.json"
    proc = torchrun("tiled_fsdp_eval.py", "--out", str(out), timeout=240, env={"EVAL_WATCHDOG_S": "60"},
                    check=False)
    assert "HANG" not in proc.stdout, proc.stdout[-6000:]
    assert proc.returncode == 0, proc.stdout[-6000:]
    r = json.loads(out.read_text())
    assert r["finished"] and r["tiled_modules"] == 2, r
    chunks = r["train_chunks_per_rank"]
    assert len(set(chunks)) == 1 and chunks[0] > 0, r  # training forwards were tiled, in step across ranks
    assert r["eval_chunks"] == 0, r  # no_grad: the stock forward, no collective
    assert r["logits_equal_untiled_reference"] is True, r
    assert r["generated_tokens"] == 5 + 4, r
