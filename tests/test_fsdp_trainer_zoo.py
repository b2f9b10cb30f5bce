"""The trainer zoo under the Trainer's FSDP2 (tests/scripts/fsdp_trainer_zoo.py): TRL ``DPOTrainer``,
``RewardTrainer`` and a plain ``Trainer`` whose ``compute_loss`` calls a head of the model outside its forward,
each through ``patch_trainer()`` under ``fsdp.yaml`` (2 gloo processes, the FSDP test device), against stock DDP
(``find_unused_parameters`` as stock needs it) on the same data in fp32: the model is FSDP2-wrapped and the
weights agree within :data:`TOL`, or the case is refused with a ``PlanError`` whose reason is recorded; a refusal
passes only where :data:`EXPECTED_REFUSALS` names that case and its message (none today: every case trains), any
other refusal fails the test.

Measured (2026-11-27): DPO 8.9e-8, Reward 0, head in ``compute_loss`` 3.0e-8 (stock FSDP2 vs stock DDP: the same
figures). Before ``ParameterUsage.observe_loss`` the head's gradients were reset to ``None`` every step under
FSDP2 (8 over 4 steps): 2.5e-2, which this test catches. TRL ``SFTTrainer`` on Qwen2-VL, rank 0 with images,
rank 1 text-only (``sft_vlm``; ``sft_vlm_sgd`` with SGD; ``sft_vlm_ga2`` with gradient accumulation 2): 9.9e-7 with
AdamW (4.1e-6 on another CPU), 7.5e-9 with SGD, bit-equal with accumulation 2 (AdamW); stock FSDP2 crashes in
step 1 (gloo "collective mismatch"; NCCL: hang), and so did hf_ddpfix before its loss observer moved a unit's
unreached ties into the loss (the text-only rank tied the vision LoRA into ``loss``, which SFTTrainer's fused LM head
path never back-propagates: its root reduce-scatter then lacked those gradients). Wall ~25 s + ~60 s (95 s loaded).
"""

from __future__ import annotations

import re

import pytest
import torch
from launch import ROOT, accelerate_launch, fsdp_device_env, torchrun

SCRIPT = ROOT / "tests" / "scripts" / "fsdp_trainer_zoo.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
CASES = ("dpo_text", "reward_text", "head_in_compute_loss", "sft_vlm", "sft_vlm_sgd", "sft_vlm_ga2")
TOL = 1.5e-7  # tests/test_fsdp_trainer.py's FSDP2-vs-DDP spread (reduce-scatter vs all-reduce order)
# sft_vlm with AdamW: measured 9.9e-7 (a LoRA A element of layer 0's MLP), 4.1e-6 on another CPU (2026-12-03), the
# same run with SGD 7.5e-9: AdamW's lr * m / (sqrt(v) + eps) turns the reduction-order rounding of a near-zero
# gradient element into a step of up to lr, so the AdamW cases get the bound of the ZeRO AdamW cells
# (tests/scripts/trainer_zoo.py's ADAM_TOL) and sft_vlm_sgd, linear in the gradient, is the tight check (TOL).
# Stock FSDP2 cannot give its own spread here: it crashes in step 1.
# sft_vlm_ga2 (gradient accumulation 2, AdamW): measured bit-equal (0); the AdamW bound of sft_vlm applies to it too
ADAM_TOL = 5e-5
CASE_TOL = {"sft_vlm": ADAM_TOL, "sft_vlm_ga2": ADAM_TOL}
#: case -> (the error's kind, a regular expression its message must match): the refusals that are the expected
#: behaviour. Empty: every case trains under FSDP2 (a PlanError in any of them is a failure, not a pass).
EXPECTED_REFUSALS: dict[str, tuple[str, str]] = {}


def check_refusal(case: str, error: str | None) -> bool:
    """True when ``case`` was refused as :data:`EXPECTED_REFUSALS` says (the caller skips its weight check); False
    when it trained; an unexpected refusal, or an expected one that did not come, fails."""
    expected = EXPECTED_REFUSALS.get(case)
    if error is None:
        assert expected is None, f"{case}: expected the refusal {expected}, but it trained"
        return False
    assert expected is not None, f"{case}: refused, which no expected refusal names: {error}"
    kind, message = expected
    assert error.startswith(f"{kind}: ") and re.search(message, error), (case, error, expected)
    return True


