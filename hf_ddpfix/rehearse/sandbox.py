"""A rehearsal rank never writes outside the rehearsal: every write whose target lies outside is redirected into
``<rehearsal folder>/outside/<the absolute path>`` and listed in the report.

Why: a rehearsal runs the user's script unchanged, and scripts save where the real run saves
(``trainer.save_model(os.path.join(out, "final"))``, ``model.save_pretrained(out)``, ``torch.save(..., out)``,
``json.dump(..., open(out / "metrics.json", "w"))``). Moving ``TrainingArguments.output_dir`` alone let a rehearsal
replace a real run's trained adapter with a 4-step random one (issue 46).

How (installed by :func:`install` at interpreter start in every rank, from ``shim/sitecustomize.py``, before the
script's first line), in three layers, each catching what the one above misses:

1. **The save entry points** (:mod:`hf_ddpfix.rehearse.saves`: ``Trainer.save_model``, ``PreTrainedModel`` / ``PeftModel`` / tokenizer / processor /
   config ``save_pretrained``, accelerate's ``Accelerator.save_state`` / ``save_model``, ``torch.save``,
   safetensors' ``save_file``): the target argument is mapped before the call, so everything the call writes lands
   in the rehearsal folder, and the report says "your script saved to X (Trainer.save_model); the rehearsal wrote
   it to Y" once per call. ``torch.save`` and ``save_file`` must be wrapped here: they write from C++ / Rust, which
   no Python-level hook sees.
2. **Python's file system calls** (``open`` = ``io.open``, ``os.open``, ``os.mkdir`` / ``makedirs``, ``os.rename``
   / ``replace``, ``os.remove`` / ``unlink`` / ``rmdir``, ``shutil.rmtree``): a write outside goes to the same
   mapped path (``pathlib``, ``shutil.copy``, ``logging.FileHandler``, ``numpy.save`` all end here); ``"a"`` / ``"r+"``
   copy the real file first; a delete or rename of a real file outside is not done (a rename copies) and is listed.
   Reads follow the writes: ``open`` for reading, ``os.path.exists`` / ``isfile`` / ``isdir`` and ``os.listdir``
   see the redirected copy, so a script that saves and reloads (``from_pretrained(out)`` through the rehearsal's
   loaders, :func:`resolve`) reads what it wrote.
3. **An audit hook** (``sys.addaudithook``, PEP 578) on ``open`` / ``os.*`` / ``shutil.*`` events: a write outside
   that reached the OS without passing through layer 2 (``io.FileIO`` called directly, an ``open`` bound before
   start-up) is refused (``PermissionError`` naming the path and the rehearsal) and listed: a failed rehearsal, never
   a changed file. Audit hooks cannot redirect, only refuse, hence layers 1-2.

Not outside: the rehearsal's own root (``DDPFIX_REHEARSE_ROOT``; the temporary folder is inside it: the driver
sets ``TMPDIR``), the shared caches (``HF_HOME``, ``HF_HUB_CACHE``, ``HF_DATASETS_CACHE``, ``TRANSFORMERS_CACHE``,
``TORCH_HOME``, ``TRITON_CACHE_DIR``, ``XDG_CACHE_HOME``, ``~/.cache``, ``~/.triton``; downloads and compiled
kernels, written by later runs the same way), Python's ``__pycache__`` folders and ``/dev``, ``/proc``, ``/sys``.

Limits: a write from native code that takes a path itself (a C++ / Rust writer other than torch's and safetensors'
— e.g. pyarrow into a dataset folder) is neither seen nor redirected; such writes are not made by the HF / PEFT /
torch save APIs. ``os.scandir`` and ``glob`` read the real folders only.

Guarantees: with :func:`install` not called (outside a rehearsal rank) nothing is patched; after it, no file
outside the allowed roots is created, changed or removed through layers 1-3 (tests/test_rehearse.py
``test_sandbox_*``).
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["install", "installed", "mapped", "resolve"]

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_state: dict[str, Any] = {"on": False}
_local = threading.local()
_lock = threading.Lock()
_orig: dict[str, Any] = {}


# --------------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------------


def _abs(path: Any) -> str | None:
    """The absolute ``str`` path of ``path`` (str, bytes, PathLike), or None (a file descriptor, anything else)."""
    if isinstance(path, int) or path is None:
        return None
    try:
        p = os.fsdecode(os.fspath(path))
    except TypeError:
        return None
    return os.path.abspath(p)


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _allowed_roots(root: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the rehearsal's own roots, the shared caches and system folders)."""
    home = os.path.expanduser("~")
    caches = [os.environ.get(k) for k in ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE",
                                          "TORCH_HOME", "TRITON_CACHE_DIR", "XDG_CACHE_HOME",
                                          "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR")]
    caches += [os.path.join(home, ".cache"), os.path.join(home, ".triton"), "/dev", "/proc", "/sys"]
    own = [root]
    tmp = os.environ.get("TMPDIR")
    if tmp and _under(os.path.abspath(tmp), (root,)):
        own.append(os.path.abspath(tmp))
    return tuple(os.path.abspath(r) for r in own), tuple(os.path.abspath(c) for c in caches if c)


