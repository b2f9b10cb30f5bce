"""RMSNorm that keeps only its low-precision input and an fp32 per-token scale (``rms_norm``).

The Llama-style RMSNorm ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`` run by
autograd saves an fp32 copy of its input (4 bytes x hidden per token, 16 KiB/token at hidden 4096)
and a bf16 normalised copy when the weight is trainable. This Function saves the input itself (in a
decoder layer that is the residual stream, already alive) and ``rstd`` (4 bytes per token), and runs
forward and backward in token chunks so no full-length fp32 tensor ever exists.

Math: the forward and the input gradient use the same fp32 elementwise ops, in the same order, as
autograd on the stock module (``pow``/``mean``/``rsqrt``/``mul`` forward; ``mul``, ``rsqrt``,
``mean`` and ``pow`` backward formulas of ``tools/autograd/derivatives.yaml``), row by row, so they are
bit-identical to stock. The weight gradient sums per chunk in fp32 (stock sums all tokens in one
reduction): equal up to summation order, exact with one chunk.

Guarantees: output and input gradient bit-identical to the stock module (tests/test_rms_norm.py);
saved tensors: the input and a ``[tokens, 1]`` fp32 ``rstd``; transient fp32 memory bounded by
``chunk_tokens x hidden x 4 x ~4`` bytes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DEFAULT_CHUNK_TOKENS", "rms_norm"]

# 4096 tokens x 4096 hidden x 4 B = 64 MiB per fp32 temporary: large enough for full-speed elementwise
# kernels, small against a 32K-token layer's 16 KiB/token fp32 copy (512 MiB) it replaces.
DEFAULT_CHUNK_TOKENS = 4096


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    size = max(1, int(size))
    return [(s, min(n, s + size)) for s in range(0, n, size)] or [(0, 0)]


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, chunk_tokens: int,  # type: ignore[override]
                unit_offset: bool) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        n = x2.shape[0]
        out_dtype = x.dtype if unit_offset else torch.result_type(weight, x.new_empty((), dtype=x.dtype))
        wp = 1.0 + weight.float() if unit_offset else None  # Gemma: (x_hat * (1 + w)).to(x.dtype), in fp32
        out = torch.empty((n, shape[-1]), dtype=out_dtype, device=x.device)
        rstd = torch.empty((n, 1), dtype=torch.float32, device=x.device)
        for s, e in _chunks(n, chunk_tokens):
            xf = x2[s:e].to(torch.float32)
            variance = xf.pow(2).mean(-1, keepdim=True)
            r = torch.rsqrt(variance + eps)
            rstd[s:e] = r
            out[s:e] = ((xf * r) * wp).to(x.dtype) if wp is not None else weight * (xf * r).to(x.dtype)
        del wp
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps = eps
        ctx.unit_offset = unit_offset
        ctx.chunk_tokens = chunk_tokens
        return out.view(*shape[:-1], shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        g2 = grad_out.reshape(-1, shape[-1])
        n, h = x2.shape
        grad_x = torch.empty_like(x2) if need_x else None
        grad_w: torch.Tensor | None = None
        chunks = _chunks(n, ctx.chunk_tokens)
        wp = 1.0 + weight.float() if ctx.unit_offset else None
        for s, e in chunks:
            xf = x2[s:e].to(torch.float32)
            r = rstd[s:e]
            g = g2[s:e]
            if wp is not None:  # Gemma's form: ToCopyBackward, then MulBackward0 of x_hat * (1 + w), fp32
                gf = g.to(torch.float32)
                if need_w:
                    gw = (gf * (xf * r)).sum(0)
                    grad_w = gw if grad_w is None else grad_w + gw
                g_hn = gf * wp
                del gf
            elif need_w:
                hb = (xf * r).to(x.dtype)
                gw = g * hb
                gw = gw.sum(0) if len(chunks) == 1 else gw.sum(0, dtype=torch.promote_types(gw.dtype, torch.float32))
                grad_w = gw if grad_w is None else grad_w + gw
            if need_x:
                if wp is None:  # MulBackward0 of weight * hb, then ToCopyBackward: grad of the fp32 normalised value
                    g_hn = (g * weight).to(torch.float32)
                # MulBackward0 of xf * r.
                g_xf = g_hn * r
                g_r = (g_hn * xf).sum(-1, keepdim=True)
                # RsqrtBackward0: -0.5 * grad * result^3; MeanBackward1: expand / h; PowBackward0: grad * (2 * x^1).
                g_var = -0.5 * g_r * r.pow(3)
                g_p = g_var.expand(e - s, h) / h
                g_xf = g_xf + g_p * (2.0 * xf.pow(1))
                grad_x[s:e] = g_xf.to(x.dtype)  # type: ignore[index]
        gx = grad_x.view(shape) if grad_x is not None else None
        gw_out = grad_w.to(weight.dtype).reshape(weight.shape) if grad_w is not None else None
        return gx, gw_out, None, None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    unit_offset: bool = False,
) -> torch.Tensor:
    """Llama-style RMSNorm: ``weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)``, or with
    ``unit_offset`` Gemma's: ``(x.float() * rsqrt(mean(x.float()**2, -1) + eps) * (1 + weight.float())).to(x.dtype)``.

    Args:
        x: ``[..., hidden]`` (any float dtype; bf16 in training).
        weight: ``[hidden]`` (trainable or frozen).
        eps: the variance epsilon.
        chunk_tokens: tokens per chunk of the fp32 computation (default 4096).
        unit_offset: Gemma's ``(1 + weight)`` form, multiplied in fp32 before the cast (Gemma 1/2/3,
            Qwen3-Next/3.5 norms); default False (Llama's).

    Returns:
        ``[..., hidden]`` in ``result_type(weight, x)`` (as the stock module's ``weight * h``); with
        ``unit_offset``, in ``x.dtype`` (as Gemma's ``type_as(x)``).

    Raises:
        ValueError: ``chunk_tokens < 1`` or ``weight`` not ``[hidden]``.

    Guarantees: see the module docstring.
    """
    if int(chunk_tokens) < 1:
        raise ValueError(f"rms_norm(chunk_tokens={chunk_tokens!r}): must be an integer >= 1")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    return _RMSNormFunction.apply(x, weight, float(eps), int(chunk_tokens), bool(unit_offset))
