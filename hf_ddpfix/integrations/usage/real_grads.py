"""Real gradients outside the loss seen, for ``ParameterUsage`` (``integrations/usage/tracker.py``).

Contract: a slot left out of the loss seen at backward (tied in with an exact zero, or observed only) whose leaf
still receives a gradient other than a tie's zero in any backward of the optimizer step (a regulariser added
below the loss seen, a hook, a second backward) counts as used in that step (``StepRecord.used``), so
``finalize`` keeps its ``.grad`` as backward left it, zero or not: "used" is what autograd delivered (stock DDP's
"its hook fired"), never the gradient's values, and no value is read on the host (ties alone hand a leaf exactly
one marked zero per backward: :mod:`hf_ddpfix.ops.zero_tie`). :func:`watch_real` registers at most one gradient hook
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
    """A watched leaf's gradient hook: anything but exactly a tie's zero is a real gradient (:func:`watch_real`),
    an exact zero included (stock keeps it: AdamW decays the weight and moves its moments)."""
    # ties alone give a leaf one marked zero per backward (ZeroTie.backward: a second tie of the same leaf in the same
    # pass gives None), so an unmarked tensor here holds some real contribution. No host read: the mark is a Python
    # attribute (tests/scripts/trainer_heads.py head_in_forward: two ties of lm_head's LoRA, still unused).
    if grad is not None and not is_tie_zero(grad):
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