def _outside(path: str) -> bool:
    """Outside the rehearsal and the caches; Python's own bytecode cache (``__pycache__``, written by the import
    system through ``posix.open``, which only the audit hook sees) is a cache too."""
    return not _under(path, _state["own"]) and not _under(path, _state["caches"]) and "__pycache__" not in path


def mapped(path: Any) -> Any:
    """Where a write to ``path`` goes in this rank: ``path`` itself when inside the rehearsal (or a cache, or not a
    path), else ``<rehearsal folder>/outside/<absolute path>`` (a ``str``)."""
    p = _abs(path) if _state["on"] else None
    if p is None or not _outside(p):
        return path
    return os.path.join(_state["shadow"], p.lstrip(os.sep))


def resolve(path: Any) -> Any:
    """Where a read of ``path`` goes: the redirected copy when the script wrote one, else ``path``."""
    p = _abs(path) if _state["on"] and _state["any"] else None
    if p is None or not _outside(p):
        return path
    m = os.path.join(_state["shadow"], p.lstrip(os.sep))
    return m if _orig["lexists"](m) else path


def installed() -> bool:
    return bool(_state["on"])


# --------------------------------------------------------------------------------------------------
# What the report lists
# --------------------------------------------------------------------------------------------------


def _note(kind: str, asked: str, wrote: str | None, how: str) -> None:
    """One entry per (kind, asked path, how) in the rank's record (``redirected`` / ``refused`` / ``kept``)."""
    key = (kind, asked, how)
    with _lock:
        if key in _state["seen"] or len(_state["seen"]) > 400:
            return
        _state["seen"].add(key)
    if getattr(_local, "noting", False):
        return
    _local.noting = True
    try:
        from .record import note

        note("sandbox", {"kind": kind, "asked": asked, "wrote": wrote, "how": how}, append=True)
    finally:
        _local.noting = False


def _redirect(path: Any, how: str, *, copy_first: bool = False) -> Any:
    """``mapped(path)``, with the mapped parent folder made and the redirect listed (unless an enclosing save
    entry point already listed it)."""
    m = mapped(path)
    if m is path:
        return path
    _state["any"] = True
    real = _abs(path)
    _orig["makedirs"](os.path.dirname(m), exist_ok=True)
    if copy_first and not _orig["lexists"](m) and _orig["isfile"](real):
        shutil.copy2(real, m)
    if not getattr(_local, "depth", 0):
        _note("redirected", real, m, how)
    return m


class _Api:
    """Inside a save entry point: the low-level layer redirects without listing each file again."""

    def __enter__(self):
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc):
        _local.depth -= 1


# --------------------------------------------------------------------------------------------------
# Layer 2: Python's file system calls
# --------------------------------------------------------------------------------------------------


