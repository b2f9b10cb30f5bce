"""Per-optimizer-step semantics of ``ParameterUsage`` (``integrations/usage/tracker.py``): finalize.

Contract: :class:`StepFinalize` is a mixin for ``ParameterUsage`` only. Once per optimizer step, on every rank
after the last backward and before gradient clipping, :meth:`~StepFinalize.finalize` (or
:meth:`~StepFinalize.agreed_step_usage`) closes the step's ``StepRecord`` (a forward whose loss was never seen
at backward counts its output's prediction, ``UNSEEN_LOSS``; with ``at_loss`` it also brings the forward's own
walk back for the rest of the run), agrees the "unused here" set across ranks in one all-reduce(MAX)
(``agreement.UsageAgreement``, which also carries ``step_flag``) and sets ``.grad = None`` where no rank used a
parameter: what stock DDP(find_unused_parameters=True) leaves. No training forward since the last call: no
collective, ``None``. The host provides the attributes annotated on the class and ``_lose_route``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ...ops import feature_counts
from .agreement import UsageAgreement
from .scopes import ParamSlot
from .step import StepRecord

#: The fallback reason counted when a training forward's loss never reached :meth:`ParameterUsage.tie_loss`.
UNSEEN_LOSS = "loss not seen at backward: usage read from the model output"

__all__ = ["UNSEEN_LOSS", "StepFinalize"]


class StepFinalize:
    """``ParameterUsage``'s per-optimizer-step methods (module docstring)."""

    slots: list[ParamSlot]
    process_group: Any
    agreement: UsageAgreement
    step_flag: Callable[[], bool] | None
    step_flags: tuple[bool, bool] | None
    step_seen: Callable[[], bool | None] | None
    at_loss: bool
    resets: int
    _all: frozenset[int]
    _step: StepRecord
    _index_cache: dict[int, int] | None
    _warned_unseen: bool
    _route_set: bool
    _lose_route: Callable[[], None]

    def reset_step(self) -> None:
        """Forget the micro-batches recorded since the last finalize."""
        self._step.clear()
        self._index_cache = None

    def finalize(self, process_group: Any = None) -> int | None:
        """Give the optimizer what stock DDP(find_unused_parameters=True) would give it.

        Call on every rank after the last backward of an optimizer step and before gradient clipping
        and ``optimizer.step()``. One all-reduce(MAX) of the per-parameter "used in some micro-batch of
        this step" bytes (asynchronous; read only on a rank that left some parameter unused); every
        parameter no rank used gets ``.grad = None``.

        Returns:
            The number of parameters reset to ``None``; ``None`` (and no collective) when no training
            forward ran since the previous call, so a second call in one step is a no-op.
        """
        unused = self._agree(process_group)
        if unused is None:
            return None
        reset = 0
        for i in sorted(unused):
            t = self.slots[i].tensor()
            if t is not None and t.grad is not None:
                t.grad = None
                reset += 1
        self.resets += reset
        if reset:
            feature_counts.record_amount("parameter_usage", "grads_reset", reset)
        return reset

    def agreed_step_usage(self, process_group: Any = None) -> torch.Tensor | None:
        """The "some rank used it in this optimizer step" mask (bool, one per slot), agreed across ranks
        with one all-reduce(MAX); the step's record is then cleared. ``None`` (and no collective) when no
        training forward ran since the previous call. Call on every rank at the same point (after the last
        backward of the step)."""
        unused = self._agree(process_group)
        if unused is None:
            return None
        mask = torch.ones(len(self.slots), dtype=torch.bool)
        if unused:
            mask[sorted(unused)] = False
        return mask

    def _agree(self, process_group: Any = None) -> set[int] | None:
        """The slots no rank used in this optimizer step (one collective), or ``None`` without a forward."""
        if self._step.forwards == 0:
            return None
        group = self.process_group if process_group is None else process_group
        unused_here, unseen = self._step.close(self._all)  # unseen: the output's observation stood in
        self._index_cache = None
        if unseen and self.at_loss:
            self._lose_route()
            feature_counts.record_fallback("parameter_usage", UNSEEN_LOSS, unseen)
            if not self._warned_unseen:
                self._warned_unseen = True
                logging.getLogger("hf_ddpfix").warning(
                    "parameter_usage: %d training forward(s) were back-propagated without passing their loss "
                    "through accelerator.backward; the parameters they used are read from the model output "
                    "(a prediction). Call accelerator.backward(loss), or set ddp_find_unused_parameters=True.",
                    unseen)
        elif self.at_loss:
            self._route_set = True  # every forward of this step had its loss seen: predictions can stop
        flag = self.step_flag() if self.step_flag is not None else None
        seen = self.step_seen() if self.step_seen is not None else None
        unused, self.step_flags = self.agreement.agree(unused_here, len(self.slots), group, flag, seen)
        return unused

    def take_step_flags(self) -> tuple[bool, bool] | None:
        """The last agreement's ``step_flag``, ``(some rank set it, every rank set it)`` (``UsageAgreement.agree``),
        once; ``None`` when no agreement carried it since the last call."""
        flags, self.step_flags = self.step_flags, None
        return flags
