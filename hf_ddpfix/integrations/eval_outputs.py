"""The Trainer's evaluation and prediction under the plan's ``eval_outputs``: every rank hands the gathers the
same prediction fields, at every step (the rule: :mod:`hf_ddpfix.ops.output_agreement`).

For one ``Trainer.evaluation_loop`` call (behind ``evaluate()`` and ``predict()``) that gathers predictions
(``prediction_loss_only`` false) with more than one process: a forward hook on the model the Trainer holds
(unwrapped from DDP; the FSDP2 root; the module a DeepSpeed engine runs) replaces each forward's outputs inside
``prediction_step`` by the agreed ones: at the loop's first step one ``all_gather_object`` of their signatures (a
few hundred bytes) fixes the kept fields; at every later step each rank conforms alone
(``OutputAgreement.apply_local``: no collective, no host read) and the Trainer's own ``pad_across_processes``,
which gathers every tensor's sizes anyway, pads every dimension to the largest over the ranks
(:func:`hf_ddpfix.ops.output_agreement.pad_all_dims`), not only dimension 1: a field present on some ranks only,
or sized differently outside dimension 1, never reaches a gather unequal, at no collective or read of its own.
Forwards inside ``generate()`` (``Seq2SeqTrainer``'s ``predict_with_generate``: ranks may run different numbers of
them) and outside ``prediction_step`` are left alone. Fields dropped are named once per trainer in a warning (rank
0) with how to keep them; counters: ``feature_counts`` feature ``eval_outputs`` (``ran`` = forwards agreed;
amounts ``fields_dropped``, ``placeholders``, ``padded``, ``outputs_rebuilt``).

Guarantees: nothing is attached with one process or when predictions are not gathered; every rank runs the same
number of exchanges per ``prediction_step`` when its trainer runs the same forwards on every rank; the loss and the
kept fields are stock's own tensors where no rank differs (tests/scripts/eval_outputs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._compat import evaluation_loop_options, prediction_ignore_keys, shadow_method, unwrap_parallel
from ..ops import feature_counts
from ..ops.output_agreement import OutputAgreement, Signature, pad_all_dims

logger = logging.getLogger("hf_ddpfix")

__all__ = ["EvalOutputSync", "agreed_eval_outputs"]

FEATURE = "eval_outputs"
Exchange = Callable[[Any], list[Any]]


def _all_gather_object(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class EvalOutputSync:
    """The agreement attached to one model for one evaluation loop.

    Args:
        model: the module whose forward outputs become the predictions (a ``PeftModel`` stays whole).
        ignore_keys: keys ``prediction_step`` leaves out (never agreed on).
        rank: this process's rank; exchange: gathers one object from every rank (default ``all_gather_object``).
    """

    def __init__(self, model: nn.Module, ignore_keys: list[str], rank: int, exchange: Exchange | None = None) -> None:
        self.model = model
        self.agreement = OutputAgreement(rank=rank, skip=tuple(ignore_keys))
        self.exchange = exchange or _all_gather_object
        self._armed = False
        self._in_generate = 0
        self._index = 0
        self.exchanges = 0  # all_gather_object calls: one per forward index, at the loop's first step
        self._undo: list[Callable[[], None]] = []

    def attach(self, trainer: Any) -> EvalOutputSync:
        handle = self.model.register_forward_hook(self._hook)
        self._undo.append(handle.remove)
        stock_step = trainer.prediction_step

        def prediction_step(*args: Any, **kwargs: Any) -> Any:
            self._armed, self._index = True, 0
            try:
                return stock_step(*args, **kwargs)
            finally:
                self._armed = False

        self._undo.append(shadow_method(trainer, "prediction_step", prediction_step))
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None and callable(getattr(accelerator, "pad_across_processes", None)):
            self._undo.append(shadow_method(accelerator, "pad_across_processes", self._pad_across(accelerator)))
        generate = getattr(self.model, "generate", None)
        if callable(generate):
            def generate_alone(*args: Any, **kwargs: Any) -> Any:
                self._in_generate += 1
                try:
                    return generate(*args, **kwargs)
                finally:
                    self._in_generate -= 1

            self._undo.append(shadow_method(self.model, "generate", generate_alone))
        return self

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _pad_across(self, accelerator: Any) -> Callable[..., Any]:
        """``accelerator.pad_across_processes`` padding every dimension to the largest over the ranks: the same one
        gather of each tensor's sizes and the same host read of them as stock's, so no collective is added (stock
        pads ``dim`` only: where the other dimensions agree, the result is stock's)."""
        gather = accelerator.gather

        def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
            if isinstance(tensor, (list, tuple)):
                return type(tensor)(pad_across_processes(t, dim, pad_index, pad_first) for t in tensor)
            if isinstance(tensor, Mapping):
                return type(tensor)({k: pad_across_processes(v, dim, pad_index, pad_first) for k, v in tensor.items()})
            if not torch.is_tensor(tensor) or getattr(tensor, "is_nested", False) or tensor.dim() == 0:
                return tensor
            d = dim + tensor.dim() if dim < 0 else dim
            if not 0 <= d < tensor.dim():
                return tensor
            sizes = gather(torch.tensor(tensor.shape, device=tensor.device)[None]).cpu().tolist()  # stock's read
            out, other = pad_all_dims(tensor, sizes, d, pad_index, pad_first)
            if other:
                self.agreement.padded += 1
                feature_counts.record_amount(FEATURE, "padded", 1)
            return out

        return pad_across_processes

    def _hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not self._armed or self._in_generate:
            return None
        index, self._index = self._index, self._index + 1
        before = (self.agreement.changed, self.agreement.placeholders, self.agreement.padded)
        dropped = len(self.agreement.dropped)
        if self.agreement.agreed(index):  # a later step: this rank alone, the padding rides on the Trainer's gathers
            agreed = self.agreement.apply_local(output, index)
        else:
            sigs: list[dict[str, Signature] | None] = self.exchange(self.agreement.describe(output))
            self.exchanges += 1
            agreed = self.agreement.apply(output, sigs, index)
        feature_counts.record_ran(FEATURE)
        for name, now, was in zip(("outputs_rebuilt", "placeholders", "padded"),
                                  (self.agreement.changed, self.agreement.placeholders, self.agreement.padded),
                                  before, strict=True):
            if now > was:
                feature_counts.record_amount(FEATURE, name, now - was)
        if len(self.agreement.dropped) > dropped:
            feature_counts.record_amount(FEATURE, "fields_dropped", len(self.agreement.dropped) - dropped)
        return None if agreed is output else agreed


def _warn_dropped(trainer: Any, sync: EvalOutputSync) -> None:
    """Once per trainer and field (rank 0): the fields left out of the predictions, why, and how to keep them."""
    said: set[str] = getattr(trainer, "_hf_ddpfix_eval_outputs_said", set())
    new = {k: why for k, why in sync.agreement.dropped.items() if k not in said}
    if not new:
        return
    trainer._hf_ddpfix_eval_outputs_said = said | set(new)
    if trainer.is_world_process_zero():
        names = ", ".join(f"{k} ({why})" for k, why in new.items())
        logger.warning(
            "eval_outputs: left out of the predictions on every rank: %s. A field that differs by rank would fail "
            "the Trainer's gathers (gloo size mismatch, NCCL hang). To keep one, every rank must produce it from the "
            "first evaluation batch on (e.g. an image on every rank); to silence this, pass ignore_keys=%r.",
            names, sorted(new))


@contextmanager
def agreed_eval_outputs(trainer: Any, decision: Any, loop_args: tuple[Any, ...],
                        loop_kwargs: dict[str, Any]) -> Iterator[EvalOutputSync | None]:
    """Around one ``evaluation_loop(*loop_args, **loop_kwargs)``: the agreement when ``decision`` (the plan's
    ``eval_outputs``) is on, the loop gathers predictions and more than one process runs; else nothing."""
    if not decision.value or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        yield None
        return
    loss_only, ignore_keys = evaluation_loop_options(trainer, loop_args, loop_kwargs)
    if loss_only:
        yield None
        return
    sync = EvalOutputSync(unwrap_parallel(trainer.model), prediction_ignore_keys(trainer, ignore_keys),
                          rank=dist.get_rank()).attach(trainer)
    trainer.hf_ddpfix_eval_outputs = sync
    try:
        yield sync
    finally:
        sync.remove()
        _warn_dropped(trainer, sync)

