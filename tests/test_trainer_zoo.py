"""The trainer zoo under 2-process DDP (one process group for every case): hf_ddpfix vs stock, same data.

What each case is and why stock's setting is the reference: tests/scripts/trainer_zoo.py (TRL) and
tests/scripts/trainer_heads.py (the plain Trainer with hidden-state heads: tests/test_usage_at_loss.py).
"""

from __future__ import annotations

import re

from launch import torchrun

CASES = ("sft_vlm", "sft_text", "sft_text_unfused", "sft_packing", "dpo_text", "reward_text", "grpo_text")


def test_trl_trainers_train_bit_equal_to_stock_with_find_unused_off() -> None:
    done = torchrun("trainer_zoo.py", "--cases", ",".join(CASES), timeout=600)
    assert done.stdout.count("TRAINER_ZOO_OK") == 2, done.stdout[-4000:]
    for case in CASES:
        lines = re.findall(rf"\] {case}: stock fu=True, hf_ddpfix fu=False, max \|fix - stock\| = 0\.0e\+00", done.stdout)
        assert len(lines) == 2, f"{case} not bit-equal on both ranks:\n{done.stdout[-4000:]}"
    # the text-only rank of the VLM case tied every vision LoRA tensor into the loss given to backward,
    # every step (at the output where TRL back-propagates the model's own loss, else at the loss);
    # the image rank tied none. Counts and the expectation (steps x tensors): trainer_zoo._check_vlm_ties
    tied = dict(re.findall(r"\[rank (\d)\] sft_vlm: vision tensors tied into the backward loss (\d+) = ", done.stdout))
    assert tied.get("0") == "0" and int(tied.get("1", 0)) > 0, done.stdout[-4000:]
