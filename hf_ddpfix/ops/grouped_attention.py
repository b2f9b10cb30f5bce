"""Causal grouped-query attention run in KV-head groups (``grouped_flash_attention``).

``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` already avoids expanded
K/V copies on flash kernels, but the FlashAttention-2 backward allocates, inside the kernel and for
the whole call, an fp32 ``dq`` accumulator (``tokens x q_heads x head_dim x 4`` bytes) and, when K/V
have fewer heads than Q, expanded ``dk``/``dv`` buffers (``2 x tokens x q_heads x head_dim x 2``
bytes): 32 KiB per token for Llama-8B (32 q heads, 8 KV heads, head_dim 128), more than a bf16 hidden
state. Running the kernel once per group of KV heads (with the query heads that share them) makes
those workspaces ``1/groups`` as large; the saved tensors (q, k, v, output, log-sum-exp) are the same.

Each call is the same fused kernel sdpa picks for these inputs (``aten._scaled_dot_product_flash_attention``
on CUDA, ``aten._scaled_dot_product_flash_attention_for_cpu`` on CPU and meta), on a subset of heads:
heads never interact, so every head's output, log-sum-exp and gradients are those of the full call.
On CUDA the first call per (device, dtype, heads, head_dim) checks the grouped path against
``F.scaled_dot_product_attention`` on a small random input (values and gradients); a mismatch or a
kernel error makes :func:`grouped_flash_attention` return ``None`` so the caller keeps sdpa. The check
runs in a thread of its own: the first call usually happens inside a checkpointed (and possibly
offloaded) layer forward, whose saved-tensor hooks are thread-local; run there, the check's own saved
tensors would be packed into the checkpoint, which then sees a different number of saved tensors in
the recompute (where the check is cached) and raises ``CheckpointError``.

Guarantees: output and gradients equal one fused call on all heads (tests/test_grouped_attention.py,
exact on CPU); only causal, unmasked, dropout-free attention is handled (anything else: ``None``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from .._compat import flash_attention_backward, flash_attention_forward

__all__ = ["grouped_flash_attention", "kv_groups_for"]

_CUDA_OK: dict[tuple[Any, ...], bool] = {}
_T = TypeVar("_T")


def _in_own_thread(fn: Callable[[], _T]) -> _T:
    """``fn()`` run in a new thread and joined: it sees none of the caller's thread-local autograd state
    (saved-tensor hooks of checkpointing and offload, grad mode, autocast), so it adds nothing to the
    graph the caller is building. Exceptions propagate to the caller."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="hf_ddpfix-attention-self-check")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def kv_groups_for(kv_heads: int, groups: int | str = "auto") -> int:
    """Number of KV-head groups: ``"auto"`` = one group per KV head; an int is clamped to a divisor.

    Raises:
        ValueError: ``groups`` neither ``"auto"`` nor an integer >= 1.
    """
    if groups == "auto":
        return max(1, int(kv_heads))
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"attention groups={groups!r}: allowed 'auto' or an integer >= 1")
    g = min(int(groups), int(kv_heads))
    while kv_heads % g:
        g -= 1
    return g


