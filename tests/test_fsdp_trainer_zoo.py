"""The trainer zoo under the Trainer's FSDP2 (tests/scripts/fsdp_trainer_zoo.py): TRL ``SFTTrainer`` on a VLM
(Qwen2-VL, rank 0 with an image and rank 1 text-only every step), ``DPOTrainer``, ``RewardTrainer`` and a plain
``Trainer`` with a ``compute_loss`` of its own, each through ``patch_trainer()`` under ``fsdp.yaml`` (2 gloo
processes, the FSDP test device), against stock DDP (``find_unused_parameters`` as stock needs it) on the same
data in fp32: the model is FSDP2-wrapped and the weights agree within :data:`TOL`, or the case is refused with a
``PlanError`` whose reason is recorded.
"""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, accelerate_launch, fsdp_device_env, torchrun

SCRIPT = ROOT / "tests" / "scripts" / "fsdp_trainer_zoo.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
CASES = ("sft_vlm", "dpo_text", "reward_text", "head_in_compute_loss")
TOL = 1.5e-7  # tests/test_fsdp_trainer.py's FSDP2-vs-DDP spread (reduce-scatter vs all-reduce order)


@pytest.mark.multiprocess
def test_trainer_zoo_under_trainer_fsdp2_like_stock_ddp(tmp_path):
    ref = torchrun(SCRIPT, "--mode", "stock-ddp", "--dir", str(tmp_path), "--cases", ",".join(CASES), timeout=420,
                   env=OFFLINE)
    assert "FSDP_TRAINER_ZOO_OK" in ref.stdout, ref.stdout[-4000:]
    ours = accelerate_launch("fsdp.yaml", SCRIPT, "--mode", "fsdp", "--dir", str(tmp_path), "--cases", ",".join(CASES),
                             timeout=420, env=fsdp_device_env(OFFLINE), extra=("--mixed_precision", "no"))
    assert "[fsdp_device] accelerate FSDP2 on CPU/gloo" in ours.stdout, ours.stdout[-4000:]
    for case in CASES:
        stock, fixed = torch.load(tmp_path / f"{case}.pt"), torch.load(tmp_path / f"fsdp-{case}.pt")
        assert stock["error"] is None and not stock["units"], (case, stock["error"])
        if fixed["error"] is not None:
            assert fixed["error"].startswith("PlanError"), (case, fixed["error"])
            continue
        assert fixed["wrapped"].startswith("FSDP") and len(fixed["units"]) >= 2, (case, fixed["wrapped"])
        assert fixed["weights"].keys() == stock["weights"].keys(), case
        diff = max((fixed["weights"][k] - stock["weights"][k]).abs().max().item() for k in stock["weights"])
        assert diff <= TOL, f"{case}: max |W_fsdp2 - W_ddp| = {diff:.2e} > {TOL:.0e}"
