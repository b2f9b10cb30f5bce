"""Ulysses sequence-parallel attention over `torch.distributed`: sequence shards -> head shards -> attention
on the full sequence with H/N heads per rank -> sequence shards again.

Each of the N ranks of an SP group holds a contiguous `S/N`-token slice of the same sequences. Before
attention one all-to-all trades sequence for heads (rank j then holds heads `j*H/N .. (j+1)*H/N - 1` of
all `S` tokens), attention runs on the full sequence, and a second all-to-all trades back. Both
all-to-alls are differentiable (`_AllToAll` below, around `dist.all_to_all_single`, gloo and NCCL), so
the backward pass routes each token's gradient to the rank that owns it.

Shapes (B batch, H query heads, Hk key/value heads, s = S/N local tokens, D head dim):
    query [B, H, s, D], key/value [B, Hk, s, D]  ->  output [B, H, s, D]

Guarantees (tests/scripts/sp_parity.py, 2 and 4 gloo processes): the output and the gradients of
q, k, v equal single-process attention on the concatenated sequence to <= 1e-6 (fp32) for MHA, GQA and
KV heads < N (KV heads replicated); `gradcheck` passes in fp64 for the all-to-all.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["all_to_all", "heads_to_sequence", "kv_replication", "sequence_to_heads", "ulysses_attention"]

#: `attend(q, k, v) -> out`, all `[B, heads, S, D]` on the full sequence (k, v already matched to q's heads).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` of equal chunks along dim 0, differentiable: chunk j of rank i goes to rank j as
    its chunk i. That exchange is its own transpose, so the backward is the same exchange of the gradient
    (exact: a permutation of values, no arithmetic). Replaces `torch.distributed.nn.functional.
    all_to_all_single`, deprecated in torch 2.15 (the same forward and backward, for equal splits only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Differentiable all-to-all of `x`'s dim-0 chunks (dim 0 = the group size, one chunk per rank): rank i's
    chunk j becomes rank j's chunk i; gradients travel back the same way. No deprecated API (torch 2.13-2.15)."""
    return _AllToAll.apply(x, group)


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`[B, H, s, D]` (this rank's tokens, all heads) -> `[B, H/N, N*s, D]` (all tokens, this rank's heads).

    Raises:
        ValueError: `H` not divisible by the group size.
    """
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    if h % n:
        raise ValueError(f"sequence_to_heads: {h} heads are not divisible by the sequence-parallel size {n}")
    # [B, N, H/N, s, D] -> [N, B, H/N, s, D]: chunk j (heads of rank j) goes to rank j
    send = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = all_to_all(send, group)
    # received chunk i = rank i's tokens (sequence slice i) of our heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: `[B, H/N, N*s, D]` -> `[B, H, s, D]`."""
    n = dist.get_world_size(group)
    b, hn, total, d = x.shape
    if total % n:
        raise ValueError(f"heads_to_sequence: {total} tokens are not divisible by the sequence-parallel size {n}")
    s = total // n
    # [B, H/N, N, s, D] -> [N, B, H/N, s, D]: sequence slice j goes back to rank j
    send = x.reshape(b, hn, n, s, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = all_to_all(send, group)
    # received chunk i = heads of rank i for our tokens
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * hn, s, d)


def kv_replication(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many copies of each key/value head Ulysses needs so that every rank gets whole KV heads
    matching its query heads: 1 when `num_kv_heads % sp_size == 0`, else the smallest `f` with
    `(num_kv_heads * f) % sp_size == 0` and `num_heads % (num_kv_heads * f) == 0`.

    Raises:
        ValueError: `num_heads` not divisible by `sp_size` or by `num_kv_heads`, or no such `f` exists.
    """
    if num_heads % sp_size:
        raise ValueError(f"{num_heads} attention heads are not divisible by sequence_parallel={sp_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} key/value heads")
    f = sp_size // math.gcd(num_kv_heads, sp_size)
    if num_heads % (num_kv_heads * f):
        raise ValueError(f"{num_kv_heads} key/value heads cannot be replicated to match {num_heads} heads "
                         f"over sequence_parallel={sp_size}")
    return f


def _sdpa(mask: torch.Tensor | None, scale: float | None, dropout: float) -> Attend:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
                                              is_causal=mask is None)

    return attend


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                      group: dist.ProcessGroup | None = None, mask: torch.Tensor | None = None,
                      scale: float | None = None, dropout: float = 0.0, attend: Attend | None = None) -> torch.Tensor:
    """Attention over the full sequence of an SP group, each rank holding a slice of it.

    Args:
        query: `[B, H, s, D]`, this rank's `s` tokens (rank r holds tokens `r*s .. (r+1)*s - 1`).
        key, value: `[B, Hk, s, D]`; `Hk` divides `H`. KV heads are replicated (`kv_replication`) when
            `Hk` is not a multiple of the group size.
        group: the SP process group (default: the world).
        mask: boolean `[B or 1, 1, S, S]` over the *full* sequence (True: may attend), or `None`: causal.
        scale, dropout: as `F.scaled_dot_product_attention`.
        attend: replaces the default SDPA (`attend(q, k, v)` on `[B, heads, S, D]`, any GQA ratio).

    Returns:
        `[B, H, s, D]`: this rank's tokens, every head.
    """
    n = dist.get_world_size(group)
    h, hk = query.shape[1], key.shape[1]
    f = kv_replication(h, hk, n)
    if f > 1:
        key = key.repeat_interleave(f, dim=1)
        value = value.repeat_interleave(f, dim=1)
    q, k, v = (sequence_to_heads(t, group) for t in (query, key, value))
    out = (attend or _sdpa(mask, scale, dropout))(q, k, v)
    return heads_to_sequence(out, group)
