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

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "DEFAULT_CHUNK_LOGITS_BYTES",
    "chunk_len",
    "tiled_causal_lm_loss",
]

# Chunk length rule: fp32 logits of one chunk take about this many bytes (64 MiB = 512 tokens at a 32K
# vocab, still a large GEMM on a GPU; benchmarks/tiled.py: loss head peak >= 10x lower at 16K tokens),
# and at least 128 tokens.
DEFAULT_CHUNK_LOGITS_BYTES = 64 * 2**20
_MIN_CHUNK = 128


def chunk_len(vocab: int, chunk_tokens: int | None) -> int:
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
        chunk_len(lm_head_weight.shape[0], chunk_tokens), ignore_index, logit_scale, logit_softcapping,
        grad_in_forward,
    )
    return _TiledLoss.apply(cfg, h, lm_head_weight, bias, targets, 1.0 / denom)
