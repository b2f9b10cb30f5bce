"""A torchrun stand-in for the suite's own 2-process launches: ranks forked from an interpreter that has already
imported torch and transformers.

Why: every `torchrun` launch starts three interpreters, and `import torch; from transformers import Trainer`
costs ~7 s of CPU in each (peft, bitsandbytes, datasets and torch's compiler stack come with it; measured with
`python -X importtime`, 2026-11-29). On CI's two cores that start-up was about a third of the whole run. Here one
server per pytest process imports them once; each launch forks a launcher that forks one process per rank.

What a rank sees, as under `torchrun --standalone --nproc_per_node=N`: the script run as `__main__` with its
arguments and its directory first on `sys.path`, the launch's environment plus RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT
(rank 0 hosts the store), TORCHELASTIC_RESTART_COUNT=0, TORCHELASTIC_MAX_RESTARTS=0, TORCHELASTIC_RUN_ID;
stdout and stderr of all ranks in one stream; fresh non-deterministic seeds for `random`, numpy and torch's
default generator, as a fresh interpreter has. At a rank's end: non-daemon threads are joined and atexit handlers
run, as at interpreter exit; an uncaught exception goes to `sys.excepthook` and exits 1. When a rank fails, the
others get SIGTERM (SIGKILL 30 s later) and the launch exits 1, as torchrun's does; success is 0.

What differs (so tests/launch.py sends such launches to the real torchrun): the launcher's own error summary
(no "Root Cause" block, no TORCHELASTIC_ERROR_FILE), restarts, sitecustomize and anything else read at
interpreter start (PYTHONPATH, PYTHON*, TORCH_*, TRANSFORMERS_*, threads, ...: `STARTUP_ENV`), and C++ static
destructors at exit (the rank leaves with `os._exit` after Python's own shutdown steps).

What differs and is kept: the server's objects (its imports) are frozen for the garbage collector (``gc.freeze()``)
before it forks, so a rank's full collections do not walk them again. Every Trainer run makes explicit full
collections (accelerate's ``clear_device_cache``, hf_ddpfix's ``destroy_default_group``), each ~0.6 CPU-s over that
heap here; frozen, a forked launch of the README example (4 steps) took 3.1 CPU-s instead of 5.6 (mean of 5 launches,
2026-12-03). Only the objects that existed before the fork are never collected (module-level state that lives for
the whole run anyway); what a rank creates is collected as in a fresh interpreter.

``accelerate launch`` (tests/launch.py's ``accelerate_launch``) is served the same way: accelerate's own command
line code runs in the forked launcher and its single-node ranks are forked (:func:`_accelerate_launch`).

Protocol (one request at a time, JSON lines): the client writes {"script", "args", "nproc", "env", "cwd", "out",
"port"} (or {"accelerate": its arguments after ``launch``, "fsdp_device": the FSDP device folder or null, "env",
"cwd", "out"}) on the server's stdin; the server answers {"pid": launcher pid} (its own session: killpg stops the whole
launch) and, when the launch ends, {"rc": exit code}. The server ends at end of input.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time

# Environment read at interpreter start or by the modules imported here: a launch whose values differ from the
# server's is run by the real torchrun (tests/launch.py).
STARTUP_ENV_PREFIXES = ("PYTHON", "PET_", "TORCH", "PYTORCH_", "TRANSFORMERS_", "HF_HUB_", "HF_HOME",
                        "HF_DATASETS_", "TOKENIZERS_", "OMP_", "MKL_", "CUDA_", "LD_", "ACCELERATE_", "BNB_",
                        "LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_")

PREIMPORTS = ("torch", "torch.distributed", "transformers", "peft", "accelerate", "datasets")


def startup_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` that must equal the server's for a forked rank to start as a fresh one would."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_ENV_PREFIXES)}


def _rank_main(req: dict, rank: int) -> None:
    """Run the script as rank ``rank``; never returns."""
    import atexit
    import random
    import runpy
    import threading
    import traceback

    n = req["nproc"]
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                      GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(n),
                      ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(req["port"]),
                      TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                      TORCHELASTIC_RUN_ID=f"fork-{req['port']}")
    os.chdir(req["cwd"])
    script = req["script"]
    sys.argv = [script, *req["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    import torch

    torch.seed()  # a fresh interpreter's default generator starts from a non-deterministic seed too
    code: int = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter does: sys.excepthook (torch.distributed's prefixes
        sys.excepthook(*sys.exc_info())  # each line with "[rankN]:"), then exit 1
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at interpreter exit
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code & 0xFF)


def _launcher_main(req: dict) -> None:
    """The launch's own process (its session, its output file): fork the ranks, or run ``accelerate launch``
    whose ranks are forked; exit 0 or 1. Never returns."""
    os.setsid()
    out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    code = _accelerate_launch(req) if req.get("accelerate") is not None else _run_ranks(req)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _run_ranks(req: dict) -> int:
    """Fork ``req["nproc"]`` ranks, wait for them, stop the rest when one fails (SIGTERM, SIGKILL 30 s later);
    0 when every rank exited 0, else 1."""
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank_main(req, rank)
        ranks[pid] = rank
    failed, kill_at = False, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                for p in ranks:
                    os.kill(p, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.05)
            continue
        if pid not in ranks:
            continue
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = True
            os.write(2, f"[forklaunch] rank {rank} exited {code}; stopping the others\n".encode())
            for p in ranks:
                os.kill(p, signal.SIGTERM)
            kill_at = time.monotonic() + 30
    return 1 if failed else 0


class _RanksFailed(Exception):
    """A forked rank of an ``accelerate launch`` exited non-zero (torchrun raises ChildFailedError there)."""


def _accelerate_launch(req: dict) -> int:
    """``accelerate launch <req["accelerate"]>`` as its command line runs it (accelerate's own parser, config
    validation, launcher choice and rank environment), with one difference: where accelerate hands a single-node
    launch to ``torch.distributed.run.run``, the ranks are forked from here (:func:`_run_ranks`) with the
    environment accelerate set. Any other path (one process, several nodes, ``-m`` scripts) runs accelerate's own
    way. With ``req["fsdp_device"]`` (the FSDP device folder first on the launch's ``PYTHONPATH``), its
    ``sitecustomize`` runs here first, as it would at the start of every interpreter of a real launch (it patches
    ``accelerate.state`` whether or not that is imported yet; the server created no accelerate state)."""
    import importlib.util

    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    device = req.get("fsdp_device")
    if device:
        sys.path.insert(1, device)
        if "sitecustomize" in sys.modules:  # the server ran the one its path had: the device's chaining ran it
            sys._hf_ddpfix_fsdp_device_chained = True  # type: ignore[attr-defined]
        spec = importlib.util.spec_from_file_location("sitecustomize", os.path.join(device, "sitecustomize.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import launch_command, launch_command_parser

    real_run = distrib_run.run

    def forked_run(targs) -> None:
        if str(targs.nnodes) not in ("1", "1:1") or targs.module or targs.no_python:
            return real_run(targs)
        rc = _run_ranks(dict(req, script=targs.training_script, args=list(targs.training_script_args),
                             nproc=int(targs.nproc_per_node), port=int(targs.master_port), env=dict(os.environ)))
        if rc:
            raise _RanksFailed

    distrib_run.run = forked_run
    try:
        launch_command(launch_command_parser().parse_args(req["accelerate"]))
    except _RanksFailed:
        return 1
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as `accelerate launch` does: the traceback, exit 1
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def serve() -> None:
    """Import the heavy modules once, then run launches read from stdin until it closes."""
    import importlib

    answer = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed from here on goes to the server's log, never into the answers
    for name in PREIMPORTS:
        importlib.import_module(name)
    from transformers import Trainer, TrainingArguments  # noqa: F401 - the Trainer's own imports

    gc.collect()
    gc.freeze()  # the imported heap: a rank's full collections skip it (module docstring, "What differs")

    # its start-up environment after the imports (they may set some: TORCHINDUCTOR_CACHE_DIR), so that a client
    # whose own process set the same by importing the same modules still matches
    answer.write(json.dumps({"ready": True, "startup_env": startup_env(dict(os.environ))}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _launcher_main(req)
            finally:
                os._exit(1)
        answer.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answer.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve()
