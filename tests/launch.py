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
    launcher: ``forklaunch``/``forklaunch-accelerate`` for forked ranks, the command, its wall seconds), so the CI
    report can say how many launches each file makes, what they cost and how many started fresh interpreters
    (``scripts/ci_report.py summary``)."""
    path = os.environ.get("DDPFIX_LAUNCH_LOG")
    if path:
        import json

        line = {"stack": os.environ.get("DDPFIX_CI_STACK", "pinned"),
                "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0], "s": round(seconds, 1),
                "launcher": Path(str(cmd[0])).name, "cmd": " ".join(str(c) for c in cmd)[-300:]}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _launch_env(env: dict[str, str] | None) -> dict[str, str]:
    """The environment of a launch: this process's, one thread per process, the worktree first on PYTHONPATH,
    then ``env``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}


def _run(cmd: list[str], label: str, timeout: float, env: dict[str, str] | None, check: bool) -> subprocess.CompletedProcess:
    """Run `cmd` from the repository root in its own session with the test environment and a hard timeout:
    past `timeout` seconds the whole process group is killed and the test fails with the output so far; with
    `check`, a non-zero exit fails the test with the full output.

    Nothing is run twice: an abort at interpreter exit ("terminate called without an active exception", gloo
    threads outliving their group) is a failure like any other, so a regression of hf_ddpfix's exit teardown
    (`hf_ddpfix.ops.dist.destroy_default_group_at_exit`) fails the test that launched it.
    """
    import pytest

    full_env = _launch_env(env)
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
                      extra: tuple[str, ...] = (), launcher: str = "auto") -> subprocess.CompletedProcess:
    """Run `accelerate launch --config_file accelerate_configs/<config> <script> <args>` from the repository
    root, as the README tells a user to, with a hard timeout (same contract as :func:`torchrun`). Only a free
    `--main_process_port` is added, so that two test runs on one machine do not collide, and `extra`
    launcher flags (e.g. `--mixed_precision no`) before the script.

    `launcher="auto"` runs accelerate's own launch code in a process forked from the server that has imported
    torch and transformers, and forks its ranks (tests/forklaunch.py; the FSDP device's sitecustomize is run
    there), whenever that is equivalent; `launcher="accelerate"` always runs the real `accelerate launch` (what the
    examples' tests launch: a clean exit of fresh interpreters is part of what they prove)."""
    if launcher not in ("auto", "accelerate"):
        raise ValueError(f"launcher={launcher!r}: allowed 'auto' or 'accelerate'")
    argv = ["--config_file", f"accelerate_configs/{config}", "--main_process_port", str(free_port()), *extra,
            str(script), *map(str, args)]
    label = f"accelerate launch {config} {script} {' '.join(map(str, args))}"
    if launcher == "auto":
        done = _FORK.run_accelerate(argv, label, timeout, _launch_env(env), check)
        if done is not None:
            return done
    exe = Path(sys.executable).with_name("accelerate")
    cmd = [str(exe) if exe.exists() else "accelerate", "launch", *argv]
    return _run(cmd, label, timeout, env, check)


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 180,
             env: dict[str, str] | None = None, check: bool = True,
             launcher: str = "auto") -> subprocess.CompletedProcess:
    """Run `script` as `nproc` ranks, as `torch.distributed.run --standalone` does, and return the finished launch.

    A hang fails fast: past `timeout` seconds the whole process group is killed and the test fails with
    every rank's output so far. With `check`, a non-zero exit fails the test with the full output.
    `launcher="auto"` forks the ranks from a server that has imported torch and transformers already
    (tests/forklaunch.py: the same ranks, ~14 s less CPU per launch) whenever that is equivalent, else runs
    the real torchrun; `launcher="torchrun"` always runs it (tests of the launcher's own output).

    A forked rank leaves by ``os._exit`` after Python's own shutdown steps, so C++ static destructors never run
    there: gloo's intermittent abort at exit ("terminate called ...") cannot show in a forked launch. The launches
    that prove a clean exit run under the real launchers: the examples under every config
    (tests/test_examples_launched.py on the oldest and newest stacks; on the pinned stack the rehearsals of
    tests/test_rehearse_examples.py and tests/test_rehearse.py) and the two-node runs of the text
    and VLM training scripts (tests/test_multinode.py: one ``torch.distributed.run`` per node).
    """
    path = str(SCRIPTS / script if not Path(script).is_absolute() else script)
    if launcher not in ("auto", "torchrun"):
        raise ValueError(f"launcher={launcher!r}: allowed 'auto' or 'torchrun'")
    if launcher == "auto":
        done = _FORK.run(path, [str(a) for a in args], nproc, timeout, _launch_env(env), check)
        if done is not None:
            return done
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", path, *args]
    return _run(cmd, f"{script} {' '.join(args)}", timeout, env, check)


