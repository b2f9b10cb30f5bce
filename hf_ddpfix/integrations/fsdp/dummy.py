"""The dummy image for FSDP2 units inside a vision tower (``fsdp_skippable = shard``): every rank all-gathers and
reduce-scatters the tower's units in the same order, images or not.

Where it runs: :class:`~hf_ddpfix.integrations.vision.zero.ZeroVisionStabilizer`'s placement, a forward pre-hook
on the language model (the module the VLM calls with ``inputs_embeds`` after merging image features). An image
rank runs its tower after the input embedding and before the language model (transformers 5.23: every family the
stabiliser knows or discovers embeds, then encodes images, then calls the language model), so a text rank's dummy
sits at the same point of the unit order: [root, embedding, tower blocks..., decoder layers..., norm/head]. That order is
checked at attach time (:func:`~hf_ddpfix.integrations.vision.zero.forward_order_problem`): a model whose forward
enters the language model before its tower gets no dummy, with the reason. The
dummy's features are tied into ``inputs_embeds`` with an exact-zero gradient, so the backward reaches the tower
units in the same order too. Evaluation, prediction and ``generate()`` agree on images first (one 1-byte
all-gather per forward; ``sync_eval``).

After ``train()`` an evaluation-only stabiliser stays attached (:func:`keep_eval_sync`): ``generate()`` on the
sharded model, whose tower units an image rank all-gathers, agrees across ranks too.

Optimizer semantics: a tower parameter a text rank ran only on the dummy gets a zero gradient, and the averaged
gradient is stock DDP's (``find_unused_parameters=True``) where some rank saw an image. In a step where **no** rank
saw an image stock leaves those gradients ``None`` (AdamW skips them); :meth:`FsdpDummy.finalize` (once per
optimizer step, before clipping: one byte in the usage agreement's all-reduce, or one all-reduce of one int without
it) resets them to ``None`` then.

Guarantees (tests/test_fsdp_skippable.py, through the FSDP test device): with tower units (an explicit
``fsdp_transformer_layer_cls_to_wrap`` naming the vision blocks, or ``fsdp_skippable = shard``) mixed image/text
ranks and an all-text step train, evaluate and predict like stock DDP; without the dummy the same run fails
(gloo size mismatch).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...ops.dist import gather_flags
from ..vision.zero import ZeroVisionStabilizer
from .grad_reset import StepImages

__all__ = ["FsdpDummy", "TowerDummyRefusal", "keep_eval_sync", "kept_eval_sync"]


class TowerDummyRefusal(ValueError):
    """FSDP2 units inside the vision tower and no dummy image that runs there: raised by :func:`attach_fsdp_dummy`
    on every rank alike, before accelerate wraps the model; ``hf_ddpfix.runtime.attach`` raises it as a ``PlanError``."""

_KEPT = "_hf_ddpfix_fsdp_eval_sync"


class FsdpDummy(StepImages):
    """The training (and evaluation) dummy for tower units under FSDP2.

    Args:
        model: the HF VLM (or a PeftModel / wrapper around it), before or after accelerate wraps it.
        sync_eval: also agree on images in evaluation, prediction and generation forwards.

    Raises:
        ValueError: no dummy image for this model (the plan then folds; see ``fsdp_skippable``).
    """

    def __init__(self, model: nn.Module, *, sync_eval: bool = True, process_group: Any = None) -> None:
        self.stabilizer = ZeroVisionStabilizer(model, train=True, sync_eval=sync_eval, process_group=process_group)
        self.adapter = self.stabilizer.adapter
        self.process_group = process_group
        self._handle: Any = None
        self._step_images = False
        self._step_forwards = 0

    @property
    def dummy_runs(self) -> int:
        """Dummy tower forwards so far (training and evaluation)."""
        return self.stabilizer.dummy_runs

    def attach(self) -> FsdpDummy:
        """Register the hooks (idempotent)."""
        self.stabilizer.attach()
        if self._handle is None:
            self._handle = self.adapter.root.register_forward_pre_hook(self._record, with_kwargs=True)
        return self

    def remove(self) -> None:
        """Remove the hooks (idempotent)."""
        self.stabilizer.remove()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._step_images, self._step_forwards = False, 0

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module.training and torch.is_grad_enabled():
            self._step_forwards += 1
            self._step_images = self._step_images or self.adapter.has_visual_input(args, kwargs)

    def _reset_modules(self) -> list[nn.Module]:
        return [mod for _, mod in self.adapter.parts()]

    def finalize(self) -> bool | None:
        """Before clipping, once per optimizer step: where no rank passed an image in any micro-batch of the step,
        every tower and projector gradient becomes ``None`` (stock DDP ``find_unused_parameters=True``). Returns
        whether some rank saw an image; ``None`` (no collective) when no training forward ran since the last call.
        The flag rides in the usage agreement where :meth:`fold_into` was called (:class:`.grad_reset.StepImages`)."""
        return self.finalize_step()


def keep_eval_sync(model: nn.Module) -> Any:
    """After ``train()`` with tower units: leave an evaluation-only stabiliser (``train=False, sync_eval=True``)
    attached to the model, so a ``generate()`` or an evaluation the user runs on the sharded model afterwards
    all-gathers the tower's units on every rank alike (one per model, idempotent). It changes no output: under
    ``no_grad`` nothing is tied. Returns it (``None`` where no dummy can be built)."""
    try:
        sync = ZeroVisionStabilizer(model, train=False, sync_eval=True)
    except ValueError:
        return None
    kept = getattr(sync.adapter.root, _KEPT, None)
    if kept is not None:
        return kept
    sync.attach()
    setattr(sync.adapter.root, _KEPT, sync)
    return sync


def kept_eval_sync(model: nn.Module) -> Any:
    """The stabiliser :func:`keep_eval_sync` left on ``model``, or ``None``."""
    from ..vision.families import find_vision_adapter

    adapter = find_vision_adapter(model, zero=True)
    return None if adapter is None else getattr(adapter.root, _KEPT, None)


def attach_fsdp_dummy(model: Any, stack: Any, before_clip: Any) -> Any:
    """Attach :class:`FsdpDummy` for a `train()` (FSDP2 with units inside the tower): the dummy image where an image
    rank runs its tower, training and evaluation; tower gradients reset to `None` in a step no rank saw an image
    (``before_clip(fn)`` registers ``fn`` before gradient clipping and returns its undo). Every undo goes on
    ``stack``; the evaluation-only stabiliser :func:`keep_eval_sync` stays after it (generate() after train()).
    A cross-attention VLM (Mllama) gets :class:`~hf_ddpfix.integrations.fsdp.cross_attention.CrossAttentionDummy`
    instead (training and evaluation alike; one stays attached after ``train()``)."""
    from .cross_attention import CrossAttentionDummy, cross_attention_parts, keep_cross_attention_dummy

    if cross_attention_parts(model) is not None:  # Mllama: tower, projector and cross-attention layers
        cross = CrossAttentionDummy(model).attach()
        stack.callback(keep_cross_attention_dummy, model)  # runs after the removal below
        stack.callback(cross.remove)
        stack.callback(before_clip(cross.finalize))
        return cross  # type: ignore[return-value]
    error: ValueError | None = None
    try:
        dummy = FsdpDummy(model)
        _try_dummy(dummy.adapter)
    except ValueError as err:  # the dummy the plan counted on does not run: no tower units without one
        error = err
    if any(row[0] for row in gather_flags([error is not None])):  # every rank refuses alike
        raise _no_dummy_refusal(model, error or ValueError("another rank's dummy image did not run")) from error
    dummy.attach()
    stack.callback(keep_eval_sync, model)  # runs after the removal below
    stack.callback(dummy.remove)
    stack.callback(before_clip(dummy.finalize))
    return dummy


def _try_dummy(adapter: Any) -> None:
    """One no-grad forward of the dummy image through the tower (eval mode, the RNG stream kept), where its
    parameters are whole on this rank: a registry family's dummy is not trialled at attach (a family found by
    structure is, in ``verify``), and one whose default geometry the tower rejects (Gemma 3's tiny default: "stride
    should not be zero" in its pooling) would otherwise fail in step 1's forward on the text-only rank only.

    Raises:
        ValueError: the dummy does not run; the message names the error.
    """
    from ..vision.adapter import materialized
    from ..vision.proof import eval_mode

    parts = [m for _, m in adapter.parts()]
    if not materialized([p for m in parts for p in m.parameters()]):
        return
    try:
        with torch.no_grad(), eval_mode(parts):
            adapter.run_dummy()
    except Exception as err:  # noqa: BLE001 - any failure: the dummy does not run here
        raise ValueError(f"{adapter.family.name}: the dummy image does not run through the tower "
                         f"({type(err).__name__}: {' '.join(str(err).split())[:200]})") from err


def _no_dummy_refusal(model: Any, err: ValueError) -> Exception:
    """The refusal (:class:`TowerDummyRefusal`; the runtime raises it as a ``PlanError``) for tower units whose dummy image does not run (a family found by
    structure whose dummy is verified at attach: a native-size image through the tower, once, before step 1):
    raised on every rank alike (the same weights, the same trial), before accelerate wraps the model, so no rank
    reaches a collective the other skips. Names the tower's block classes and the fix."""
    from ..vision.families import find_vision_adapter

    adapter = find_vision_adapter(model, zero=True)
    blocks: list[str] = []
    for _, part in adapter.parts() if adapter is not None else ():
        for mod in part.modules():
            if isinstance(mod, nn.ModuleList):
                blocks += [type(m).__name__ for m in mod]
    named = ", ".join(dict.fromkeys(blocks)) or "the vision tower's block classes"
    return TowerDummyRefusal(
        f"fsdp_skippable = shard: {named} (vision tower) would get FSDP2 units of their own (an explicit "
        f"fsdp_transformer_layer_cls_to_wrap naming them, or fsdp_skippable='shard' forced), so a text-only rank must run "
        f"a dummy image through them to all-gather the same units as an image rank, and no dummy runs for this "
        f"model ({' '.join(str(err).split())[:300]}). Fix: leave {named} out of fsdp_transformer_layer_cls_to_wrap "
        f"(or drop the list: the plan's units keep the tower in its enclosing unit).")
