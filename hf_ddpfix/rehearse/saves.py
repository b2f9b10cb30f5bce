"""Layer 1 of the rehearsal's sandbox (:mod:`hf_ddpfix.rehearse.sandbox`): the save entry points of HF, PEFT,
accelerate, torch and safetensors, their target argument redirected before the call.

Why here and not only in Python's file calls: ``torch.save`` and safetensors' ``save_file`` write from C++ / Rust,
which no Python-level hook sees; and one report line per call ("your script saved to X (Trainer.save_model)")
reads better than one per file (the files a call writes are not listed again: ``sandbox._Api``).

Guarantees: a wrapped entry point called with a target outside the rehearsal writes under the rehearsal's
``outside/`` folder instead; a missing or ``None`` target, a file object, or a sandbox not installed leave the call
as it was (tests/test_rehearse.py ``test_sandbox_*``).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

from .sandbox import _Api, _redirect, resolve

__all__ = ["ENTRIES", "HOOKS", "Entry", "patch", "wrap_reader", "wrap_target"]


def wrap_target(owner: Any, name: str, arg: str, pos: int, label: str | None = None) -> None:
    """Wrap ``owner.name`` so that its target argument (keyword ``arg`` or positional ``pos``, counted without
    ``self``) is redirected before the call; a missing argument (the method's own default, e.g. the Trainer's
    ``output_dir``) is left as is."""
    fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if fn is None or getattr(fn, "_hf_ddpfix_sandbox", False):
        return
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"
    method = isinstance(owner, type) and not isinstance(fn, staticmethod | classmethod)
    inner = fn.__func__ if isinstance(fn, staticmethod | classmethod) else fn

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        shift = 1 if method else 0
        if arg in kwargs:
            if kwargs[arg] is not None and not hasattr(kwargs[arg], "write"):
                kwargs[arg] = _redirect(kwargs[arg], label)
        elif len(args) > pos + shift and args[pos + shift] is not None and not hasattr(args[pos + shift], "write"):
            args = (*args[:pos + shift], _redirect(args[pos + shift], label), *args[pos + shift + 1:])
        with _Api():
            return inner(*args, **kwargs)

    wrapper._hf_ddpfix_sandbox = True  # type: ignore[attr-defined]
    setattr(owner, name, staticmethod(wrapper) if isinstance(fn, staticmethod) else wrapper)


def wrap_reader(owner: Any, name: str, arg: str, pos: int) -> None:
    """Wrap ``owner.name`` so that its source argument reads the redirected copy when the script wrote one."""
    fn = getattr(owner, name, None)
    if fn is None or getattr(fn, "_hf_ddpfix_sandbox", False):
        return

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if arg in kwargs:
            kwargs[arg] = resolve(kwargs[arg])
        elif len(args) > pos:
            args = (*args[:pos], resolve(args[pos]), *args[pos + 1:])
        return fn(*args, **kwargs)

    wrapper._hf_ddpfix_sandbox = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


@dataclass(frozen=True)
class Entry:
    """One wrapped entry point: ``<module>.<owner>.<name>`` (``owner`` empty: a module-level function).

    Attributes:
        owner: the class in the module that holds ``name`` ("" for the module itself).
        name: the function or method wrapped.
        arg: its target (or, ``reader``, source) argument's keyword name.
        pos: that argument's position, counted without ``self``.
        label: how the report names the call (saves only; ``None``: ``<owner>.<name>``).
        reader: a load (its source reads the redirected copy) instead of a save.
    """

    owner: str
    name: str
    arg: str
    pos: int
    label: str | None = None
    reader: bool = False


#: module -> the entry points it defines: the sandbox's whole layer 1, as data (one patcher, ``patch``).
ENTRIES: dict[str, tuple[Entry, ...]] = {
    # torch.save / torch.load: bound into ``torch`` when ``torch/__init__`` runs, after torch.serialization
    "torch.serialization": (Entry("", "save", "f", 1, "torch.save"), Entry("", "load", "f", 0, reader=True)),
    "safetensors.torch": (Entry("", "save_file", "filename", 1, "safetensors save_file"),
                          Entry("", "load_file", "filename", 0, reader=True)),
    "transformers.trainer": (Entry("Trainer", "save_model", "output_dir", 0, "Trainer.save_model"),),
    "transformers.modeling_utils": (
        Entry("PreTrainedModel", "save_pretrained", "save_directory", 0, "save_pretrained"),),
    "peft.peft_model": (Entry("PeftModel", "save_pretrained", "save_directory", 0, "PeftModel.save_pretrained"),),
    "transformers.tokenization_utils_base": (
        Entry("PreTrainedTokenizerBase", "save_pretrained", "save_directory", 0, "tokenizer.save_pretrained"),),
    "transformers.processing_utils": (
        Entry("ProcessorMixin", "save_pretrained", "save_directory", 0, "processor.save_pretrained"),),
    "transformers.configuration_utils": (
        Entry("PretrainedConfig", "save_pretrained", "save_directory", 0, "config.save_pretrained"),),
    "accelerate.accelerator": (Entry("Accelerator", "save_state", "output_dir", 0, "Accelerator.save_state"),
                               Entry("Accelerator", "save_model", "save_directory", 1, "Accelerator.save_model")),
}

#: a module whose functions are also bound, at import, into its package: (package, names), rebound after wrapping
#: while the package still holds the unwrapped function
REBOUND = {"torch.serialization": ("torch", ("save", "load"))}


def patch(module: Any) -> None:
    """Wrap every entry point ``ENTRIES`` lists for ``module`` (looked up by ``module.__name__``); idempotent."""
    rebound = REBOUND.get(module.__name__)
    before = {n: getattr(module, n, None) for n in rebound[1]} if rebound else {}
    for e in ENTRIES.get(module.__name__, ()):
        owner = getattr(module, e.owner) if e.owner else module
        if e.reader:
            wrap_reader(owner, e.name, e.arg, e.pos)
        else:
            wrap_target(owner, e.name, e.arg, e.pos, e.label)
    package = sys.modules.get(rebound[0]) if rebound else None  # imported already: its own binding too
    if package is not None and getattr(package, rebound[1][0], None) is before[rebound[1][0]]:
        for n in before:
            setattr(package, n, getattr(module, n))


#: module -> patch, for inject's import hooks (a module already imported is patched at once).
HOOKS = {name: patch for name in ENTRIES}
