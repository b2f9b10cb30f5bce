"""Tile a model's token-wise MLPs in place: ``apply_tiled_mlp`` / ``remove_tiled_mlp``.

Each module :func:`~hf_ddpfix.integrations.long_context.token_wise.is_token_wise` accepts gets an instance-level
``forward`` that decides the shard count per call (:func:`hf_ddpfix.ops.tiled.choose_shards`) and runs
:func:`hf_ddpfix.ops.tiled.tiled_call`. The patch is idempotent, deep-copy safe and undone by
``handle.remove()``; it chains with an instance-level forward someone else installed before it.

Counts (:mod:`hf_ddpfix.ops.feature_counts`, feature ``"tiled_mlp"``): ``ran`` = MLP calls that ran
tiled (forward and checkpoint recompute each count; amount ``shards`` sums their shard counts); a call
that is not one hidden-states tensor is a fallback with its reason; an input the shard policy leaves
whole (below ``min_tokens``) is the amount ``untiled_calls``, a synced module's ``no_grad`` call
``stock_no_grad_calls``. With ``sync`` the shard count is all-reduced only for an MLP that is or holds an FSDP2
unit (``ops.tiled.holds_fsdp_unit``: only then do its chunks gather); inside a unit (a decoder layer's MLP, a
vision tower folded into the root, which text-only ranks never call) it stays local, counted as
``local_count_calls``.

Usage::

    handle = apply_tiled_mlp(model, shards="auto")   # before DDP/FSDP wrapping
    print(handle.report)                              # what was tiled, what was skipped and why
    handle.remove()                                   # or remove_tiled_mlp(model)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...ops.feature_counts import record_amount, record_fallback, record_ran
from ...ops.tiled import (
    ALLOWED_SETTINGS,
    DEFAULT_MIN_TOKENS,
    DEFAULT_TOKENS_PER_SHARD,
    TiledMLPSetting,
    choose_shards,
    holds_fsdp_unit,
    parse_tiled_mlp_setting,
    sync_shards,
    tiled_call,
)
from .forward_patch import restore_forward
from .token_wise import intermediate_size, is_token_wise

__all__ = ["TiledMLPEntry", "TiledMLPHandle", "apply_tiled_mlp", "remove_tiled_mlp"]

_STATE_ATTR = "_hf_ddpfix_tiled_mlp"
FEATURE = "tiled_mlp"  # the name its counts carry (hf_ddpfix.ops.feature_counts)


@dataclass
class _TiledConfig:
    shards: int | TiledMLPSetting
    min_tokens: int
    tokens_per_shard: int
    target_gb: float | None
    sync: bool
    group: Any
    skip_in_recompute: bool
    intermediate: int


class _TiledForward:
    """Instance-level ``forward`` replacing a token-wise module's forward (deep-copy safe)."""

    def __init__(self, module: nn.Module, prev: Any, config: _TiledConfig) -> None:
        self.module = module
        self.prev = prev  # the instance-level forward we replaced (None: the class forward)
        self.config = config
        self.stats: dict[str, int] | None = None

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._base_forward())

    def _base_forward(self) -> Callable[..., torch.Tensor]:
        return self.prev if self.prev is not None else type(self.module).forward.__get__(self.module)

    def shards_for(self, x: torch.Tensor) -> int:
        c = self.config
        hidden = int(x.shape[-1]) if x.dim() else 1
        n = choose_shards(
            x.numel() // max(1, hidden), hidden, c.intermediate, c.shards,
            min_tokens=c.min_tokens, tokens_per_shard=c.tokens_per_shard, target_gb=c.target_gb,
            dtype_bytes=x.element_size(),
        )
        if not c.sync:
            return n
        if not holds_fsdp_unit(self.module):  # its unit gathers around it: no collective per chunk to align
            record_amount(FEATURE, "local_count_calls", 1)
            return n
        return sync_shards(n, c.group)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        base = self._base_forward()
        if len(args) + len(kwargs) != 1:
            record_fallback(FEATURE, f"called with {len(args)} positional and keywords {sorted(kwargs)}, "
                                     "not one hidden-states tensor")
            return base(*args, **kwargs)
        x = args[0] if args else next(iter(kwargs.values()))
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            record_fallback(FEATURE, f"input is {type(x).__name__}, not a [..., hidden] tensor")
            return base(*args, **kwargs)
        if x.numel() == 0:
            record_amount(FEATURE, "untiled_calls", 1)
            return base(*args, **kwargs)
        if self.config.sync and not torch.is_grad_enabled():
            # Not a training forward (evaluation, generation), which may run on one rank only: no
            # collective here, or that rank would wait forever for the others' shard counts. Untiled:
            # exactly stock's forward and stock's collectives.
            record_amount(FEATURE, "stock_no_grad_calls", 1)
            return base(x)
        shards = self.shards_for(x)
        if shards <= 1:  # the shard policy's choice (short input), not a fallback
            record_amount(FEATURE, "untiled_calls", 1)
            return base(x)
        record_ran(FEATURE)
        record_amount(FEATURE, "shards", shards)
        return tiled_call(
            self.module, x, shards, forward=base,
            skip_in_recompute=self.config.skip_in_recompute, stats=self.stats,
        )


@dataclass(frozen=True)
class TiledMLPEntry:
    """One candidate module: qualified name, class, whether it is tiled and why."""

    name: str
    cls: str
    tiled: bool
    reason: str


