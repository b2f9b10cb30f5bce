"""Checkpoints under the Trainer's FSDP2, launched as users launch it (``accelerate launch --config_file
accelerate_configs/fsdp.yaml``, 2 gloo processes through the FSDP test device; tests/scripts/fsdp_checkpoints.py):

- with fsdp.yaml's ``SHARDED_STATE_DICT`` and with ``--fsdp_state_dict_type FULL_STATE_DICT``, rank 1 is killed
  (SIGKILL) mid-run after a checkpoint; the relaunch resumes from ``last_complete_checkpoint`` and ends with the
  weights of the uninterrupted run, bit-equal (measured: max |diff| 0 for both types, Qwen2.5-VL with image and
  text-only ranks mixed, 2026-11-27);
- the adapter ``save_model_atomic`` wrote loads in one process (``PeftModel.from_pretrained`` on the saved base)
  and gives the FSDP2 run's logits on a fixed batch, bit-equal (measured 0). Under ``SHARDED_STATE_DICT`` stock
  ``Trainer.save_model`` writes nothing; ``save_model_atomic`` gathers and saves the adapter.

Wall time: ~40 s (4 launches; 2 cores, quiet machine), up to ~4 min when the cores are shared.
"""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, accelerate_launch, fsdp_device_env

SCRIPT = ROOT / "tests" / "scripts" / "fsdp_checkpoints.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
FP32 = ("--mixed_precision", "no")  # weights compared exactly: no bf16 (docs/fsdp.md, "mixed precision")


def _launch(kind: str, *args: str, check: bool):
    extra = FP32 + (("--fsdp_state_dict_type", kind) if kind != "SHARDED_STATE_DICT" else ())
    return accelerate_launch("fsdp.yaml", SCRIPT, *args, timeout=300, env=fsdp_device_env(OFFLINE), check=check,
                             extra=extra)


def _script():
    import sys

    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    import fsdp_checkpoints

    return fsdp_checkpoints


def _one_process_logits(out, kind: str) -> torch.Tensor:
    """The saved adapter on the saved base, in this (single) process, on the script's fixed batch."""
    from peft import PeftModel
    from zoo import ZOO

    probe_batch = _script().probe_batch

    entry = ZOO["qwen2_5_vl"]
    base = type(entry.build(0)).from_pretrained(out / "saved-qwen2_5_vl" / "base")
    model = PeftModel.from_pretrained(base, out / f"adapter-{kind}").eval()
    with torch.no_grad():
        return model(**probe_batch(entry)).logits.float()


@pytest.mark.multiprocess
def test_a_rank_killed_mid_run_resumes_to_the_uninterrupted_weights_and_the_adapter_loads_in_one_process(tmp_path):
    from zoo import ZOO

    KILL_AT, SAVE_EVERY = _script().KILL_AT, _script().SAVE_EVERY  # noqa: N806

    init = {n: p.detach() for n, p in ZOO["qwen2_5_vl"].model(0).named_parameters() if p.requires_grad}
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        killed = _launch(kind, "--out", str(tmp_path), "--phase", "kill",
                         *(("--reference",) if kind == "SHARDED_STATE_DICT" else ()), check=False)
        assert killed.returncode != 0, killed.stdout[-4000:]
        assert f"KILLING rank 1 at step {KILL_AT}" in killed.stdout, killed.stdout[-4000:]
        assert "[fsdp_device] accelerate FSDP2 on CPU/gloo" in killed.stdout, killed.stdout[-4000:]
        assert f"state_dict StateDictType.{kind}" in killed.stdout, killed.stdout[-4000:]
        newest = (KILL_AT // SAVE_EVERY) * SAVE_EVERY
        assert not (tmp_path / f"run-{kind}" / f"checkpoint-{newest + SAVE_EVERY}").exists()
        resumed = _launch(kind, "--out", str(tmp_path), "--phase", "resume", check=True)
        assert f"RESUMING from checkpoint-{newest} ({kind})" in resumed.stdout, resumed.stdout[-4000:]
        assert f"FSDP_CHECKPOINTS_OK {kind}" in resumed.stdout, resumed.stdout[-4000:]

        ref = torch.load(tmp_path / "reference.pt")["weights"]
        got = torch.load(tmp_path / f"resumed-{kind}.pt")
        assert got["wrapped"].startswith("FSDP") and len(got["units"]) >= 4, (got["wrapped"], got["units"])
        assert got["resumed_from"] == f"checkpoint-{newest}" and kind in got["state_dict_type"], got
        assert got["weights"].keys() == ref.keys() == init.keys()
        diff = max((got["weights"][k] - ref[k]).abs().max().item() for k in ref)
        assert diff == 0.0, f"{kind}: resumed vs uninterrupted max |dW| = {diff:.2e}"
        moved = max((ref[k] - init[k]).abs().max().item() for k in init)
        assert moved > 1e-4, f"training moved the weights by {moved:.2e} only"
        logits = _one_process_logits(tmp_path, kind)
        assert torch.equal(logits, got["logits"]), (kind, (logits - got["logits"]).abs().max().item())
