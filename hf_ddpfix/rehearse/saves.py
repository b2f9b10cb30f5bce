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
from typing import Any

from .sandbox import _Api, _redirect, resolve

__all__ = ["HOOKS", "wrap_reader", "wrap_target"]


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


def patch_torch_serialization(module: Any) -> None:
    """``torch.save`` / ``torch.load`` (bound into ``torch`` when ``torch/__init__`` runs, after this module)."""
    before = module.save, module.load
    wrap_target(module, "save", "f", 1, "torch.save")
    wrap_reader(module, "load", "f", 0)
    torch = sys.modules.get("torch")  # imported already: its own binding too
    if torch is not None and getattr(torch, "save", None) is before[0]:
        torch.save, torch.load = module.save, module.load


def patch_safetensors(module: Any) -> None:
    wrap_target(module, "save_file", "filename", 1, "safetensors save_file")
    wrap_reader(module, "load_file", "filename", 0)


def patch_trainer(module: Any) -> None:
    wrap_target(module.Trainer, "save_model", "output_dir", 0, "Trainer.save_model")


def patch_modeling(module: Any) -> None:
    wrap_target(module.PreTrainedModel, "save_pretrained", "save_directory", 0, "save_pretrained")


def patch_peft(module: Any) -> None:
    wrap_target(module.PeftModel, "save_pretrained", "save_directory", 0, "PeftModel.save_pretrained")


def patch_tokenizer(module: Any) -> None:
    wrap_target(module.PreTrainedTokenizerBase, "save_pretrained", "save_directory", 0, "tokenizer.save_pretrained")


def patch_processor(module: Any) -> None:
    wrap_target(module.ProcessorMixin, "save_pretrained", "save_directory", 0, "processor.save_pretrained")


def patch_config(module: Any) -> None:
    wrap_target(module.PretrainedConfig, "save_pretrained", "save_directory", 0, "config.save_pretrained")


def patch_accelerator(module: Any) -> None:
    wrap_target(module.Accelerator, "save_state", "output_dir", 0, "Accelerator.save_state")
    wrap_target(module.Accelerator, "save_model", "save_directory", 1, "Accelerator.save_model")


#: module -> patch, for inject's import hooks (a module already imported is patched at once).
HOOKS = {"torch.serialization": patch_torch_serialization, "safetensors.torch": patch_safetensors,
         "transformers.trainer": patch_trainer, "transformers.modeling_utils": patch_modeling,
         "peft.peft_model": patch_peft, "transformers.tokenization_utils_base": patch_tokenizer,
         "transformers.processing_utils": patch_processor, "transformers.configuration_utils": patch_config,
         "accelerate.accelerator": patch_accelerator}