@dataclass
class TiledMLPHandle:
    """Result of ``apply_tiled_mlp``: the report and a ``remove()`` that undoes the patch."""

    model: nn.Module
    report: list[TiledMLPEntry] = field(default_factory=list)

    @property
    def patched(self) -> list[str]:
        return [e.name for e in self.report if e.tiled]

    @property
    def skipped(self) -> list[TiledMLPEntry]:
        return [e for e in self.report if not e.tiled]

    def remove(self) -> int:
        """Restore every patched module's forward; returns how many were restored."""
        return remove_tiled_mlp(self.model)


def _looks_like_mlp(name: str, module: nn.Module) -> bool:
    leaf = name.rsplit(".", 1)[-1].lower()
    return leaf in ("mlp", "feed_forward", "ffn") or "mlp" in type(module).__name__.lower()


def apply_tiled_mlp(
    model: nn.Module,
    shards: int | str | TiledMLPSetting = "auto",
    *,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD,
    target_gb: float | None = None,
    modules: Sequence[str | nn.Module] | None = None,
    sync: bool | Any = False,
    skip_in_recompute: bool = True,
) -> TiledMLPHandle:
    """Tile the token-wise MLPs of ``model`` (instance-level forward replacement).

    Args:
        model: any ``nn.Module`` (HF model, ``PeftModel``); patch it before DDP/FSDP wrapping (works
            after too: the parameters are unchanged).
        shards: ``"auto"`` (default: 1 below ``min_tokens`` tokens, else ``ceil(tokens /
            tokens_per_shard)``), ``"on"`` (forced: ``max(2, ceil(tokens / tokens_per_shard))`` at every
            length), ``"arctic"``, ``"target"``, ``"target:<GB>"``, an int, or a
            ``TiledMLPSetting``. Decided per call from the flattened token count.
        min_tokens: ``"auto"`` does not tile below this many tokens (default 8192).
        tokens_per_shard: ``"auto"`` chunk length target (default 2048).
        target_gb: GiB budget of one chunk's intermediate for ``"target"`` (default 1.0).
        modules: restrict to these modules (qualified names or module objects); each must be shown
            token-wise, else ``ValueError`` naming it. Default: every module of the model that is.
        sync: ``True`` (default group) or a process group: all-reduce MAX of the shard count per call
            so every rank uses the same count (ZeRO-3 / FSDP wrapping the MLP's Linears). Only in
            forwards with grad enabled (training): under ``no_grad`` (evaluation, generation, maybe
            on one rank only) a synced module runs its stock forward, untiled, with no collective.
        skip_in_recompute: see ``tiled_call`` (default True: 2 MLP forwards per step under
            non-reentrant checkpointing instead of 3; falls back to computing when not provably safe).

    Returns:
        ``TiledMLPHandle`` with ``report`` (every MLP-like module: tiled or skipped with the reason),
        ``patched`` names and ``remove()``.

    Raises:
        ValueError: a module named in ``modules`` is missing or not shown token-wise; bad ``shards``.

    Guarantees: idempotent (a second call updates the settings, never stacks wrappers); reversible
    (``remove()`` restores the exact previous forward); parameters, state dict and module hooks are
    untouched; with ``shards`` resolving to 1 the original forward runs (bit-identical).
    """
    if isinstance(shards, str):
        shards = parse_tiled_mlp_setting(shards, name="shards")
    elif not isinstance(shards, (int, TiledMLPSetting)) or isinstance(shards, bool) or (
        isinstance(shards, int) and shards < 1
    ):
        raise ValueError(f"shards={shards!r}: expected an int >= 1 or a setting string ({ALLOWED_SETTINGS})")
    group = None if isinstance(sync, bool) else sync
    do_sync = bool(sync) if isinstance(sync, bool) else True

    named = dict(model.named_modules())
    candidates: list[tuple[str, nn.Module, bool]] = []  # (name, module, explicitly requested)
    if modules is not None:
        by_id = {id(m): n for n, m in named.items()}
        for item in modules:
            if isinstance(item, str):
                if item not in named:
                    raise ValueError(f"apply_tiled_mlp(modules=...): no module named {item!r} in the model")
                candidates.append((item, named[item], True))
            else:
                if id(item) not in by_id:
                    raise ValueError(f"apply_tiled_mlp(modules=...): {type(item).__name__} is not part of the model")
                candidates.append((by_id[id(item)], item, True))
    else:
        candidates = [(n, m, False) for n, m in named.items() if (n and _looks_like_mlp(n, m)) or is_token_wise(m)[0]]

    handle = TiledMLPHandle(model)
    for name, module, explicit in candidates:
        ok, reason = is_token_wise(module)
        if not ok:
            if explicit:
                raise ValueError(f"apply_tiled_mlp: cannot tile {name!r}: {reason}")
            handle.report.append(TiledMLPEntry(name, type(module).__name__, False, reason))
            continue
        config = _TiledConfig(
            shards, min_tokens, tokens_per_shard, target_gb, do_sync, group, skip_in_recompute,
            intermediate_size(module),
        )
        existing = module.__dict__.get("forward")
        if isinstance(existing, _TiledForward):
            existing.config = config
            reason += " (already tiled: settings updated)"
        else:
            module.__dict__[_STATE_ATTR] = True
            module.forward = _TiledForward(module, existing, config)  # type: ignore[method-assign]
        handle.report.append(TiledMLPEntry(name, type(module).__name__, True, reason))
    return handle


def remove_tiled_mlp(model: nn.Module) -> int:
    """Undo ``apply_tiled_mlp`` on every module of ``model``; returns how many were restored.

    Guarantees: afterwards no module of ``model`` runs tiled and each has its previous forward.
    """
    return sum(restore_forward(module, _TiledForward, _STATE_ATTR) for module in model.modules())
