"""A parameter unfrozen after DDP wrapped the model (tests/scripts/unfreeze_ddp.py): hf_ddpfix averages its
gradient over the ranks from the step of the change, so 2-process DDP equals a one-process run with the same
global batch; the stock Trainer's replicas drift apart."""

from __future__ import annotations

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
