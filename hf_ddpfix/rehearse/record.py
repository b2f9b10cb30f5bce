"""A rehearsal rank's record (``<dir>/rank<R>.json``, rewritten as the run goes), its output copied
(``<dir>/rank<R>.out``), its environment and the error a step that cannot run here raises. Shared by :mod:`hf_ddpfix.rehearse.inject` and :mod:`hf_ddpfix.rehearse.loading`.

Guarantees: outside a rehearsal (``DDPFIX_REHEARSE_DIR`` unset) nothing is written.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

ENV = "DDPFIX_REHEARSE_"


class RehearsalStepError(RuntimeError):
    """A step of the rehearsal that cannot run here; the message names the step and what to do."""


def _env(name: str, default: str = "") -> str:
    return os.environ.get(ENV + name, default)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# --------------------------------------------------------------------------------------------------
# The rank's record
# --------------------------------------------------------------------------------------------------

_record: dict[str, Any] = {}
_lock = threading.Lock()


def note(key: str, value: Any, append: bool = False) -> None:
    """Set (or append to) ``key`` in this rank's record and write it."""
    with _lock:
        if append:
            _record.setdefault(key, []).append(value)
        else:
            _record[key] = value
        _write()


def _write() -> None:
    directory = _env("DIR")
    if not directory:
        return
    path = os.path.join(directory, f"rank{_rank()}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(_record, f, indent=1, default=str)
        os.replace(tmp, path)
    except OSError:  # pragma: no cover - the folder was removed under us
        pass


# --------------------------------------------------------------------------------------------------
# The rank's output, copied
# --------------------------------------------------------------------------------------------------


class _Tee:
    """``sys.stdout`` / ``sys.stderr`` of a rank, also written to ``rank<R>.out`` (the report shows rank 0's last
    lines); everything else (``fileno``, ``isatty``, ``encoding``) is the stream's own."""

    def __init__(self, stream: Any, copy: Any) -> None:
        self._stream, self._copy = stream, copy

    def write(self, text: str) -> int:
        try:
            self._copy.write(text)
        except (OSError, ValueError):  # pragma: no cover - the folder was removed
            pass
        return self._stream.write(text)

    def flush(self) -> None:
        try:
            self._copy.flush()
        except (OSError, ValueError):  # pragma: no cover
            pass
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _tee_output(path: str) -> None:
    try:
        copy = open(path, "a", buffering=1, errors="replace")  # noqa: SIM115 - lives with the process
    except OSError:  # pragma: no cover
        return
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None:
            setattr(sys, name, _Tee(stream, copy))