def _is_write_mode(mode: str) -> bool:
    return any(c in mode for c in "wax+")


def _open(file, mode="r", *args, **kwargs):
    if isinstance(mode, str) and _is_write_mode(mode):
        file = _redirect(file, f"open(mode={mode!r})", copy_first=("a" in mode or "+" in mode) and "w" not in mode)
    else:
        file = resolve(file)
    return _orig["open"](file, mode, *args, **kwargs)


def _os_open(path, flags, *args, **kwargs):
    if kwargs.get("dir_fd") is not None:  # relative to a folder descriptor (shutil.rmtree's walk): as is
        return _orig["os_open"](path, flags, *args, **kwargs)
    if flags & _WRITE_FLAGS:
        path = _redirect(path, "os.open", copy_first=not flags & os.O_TRUNC)
    else:
        path = resolve(path)
    return _orig["os_open"](path, flags, *args, **kwargs)


def _makedirs(name, *args, **kwargs):
    return _orig["makedirs"](_redirect(name, "os.makedirs"), *args, **kwargs)


def _mkdir(path, *args, **kwargs):
    if kwargs.get("dir_fd") is not None:
        return _orig["mkdir"](path, *args, **kwargs)
    return _orig["mkdir"](_redirect(path, "os.mkdir"), *args, **kwargs)


def _rename_like(which: str):
    def rename(src, dst, *args, **kwargs):
        if kwargs.get("src_dir_fd") is not None or kwargs.get("dst_dir_fd") is not None:
            return _orig[which](src, dst, *args, **kwargs)
        d = _redirect(dst, f"os.{which}")
        s_abs = _abs(src)
        if s_abs is not None and _outside(s_abs):
            s = resolve(src)
            if s is src:  # a real file outside: copied, never moved
                if _orig["isdir"](s_abs):
                    shutil.copytree(s_abs, d, dirs_exist_ok=True)
                elif _orig["lexists"](s_abs):
                    shutil.copy2(s_abs, d)
                _note("kept", s_abs, d, f"os.{which}: copied, the original left in place")
                return None
            src = s
        return _orig[which](src, d, *args, **kwargs)

    return rename


def _remove_like(which: str):
    def remove(path, *args, **kwargs):
        p = _abs(path) if kwargs.get("dir_fd") is None else None
        if p is not None and _state["on"] and _outside(p):
            m = resolve(path)
            if m is path:  # a real file outside: left in place
                _note("kept", p, None, f"{which}: not deleted")
                return None
            path = m
        return _orig[which](path, *args, **kwargs)

    return remove


def _exists_like(which: str):
    def check(path, *args, **kwargs):
        return _orig[which](path, *args, **kwargs) or (_state["any"] and resolve(path) is not path and
                                                        _orig[which](resolve(path), *args, **kwargs))

    return check


def _stat_like(which: str):
    def stat(path, *args, **kwargs):
        if kwargs.get("dir_fd") is None and isinstance(path, str | bytes | os.PathLike):
            path = resolve(path)
        return _orig[which](path, *args, **kwargs)

    return stat


def _meta_like(which: str):
    """``chmod`` / ``utime`` (``shutil.copy2``'s metadata): the redirected copy, else nothing for a real file
    outside."""
    def meta(path, *args, **kwargs):
        p = _abs(path) if kwargs.get("dir_fd") is None else None
        if p is not None and _state["on"] and _outside(p):
            m = resolve(path)
            if m is path:
                return None
            path = m
        return _orig[which](path, *args, **kwargs)

    return meta


def _truncate(path, length):
    return _orig["truncate"](_redirect(path, "os.truncate", copy_first=True), length)


def _listdir(path="."):
    m = resolve(path) if isinstance(path, str | os.PathLike) else path
    if m is path or not _orig["isdir"](m):
        return _orig["listdir"](path)
    try:
        names = _orig["listdir"](path)
    except FileNotFoundError:
        names = []
    return sorted(set(names) | set(_orig["listdir"](m)))


