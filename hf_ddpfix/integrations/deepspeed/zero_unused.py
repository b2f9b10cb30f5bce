"""ZeRO-1/2/3 with stock DDP's optimizer semantics: a parameter no rank used in a step is left out of it.

Problem (measured on CPU, 2 gloo ranks, deepspeed 0.19.8, 2026-11-25; docs/deepspeed.md): in an
optimizer step where no rank gives a parameter a gradient (the vision tower in a step where no rank has an
image; a module whose output never reaches the loss, such as PaliGemma's SigLIP pooling head), stock DDP
(``find_unused_parameters=True``) leaves its ``.grad`` ``None`` and ``torch.optim.AdamW`` skips it. ZeRO
steps flat fp32 partitions with zero-filled gradients: AdamW's weight decay and the remaining momentum
move it, and the partition's one step count advances for it too.

:class:`ZeroSkipUnused` (the plan's ``zero_skip_unused``, off unless asked: stock DeepSpeed's semantics
are the default) gives the run stock DDP's semantics:

1. **Observe** which parameters each micro-batch really uses: a :class:`~hf_ddpfix.integrations.usage.
   ParameterUsage` that ties nothing (``tie=False, guard=False``) walks the autograd graph from the loss
   handed to ``accelerator.backward`` (``_compat.around_backward``); parameters reached only through an
   exact-zero tie (the ZeRO dummy image's) count as unused, like parameters the loss does not reach.
2. **Agree** once per optimizer step, at the first step of the inner optimizer (inside DeepSpeed's
   ``step``, where every rank is): one all-reduce(MAX) of one byte per trainable tensor.
3. **Restore** around each step of the inner optimizer (``torch.optim.Optimizer`` step pre/post hooks; ZeRO
   calls it once per parameter group / sub-group): :class:`~hf_ddpfix.ops.skip_unused.SkipUnusedSteps`
   writes back the fp32 slices and the ``exp_avg`` / ``exp_avg_sq`` slices of the parameters no rank used,
   and recomputes AdamW's bias correction for parameters used again after skipping steps, with their own
   step count. DeepSpeed then copies the fp32 partition into the model weights and all-gathers them as
   usual, so the model weights follow. The slices come from :func:`hf_ddpfix._compat.zero_flat_slices`
   (checked against the weights before use).

Cost per optimizer step: one all-reduce of ``n_trainable`` bytes; a copy of the unused parameters' slices
(weights and two moments); per micro-batch, the graph walks of ``ParameterUsage`` (forward and loss).

Stands down (stock DeepSpeed semantics; ``feature_counts["zero_skip_unused"]`` ``fell_back`` with the
reason, which the feature report logs on rank 0 and strict mode raises) when the optimizer is not
``torch.optim.Adam/AdamW`` or the ZeRO layout is not the one checked (NVMe optimizer swap, partial offload,
another optimizer class).

Limit: the per-parameter count of skipped steps lives in this object, not in checkpoints; after a resume
every parameter starts level with its partition's step count (a parameter that had skipped steps before the
checkpoint then gets the partition's bias correction, as in stock DeepSpeed).

Guarantees: Qwen2.5-VL with LoRA on every linear including the vision tower, steps where no rank has an
image and steps where one does, AdamW with weight decay and clipping: ZeRO-2 and ZeRO-3 end within 1e-5 of
stock DDP (tests/test_deepspeed.py, ``--suite skip_unused``).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..._compat import around_backward, deepspeed_engine, zero_flat_slices
from ...ops import feature_counts
from ...ops.skip_unused import FlatSlice, SkipUnusedSteps
from ..usage import ParameterUsage

__all__ = ["FEATURE", "ZeroSkipUnused", "attach_zero_skip_unused"]

#: ``feature_counts`` name (= the plan field): ``ran`` once per optimizer step it handled; amounts
#: ``restored_elements`` (fp32 elements written back), ``recomputed_elements`` (elements whose bias
#: correction used their own step count), ``skipped_params`` (parameters left out of a step, summed).
FEATURE = "zero_skip_unused"


class ZeroSkipUnused:
    """Observe usage on ``model``; once the engine exists, restore what no rank used around each step.

    Args:
        model: the model before ``deepspeed.initialize`` (hooks go on the unwrapped module).
        process_group: the group the ranks agree over (default: the world).

    Use: :meth:`attach` before the engine is built, :meth:`attach_engine` after (the Trainer wiring in
    :func:`attach_zero_skip_unused` does both), :meth:`remove` at the end.
    """

    def __init__(self, model: nn.Module, process_group: Any = None) -> None:
        self.usage = ParameterUsage(model, tie=False, guard=False, process_group=process_group)
        self.process_group = process_group
        self.skip: SkipUnusedSteps | None = None
        self._mask: torch.Tensor | None = None
        self._handles: list[Any] = []
        self.reason: str | None = None  # why it stood down, if it did

    def attach(self) -> ZeroSkipUnused:
        """Start observing (idempotent). Every loss must then go through :meth:`observe_loss`."""
        self.usage.attach()
        self.usage.at_loss = True
        return self

    def observe_loss(self, loss: Any) -> Any:
        """Record what the loss about to be back-propagated uses (returns it unchanged: nothing is tied)."""
        return self.usage.tie_loss(loss)

    def attach_engine(self, engine: Any) -> bool:
        """Hook the engine's inner optimizer. Returns False (stock semantics kept, reason recorded) when
        the optimizer or the ZeRO layout is not supported."""
        if self.skip is not None:
            return True
        try:
            inner, raw = zero_flat_slices(engine)
            index = {id(slot.tensor()): i for i, slot in enumerate(self.usage.slots)}
            slices = [FlatSlice(index[id(p)], flat, start, numel) for p, flat, start, numel in raw if id(p) in index]
            self.skip = SkipUnusedSteps(inner, slices, len(self.usage.slots))
        except ValueError as err:
            self.reason = str(err)
            feature_counts.record_fallback(FEATURE, f"stock DeepSpeed semantics kept: {err}")
            self.usage.remove()
            return False
        self._handles = [inner.register_step_pre_hook(self._pre_step), inner.register_step_post_hook(self._post_step)]
        return True

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        assert self.skip is not None
        flats = self.skip.stepped_flats()
        if not flats:
            return
        mask = self.usage.agreed_step_usage()  # None: same optimizer step, another group (no collective)
        if mask is not None:
            self._mask = mask
            feature_counts.record_ran(FEATURE)
            feature_counts.record_amount(FEATURE, "skipped_params", int((~mask).sum()))
        used = self._mask if self._mask is not None else torch.ones(len(self.usage.slots), dtype=torch.bool)
        self.skip.before_step(flats, used)

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        assert self.skip is not None
        restored, recomputed = self.skip.restored_elements, self.skip.recomputed_elements
        self.skip.after_step()
        if self.skip.restored_elements > restored:
            feature_counts.record_amount(FEATURE, "restored_elements", self.skip.restored_elements - restored)
        if self.skip.recomputed_elements > recomputed:
            feature_counts.record_amount(FEATURE, "recomputed_elements", self.skip.recomputed_elements - recomputed)

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.usage.remove()


class _EngineReady(TrainerCallback):
    """Hands the engine to :class:`ZeroSkipUnused` once accelerate has built it (train begin)."""

    def __init__(self, trainer: Any, skip: ZeroSkipUnused) -> None:
        self.trainer, self.skip = trainer, skip

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        engine = deepspeed_engine(self.trainer.accelerator)
        if engine is None:
            self.skip.reason = "no DeepSpeed engine after accelerator.prepare"
            feature_counts.record_fallback(FEATURE, f"stock DeepSpeed semantics kept: {self.skip.reason}")
            self.skip.remove()
            return
        self.skip.attach_engine(engine)  # a refusal is a recorded fallback: FallbackWatch warns (strict: raises)


def attach_zero_skip_unused(trainer: Any, model: nn.Module, stack: ExitStack) -> ZeroSkipUnused:
    """Trainer wiring: observe before ``deepspeed.initialize``, hook the optimizer at train begin; undo on ``stack``."""
    skip = ZeroSkipUnused(model).attach()
    stack.callback(skip.remove)
    stack.callback(around_backward(trainer.accelerator, skip.observe_loss))
    callback = _EngineReady(trainer, skip)
    trainer.add_callback(callback)
    stack.callback(trainer.remove_callback, callback)
    return skip
