"""Activation checkpointing on HF models: detect what a model uses, and switch it to our checkpoint function.

transformers' checkpointed layers call `self._gradient_checkpointing_func(forward, *args, **kwargs)`;
`activation_checkpointing_enable()` sets that attribute on every module that has a
`gradient_checkpointing` flag. We replace only the function (keeping each layer's on/off flag, so
`every_n_layers` survives), which makes the switch idempotent and reversible.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from torch import nn
from torch.utils.checkpoint import checkpoint

from .._compat import (
    checkpointable_layers,
    is_checkpointing,
    layer_checkpoint_func,
    set_layer_checkpoint_func,
)


class _PackScope(Protocol):
    def pack_scope(self) -> Any: ...


class CheckpointFunction:
    """A `torch.utils.checkpoint.checkpoint` replacement with a fixed mode and an optional offload.

    Args:
        use_reentrant: the checkpoint variant.
        offload: an object with `pack_scope()` (e.g. `ActivationOffload`) entered around each
            non-reentrant checkpoint call so only the checkpoint's inputs are packed; `None` for none.
        **checkpoint_kwargs: passed to `torch.utils.checkpoint.checkpoint` (e.g. `preserve_rng_state`).

    Guarantees: calls `checkpoint(function, *args, use_reentrant=..., **kwargs)` exactly once per call;
    the math is the stock checkpoint's.
    """

    def __init__(self, use_reentrant: bool, offload: _PackScope | None = None, **checkpoint_kwargs: Any):
        if use_reentrant and offload is not None:
            raise ValueError("activation offload needs use_reentrant=False (its hooks see only non-reentrant inputs)")
        self.use_reentrant = use_reentrant
        self.offload = offload
        self.checkpoint_kwargs = checkpoint_kwargs

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        if self.offload is None:
            return checkpoint(function, *args, use_reentrant=self.use_reentrant, **self.checkpoint_kwargs, **kwargs)
        with self.offload.pack_scope():
            return checkpoint(function, *args, use_reentrant=self.use_reentrant, **self.checkpoint_kwargs, **kwargs)

    def __repr__(self) -> str:
        return f"CheckpointFunction(use_reentrant={self.use_reentrant}, offload={self.offload is not None})"


def _use_reentrant_of(func: Callable) -> bool:
    """The checkpoint variant a `_gradient_checkpointing_func` runs (torch's default when unset is reentrant)."""
    if isinstance(func, CheckpointFunction):
        return func.use_reentrant
    inner = func
    while isinstance(inner, functools.partial):
        if "use_reentrant" in inner.keywords:
            return bool(inner.keywords["use_reentrant"])
        inner = inner.func
    return True


def detect_checkpointing(model: nn.Module) -> str:
    """The checkpointing a model has enabled now: "off", "reentrant" or "non_reentrant"."""
    modes = {
        _use_reentrant_of(layer_checkpoint_func(m))
        for m in checkpointable_layers(model)
        if is_checkpointing(m)
    }
    if not modes:
        return "off"
    return "reentrant" if True in modes else "non_reentrant"


def requested_checkpointing(kwargs: dict[str, Any] | None) -> tuple[str, bool | None, bool]:
    """Read TrainingArguments' `activation_checkpointing_kwargs` as transformers 5.23 applies them.

    Returns:
        (mode, explicit use_reentrant or None, offload requested).
    """
    kw = dict(kwargs or {})
    offload = bool(kw.pop("offload", False))
    kw.pop("every_n_layers", None)
    explicit = kw.get("use_reentrant")
    if not kw:
        return "non_reentrant", None, offload  # transformers passes {"use_reentrant": False} when empty
    reentrant = True if explicit is None else bool(explicit)  # torch's default when unset
    return ("reentrant" if reentrant else "non_reentrant"), (None if explicit is None else bool(explicit)), offload


def apply_checkpointing(
    model: nn.Module, *, use_reentrant: bool, offload: _PackScope | None = None, **checkpoint_kwargs: Any
) -> int:
    """Make every checkpointed layer of `model` use `CheckpointFunction(use_reentrant, offload)`.

    Keeps which layers are checkpointed. Reentrant checkpointing also needs an input that requires
    grad, so `enable_input_require_grads()` is called for it (LoRA leaves the embeddings frozen).

    Returns:
        The number of modules whose checkpoint function was replaced (0: the model has none enabled).
    """
    func = CheckpointFunction(use_reentrant, offload, **checkpoint_kwargs)
    count = 0
    for m in checkpointable_layers(model):
        set_layer_checkpoint_func(m, func)
        count += 1
    if count and use_reentrant and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    return count


def checkpoint_kwargs_without_mode(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The user's checkpoint kwargs minus the keys hf_ddpfix decides itself."""
    return {k: v for k, v in (kwargs or {}).items() if k not in ("use_reentrant", "offload", "every_n_layers")}


__all__ = [
    "CheckpointFunction",
    "apply_checkpointing",
    "checkpoint_kwargs_without_mode",
    "detect_checkpointing",
    "requested_checkpointing",
]