# --------------------------------------------------------------------------------------------------
# Layer 3: the audit hook
# --------------------------------------------------------------------------------------------------

_EVENTS = {"open": (0,), "os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1),
           "os.truncate": (0,), "os.symlink": (1,), "os.link": (1,), "shutil.rmtree": (0,)}
# (shutil.copyfile / shutil.move audit before their own open / rename: those are the events checked)


def _audit(event: str, args: tuple) -> None:
    where = _EVENTS.get(event)
    if where is None or not _state["on"]:
        return
    if event == "open":
        mode, flags = (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else 0)
        if not ((isinstance(flags, int) and flags & _WRITE_FLAGS) or (isinstance(mode, str) and
                                                                     _is_write_mode(mode))):
            return
    if event.startswith("os.") and any(isinstance(a, int) and not isinstance(a, bool) for a in args[1:]) and \
            event in ("os.remove", "os.rmdir", "os.mkdir", "os.rename"):
        dir_fds = args[2:] if event == "os.rename" else args[-1:]
        if any(d is not None and d != -1 for d in dir_fds):
            return  # relative to a folder descriptor: shutil.rmtree's walk inside a folder already checked
    for i in where:
        if i >= len(args):
            continue
        p = _abs(args[i])
        if p is not None and _outside(p):
            _note("refused", p, None, f"{event} (not through a redirected call)")
            raise PermissionError(f"hf-ddpfix rehearse: {event} of {p} refused: a rehearsal never writes outside "
                                  f"its folder ({_state['root']}) and this write bypassed the redirect "
                                  "(hf_ddpfix/rehearse/sandbox.py)")


# --------------------------------------------------------------------------------------------------
# install
# --------------------------------------------------------------------------------------------------


def install(folder: str, root: str | None = None, hooks: Mapping[str, Callable[[Any], None]] | None = None) -> None:
    """Redirect this process's writes outside ``root`` (default ``folder``) into ``<folder>/outside/``; idempotent.
    ``hooks``: layer 1's entry points by module (``saves.HOOKS``, passed in by the caller so that this module does
    not import :mod:`hf_ddpfix.rehearse.saves`, which imports it): patched here when already imported, else by the
    caller's import hooks."""
    if _state["on"]:
        return
    root = os.path.abspath(root or folder)
    own, caches = _allowed_roots(root)
    _state.update(on=True, root=root, own=own, caches=caches, any=False, seen=set(),
                  shadow=os.path.join(os.path.abspath(folder), "outside"))
    _orig.update(open=io.open, os_open=os.open, makedirs=os.makedirs, mkdir=os.mkdir, rename=os.rename,
                 replace=os.replace, remove=os.remove, unlink=os.unlink, rmdir=os.rmdir, rmtree=shutil.rmtree,
                 lexists=os.path.lexists, exists=os.path.exists, isfile=os.path.isfile, isdir=os.path.isdir,
                 listdir=os.listdir, stat=os.stat, lstat=os.lstat, chmod=os.chmod, utime=os.utime,
                 truncate=os.truncate)
    builtins.open = io.open = _open
    os.open, os.makedirs, os.mkdir = _os_open, _makedirs, _mkdir
    os.rename, os.replace = _rename_like("rename"), _rename_like("replace")
    os.remove, os.unlink, os.rmdir = _remove_like("remove"), _remove_like("unlink"), _remove_like("rmdir")
    shutil.rmtree = _remove_like("rmtree")
    os.path.exists, os.path.isfile, os.path.isdir = (_exists_like("exists"), _exists_like("isfile"),
                                                     _exists_like("isdir"))
    os.listdir = _listdir
    os.stat, os.lstat = _stat_like("stat"), _stat_like("lstat")
    os.chmod, os.utime, os.truncate = _meta_like("chmod"), _meta_like("utime"), _truncate
    for name, patch in (hooks or {}).items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.addaudithook(_audit)