class _GroupedFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int) -> torch.Tensor:  # type: ignore[override]
        b, hq, s, d = q.shape
        hk = k.shape[1]
        qg, kg = hq // groups, hk // groups
        # [B, S, H, D] storage, returned as a [B, H, S, D] view: the layout flash kernels produce, so
        # ``out.transpose(1, 2).reshape(B, S, H * D)`` is a view (no copy for the o projection).
        out = q.new_empty((b, s, hq, d)).transpose(1, 2)
        lse: torch.Tensor | None = None  # fp32 (fp64 for fp64 inputs on CPU), as the kernel returns it
        extras = []
        for j in range(groups):
            qs, ks = slice(j * qg, (j + 1) * qg), slice(j * kg, (j + 1) * kg)
            o, l_, extra = flash_attention_forward(q[:, qs], k[:, ks], v[:, ks], scale)
            out[:, qs] = o
            if lse is None:
                lse = l_.new_empty((b, hq, l_.shape[-1]))
            lse[:, qs] = l_
            extras.append(extra)
            del o, l_
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.extras = extras
        ctx.scale = scale
        ctx.groups = groups
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        groups = ctx.groups
        hq, hk = q.shape[1], k.shape[1]
        qg, kg = hq // groups, hk // groups
        gq = torch.empty_like(q)
        gk = torch.empty_like(k)
        gv = torch.empty_like(v)
        for j in range(groups):
            qs, ks = slice(j * qg, (j + 1) * qg), slice(j * kg, (j + 1) * kg)
            dq, dk, dv = flash_attention_backward(grad_out[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, qs].contiguous(),
                              ctx.extras[j], ctx.scale)
            gq[:, qs] = dq
            gk[:, ks] = dk
            gv[:, ks] = dv
            del dq, dk, dv
        return gq, gk, gv, None, None


def _cuda_checked(q: torch.Tensor, k: torch.Tensor, groups: int) -> bool:
    """Whether the grouped path matches ``F.scaled_dot_product_attention`` for ``q``/``k``'s device, dtype
    and head layout (values and gradients on a small random input); computed once per key, in a thread
    of its own (see the module docstring), then cached."""
    key = (q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1], groups)
    if key not in _CUDA_OK:
        _CUDA_OK[key] = _in_own_thread(lambda: _self_check(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1],
                                                           groups))
    return _CUDA_OK[key]


def _self_check(device: torch.device, dtype: torch.dtype, hq: int, hk: int, d: int, groups: int) -> bool:
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        shape_q, shape_k = (1, hq, 256, d), (1, hk, 256, d)
        tq = torch.randn(shape_q, generator=gen, device=device, dtype=dtype).requires_grad_()
        tk = torch.randn(shape_k, generator=gen, device=device, dtype=dtype).requires_grad_()
        tv = torch.randn(shape_k, generator=gen, device=device, dtype=dtype).requires_grad_()
        tg = torch.randn(shape_q, generator=gen, device=device, dtype=dtype)
        scale = d**-0.5
        ref = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=scale, enable_gqa=True)
        ref_g = torch.autograd.grad(ref, (tq, tk, tv), tg)
        got = _GroupedFlash.apply(tq, tk, tv, scale, groups)
        got_g = torch.autograd.grad(got, (tq, tk, tv), tg)
        tol = dict(rtol=2e-2, atol=2e-2)
        return torch.allclose(ref, got, **tol) and all(
            torch.allclose(a, b, **tol) for a, b in zip(ref_g, got_g, strict=True))
    except Exception:  # noqa: BLE001 - any kernel refusal means: keep sdpa
        return False


def grouped_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, groups: int | str = "auto"
) -> torch.Tensor | None:
    """Causal attention of ``q [B, Hq, S, D]`` over ``k, v [B, Hk, S, D]`` in ``groups`` KV-head groups.

    Args:
        q, k, v: ``Hq`` a multiple of ``Hk``; same ``S`` (training, no cache); any strides with a unit
            last-dim stride.
        scale: softmax scale (``head_dim ** -0.5`` for Llama).
        groups: ``"auto"`` (one group per KV head, default) or an int (clamped to a divisor of ``Hk``).

    Returns:
        ``[B, Hq, S, D]`` (a view of ``[B, S, Hq, D]`` storage), or ``None`` when this path does not
        apply (mismatched sequence lengths, heads not a multiple, a device other than CPU/meta/CUDA,
        or the CUDA self-check failed): the caller then uses ``F.scaled_dot_product_attention``.

    Guarantees: see the module docstring.
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        return None
    if q.device.type not in ("cpu", "meta", "cuda"):
        return None
    g = kv_groups_for(k.shape[1], groups)
    if q.device.type == "cuda" and not _cuda_checked(q, k, g):
        return None
    return _GroupedFlash.apply(q, k, v, float(scale), g)