class _ForkServer:
    """The client of tests/forklaunch.py: one server per test process, started at the first launch it can take.

    ``run`` (torchrun's stand-in) and ``run_accelerate`` answer None when the launch must go to the real launcher:
    ``HF_DDPFIX_TEST_LAUNCHER=torchrun`` (every launch), a launch whose ``PYTHON*`` environment differs from a plain
    launch's (a sitecustomize runs only at interpreter start: patches/; the FSDP device is the one exception, run in
    the forked launcher of an ``accelerate launch``) or that configures torchrun (``PET_*``, ``TORCHELASTIC_*``:
    restarts), or a server that did not start (said once on stderr). A launch whose other start-up environment
    (forklaunch.STARTUP_ENV_PREFIXES: TORCH_*, ...) differs gets a new server started with it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.startup: dict[str, str] = {}  # the start-up environment the server was given
        self.imported: dict[str, str] = {}  # ... and the one it had after its imports
        self.broken = False

    def _start(self, env: dict[str, str]) -> bool:
        import atexit
        import json
        import tempfile

        log = tempfile.NamedTemporaryFile("w+", prefix="forklaunch-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forklaunch.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     env=env, cwd=str(ROOT))
        atexit.register(self.close)
        line = self._read(time.monotonic() + 300)
        if not line:
            self.close()
            self.broken = True
            log.seek(0)
            print(f"tests/launch.py: the fork server did not start; launching with torchrun\n{log.read()[-3000:]}",
                  file=sys.stderr)
            return False
        from forklaunch import startup_env

        self.startup = startup_env(env)  # what the server started with, and what its imports added to it
        self.imported = json.loads(line)["startup_env"]
        return True

    def _differing(self, env: dict[str, str]) -> set[str]:
        """The start-up variables of ``env`` that differ from the server's (neither what it started with nor what
        its imports set)."""
        from forklaunch import startup_env

        asked = startup_env(env)
        return {k for k in {*asked, *self.startup} if asked.get(k) not in (self.startup.get(k), self.imported.get(k))}

    def _read(self, deadline: float) -> str | None:
        import select

        assert self.proc is not None and self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, min(5.0, deadline - time.monotonic())))
            if ready:
                return self.proc.stdout.readline() or None  # "" at end of file: the server is gone
        return None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def _usable(self, env: dict[str, str]) -> bool:
        """Whether a launch with ``env`` can be forked: never with ``HF_DDPFIX_TEST_LAUNCHER=torchrun``, a
        ``PYTHON*`` variable that differs from a plain launch's, or one that configures torchrun; a server with the
        launch's start-up environment is (re)started when needed."""
        if self.broken or os.environ.get("HF_DDPFIX_TEST_LAUNCHER", "auto") == "torchrun":
            return False
        from forklaunch import startup_env

        asked, default = startup_env(env), startup_env(_launch_env(None))
        if any(k.startswith(("PYTHON", "PET_", "TORCHELASTIC_")) and asked.get(k) != default.get(k)
               for k in {*asked, *default}):
            return False  # sitecustomize (patches/, the FSDP device) runs only in a fresh interpreter; PET_* and
            # TORCHELASTIC_* configure torchrun itself (restarts: tests/test_resume.py). Never a server for them.
        differing = self._differing(env) if self.proc is not None else set()
        if differing:
            self.close()  # another start-up environment: a server that starts with it
        return self.proc is not None or self._start(env)

    def run(self, script: str, args: list[str], nproc: int, timeout: float, env: dict[str, str],
            check: bool) -> subprocess.CompletedProcess | None:
        """``script`` as ``nproc`` forked ranks (torchrun --standalone's); None: use the real torchrun."""
        if not self._usable(env):
            return None
        return self._submit(dict(script=script, args=args, nproc=nproc, env=env, port=free_port()),
                            ["forklaunch", f"--nproc_per_node={nproc}", script, *args],
                            f"{script} {' '.join(args)}", timeout, check)

    def run_accelerate(self, argv: list[str], label: str, timeout: float, env: dict[str, str],
                       check: bool) -> subprocess.CompletedProcess | None:
        """``accelerate launch <argv>`` with forked ranks; None: use the real ``accelerate launch``. A launch
        whose ``PYTHONPATH`` is a plain launch's with the FSDP device first (:func:`fsdp_device_env`) is forked
        too: the device's sitecustomize runs in the forked launcher (forklaunch._accelerate_launch). patches/ and
        any other start-up hook on the path: the real launcher."""
        device, server_env = None, env  # the server starts with a plain launch's PYTHONPATH
        prefix = str(FSDP_DEVICE) + os.pathsep
        if env.get("PYTHONPATH", "").startswith(prefix):
            device, server_env = str(FSDP_DEVICE), {**env, "PYTHONPATH": env["PYTHONPATH"][len(prefix):]}
            if server_env["PYTHONPATH"] != _launch_env(None)["PYTHONPATH"]:
                return None
        if not self._usable(server_env):
            return None
        return self._submit(dict(accelerate=argv, fsdp_device=device, env=env),
                            ["forklaunch-accelerate", "launch", *argv], label, timeout, check)

    def _submit(self, req: dict, cmd: list[str], label: str, timeout: float,
                check: bool) -> subprocess.CompletedProcess:
        import json
        import tempfile

        import pytest

        assert self.proc is not None
        t0 = time.monotonic()
        with tempfile.NamedTemporaryFile("r", prefix="forklaunch-out-", suffix=".txt") as out:
            self.proc.stdin.write(json.dumps({**req, "cwd": str(ROOT), "out": out.name}) + "\n")
            self.proc.stdin.flush()
            deadline = t0 + timeout
            started = self._read(deadline)
            if started is None:
                self.close()
                pytest.fail(f"{label}: the fork server did not start the launch")
            pid = json.loads(started)["pid"]
            ended = self._read(deadline)
            if ended is None:
                try:
                    os.killpg(pid, 9)
                except ProcessLookupError:  # the launch ended as the deadline passed, or the server is gone
                    pass
                self._read(time.monotonic() + 30)
                pytest.fail(f"{label}: no result after {timeout:.0f}s (hang?)\n{out.read()[-6000:]}")
            rc = json.loads(ended)["rc"]
            text = out.read()
        done = subprocess.CompletedProcess(cmd, rc, text, "")
        _record_launch(cmd, time.monotonic() - t0)
        if check and rc != 0:
            pytest.fail(f"{label} exited {rc}\n{text[-8000:]}")
        return done


_FORK = _ForkServer()


def torchrun_nodes(script: str | Path, *args: str, nnodes: int = 2, timeout: float = 240,
                   env: dict[str, str] | None = None, check: bool = True) -> list[subprocess.CompletedProcess]:
    """Run `script` as `nnodes` localhost "nodes" of one process each: one `torch.distributed.run` launcher
    per node (`--nnodes`, `--node_rank`, c10d rendezvous on 127.0.0.1:<free port>), as a multi-node job is
    launched. Same contract as :func:`torchrun` (hard timeout over all launchers, every output on failure;
    ``check=False``: a non-zero exit is returned, not failed); returns the launchers' finished processes in node
    order."""
    import pytest

    port = free_port()
    full_env = _launch_env(env)
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
    if check and any(d.returncode for d in done):
        pytest.fail(f"{script} on {nnodes} nodes exited {[d.returncode for d in done]}\n"
                    + "\n".join(d.stdout[-4000:] for d in done))
    return done
