"""The hang guard: ranks that disagree on which parameter groups ran raise a named error, not a hang.

When DDP runs with ``find_unused_parameters=False`` and some trainable group (a vision tower without
the stabiliser) can be skipped on a rank, stock DDP hangs in backward (ranks differ) or fails a step
later ("Expected to have finished reduction"). :class:`HangGuard` records per forward which groups
ran and, before backward, all-gathers one flag per group; on a disagreement every rank raises
:class:`UnusedParametersError` naming the group, the ranks and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..._compat import ddp_syncs_grads, unwrap_model
from ...ops.dist import dist_ready, gather_flags
from ..vision.families import vision_groups
from ..vision.stabilizer import STABILIZER_ENV

__all__ = ["HangGuard", "UnusedParametersError", "check_used_groups"]


class UnusedParametersError(RuntimeError):
    """Raised on every rank when DDP(find_unused_parameters=False) would hang or crash on unused params."""



_FIX_HINT = (
    f"Fix: enable the dummy-image stabiliser ({STABILIZER_ENV}=1; supported: "
    "Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or set ddp_find_unused_parameters=True in TrainingArguments."
)


def _usage_error(
    names: list[str], per_rank: list[list[bool]], unused_everywhere_is_error: bool
) -> str | None:
    """The error message for a usage table ``per_rank[rank][group]``, or ``None`` when consistent."""
    problems = []
    for g, name in enumerate(names):
        used_on = [r for r, row in enumerate(per_rank) if row[g]]
        unused_on = [r for r, row in enumerate(per_rank) if not row[g]]
        if used_on and unused_on:
            problems.append(
                f"{name!r} ran on rank(s) {used_on} but not on rank(s) {unused_on}: its parameters get no "
                "gradient there and stock DDP hangs in backward"
            )
        elif not used_on and unused_everywhere_is_error:
            problems.append(
                f"{name!r} ran on no rank (a step without images): its parameters get no gradient and "
                "stock DDP fails at the next step with 'Expected to have finished reduction'"
            )
    if not problems:
        return None
    return (
        "hf_ddpfix: DistributedDataParallel(find_unused_parameters=False) cannot train this step: "
        + "; ".join(problems)
        + ". "
        + _FIX_HINT
    )


def check_used_groups(
    used: dict[str, bool], group: Any = None, *, unused_everywhere_is_error: bool = True
) -> None:
    """Raise :class:`UnusedParametersError` on every rank when ranks disagree on which groups ran.

    One ``all_gather`` of ``len(used)`` byte flags (``ops.dist.gather_flags``) (every rank must call it with the same keys in
    the same order). No-op without an initialised process group of size > 1.

    Raises:
        UnusedParametersError: a group ran on some ranks only, or (``unused_everywhere_is_error``)
            on none; the message names the group, the ranks, and the fix.

    Guarantees: with mixed ranks every rank raises within seconds (tests/scripts/vlm_hang_guard.py).
    """
    if not used or not dist_ready(group):
        return
    names = list(used)
    table = gather_flags([used[n] for n in names], group)
    msg = _usage_error(names, table, unused_everywhere_is_error)
    if msg is not None:
        raise UnusedParametersError(msg)


class HangGuard:
    """Turns a DDP(find_unused_parameters=False) hang on vision parameters into a clear error.

    Use when the stabiliser is off (disabled, or a VLM without adapter) and DDP runs with
    ``find_unused_parameters=False``. Forward pre-hooks on each vision group record whether it ran;
    the HF model's forward post-hook (inside DDP's forward, before backward) calls
    :func:`check_used_groups`. Only groups with trainable parameters are checked; eval and
    ``no_grad`` forwards are skipped.

    Args:
        model: HF VLM, PeftModel or wrapper.
        groups: ``{name: module}`` to watch; default: the adapter's tower, else modules named like
            ``visual`` / ``vision_tower`` / ``multi_modal_projector``.
        ddp_module: the DDP wrapper; when given, ``no_sync`` micro-batches are not checked (only the
            synchronising backward must use every parameter).
        process_group: group for the check (default: WORLD).
        unused_everywhere_is_error: also raise when no rank ran a group (``static_graph=True`` users
            whose graph never uses the tower may set this to ``False``).

    Guarantees: mixed image/text ranks raise :class:`UnusedParametersError` on both ranks, and the
    processes exit non-zero in seconds (tests/scripts/vlm_hang_guard.py).
    """

    def __init__(
        self,
        model: nn.Module,
        groups: dict[str, nn.Module] | None = None,
        *,
        ddp_module: nn.Module | None = None,
        process_group: Any = None,
        unused_everywhere_is_error: bool = True,
    ) -> None:
        self.root = unwrap_model(model)
        if groups is None:
            groups = dict(vision_groups(self.root))
        self.groups = {n: m for n, m in groups.items() if any(p.requires_grad for p in m.parameters())}
        self.ddp_module = ddp_module
        self.process_group = process_group
        self.unused_everywhere_is_error = unused_everywhere_is_error
        self._handles: list[Any] = []
        self._used: dict[str, bool] = {}
        self._active = False

    @property
    def attached(self) -> bool:
        """True while the hooks are registered."""
        return bool(self._handles)

    def attach(self) -> HangGuard:
        """Register the hooks (idempotent; nothing to do when no group is trainable). Returns ``self``."""
        if self._handles or not self.groups:
            return self
        self._handles.append(self.root.register_forward_pre_hook(self._pre_hook))
        self._handles.append(self.root.register_forward_hook(self._post_hook))
        for name, mod in self.groups.items():
            self._handles.append(mod.register_forward_pre_hook(self._group_hook(name)))
        return self

    def remove(self) -> None:
        """Remove the hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._active = False

    def _group_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self._active:
                self._used[name] = True

        return hook

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._active = module.training and torch.is_grad_enabled()
        self._used = dict.fromkeys(self.groups, False)

    def _post_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._active:
            return
        self._active = False
        if self.ddp_module is not None and not ddp_syncs_grads(self.ddp_module):
            return
        check_used_groups(
            self._used, self.process_group, unused_everywhere_is_error=self.unused_everywhere_is_error
        )
