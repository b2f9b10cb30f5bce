"""Hang detection inside one rank: a collective that does not return within ``timeout`` seconds.

A daemon thread samples the main thread's Python stack every :data:`PERIOD` seconds (``sys._current_frames``:
gloo and NCCL waits release the GIL, so the sampler keeps running while the main thread is blocked). When the
innermost frame stays the same frame inside a communication module (:data:`COMM_FILES`: ``torch.distributed``,
DeepSpeed's ``comm``, accelerate's gather/broadcast helpers) for ``timeout`` seconds, the rank is hung in a
collective: the thread writes ``<dir>/rank<R>.hang.json`` (the collective's function, the stack) and the stacks of
every thread (``faulthandler``) to ``<dir>/rank<R>.stacks.txt``. The rehearsal's driver reads those files, asks the
other ranks for their stacks (``SIGUSR1``, registered here with ``faulthandler``) and ends the launch.

Guarantees: a frame outside the communication modules never counts as a hang, however long (a slow forward is
not a hang); the files are written once per rank.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import threading
import time
import traceback
from types import FrameType
from typing import Any

__all__ = ["COMM_FILES", "PERIOD", "collective_of", "frames_of", "start"]

PERIOD = 0.5  # seconds between two samples of the main thread's stack
#: Path fragments of modules whose frames are communication (where a rank waits on the others): a frame that stays
#: the innermost one in these for the timeout is a hang.
COMM_FILES = ("torch/distributed/", "deepspeed/comm/")
#: The collective APIs themselves: the innermost of these in a failing stack names the collective.
COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives.py",
                    "deepspeed/comm/")
_INTERNAL = ("torch/distributed/", "deepspeed/", "accelerate/", "torch/nn/modules/module.py", "torch/utils/",
             "torch/autograd/", "torch/_tensor.py", "torch/_dynamo", "torch/_functorch", "/threading.py",
             "transformers/utils/", "transformers/integrations/", "transformers/modeling_layers.py", "peft/tuners/",
             "hf_ddpfix/rehearse/", "torch/_compile.py", "/contextlib.py", "/functools.py")


def frames_of(frame: FrameType | None, limit: int = 40) -> list[dict[str, Any]]:
    """The stack ending at ``frame``, outermost first: ``{"file", "line", "func", "code"}`` per frame."""
    out = [{"file": f.filename, "line": f.lineno, "func": f.name, "code": (f.line or "").strip()}
           for f in traceback.extract_stack(frame, limit=limit)] if frame is not None else []
    return out


def collective_of(frames: list[dict[str, Any]]) -> tuple[str | None, dict[str, Any] | None]:
    """``(collective function, the frame that issued it)``: the innermost frame in a communication module whose
    caller is not one, and that caller (the first frame outside torch.distributed, DeepSpeed's comm, accelerate's
    operations helpers)."""
    for i in range(len(frames) - 1, -1, -1):
        f = frames[i]
        if any(c in f["file"].replace("\\", "/") for c in COLLECTIVE_FILES):
            j = i
            while j > 0 and any(c in frames[j - 1]["file"].replace("\\", "/") for c in COLLECTIVE_FILES):
                j -= 1
            name = frames[i]["func"]
            issuer = frames[j - 1] if j > 0 else None
            return name, issuer
    return None, None


def user_frames(frames: list[dict[str, Any]], n: int = 3) -> list[dict[str, Any]]:
    """The ``n`` innermost frames outside torch / DeepSpeed / accelerate internals (the model's and the script's)."""
    keep = [f for f in frames if not any(c in f["file"].replace("\\", "/") for c in _INTERNAL)]
    return keep[-n:]


def _in_comm(frame: FrameType) -> bool:
    name = frame.f_code.co_filename.replace("\\", "/")
    return any(c in name for c in COMM_FILES)


def start(directory: str, rank: int, timeout: float) -> None:
    """Register the ``SIGUSR1`` stack dump and start the sampling thread for this rank (once per process)."""
    if getattr(start, "_hf_ddpfix_started", False):
        return
    start._hf_ddpfix_started = True  # type: ignore[attr-defined]
    stacks = open(os.path.join(directory, f"rank{rank}.stacks.txt"), "w")  # noqa: SIM115 - lives with the process
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    main = threading.main_thread().ident

    def sample() -> None:
        from .._compat.torch_internals import thread_frame  # here: the shim imports nothing heavy at start-up

        since, last = None, None
        while True:
            time.sleep(PERIOD)
            frame = thread_frame(main)
            if frame is None:
                return
            key = (id(frame), frame.f_lineno) if _in_comm(frame) else None
            if key is None or key != last:
                since, last = (time.monotonic() if key else None), key
                continue
            if since is not None and time.monotonic() - since >= timeout:
                frames = frames_of(frame)
                name, issuer = collective_of(frames)
                record = {"rank": rank, "pid": os.getpid(), "waited_s": round(time.monotonic() - since, 1),
                          "collective": name, "issued_at": issuer, "user_frames": user_frames(frames),
                          "stack": frames[-25:]}
                path = os.path.join(directory, f"rank{rank}.hang.json")
                with open(path + ".tmp", "w") as f:
                    json.dump(record, f, indent=1)
                os.replace(path + ".tmp", path)
                faulthandler.dump_traceback(file=stacks, all_threads=True)
                stacks.flush()
                return

    threading.Thread(target=sample, name="hf_ddpfix-rehearse-watchdog", daemon=True).start()
