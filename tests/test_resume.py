"""Resume after a failure: torchrun --max-restarts=1 restarts the group, which resumes from the last
complete checkpoint and ends bit-identical to an uninterrupted run; the final adapter is written
atomically, once, by rank 0."""

import json
import os
import re

import pytest
import torch
from launch import torchrun
from safetensors.torch import load_file

from hf_ddpfix.runtime.checkpoints import last_complete_checkpoint, save_model_atomic


def _checkpoint(root, step, *, state=True, ranks=(0, 1)):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if state:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    for r in ranks:
        (path / f"rng_state_{r}.pth").write_bytes(b"x")
    return str(path)


def test_last_complete_checkpoint_skips_partial_ones(tmp_path):
    assert last_complete_checkpoint(str(tmp_path / "none")) is None
    good = _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 10)  # numeric order, not string order ("10" > "4")
    assert last_complete_checkpoint(str(tmp_path), world_size=2).endswith("checkpoint-10")
    _checkpoint(tmp_path, 12, state=False)  # crashed before rank 0 wrote the trainer state
    _checkpoint(tmp_path, 14, ranks=(0,))  # rank 1 died before its RNG state
    assert last_complete_checkpoint(str(tmp_path), world_size=2).endswith("checkpoint-10")
    assert last_complete_checkpoint(str(tmp_path), world_size=1).endswith("checkpoint-14")
    (tmp_path / "checkpoint-10" / "trainer_state.json").unlink()
    assert last_complete_checkpoint(str(tmp_path), world_size=2) == good


class _FakeTrainer:
    """save_model writes two files; `fail` makes it die halfway (after the first file)."""

    def __init__(self, tag, fail=False):
        self.tag, self.fail = tag, fail

    def is_world_process_zero(self):
        return True

    def save_model(self, output_dir):
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "adapter_config.json"), "w") as f:
            f.write(self.tag)
        if self.fail:
            raise OSError("disk full")
        with open(os.path.join(output_dir, "adapter_model.safetensors"), "w") as f:
            f.write(self.tag)


def test_save_model_atomic_never_leaves_a_half_written_folder(tmp_path):
    final = tmp_path / "final"
    assert save_model_atomic(_FakeTrainer("v1"), str(final)) is True
    assert sorted(os.listdir(final)) == ["adapter_config.json", "adapter_model.safetensors"]
    with pytest.raises(OSError):
        save_model_atomic(_FakeTrainer("v2", fail=True), str(final))
    # the previous complete model is untouched
    assert (final / "adapter_config.json").read_text() == "v1"
    assert (final / "adapter_model.safetensors").read_text() == "v1"
    (final / "checkpoint-1").mkdir()  # the final model often goes into the training output_dir
    (final / "checkpoint-1" / "trainer_state.json").write_text("{}")
    save_model_atomic(_FakeTrainer("v3"), str(final))
    assert (final / "adapter_model.safetensors").read_text() == "v3"
    assert (final / "checkpoint-1" / "trainer_state.json").exists()  # nothing else is lost
    assert sorted(os.listdir(tmp_path)) == ["final"]  # temp / old folders gone


@pytest.mark.multiprocess
def test_restarted_group_resumes_and_matches_an_uninterrupted_run(tmp_path):
    common = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch#135712: stale addresses on restart
    ref = torchrun("ops_resume.py", "--run-dir", str(tmp_path / "ref"), "--final", str(tmp_path / "ref_final"),
                   "--weights", str(tmp_path / "ref.pt"), timeout=150, env=common)
    assert re.findall(r"FINAL_WRITTEN rank=(\d)", ref.stdout) == ["0"]

    crash = torchrun("ops_resume.py", "--run-dir", str(tmp_path / "crash"), "--final",
                     str(tmp_path / "crash_final"), "--weights", str(tmp_path / "crash.pt"), "--crash-at", "5",
                     timeout=200, env={**common, "PET_MAX_RESTARTS": "1"})
    out = crash.stdout
    assert "CRASHING rank=1 step=5" in out
    # both restarted ranks resumed from the last checkpoint before the crash (saved every 2 steps)
    assert sorted(re.findall(r"ATTEMPT rank=(\d) attempt=1 resume=checkpoint-4", out)) == ["0", "1"], out[-4000:]
    # the final adapter was written once, by rank 0, in the successful attempt, and moved into place whole
    assert re.findall(r"FINAL_WRITTEN rank=(\d) attempt=(\d)", out) == [("0", "1")]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("crash_final")) == ["crash_final"]

    a, b = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "crash.pt")
    assert a.keys() == b.keys() and len(a) == 8
    for name in a:
        assert torch.equal(a[name], b[name]), name
    fa = load_file(tmp_path / "ref_final" / "adapter_model.safetensors")
    fb = load_file(tmp_path / "crash_final" / "adapter_model.safetensors")
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
