"""Launch a script as N gloo processes (torchrun) with a hard timeout; shared by the multi-process tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
FSDP_DEVICE = ROOT / "hf_ddpfix" / "rehearse" / "device"  # the package's FSDP device (one copy: hf_ddpfix.rehearse)


def fsdp_device_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` plus the FSDP device on ``PYTHONPATH`` (hf_ddpfix/rehearse/device/sitecustomize.py, the one
    ``hf-ddpfix rehearse`` uses: accelerate's FSDP2 path on the CPU; docs/fsdp.md), ahead of the worktree root."""
    path = os.pathsep.join([str(FSDP_DEVICE), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**(env or {}), "PYTHONPATH": path}


def free_port() -> int:
    """A TCP port nobody listens on now (tests running side by side must not share accelerate's 29500)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record_launch(cmd: list[str], seconds: float) -> None:
    """With ``DDPFIX_LAUNCH_LOG`` set (``.ci/run`` sets it): one JSON line per launch (the stack, the test, the
    command, its wall seconds), so the CI report can say how many launches each file makes and what they cost
    (``scripts/ci_report.py summary``: every launch starts interpreters that import torch and transformers)."""
    path = os.environ.get("DDPFIX_LAUNCH_LOG")
    if path:
        import json

        line = {"stack": os.environ.get("DDPFIX_CI_STACK", "pinned"),
                "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0], "s": round(seconds, 1),
                "cmd": " ".join(str(c) for c in cmd)[-300:]}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _run(cmd: list[str], label: str, timeout: float, env: dict[str, str] | None, check: bool) -> subprocess.CompletedProcess:
    """Run `cmd` from the repository root in its own session with the test environment and a hard timeout:
    past `timeout` seconds the whole process group is killed and the test fails with the output so far; with
    `check`, a non-zero exit fails the test with the full output.

    Nothing is run twice: an abort at interpreter exit ("terminate called without an active exception", gloo
    threads outliving their group) is a failure like any other, so a regression of hf_ddpfix's exit teardown
    (`hf_ddpfix.ops.dist.destroy_default_group_at_exit`) fails the test that launched it.
    """
    import pytest

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True, cwd=str(ROOT))
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"{label}: no result after {timeout:.0f}s (hang?)\n{out[-6000:]}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    _record_launch(cmd, time.monotonic() - t0)
    if check and done.returncode != 0:
        pytest.fail(f"{label} exited {done.returncode}\n{done.stdout[-8000:]}")
    return done


def accelerate_launch(config: str, script: str | Path, *args: str, timeout: float = 300,
                      env: dict[str, str] | None = None, check: bool = True,
                      extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run `accelerate launch --config_file accelerate_configs/<config> <script> <args>` from the repository
    root, as the README tells a user to, with a hard timeout (same contract as :func:`torchrun`). Only a free
    `--main_process_port` is added, so that two test runs on one machine do not collide, and `extra`
    launcher flags (e.g. `--mixed_precision no`) before the script."""
    launcher = Path(sys.executable).with_name("accelerate")
    cmd = [str(launcher) if launcher.exists() else "accelerate", "launch", "--config_file",
           f"accelerate_configs/{config}", "--main_process_port", str(free_port()), *extra, str(script), *args]
    return _run(cmd, f"accelerate launch {config} {script} {' '.join(args)}", timeout, env, check)


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 180,
             env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `script` under `torch.distributed.run --standalone` and return the finished process.

    A hang fails fast: past `timeout` seconds the whole process group is killed and the test fails with
    every rank's output so far. With `check`, a non-zero exit fails the test with the full output.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(SCRIPTS / script if not Path(script).is_absolute() else script), *args]
    return _run(cmd, f"{script} {' '.join(args)}", timeout, env, check)


def torchrun_nodes(script: str | Path, *args: str, nnodes: int = 2, timeout: float = 240,
                   env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Run `script` as `nnodes` localhost "nodes" of one process each: one `torch.distributed.run` launcher
    per node (`--nnodes`, `--node_rank`, c10d rendezvous on 127.0.0.1:<free port>), as a multi-node job is
    launched. Same contract as :func:`torchrun` (hard timeout over all launchers, every output on failure);
    returns the launchers' finished processes in node order."""
    import pytest

    port = free_port()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    procs = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc_per_node=1",
               f"--node_rank={node}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
               f"--rdzv_id=hf_ddpfix_{port}", str(SCRIPTS / script), *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=full_env, start_new_session=True, cwd=str(ROOT)))
    deadline, outs = time.monotonic() + timeout, []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
            rest = [p.communicate()[0] for p in procs[len(outs):]]
            pytest.fail(f"{script} on {nnodes} nodes: no result after {timeout:.0f}s (hang?)\n"
                        + "\n".join(o[-3000:] for o in outs + rest))
        outs.append(out)
    done = [subprocess.CompletedProcess(p.args, p.returncode, o, "") for p, o in zip(procs, outs, strict=True)]
    if any(d.returncode for d in done):
        pytest.fail(f"{script} on {nnodes} nodes exited {[d.returncode for d in done]}\n"
                    + "\n".join(d.stdout[-4000:] for d in done))
    return done
