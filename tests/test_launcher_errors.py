"""A run that fails for a reason hf_ddpfix knows ends with that reason, once, not only with the launcher's
traceback (issue 40, item 3): torch elastic's summary ("Root Cause") used to say only "exitcode: 1".

The launch test is also the library route of `HF_DDPFIX_*` validation (item 6): `patch_trainer()` refuses
`HF_DDPFIX_DISABLE=banana`, naming the variable and the allowed values, as patches/ and `doctor` do.
"""

from __future__ import annotations

import json

import pytest
from launch import torchrun, torchrun_nodes

from hf_ddpfix.config.options import DDPFixConfig
from hf_ddpfix.plan.types import PlanError
from hf_ddpfix.runtime.launcher_errors import is_known_error, report_to_launcher

SCRIPT = """
from hf_ddpfix import patch_trainer
patch_trainer()
print("PATCHED")
"""
MESSAGE = "HF_DDPFIX_DISABLE='banana' is not a recognised value; allowed: 1/true/yes/on or 0/false/no/off"


def test_report_writes_the_error_file_once_and_only_under_a_launcher(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    assert report_to_launcher(PlanError("x")) is False and not path.exists()  # plain python: nothing
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    assert report_to_launcher(PlanError("first: set A=1")) is True
    assert report_to_launcher(PlanError("second")) is False  # the first error of a worker wins
    data = json.loads(path.read_text())["message"]
    assert data["message"] == "PlanError: first: set A=1" and data["extraInfo"]["py_callstack"].strip() == \
        "PlanError: first: set A=1" and int(data["extraInfo"]["timestamp"]) > 0
    path.unlink()
    assert report_to_launcher(SystemExit("refused: give --output-dir")) is True
    assert json.loads(path.read_text())["message"]["message"] == "refused: give --output-dir"
    path.unlink()
    monkeypatch.setenv("RANK", "1")  # a setting's error is alike on every rank: rank 0 says it; a rank's own is its own
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert report_to_launcher(PlanError("x")) is False and report_to_launcher(SystemExit("x")) is False
    assert report_to_launcher(RuntimeError("rank 1's collective failed")) is True and path.exists()
    path.unlink()
    monkeypatch.setenv("RANK", "8")  # the second node's first process: its launcher's summary needs the reason too
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert report_to_launcher(PlanError("node 1 says it too")) is True and path.exists()
    path.unlink()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "missing-dir" / "error.json"))
    assert report_to_launcher(PlanError("x")) is False  # never raises


def test_known_errors_are_ours_or_name_a_setting():
    assert is_known_error(PlanError("x")) and is_known_error(ValueError("HF_DDPFIX_TILED_MLP='x' ..."))
    assert is_known_error(ValueError("UNSLOTH_TILED_MLP='x' ..."))
    assert not is_known_error(ValueError("a user's own error")) and not is_known_error(RuntimeError("boom"))


@pytest.mark.parametrize("value", ["banana", "2", "enabled"])
def test_disable_is_validated_on_the_library_route(value):
    with pytest.raises(ValueError, match=rf"HF_DDPFIX_DISABLE='{value}' is not a recognised value; allowed: "):
        DDPFixConfig.from_env({"HF_DDPFIX_DISABLE": value})
    for ok in ("", "0", "off", "1", "yes"):
        DDPFixConfig.from_env({"HF_DDPFIX_DISABLE": ok})


@pytest.mark.multiprocess
def test_a_refusal_is_the_last_thing_a_torchrun_user_reads(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = torchrun(script, env={"HF_DDPFIX_DISABLE": "banana"}, timeout=180, check=False, launcher="torchrun")
    out = done.stdout
    assert done.returncode != 0 and "PATCHED" not in out, out[-3000:]
    summary = out[out.rindex("Failures:"):].splitlines()  # the launcher's summary, the last thing printed
    assert "Root Cause" in out[out.rindex("Failures:"):], out[-3000:]
    assert sum(MESSAGE in ln for ln in summary) == 1, "\n".join(summary)  # once, with the allowed values
    assert MESSAGE in "\n".join(summary[-4:]), "\n".join(summary)  # in the Root Cause, at the very end


@pytest.mark.multiprocess
def test_a_refusal_ends_every_nodes_launcher_summary(tmp_path):
    """Two localhost "nodes" of one process (one launcher each): both launchers' summaries end with the reason,
    not a bare ``exitcode: 1`` on the node whose worker is global rank 1 (issue 49, item 5). Shown failing once
    with the check keyed on the global ``RANK`` again (node 1's summary: 0 lines with the message)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for _ in range(3):  # torch elastic's own race: a launcher whose c10d store went down with the other node's
        # launcher (both workers failed at once) dies with RendezvousConnectionError before printing any summary
        done = torchrun_nodes(script, env={"HF_DDPFIX_DISABLE": "banana"}, timeout=180, check=False)
        if not any("RendezvousConnectionError" in d.stdout and "Failures:" not in d.stdout for d in done):
            break
    for node, d in enumerate(done):
        out = d.stdout
        assert d.returncode != 0 and "PATCHED" not in out, out[-3000:]
        summary = out[out.rindex("Failures:"):].splitlines() if "Failures:" in out else []
        assert sum(MESSAGE in ln for ln in summary) == 1, f"node {node}:\n" + out[-3000:]
