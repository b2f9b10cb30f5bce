"""Real gradients outside the loss seen, for ``ParameterUsage`` (``integrations/usage/tracker.py``).

Contract: a slot left out of the loss seen at backward (tied in with an exact zero, or observed only) whose leaf
still receives a gradient other than a tie's zero in any backward of the optimizer step (a regulariser added
below the loss seen, a hook, a second backward) counts as used in that step (``StepRecord.used``), so
``finalize`` keeps its ``.grad`` as backward left it. :func:`watch_real` registers at most one gradient hook
per slot and step (kept in ``StepRecord.real_hooks``, removed by ``StepRecord.clear``); none for a slot
already watched, or whose tensor does not require grad (frozen: it receives nothing). The first real
gradient of a slot in a step counts ``parameter_usage / real_grads_outside_loss``.
"""

from __future__ import annotations

import functools
from typing import Any

from ...ops import feature_counts
from ...ops.zero_tie import is_tie_zero
from .scopes import ParamSlot
from .step import StepRecord

__all__ = ["mark_real", "watch_real"]


def mark_real(step: StepRecord, slot: int, grad: Any) -> None:
    """A watched leaf's gradient hook: anything but exactly a tie's zero is a real gradient (:func:`watch_real`)."""
    # exactly zero is not a real gradient: autograd sums the marked zeros of two ties (output and loss) into an
    # unmarked zero tensor (tests/scripts/trainer_heads.py head_in_forward: 5e-4 off stock by AdamW's decay otherwise).
    # Cost: one host read per watched leaf whose gradient is not a single tie's zero.
    if grad is not None and not is_tie_zero(grad) and bool(grad.any()):
        if slot not in step.used:
            feature_counts.record_amount("parameter_usage", "real_grads_outside_loss", 1)
        step.used.add(slot)


def watch_real(step: StepRecord, all_slots: list[ParamSlot], slots: list[int]) -> None:
    """Until ``step`` ends, a slot of ``slots`` whose leaf receives a real gradient counts as used (module
    docstring). One gradient hook per such slot and step (:func:`hf_ddpfix.ops.zero_tie.is_tie_zero`)."""
    hooks = step.real_hooks
    for i in slots:
        if i in hooks:
            continue
        t = all_slots[i].tensor()
        if t is None or not t.requires_grad:
            continue
        hooks[i] = t.register_hook(functools.partial(mark_real, step, i))
