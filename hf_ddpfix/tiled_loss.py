"""Tiled causal-LM loss head: ``lm_head`` + cross-entropy without the full ``[tokens, vocab]`` logits.

Logits dominate long-context memory (``tokens x vocab x 4`` bytes in fp32: 32K tokens x 152K vocab is
19.5 GB). ``tiled_causal_lm_loss`` computes logits chunk by chunk over the label tokens only, with
HF's semantics (``ForCausalLMLoss``: labels shifted left and padded with ``ignore_index``, logits
upcast to fp32, ``sum`` cross-entropy divided by ``num_items_in_batch`` or by the number of label
tokens). ``patch_model_loss`` makes a HF CausalLM / Qwen2-VL / Qwen2.5-VL forward use it whenever
``labels`` are given in training.

Usage::

    handle = patch_model_loss(model)        # PeftModel or PreTrainedModel; before DDP wrapping
    out = model(input_ids=ids, labels=labels)   # out.loss as before, out.logits is None
    handle.remove()
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DEFAULT_CHUNK_LOGITS_BYTES",
    "TiledLossHandle",
    "patch_model_loss",
    "tiled_causal_lm_loss",
    "unpatch_model_loss",
]

# Chunk length rule: fp32 logits of one chunk take about this many bytes (64 MiB = 512 tokens at a 32K
# vocab, still a large GEMM on a GPU; benchmarks/tiled.py: loss head peak >= 10x lower at 16K tokens),
# and at least 128 tokens.
DEFAULT_CHUNK_LOGITS_BYTES = 64 * 2**20
_MIN_CHUNK = 128


def _chunk_len(vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1")
        return int(chunk_tokens)
    return max(_MIN_CHUNK, DEFAULT_CHUNK_LOGITS_BYTES // (4 * max(1, vocab)))


@dataclass
class _LossCfg:
    chunk: int
    ignore_index: int
    logit_scale: float | None
    softcap: float | None
    grad_in_forward: bool


def _chunk_loss(
    cfg: _LossCfg, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, t: torch.Tensor
) -> torch.Tensor:
    logits = F.linear(h, w, b)
    if cfg.logit_scale is not None:
        logits = logits * cfg.logit_scale
    if cfg.softcap is not None:
        logits = torch.tanh(logits / cfg.softcap) * cfg.softcap
    return F.cross_entropy(logits.float(), t, ignore_index=cfg.ignore_index, reduction="sum")


def _chunk_with_grads(
    cfg: _LossCfg,
    hc: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    tc: torch.Tensor,
    ic: torch.Tensor,
    needs: tuple[bool, bool, bool],
    inv_denom: torch.Tensor,
    acc: list[torch.Tensor | None],
) -> torch.Tensor:
    """One chunk's summed loss (detached); its gradients, scaled by `inv_denom`, go into `acc`.

    `acc` is `[grad_h, grad_w, grad_b]`: the rows `ic` of `grad_h` are written, the weight and bias
    gradients are summed over chunks in fp32 (one tensor each, handed to autograd once at the end).
    """
    need_h, need_w, need_b = needs
    hc = hc.detach().requires_grad_(need_h)
    wl = w.detach().requires_grad_(need_w)
    bl = b.detach().requires_grad_(need_b) if b is not None else None
    with torch.enable_grad():
        lc = _chunk_loss(cfg, hc, wl, bl, tc)
    ins = [t for t, need in ((hc, need_h), (wl, need_w), (bl, need_b)) if need]
    grads = list(torch.autograd.grad(lc, ins, inv_denom.to(lc.dtype)))
    if need_h:
        acc[0].index_copy_(0, ic, grads.pop(0).to(acc[0].dtype))  # type: ignore[union-attr]
    for slot, need in ((1, need_w), (2, need_b)):
        if need:
            g = grads.pop(0)
            acc[slot] = g.float() if acc[slot] is None else acc[slot].add_(g)  # type: ignore[union-attr]
    return lc.detach()


class _TiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        cfg: _LossCfg,
        h: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        targets: torch.Tensor,
        inv_denom: torch.Tensor,
    ) -> torch.Tensor:
        idx = (targets != cfg.ignore_index).nonzero().squeeze(1)
        n = int(idx.numel())
        need_h, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_b = b is not None and ctx.needs_input_grad[3]
        ctx.cfg = cfg
        ctx.flags = (need_h, need_w, need_b)
        ctx.h_meta = (h.shape, h.dtype)
        ctx.w_dtype, ctx.b_dtype = w.dtype, (b.dtype if b is not None else None)
        device_type = h.device.type
        ctx.autocast = (
            device_type, torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled(),
        )
        grad_mode = cfg.grad_in_forward and (need_h or need_w or need_b)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        acc: list[torch.Tensor | None] = [torch.zeros_like(h) if grad_mode and need_h else None, None, None]
        for s in range(0, n, cfg.chunk):
            ic = idx[s : s + cfg.chunk]
            hc, tc = h.index_select(0, ic), targets.index_select(0, ic)
            if not grad_mode:
                total += _chunk_loss(cfg, hc, w, b, tc)
                continue
            total += _chunk_with_grads(cfg, hc, w, b, tc, ic, ctx.flags, inv_denom, acc)
        gh, gw, gb = acc
        if grad_mode:
            ctx.save_for_backward(gh, gw, gb)
        else:
            ctx.save_for_backward(h, w, b, targets, idx, inv_denom)
        return total * inv_denom

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        cfg: _LossCfg = ctx.cfg
        need_h, need_w, need_b = ctx.flags
        if cfg.grad_in_forward:
            gh, gw, gb = ctx.saved_tensors
        else:
            h, w, b, targets, idx, inv_denom = ctx.saved_tensors
            acc: list[torch.Tensor | None] = [torch.zeros_like(h) if need_h else None, None, None]
            device_type, ac_on, ac_dtype, ac_cache = ctx.autocast
            with torch.autocast(device_type, dtype=ac_dtype, enabled=ac_on, cache_enabled=ac_cache):
                for s in range(0, int(idx.numel()), cfg.chunk):
                    ic = idx[s : s + cfg.chunk]
                    _chunk_with_grads(cfg, h.index_select(0, ic), w, b, targets.index_select(0, ic), ic,
                                      ctx.flags, inv_denom, acc)
            gh, gw, gb = acc
        scale = grad_out.float()
        out_h = (gh * scale.to(gh.dtype)) if (need_h and gh is not None) else None
        out_w = (gw * scale).to(ctx.w_dtype) if (need_w and gw is not None) else None
        out_b = (gb * scale).to(ctx.b_dtype) if (need_b and gb is not None) else None
        if need_h and out_h is None:
            out_h = torch.zeros(ctx.h_meta[0], dtype=ctx.h_meta[1], device=grad_out.device)
        return None, out_h, out_w, out_b, None, None


def tiled_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    bias: torch.Tensor | None = None,
    logit_scale: float | None = None,
    logit_softcapping: float | None = None,
    grad_in_forward: bool = True,
) -> torch.Tensor:
    """Causal-LM loss of ``lm_head(hidden_states)`` against ``labels`` without materialising logits.

    Args:
        hidden_states: ``[B, S, H]`` (or ``[N, H]`` with ``shift_labels``) final hidden states.
        lm_head_weight: ``[V, H]``; ``bias``: optional ``[V]``.
        labels: ``[B, S]`` unshifted labels (HF convention: shifted left here, the last position padded
            with ``ignore_index``). Mutually exclusive with ``shift_labels`` (already shifted, same
            number of elements as tokens).
        ignore_index: label value that carries no loss (default -100).
        num_items_in_batch: denominator (global label-token count, as the HF Trainer passes it); default
            the number of non-ignored shifted labels (HF's ``mean``).
        chunk_tokens: label tokens per chunk (default: fp32 chunk logits ~64 MiB, >= 128 tokens).
        logit_scale / logit_softcapping: applied to the logits (in the matmul dtype) like Cohere / Gemma2
            before the fp32 upcast.
        grad_in_forward: compute the (unscaled) gradients chunk by chunk during the forward and only
            scale them in backward (default; one logits matmul fewer than recomputing). ``False``
            recomputes each chunk in backward instead (saves ``hidden_states`` instead of its grad).

    Returns:
        fp32 scalar loss: ``sum(CE over label tokens) / denominator``.

    Guarantees: equals HF ``ForCausalLMLoss`` (fp32) to float summation order (tests: 1e-5 relative) and
    so do the gradients of ``hidden_states``, weight and bias; ignored tokens cost no compute; every
    input receives one gradient per backward (the weight's ``AccumulateGrad``/DDP hook fires once); peak
    extra memory is one chunk's logits plus the gradient buffers, never ``[tokens, vocab]``.
    """
    if (labels is None) == (shift_labels is None):
        raise ValueError("tiled_causal_lm_loss: pass exactly one of labels= or shift_labels=")
    if shift_labels is None:
        assert labels is not None
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hid = hidden_states.shape[-1]
    h = hidden_states.reshape(-1, hid)
    targets = shift_labels.reshape(-1).to(h.device)
    if targets.numel() != h.shape[0]:
        raise ValueError(f"labels have {targets.numel()} tokens but hidden_states has {h.shape[0]}")
    if num_items_in_batch is None:
        denom = (targets != ignore_index).sum().to(torch.float32)
    elif torch.is_tensor(num_items_in_batch):
        denom = num_items_in_batch.to(device=h.device, dtype=torch.float32)
    else:
        denom = torch.tensor(float(num_items_in_batch), device=h.device)
    cfg = _LossCfg(
        _chunk_len(lm_head_weight.shape[0], chunk_tokens), ignore_index, logit_scale, logit_softcapping,
        grad_in_forward,
    )
    return _TiledLoss.apply(cfg, h, lm_head_weight, bias, targets, 1.0 / denom)


# --------------------------------------------------------------------------------------------------
# Patching a HF model's forward
# --------------------------------------------------------------------------------------------------


def _target_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base() if callable(get_base) else model


def _check_forward_source(cls: type) -> str | None:
    """None when ``cls.forward`` computes ``logits = self.lm_head(...)`` once, applies nothing else to
    the logits, and passes them to ``self.loss_function``; else the reason."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
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
    from transformers.loss.loss_utils import ForCausalLMLoss

    name = type(m).__name__
    base, head = getattr(m, "model", None), getattr(m, "lm_head", None)
    if not isinstance(base, nn.Module) or not isinstance(head, nn.Module):
        raise ValueError(f"patch_model_loss: {name} has no .model/.lm_head; not a HF CausalLM-style model")
    if type(head) is not nn.Linear:
        raise ValueError(
            f"patch_model_loss: {name}.lm_head is {type(head).__name__}, not a plain nn.Linear (an adapter "
            "on lm_head, or FSDP wrapping it alone); the tiled loss needs its weight directly"
        )
    if getattr(m, "loss_function", None) is not ForCausalLMLoss:
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
        except TypeError:
            return base(*args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self", None)
        extra: dict[str, Any] = {}
        for pname, p in sig.parameters.items():
            if p.kind is p.VAR_KEYWORD and pname in arguments:
                extra = dict(arguments.pop(pname))
        labels = arguments.get("labels")
        keep = arguments.get("logits_to_keep", 0)
        keep_all = (isinstance(keep, int) and keep == 0) or keep is None
        if labels is None or not keep_all or not (torch.is_grad_enabled() or self.in_eval):
            return base(*args, **kwargs)
        arguments.pop("labels")
        arguments.pop("logits_to_keep", None)
        return_dict = extra.pop("return_dict", None)
        outputs = self.model.model(**arguments, **extra)
        hidden = outputs[0]
        head = self.model.lm_head
        shift = extra.get("shift_labels")
        loss = tiled_causal_lm_loss(
            hidden, head.weight, labels if shift is None else None,
            ignore_index=extra.get("ignore_index", -100),
            num_items_in_batch=extra.get("num_items_in_batch"),
            shift_labels=shift,
            chunk_tokens=self.chunk_tokens,
            bias=head.bias,
        )
        self.calls += 1
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=getattr(outputs, "past_key_values", None),
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
        )
        return out.to_tuple() if return_dict is False else out


@dataclass
class TiledLossHandle:
    """Result of ``patch_model_loss``: the patched model (inner HF model for a PeftModel) and ``remove()``."""

    model: nn.Module
    target: nn.Module

    @property
    def calls(self) -> int:
        """How many forwards used the tiled loss so far."""
        fwd = self.target.__dict__.get("forward")
        return fwd.calls if isinstance(fwd, _TiledLossForward) else 0

    def remove(self) -> bool:
        return unpatch_model_loss(self.model)


def patch_model_loss(model: nn.Module, *, chunk_tokens: int | None = None, in_eval: bool = False) -> TiledLossHandle:
    """Make ``model``'s forward compute its loss with ``tiled_causal_lm_loss`` when ``labels`` are given.

    The patched forward calls the base model (``model.model(...)``, with every argument the original
    forward would pass it), then the tiled loss on ``model.lm_head.weight`` with HF's
    ``ForCausalLMLoss`` semantics (``num_items_in_batch``, ``ignore_index``, ``shift_labels`` from the
    kwargs, as the Trainer passes them), and returns a ``CausalLMOutputWithPast`` with ``logits=None``.
    Without labels, with ``logits_to_keep != 0``, or under ``no_grad`` (evaluation needs logits for
    metrics; ``in_eval=True`` tiles there too) the original forward runs unchanged.

    Args:
        model: a HF CausalLM / ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
            or a ``PeftModel`` around one (the inner model is patched).
        chunk_tokens: label tokens per chunk (default: by vocab size, see ``tiled_causal_lm_loss``).
        in_eval: also tile when grad is disabled (returns no logits).

    Raises:
        ValueError: the model's forward is not the plain ``lm_head -> loss_function(ForCausalLMLoss)``
            shape (soft-capped logits, custom loss, adapter on ``lm_head``), naming the model and reason.

    Guarantees: same loss and gradients as the model's own loss (1e-5 relative, tests); idempotent;
    reversible (``remove()`` restores the previous forward); the forward's signature is preserved (the
    Trainer's column filtering and loss-kwargs detection see the original one).
    """
    target = _target_model(model)
    existing = target.__dict__.get("forward")
    if isinstance(existing, _TiledLossForward):
        existing.chunk_tokens, existing.in_eval = chunk_tokens, in_eval
        return TiledLossHandle(model, target)
    _check_model(target)
    target.forward = _TiledLossForward(target, existing, chunk_tokens, in_eval)  # type: ignore[method-assign]
    return TiledLossHandle(model, target)


def unpatch_model_loss(model: nn.Module) -> bool:
    """Undo ``patch_model_loss``; returns True when a patch was removed."""
    target = _target_model(model)
    fwd = target.__dict__.get("forward")
    if not isinstance(fwd, _TiledLossForward):
        return False
    if fwd.prev is None:
        del target.__dict__["forward"]
    else:
        target.__dict__["forward"] = fwd.prev
    return True
