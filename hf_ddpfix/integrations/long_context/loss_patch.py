"""Make a HF causal-LM forward compute its loss with :func:`hf_ddpfix.ops.tiled_loss.tiled_causal_lm_loss`.

``patch_model_loss`` replaces the forward of a HF CausalLM / Qwen2-VL / Qwen2.5-VL model (instance
level, undoable) so that, when ``labels`` are given in training, ``lm_head`` + cross-entropy run in
chunks and the full ``[tokens, vocab]`` logits never exist. A model whose forward does anything else to
the logits (soft-capping, scaling), whose head is not a plain ``nn.Linear`` or whose ``loss_function``
is not transformers' ``ForCausalLMLoss`` is refused with the reason.

Counts (:mod:`hf_ddpfix.ops.feature_counts`, feature ``"tiled_loss"``): ``ran`` = forwards whose loss
was tiled; a call left to the previous forward (unknown keywords, TRL's ``fused_lm_head``, arguments
that do not bind, ``logits_to_keep``) is a fallback with its reason; a call with labels under
``no_grad`` (evaluation keeps its logits) is the amount ``stock_no_grad_calls``.

Usage::

    handle = patch_model_loss(model)        # PeftModel or PreTrainedModel; before DDP wrapping
    out = model(input_ids=ids, labels=labels)   # out.loss as before, out.logits is None
    handle.remove()
"""

from __future__ import annotations

import ast
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..._compat import cache_output_field, causal_lm_loss_function, forward_source, output_cache, unwrap_model
from ...ops.feature_counts import record_amount, record_fallback, record_ran
from ...ops.tiled_loss import tiled_causal_lm_loss
from .forward_patch import restore_forward

__all__ = ["TiledLossHandle", "patch_model_loss", "unpatch_model_loss"]

logger = logging.getLogger("hf_ddpfix")
FEATURE = "tiled_loss"  # the name its counts carry (hf_ddpfix.ops.feature_counts)


def _known_extra_keywords() -> frozenset[str]:
    """Keywords a HF CausalLM forward takes through ``**kwargs`` and forwards to its base model or loss
    (transformers 5.x ``TransformersKwargs`` plus the loss keywords the Trainer passes)."""
    try:
        from transformers.utils import TransformersKwargs

        typed = set(getattr(TransformersKwargs, "__annotations__", {}))
    except ImportError:  # pragma: no cover - transformers < 4.54
        typed = set()
    return frozenset(typed | {"return_dict", "ignore_index", "shift_labels", "num_items_in_batch"})




