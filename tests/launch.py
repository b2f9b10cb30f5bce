"""Launch a script as N gloo processes (torchrun) with a hard timeout; shared by the multi-process tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 180,
             env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `script` under `torch.distributed.run --standalone` and return the finished process.

    A hang fails fast: past `timeout` seconds the whole process group is killed and the test fails with
    every rank's output so far. With `check`, a non-zero exit fails the test with the full output.
    """
    import pytest

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(SCRIPTS / script if not Path(script).is_absolute() else script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True, cwd=str(ROOT))
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"{script} {' '.join(args)}: no result after {timeout:.0f}s (hang?)\n{out[-6000:]}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if check and proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(args)} exited {proc.returncode}\n{out[-8000:]}")
    return done