@pytest.mark.multiprocess
def test_trainer_zoo_under_trainer_fsdp2_like_stock_ddp(tmp_path):
    ref = torchrun(SCRIPT, "--mode", "stock-ddp", "--dir", str(tmp_path), "--cases", ",".join(CASES), timeout=300,
                   env=OFFLINE)
    assert "FSDP_TRAINER_ZOO_OK" in ref.stdout, ref.stdout[-4000:]
    ours = accelerate_launch("fsdp.yaml", SCRIPT, "--mode", "fsdp", "--dir", str(tmp_path), "--cases", ",".join(CASES),
                             timeout=300, env=fsdp_device_env(OFFLINE), extra=("--mixed_precision", "no"))
    assert "[fsdp_device] accelerate FSDP2 on CPU/gloo" in ours.stdout, ours.stdout[-4000:]
    for case in CASES:
        stock, fixed = torch.load(tmp_path / f"{case}.pt"), torch.load(tmp_path / f"fsdp-{case}.pt")
        assert stock["error"] is None and not stock["units"], (case, stock["error"])
        if check_refusal(case, fixed["error"]):
            continue
        assert fixed["wrapped"].startswith("FSDP") and len(fixed["units"]) >= 2, (case, fixed["wrapped"])
        assert fixed["weights"].keys() == stock["weights"].keys(), case
        diff = max((fixed["weights"][k] - stock["weights"][k]).abs().max().item() for k in stock["weights"])
        tol = CASE_TOL.get(case, TOL)
        assert diff <= tol, f"{case}: max |W_fsdp2 - W_ddp| = {diff:.2e} > {tol:.0e}"
    # the head called in compute_loss: its gradients kept (what the loss really used), none reset; the ties made at
    # the output (lm_head's LoRA, unused by the loss on both ranks) are moved into the loss, alike on both ranks
    import ast

    found = re.search(r"head_in_compute_loss parameter_usage: \(0, (\{[^}]*\})", ours.stdout)
    assert found, ours.stdout[-4000:]
    amounts = ast.literal_eval(found.group(1))
    assert {k: amounts.get(k) for k in ("forwards", "ties_at_output", "used_at_loss", "ties_moved_to_loss")} == {
        "forwards": 4, "ties_at_output": 8, "used_at_loss": 8, "ties_moved_to_loss": 8}, amounts
    assert set(amounts) <= {"forwards", "ties_at_output", "used_at_loss", "ties_moved_to_loss",
                            "real_grads_outside_loss"} and "grads_reset" not in amounts, amounts
    # SFTTrainer on the VLM: the text-only rank ties the vision tower's 10 LoRA tensors (folded into the root unit)
    # into the output's `loss` every forward; SFTTrainer back-propagates `-log_probs` (TRL's fused head), so the loss
    # observer moves the ties into the loss given to backward
    assert "[rank 1] sft_vlm parameter_usage: (0, {'forwards': 3, 'ties_at_output': 30, 'ties_moved_to_loss': 30}" \
        in ours.stdout, ours.stdout[-4000:]
    assert "[rank 0] sft_vlm parameter_usage: (0, {'forwards': 3}" in ours.stdout, ours.stdout[-4000:]
    # gradient accumulation 2: 6 forwards (2 micro-batches of different lengths per step, FSDP2 reduce-scatters at
    # the second only); the text-only rank's ties move into the loss in every micro-batch
    assert "[rank 1] sft_vlm_ga2 parameter_usage: (0, {'forwards': 6, 'ties_at_output': 60, " \
        "'ties_moved_to_loss': 60}" in ours.stdout, ours.stdout[-4000:]
    assert "[rank 0] sft_vlm_ga2 parameter_usage: (0, {'forwards': 6}" in ours.stdout, ours.stdout[-4000:]


def test_a_refusal_passes_only_where_it_is_the_expected_one(monkeypatch):
    """The parity test's refusal rule: an unnamed refusal fails, a named one must carry its kind and message."""
    assert check_refusal("dpo_text", None) is False
    with pytest.raises(AssertionError, match="no expected refusal names"):
        check_refusal("dpo_text", "PlanError: fsdp2: something")
    monkeypatch.setitem(EXPECTED_REFUSALS, "dpo_text", ("PlanError", r"fsdp_cpu_ram_efficient_loading: false"))
    assert check_refusal("dpo_text", "PlanError: set fsdp_cpu_ram_efficient_loading: false") is True
    with pytest.raises(AssertionError):
        check_refusal("dpo_text", "PlanError: another reason")
    with pytest.raises(AssertionError, match="but it trained"):
        check_refusal("dpo_text", None)
