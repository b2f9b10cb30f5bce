"""The step-end reset both FSDP2 dummies share (the tower dummy, :mod:`.dummy`; the cross-attention dummy,
:mod:`.cross_attention`): a dummy's exact-zero gradients become stock DDP's "unused" (``grad = None``) in a step
where no rank saw an image. Its own module so that neither dummy imports the other for it.

Where the usage agreement runs (``parameter_usage``, the same process group), the dummy's "this rank passed an
image" rides in its all-reduce (:meth:`StepImages.fold_into`: one byte more in a collective the step makes anyway);
a rank that passed an image knows the answer without reading it, a text-only rank reads it with the agreement's
one read. Otherwise :func:`reset_grads_unless_any_rank_saw` runs its own one-int all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...ops.dist import collective_device, dist_ready

__all__ = ["StepImages", "reset_grads_unless_any_rank_saw"]


def _reset(modules: list[nn.Module]) -> None:
    for mod in modules:
        for p in mod.parameters():
            if p.requires_grad:
                p.grad = None


def reset_grads_unless_any_rank_saw(local: bool, modules: list[nn.Module], process_group: Any = None) -> bool:
    """One MAX all-reduce of ``local`` (this rank saw an image this step) over ``process_group``; where no rank did,
    every trainable parameter of ``modules`` gets ``grad = None`` (the dummy's exact zeros become stock DDP's
    "unused": AdamW skips them, no weight decay). Returns whether some rank saw one. Without a process group: local."""
    if dist_ready(process_group):
        flag = torch.tensor([int(local)], dtype=torch.int32, device=collective_device(process_group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        seen = bool(flag.item())
    else:
        seen = local
    if not seen:
        _reset(modules)
    return seen


class StepImages:
    """A dummy's per-optimizer-step "this rank passed an image" and its step-end reset (mixin: the host sets
    ``_step_images``, ``_step_forwards`` and ``process_group``, and names the reset modules in ``_reset_modules``).

    Guarantees: after :meth:`finalize_step`, the modules' gradients are ``None`` exactly where no rank passed an
    image in the step, whether the flag rode in the usage agreement (:meth:`fold_into`) or in its own all-reduce
    (tests/test_step_overhead.py counts the collectives; tests/test_fsdp_skippable.py the all-text step)."""

    _step_images: bool
    _step_forwards: int
    process_group: Any
    folded: Any = None  # the UsageAgreement carrying the flag (fold_into), else None

    def _reset_modules(self) -> list[nn.Module]:
        raise NotImplementedError

    def take_step_images(self) -> bool | None:
        """This step's local "passed an image", cleared; ``None`` when no training forward ran since the last call."""
        if not self._step_forwards:
            return None
        local, self._step_images, self._step_forwards = self._step_images, False, 0
        return local

    def fold_into(self, usage: Any) -> None:
        """Carry the flag in ``usage``'s agreement (a ``ParameterUsage`` over the same process group, whose finalize
        runs before this dummy's in the step): no collective and, on a rank that passed an image, no read of its
        own."""
        usage.step_seen = self.take_step_images
        self.folded = usage.agreement

    def finalize_step(self) -> bool | None:
        """Before clipping, once per optimizer step: where no rank passed an image in any micro-batch of the step,
        every trainable parameter of the reset modules gets ``grad = None``. Returns whether some rank saw an image;
        ``None`` (no collective) when no training forward ran since the last call."""
        if self.folded is not None:
            seen = self.folded.take_seen()
            if seen is not None:  # the agreement carried this step's flag
                if not seen:
                    _reset(self._reset_modules())
                return seen
        local = self.take_step_images()
        if local is None:
            return None
        return reset_grads_unless_any_rank_saw(local, self._reset_modules(), self.process_group)
