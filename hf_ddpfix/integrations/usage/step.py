"""What the current optimizer step has seen, for ``ParameterUsage`` (``integrations/usage/tracker.py``).

A :class:`StepRecord` holds slot indices only (sets: the per-step bookkeeping costs no per-parameter Python
loop): the slots the losses given to backward really used, and the training forwards still waiting for
their loss (the output's prediction, the reentrant regions they ran). ``ParameterUsage`` agrees the step's
"unused here" set across ranks at finalize (``agreement.UsageAgreement``) and clears the record.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StepRecord", "UnitTies"]


class UnitTies:
    """The ties FSDP2 units made in the training forwards since the last loss seen at backward: per tie its
    autograd node, the tensors tied (the unsharded parameters the unit's graph holds, which FSDP2 reduce-scatters
    from) and the witness (the autograd nodes of the unit's output tensors in that forward, before the tie: which
    outputs a loss is built from is the trainer's code, the same on every rank, not what a rank used)."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, list[torch.Tensor], set[Any]]] = []

    def add(self, tied: torch.Tensor, extras: list[torch.Tensor], witness: set[Any]) -> None:
        if extras and tied.grad_fn is not None:
            self.pending.append((tied.grad_fn, list(extras), set(witness)))


class StepRecord:
    """One optimizer step's usage.

    Attributes:
        used: slot indices the losses seen at backward used (or, for a forward whose loss was never seen,
            its output's prediction, merged in by :meth:`close`), and those left out of such a loss that received
            a real gradient in some backward of the step (``real_hooks``: ``ParameterUsage._watch_real``).
        forwards: training forwards in this step.
        pending_forwards: training forwards since the last loss seen at backward.
        pending_used: the union of those forwards' predictions.
        pending_unpredicted: some of those forwards ran without a prediction (the walk from the loss was to
            decide): if their loss is never seen, every slot counts as used (nothing is reset: the gradients
            stay as backward left them, never a reset of a parameter that was used).
        region_outputs: per reentrant region of those forwards: (its output nodes, the watched ids it read).
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget everything (a new optimizer step); the real-gradient hooks of the step are removed."""
        for handle in getattr(self, "real_hooks", {}).values():
            handle.remove()
        self.real_hooks: dict[int, Any] = {}  # slot -> the hook that marks it used on a real gradient
        self.used: set[int] = set()
        self.forwards = 0
        self.unit_ties = UnitTies()  # FSDP2: ties the loss must reach (loss_observer.py); their graphs freed here
        self._clear_pending()

    def _clear_pending(self) -> None:
        self.pending_forwards = 0
        self.pending_used: set[int] = set()
        self.pending_unpredicted = False
        self.region_outputs: list[tuple[set[Any], set[int]]] = []

    def forward_done(self, predicted: set[int] | None, region_outputs: list[tuple[set[Any], set[int]]]) -> None:
        """A training forward finished: ``predicted`` from its output (``None``: no prediction ran)."""
        if predicted is None:
            self.pending_unpredicted = True
        else:
            self.pending_used |= predicted
        self.region_outputs += region_outputs
        self.pending_forwards += 1
        self.forwards += 1

    def loss_seen(self, used: set[int]) -> None:
        """The loss of the pending forwards was observed at backward: ``used`` decides for them."""
        self.used |= used
        self._clear_pending()

    def close(self, all_slots: frozenset[int]) -> tuple[frozenset[int], int]:
        """End the step: (the slots unused here, the forwards whose loss was never seen, whose prediction
        stands in); the record is cleared."""
        unseen = self.pending_forwards
        if unseen:
            self.used |= all_slots if self.pending_unpredicted else self.pending_used
        unused = all_slots - self.used
        self.clear()
        return unused, unseen
