"""A parameter unfrozen after DDP wrapped the model (tests/scripts/unfreeze_ddp.py): hf_ddpfix averages its
gradient over the ranks from the step of the change, so 2-process DDP equals a one-process run with the same
global batch; the stock Trainer's replicas drift apart."""

from __future__ import annotations

import re

import pytest
import torch
from launch import torchrun


@pytest.mark.multiprocess
def test_a_head_unfrozen_at_step_2_trains_like_one_process_sgd_and_adamw(tmp_path):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    torchrun("unfreeze_ddp.py", "--out", str(one), nproc=1, timeout=240)
    done = torchrun("unfreeze_ddp.py", "--out", str(two), nproc=2, timeout=300)
    ref, got = torch.load(one), torch.load(two)
    gaps = got["gaps"]
    for opt in ("sgd", "adamw"):
        diff = max((got["weights"][opt][n] - ref["weights"][opt][n]).abs().max().item() for n in ref["weights"][opt])
        assert diff <= 1e-6, (opt, diff)
        assert gaps[f"head_moved_{opt}"] > 1e-3, gaps  # the unfrozen head was trained
        assert gaps[f"fixed_rank_gap_{opt}"] == 0.0, gaps
        assert gaps[f"stock_rank_gap_{opt}"] > 1e-4, gaps  # what stock DDP does: the replicas drift apart
    assert "require grad that did not when DDP wrapped the model (lm_head.weight)" in done.stdout, done.stdout[-3000:]


@pytest.mark.multiprocess
def test_fsdp_and_rank_mismatched_unfreezing_are_refused_at_the_step_on_every_rank():
    done = torchrun("trainable_set_refusals.py", timeout=120)
    out = done.stdout
    assert "NOT_REFUSED" not in out, out[-3000:]
    for case in ("fsdp", "ddp_mismatch", "ddp_one_rank"):
        assert sorted(re.findall(rf"REFUSED rank=(\d) case={case} ok=True", out)) == ["0", "1"], out[-3000:]
    assert sorted(re.findall(r"QUIET rank=(\d) reduced=0", out)) == ["0", "1"], out[-3000:]


@pytest.mark.multiprocess
def test_deepspeed_zero2_and_zero3_refuse_a_head_unfrozen_at_step_2_and_a_plain_run_is_untouched():
    """tests/scripts/unfreeze_deepspeed.py through the Trainer: stock ZeRO trains on and silently never steps the
    unfrozen head; hf_ddpfix raises at step 2 on every rank. Without a change: bit-equal to stock (ZeRO-2 and
    ZeRO-3), no warning."""
    done = torchrun("unfreeze_deepspeed.py", timeout=300, env={"DS_ACCELERATOR": "cpu"})
    out = done.stdout
    assert "NOT_REFUSED" not in out, out[-3000:]
    for case in ("zero2", "zero3"):
        assert sorted(re.findall(rf"REFUSED rank=(\d) case={case} ok=True", out)) == ["0", "1"], out[-3000:]
    for case in ("zero2", "zero3"):
        assert sorted(re.findall(rf"QUIET rank=(\d) case={case} diff=0\.0(?![0-9e])", out)) == ["0", "1"], out[-3000:]
    quiet = (out + done.stderr).split("REFUSED", 1)[0]
    assert "hf_ddpfix: at optimizer step" not in quiet and "require grad" not in quiet, quiet[-3000:]
