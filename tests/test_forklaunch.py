"""tests/forklaunch.py (the suite's torchrun stand-in) starts ranks as torchrun does: the same rank environment,
arguments, `sys.path[0]`, `__name__` and working directory; fresh seeds per rank (Python's, torch's);
a failing rank's traceback with torch's "[rankN]:" prefix and a non-zero exit. One launch each way; the same for
`accelerate launch` under fsdp.yaml through the FSDP device (accelerate's rank environment, the engine the Accelerator
picks, the device's sitecustomize in every rank)."""

import json

import pytest
from launch import ROOT, accelerate_launch, fsdp_device_env, torchrun

PROBE = ROOT / "tests" / "scripts" / "launch_probe.py"


def _probes(out) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.multiprocess
def test_forked_ranks_start_as_torchrun_ranks_do(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "fork").mkdir()
    torchrun(PROBE, "a", "--b", env={"PROBE_ENV": "yes", "PROBE_OUT": str(tmp_path / "real")}, launcher="torchrun",
             timeout=120)
    fork = torchrun(PROBE, "a", "--b", env={"PROBE_ENV": "yes", "PROBE_OUT": str(tmp_path / "fork")}, timeout=120)
    assert fork.args[0] == "forklaunch", fork.args  # the fork server took it (not a fallback to torchrun)
    r, f = _probes(tmp_path / "real"), _probes(tmp_path / "fork")
    for a, b in zip(r, f, strict=True):
        for key in ("env", "argv", "path0", "name", "cwd", "sum"):
            assert a[key] == b[key], (key, a[key], b[key])
    for probes in (r, f):  # each rank seeded afresh, as two fresh interpreters are (torch's default seed too)
        for key in ("py_random", "torch_rand", "initial_seed"):
            assert probes[0][key] != probes[1][key], (key, probes)

    failed = torchrun(PROBE, "--fail", env={"PROBE_OUT": str(tmp_path)}, timeout=120, check=False)
    assert failed.args[0] == "forklaunch" and failed.returncode == 1, failed.stdout[-3000:]
    assert "[rank1]: RuntimeError: probe failure on rank 1" in failed.stdout, failed.stdout[-3000:]


@pytest.mark.multiprocess
def test_forked_accelerate_ranks_start_as_accelerate_launch_ranks_do(tmp_path):
    """Shown failing (2026-12-03): with the device's sitecustomize not run in the forked launcher, the comparison
    failed on the probe's ``accelerate`` entry (engine, start-up hook and path entries are in it)."""
    runs = {}
    for how in ("accelerate", "auto"):
        (tmp_path / how).mkdir()
        runs[how] = accelerate_launch("fsdp.yaml", PROBE, "a", "--accelerate", launcher=how, timeout=180,
                                      extra=("--mixed_precision", "no"),
                                      env=fsdp_device_env({"PROBE_ENV": "yes", "PROBE_OUT": str(tmp_path / how)}))
    assert runs["auto"].args[0] == "forklaunch-accelerate", runs["auto"].args  # forked, not a fallback
    assert runs["accelerate"].args[1] == "launch", runs["accelerate"].args
    r, f = _probes(tmp_path / "accelerate"), _probes(tmp_path / "auto")
    for a, b in zip(r, f, strict=True):
        for key in ("env", "argv", "path0", "name", "cwd", "sum", "accelerate"):
            assert a[key] == b[key], (key, a[key], b[key])
    assert r[0]["accelerate"]["type"] == "DistributedType.FSDP" and r[0]["accelerate"]["fsdp_version"] == 2, r[0]
    assert r[0]["accelerate"]["env"]["ACCELERATE_USE_FSDP"] == "true", r[0]["accelerate"]["env"]

    failed = accelerate_launch("ddp_cpu.yaml", PROBE, "--fail", env={"PROBE_OUT": str(tmp_path)}, timeout=120,
                               check=False)
    assert failed.args[0] == "forklaunch-accelerate" and failed.returncode == 1, failed.stdout[-3000:]
    assert "[rank1]: RuntimeError: probe failure on rank 1" in failed.stdout, failed.stdout[-3000:]


def test_launches_that_need_a_fresh_interpreter_or_torchrun_itself_are_never_forked():
    """A sitecustomize on PYTHONPATH (patches/, the FSDP device) and torchrun's own settings (restarts) go to the
    real torchrun, even as a process's first launch (no server is started for them)."""
    from launch import _ForkServer, _launch_env

    server = _ForkServer()
    for extra in ({"PYTHONPATH": "/elsewhere"}, {"PET_MAX_RESTARTS": "1"}, {"TORCHELASTIC_ERROR_FILE": "/e.json"}):
        assert server.run(str(PROBE), [], 2, 10.0, _launch_env(extra), check=True) is None, extra
    assert server.proc is None
