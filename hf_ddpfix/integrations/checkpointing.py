"""Activation checkpointing on HF models: detect what a model uses, and switch it to our checkpoint function.

transformers' checkpointed layers call `self._gradient_checkpointing_func(forward, *args, **kwargs)`;
`activation_checkpointing_enable()` sets that attribute on every module that has a
`gradient_checkpointing` flag. We replace only the function (keeping each layer's on/off flag, so
`every_n_layers` survives), which makes the switch idempotent and reversible.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class CheckpointFunctionInfo:
    """What a layer's checkpoint function really runs, read by :func:`read_checkpoint_function`.

    Attributes:
        reentrant: the variant it runs (a custom recompute that is not torch's checkpoint counts as
            reentrant: it re-runs the layer inside backward, which is what DDP sees of reentrant).
        explicit: ``use_reentrant`` was found set somewhere along the chain (else torch's default).
        torch_checkpoint: the chain reaches ``torch.utils.checkpoint.checkpoint`` (else: a custom recompute,
            e.g. an offloading autograd Function).
        ours: it is hf_ddpfix's own :class:`CheckpointFunction`.
        chain: the callables followed, outermost first (names, for the plan log).
        origin: the module of the outermost callable (e.g. ``transformers.modeling_utils`` for transformers'
            own offloading wrapper, which hf_ddpfix's plan replaces like the plain partial).
    """

    reentrant: bool
    explicit: bool
    torch_checkpoint: bool
    ours: bool
    chain: tuple[str, ...]
    origin: str = ""

    def describe(self) -> str:
        kind = "torch checkpoint" if self.torch_checkpoint else "custom recompute"
        variant = "reentrant" if self.reentrant else "non-reentrant"
        return f"{' -> '.join(self.chain)} ({kind}, {variant}{'' if self.explicit else ' by default'})"


def _name(obj: Any) -> str:
    if isinstance(obj, functools.partial):
        kw = ", ".join(f"{k}={v!r}" for k, v in obj.keywords.items())
        return f"partial({_name(obj.func)}{', ' + kw if kw else ''})"
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def read_checkpoint_function(func: Callable) -> CheckpointFunctionInfo:
    """Follow a checkpoint function to what it really calls: hf_ddpfix's `CheckpointFunction`,
    ``functools.partial`` (its ``use_reentrant`` keyword, then its ``func``), ``__wrapped__`` (functools.wraps),
    and the callables a wrapper closes over or takes as defaults (LLaMA-Factory wraps
    ``partial(checkpoint, use_reentrant=...)`` in a function; Unsloth-style tools install a function around
    their own offloading autograd Function). The first explicit ``use_reentrant`` found wins; reaching
    torch's ``checkpoint`` without one means torch's default (reentrant); never reaching it means a custom
    recompute (reentrant-like).

    Guarantees: pure (calls nothing it reads); a cycle or a depth over 16 stops the walk
    (tests/test_checkpoint_functions.py).
    """
    chain: list[str] = []
    explicit: bool | None = None
    reaches_torch = False
    ours = isinstance(func, CheckpointFunction)
    seen: set[int] = set()
    origin = ""
    todo: list[Any] = [func]
    while todo and len(seen) < 16:
        cur = todo.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        chain.append(_name(cur))
        if isinstance(cur, CheckpointFunction):
            if explicit is None:
                explicit = cur.use_reentrant
            reaches_torch = True
            continue
        if cur is checkpoint:
            reaches_torch = True
            continue
        if isinstance(cur, functools.partial):
            if explicit is None and "use_reentrant" in cur.keywords:
                explicit = bool(cur.keywords["use_reentrant"])
            todo.insert(0, cur.func)
            continue
        if not origin:  # the first callable that is not a partial (a partial's __module__ is "functools")
            origin = str(getattr(cur, "__module__", None) or "")
        code = getattr(cur, "__code__", None)
        glb = getattr(cur, "__globals__", None) or {}
        if code is not None and any(glb.get(n) is checkpoint for n in code.co_names):
            reaches_torch = True  # calls torch's checkpoint by a global name (transformers' offload wrapper)
        inner = getattr(cur, "__wrapped__", None)
        found: list[Any] = [inner] if callable(inner) else []
        for default in (getattr(cur, "__kwdefaults__", None) or {}).items():
            if default[0] == "use_reentrant" and explicit is None and isinstance(default[1], bool):
                explicit = default[1]
        for cell in getattr(cur, "__closure__", None) or ():
            try:
                val = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(val, bool) and explicit is None and "use_reentrant" in cur.__code__.co_freevars:
                names = cur.__code__.co_freevars
                if names[list(cur.__closure__).index(cell)] == "use_reentrant":
                    explicit = val
            elif callable(val) and not isinstance(val, type):
                found.append(val)
        todo[:0] = found
    reentrant = explicit if explicit is not None else True
    if not reaches_torch:
        reentrant = True  # a custom recompute re-runs the layer inside backward
    return CheckpointFunctionInfo(reentrant=bool(reentrant), explicit=explicit is not None,
                                  torch_checkpoint=reaches_torch, ours=ours, chain=tuple(chain[:6]),
                                  origin=origin)


#: The attribute a hf_ddpfix wrapper around a checkpoint function (the usage observer of reentrant layers,
#: ``integrations/usage/regions.py``) names the function it calls by: a layer that calls such a wrapper
#: runs what the wrapper wraps.
INNER_ATTR = "_hf_ddpfix_inner"


def unwrap_own(func: Any) -> Any:
    """``func`` without hf_ddpfix's own wrappers (followed through :data:`INNER_ATTR`, at most 8 deep)."""
    for _ in range(8):
        inner = getattr(func, INNER_ATTR, None)
        if inner is None:
            return func
        func = inner
    return func


def runs_own_function(func: Any) -> bool:
    """True when a layer calling ``func`` runs hf_ddpfix's :class:`CheckpointFunction` (directly or through
    hf_ddpfix's own wrappers), or calls nothing (``None``). An identity test: no walk of the chain."""
    return func is None or isinstance(unwrap_own(func), CheckpointFunction)


def _use_reentrant_of(func: Callable) -> bool:
    """The checkpoint variant a `_gradient_checkpointing_func` runs (:func:`read_checkpoint_function`)."""
    return read_checkpoint_function(func).reentrant


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


def installed_checkpoint_functions(model: nn.Module) -> dict[str, CheckpointFunctionInfo]:
    """The distinct checkpoint functions the model's checkpointing layers call now (not hf_ddpfix's own),
    keyed by their description."""
    out: dict[str, CheckpointFunctionInfo] = {}
    for m in checkpointable_layers(model):
        if is_checkpointing(m):
            func = layer_checkpoint_func(m)
            if func is None:
                continue
            info = read_checkpoint_function(unwrap_own(func))
            if not info.ours:
                out.setdefault(info.describe(), info)
    return out


def tool_checkpoint_functions(model: nn.Module) -> dict[str, CheckpointFunctionInfo]:
    """:func:`installed_checkpoint_functions` minus transformers' and hf_ddpfix's own (``partial(checkpoint,
    ...)``, transformers' offloading wrapper, the usage observer): the functions a trainer or tool brought."""
    return {k: v for k, v in installed_checkpoint_functions(model).items()
            if not (v.torch_checkpoint and len(v.chain) <= 2 and v.chain[0].startswith("partial("))
            and not v.origin.startswith(("transformers.", "hf_ddpfix."))}


def keep_tool_checkpointing(model: nn.Module, *, use_reentrant: bool, offload: bool) -> str | None:
    """Why the tool's own checkpoint functions can stay (a sentence for the log), or None to replace them.

    They stay when every one runs the plan's variant and no activation offload of hf_ddpfix needs its own
    function around each call.
    """
    tools = tool_checkpoint_functions(model)
    if not tools or offload:
        return None
    if all(info.reentrant == use_reentrant for info in tools.values()):
        return "kept the model's own checkpoint function: " + "; ".join(tools)
    return None


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
    "CheckpointFunctionInfo",
    "installed_checkpoint_functions",
    "keep_tool_checkpointing",
    "tool_checkpoint_functions",
    "read_checkpoint_function",
    "runs_own_function",
    "unwrap_own",
    "apply_checkpointing",
    "checkpoint_kwargs_without_mode",
    "detect_checkpointing",
    "requested_checkpointing",
]
