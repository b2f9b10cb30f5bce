"""An error hf_ddpfix knows, handed to the launcher so that it is the last thing a user reads.

Under torchrun / `accelerate launch` (torch elastic) a failed worker ends in the launcher's `ChildFailedError`
summary, whose "Root Cause" said only "exitcode: 1" (and "To enable traceback see ...") unless the worker
recorded its error in the file the launcher names in `TORCHELASTIC_ERROR_FILE`. `report_to_launcher(exc)` writes
that file (torch elastic's documented error-file format: `{"message": {"message": ..., "extraInfo":
{"py_callstack": ..., "timestamp": ...}}}`) with the error's type and message as the whole "traceback", so
the summary's last lines say what failed and the fix, once (the worker's own traceback is printed above, as
before).

Guarantees (tests/test_launcher_errors.py): writes only when a launcher asked for it (`TORCHELASTIC_ERROR_FILE`
set) and no error was recorded there yet (the first error of a worker wins); an error raised alike on every rank
is recorded by each node's local rank 0 only (every node's launcher prints its own summary: one line per node,
never a bare ``exitcode: 1`` on the nodes after the first); never raises; changes nothing else
(the exception is re-raised by the caller unchanged). Without a launcher (plain `python`) it does nothing: the
traceback is then the last thing printed anyway.
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["KNOWN_ERROR_MODULE", "is_known_error", "report_to_launcher"]

#: errors defined in this package (PlanError, DDPFixError, OffloadBudgetError, ...) say the cause and the fix
KNOWN_ERROR_MODULE = "hf_ddpfix"


def is_known_error(exc: BaseException) -> bool:
    """True for an error whose message hf_ddpfix wrote: a class of this package, or a `ValueError` naming an
    `HF_DDPFIX_*` / `UNSLOTH_*` setting (the option parsers')."""
    if type(exc).__module__.split(".")[0] == KNOWN_ERROR_MODULE:
        return True
    return isinstance(exc, ValueError) and ("HF_DDPFIX_" in str(exc) or "UNSLOTH_" in str(exc))


def report_to_launcher(exc: BaseException, same_on_every_rank: bool | None = None) -> bool:
    """Record ``exc`` as this worker's error for torch elastic's launcher summary. Returns whether it wrote.

    Args:
        same_on_every_rank: the error is raised alike on every rank (a setting, a plan, a refusal: default for a
            `ValueError` such as `PlanError`, and `SystemExit`), so only each node's local rank 0 records it and
            that node's summary says it once (its "Root Cause"; the other ranks' entries show no traceback). Each
            node's launcher summarises only its own workers, so keying this on the global ``RANK`` left every node
            but the first with a bare ``exitcode: 1``. Otherwise (e.g. a collective error seen by one rank) every
            rank records its own.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return False
    if same_on_every_rank is None:
        same_on_every_rank = isinstance(exc, (ValueError, SystemExit))
    if same_on_every_rank and os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) not in ("", "0"):
        return False
    text = str(exc) if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"  # a refusal: its message
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text + "\n",
                                                       "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True