def _check_forward_source(cls: type) -> str | None:
    """None when ``cls.forward`` computes ``logits = self.lm_head(...)`` once, applies nothing else to
    the logits, and passes them to ``self.loss_function``; else the reason."""
    try:
        tree = ast.parse(forward_source(cls))
    except (OSError, TypeError, SyntaxError):
        return f"{cls.__name__}.forward source is not available"
    logits_assigns = []
    calls_loss = calls_head = False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "logits" for t in targets):
                logits_assigns.append(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "self":
                calls_loss |= node.func.attr == "loss_function"
                calls_head |= node.func.attr == "lm_head"
    if not (calls_loss and calls_head):
        return f"{cls.__name__}.forward does not call self.lm_head(...) and self.loss_function(...)"
    ok = (
        len(logits_assigns) == 1
        and isinstance(logits_assigns[0], ast.Assign)
        and isinstance(logits_assigns[0].value, ast.Call)
        and isinstance(logits_assigns[0].value.func, ast.Attribute)
        and logits_assigns[0].value.func.attr == "lm_head"
    )
    if not ok:
        return (
            f"{cls.__name__}.forward transforms the logits after lm_head (e.g. soft-capping or scaling); "
            "use tiled_causal_lm_loss(logit_softcapping=/logit_scale=) in your own forward"
        )
    return None


def _check_model(m: nn.Module) -> None:
    name = type(m).__name__
    base, head = getattr(m, "model", None), getattr(m, "lm_head", None)
    if not isinstance(base, nn.Module) or not isinstance(head, nn.Module):
        raise ValueError(f"patch_model_loss: {name} has no .model/.lm_head; not a HF CausalLM-style model")
    if type(head) is not nn.Linear:
        raise ValueError(
            f"patch_model_loss: {name}.lm_head is {type(head).__name__}, not a plain nn.Linear (an adapter "
            "on lm_head, or FSDP wrapping it alone); the tiled loss needs its weight directly"
        )
    if getattr(m, "loss_function", None) is not causal_lm_loss_function():
        raise ValueError(f"patch_model_loss: {name}.loss_function is not transformers' ForCausalLMLoss")
    reason = _check_forward_source(type(m))
    if reason:
        raise ValueError(f"patch_model_loss: {reason}")
    fsig = inspect.signature(type(m).forward)
    bsig = inspect.signature(type(base).forward)
    base_kw = any(p.kind is p.VAR_KEYWORD for p in bsig.parameters.values())
    for pname, p in fsig.parameters.items():
        if pname in ("self", "labels", "logits_to_keep") or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if pname not in bsig.parameters and not base_kw:
            raise ValueError(f"patch_model_loss: {name}.forward argument {pname!r} is not accepted by {type(base).__name__}")


class _TiledLossForward:
    """Instance-level ``forward``: tiled loss when ``labels`` are given and grad is enabled."""

    def __init__(self, model: nn.Module, prev: Any, chunk_tokens: int | None, in_eval: bool) -> None:
        self.model = model
        self.prev = prev
        self.chunk_tokens = chunk_tokens
        self.in_eval = in_eval
        self.calls = 0
        self.stood_down: dict[str, int] = {}  # reason -> calls left to the previous forward for it
        self._known = _known_extra_keywords()

    def _stand_down(self, reason: str, base: Any, args: tuple, kwargs: dict) -> Any:
        """Leave this call to the forward we replaced (a trainer's own fused/chunked head, a wrapper's
        keywords): never break the trainer. The first call for each reason is logged."""
        if reason not in self.stood_down:
            logger.info("tiled_loss: stands down (%s); the previous forward computes this call's loss", reason)
        self.stood_down[reason] = self.stood_down.get(reason, 0) + 1
        record_fallback(FEATURE, reason)
        return base(*args, **kwargs)

    def _base(self) -> Any:
        return self.prev if self.prev is not None else type(self.model).forward.__get__(self.model)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._base())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        base = self._base()
        sig = inspect.signature(type(self.model).forward)
        try:
            bound = sig.bind(self.model, *args, **kwargs)
        except TypeError as err:
            return self._stand_down(f"arguments do not bind to {type(self.model).__name__}.forward ({err})",
                                    base, args, kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self", None)
        extra: dict[str, Any] = {}
        for pname, p in sig.parameters.items():
            if p.kind is p.VAR_KEYWORD and pname in arguments:
                extra = dict(arguments.pop(pname))
        unknown = sorted(k for k in extra if k not in self._known)
        if unknown:
            if "fused_lm_head" in unknown and extra.get("fused_lm_head"):
                why = ("fused_lm_head=True: the trainer brings its own chunked LM head and loss (TRL), which "
                       "never holds the full logits either")
            else:
                why = f"keyword(s) {unknown} unknown to {type(self.model).__name__}.forward (a forward wrapper's)"
            return self._stand_down(why, base, args, kwargs)
        labels = arguments.get("labels")
        keep = arguments.get("logits_to_keep", 0)
        keep_all = (isinstance(keep, int) and keep == 0) or keep is None
        if labels is None:  # no loss asked for: nothing to tile
            return base(*args, **kwargs)
        if not (torch.is_grad_enabled() or self.in_eval):  # evaluation needs the logits: stock by design
            record_amount(FEATURE, "stock_no_grad_calls", 1)
            return base(*args, **kwargs)
        if not keep_all:
            return self._stand_down(f"logits_to_keep={keep!r} (the tiled loss covers every position)",
                                    base, args, kwargs)
        arguments.pop("labels")
        arguments.pop("logits_to_keep", None)
        return_dict = extra.pop("return_dict", None)
        outputs = self.model.model(**arguments, **extra)
        hidden = outputs[0]
        head = self.model.lm_head
        shift = extra.get("shift_labels")

        def head_loss(h: torch.Tensor) -> torch.Tensor:  # reads the head's weight when its unit has gathered it
            return tiled_causal_lm_loss(
                h, head.weight, labels if shift is None else None,
                ignore_index=extra.get("ignore_index", -100),
                num_items_in_batch=extra.get("num_items_in_batch"),
                shift_labels=shift,
                chunk_tokens=self.chunk_tokens,
                bias=head.bias,
            )

        loss = _as_head_forward(head, head_loss, hidden)
        self.calls += 1
        record_ran(FEATURE)
        fields: dict[str, Any] = {"loss": loss, "logits": None,
                                  "hidden_states": getattr(outputs, "hidden_states", None),
                                  "attentions": getattr(outputs, "attentions", None)}
        cache_field = cache_output_field(CausalLMOutputWithPast)  # past_key_values (5.0-5.23) / cache (5.24)
        if cache_field is not None:
            fields[cache_field] = output_cache(outputs)
        out = CausalLMOutputWithPast(**fields)
        return out.to_tuple() if return_dict is False else out


def _as_head_forward(head: nn.Module, fn: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``fn(hidden)``; where ``head`` is an FSDP2 unit of its own (accelerate 1.15 shards ``[final norm, lm_head]``
    as one unit), ``fn`` runs as the head's forward, so FSDP2's hooks on the head do for the tiled loss what they
    do for the head's own call: gather its weight before (outside that call ``head.weight`` is this rank's DTensor
    shard: "mixed torch.Tensor and DTensor"), reshard after, gather again for backward and reduce-scatter its
    gradient. Anywhere else (DDP, one process, the head inside a larger unit) ``fn`` is called directly."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(head, FSDPModule):
        return fn(hidden)
    own = head.__dict__.get("forward")
    head.forward = fn  # type: ignore[method-assign]
    try:
        return head(hidden)
    finally:
        if own is None:
            del head.__dict__["forward"]
        else:
            head.__dict__["forward"] = own


@dataclass
class TiledLossHandle:
    """Result of ``patch_model_loss``: the patched model (inner HF model for a PeftModel) and ``remove()``."""

    model: nn.Module
    target: nn.Module

    def _forward(self) -> Any:
        fwd = self.target.__dict__.get("forward")
        return fwd if isinstance(fwd, _TiledLossForward) else self.__dict__.get("_last_forward")

    @property
    def calls(self) -> int:
        """How many forwards used the tiled loss so far (still readable after ``remove()``)."""
        fwd = self._forward()
        return fwd.calls if fwd is not None else 0

    @property
    def stood_down(self) -> dict[str, int]:
        """Calls left to the previous forward, by reason (e.g. TRL's ``fused_lm_head=True``)."""
        fwd = self._forward()
        return dict(fwd.stood_down) if fwd is not None else {}

    def remove(self) -> bool:
        self.__dict__["_last_forward"] = self._forward()
        return unpatch_model_loss(self.model)


def patch_model_loss(model: nn.Module, *, chunk_tokens: int | None = None, in_eval: bool = False) -> TiledLossHandle:
    """Make ``model``'s forward compute its loss with ``tiled_causal_lm_loss`` when ``labels`` are given.

    The patched forward calls the base model (``model.model(...)``, with every argument the original
    forward would pass it), then the tiled loss on ``model.lm_head.weight`` with HF's
    ``ForCausalLMLoss`` semantics (``num_items_in_batch``, ``ignore_index``, ``shift_labels`` from the
    kwargs, as the Trainer passes them), and returns a ``CausalLMOutputWithPast`` with ``logits=None``.
    Without labels, with ``logits_to_keep != 0``, or under ``no_grad`` (evaluation needs logits for
    metrics; ``in_eval=True`` tiles there too) the original forward runs unchanged. A call with a
    keyword the model's forward does not know (neither a named argument nor one of transformers'
    ``TransformersKwargs`` / loss keywords) is left to the forward this patch replaced, with the reason
    logged once and counted in ``handle.stood_down``: e.g. TRL 1.16's ``SFTTrainer`` (and GRPO, RLOO,
    KTO) installs its own fused LM head and calls ``model(..., fused_lm_head=True)``, then reads
    ``outputs.log_probs``; that call runs TRL's head unchanged.

    Args:
        model: a HF CausalLM / ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
            or a ``PeftModel`` around one (the inner model is patched).
        chunk_tokens: label tokens per chunk (default: by vocab size, see ``tiled_causal_lm_loss``).
        in_eval: also tile when grad is disabled (returns no logits).

    Raises:
        ValueError: the model's forward is not the plain ``lm_head -> loss_function(ForCausalLMLoss)``
            shape (soft-capped logits, custom loss, adapter on ``lm_head``), naming the model and reason.

    Guarantees: same loss and gradients as the model's own loss (1e-5 relative, tests); a call with
    keywords it does not know runs the previous forward exactly (never breaks a trainer); idempotent;
    reversible (``remove()`` restores the previous forward); the forward's signature is preserved (the
    Trainer's column filtering and loss-kwargs detection see the original one).
    """
    target = unwrap_model(model)
    existing = target.__dict__.get("forward")
    if isinstance(existing, _TiledLossForward):
        existing.chunk_tokens, existing.in_eval = chunk_tokens, in_eval
        return TiledLossHandle(model, target)
    _check_model(target)
    target.forward = _TiledLossForward(target, existing, chunk_tokens, in_eval)  # type: ignore[method-assign]
    return TiledLossHandle(model, target)


def unpatch_model_loss(model: nn.Module) -> bool:
    """Undo ``patch_model_loss``; returns True when a patch was removed."""
    return restore_forward(unwrap_model(model), _TiledLossForward)
