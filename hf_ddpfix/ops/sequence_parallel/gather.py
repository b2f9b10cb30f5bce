"""Make a sequence-sharded tensor whole on every rank of a sequence-parallel group, for a loss that needs
the whole sequence (a trainer's own `compute_loss`, `compute_loss_func`, label smoothing, a head on hidden
states).

`gather_sequence(x, dim, group)`: forward all-gathers the N equal slices and concatenates them along `dim`;
backward hands each rank the gradient of *its own* slice, times N. Every rank of the group then computes the
identical loss L from the whole tensor; the caller divides the loss it backpropagates by N (`1/N * L` on each
rank), so each rank's seed on its slice is `dL/d(slice)` (as the sharded token-sum loss gives it) and a term
that does not pass through the gather (a penalty on the weights) gets `1/N` on each of the N ranks: summed
over the group, exactly one process's gradient of L. No reduction over the group happens in backward: the N
copies of `dL/d(whole)` are identical, summing them would count the loss N times.

Guarantees (tests/scripts/sp_losses.py, 2 gloo processes): a trainer loss on the whole outputs, backpropagated
as `L / N` through this gather, gives weights equal to one process on the whole batch (SGD, <= 1e-6).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_sequence"]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:  # noqa: ANN401
        n, r = dist.get_world_size(group), dist.get_rank(group)
        ctx.dim, ctx.n, ctx.r, ctx.size = dim, n, r, x.shape[dim]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN401
        own = grad.narrow(ctx.dim, ctx.r * ctx.size, ctx.size)
        return own * ctx.n, None, None


def gather_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`x` (this rank's slice, the same shape on every rank of `group`) -> the N slices concatenated along `dim`,
    in rank order; the backward returns N x this rank's slice of the incoming gradient (see the module)."""
    return _GatherSequence.apply(x, dim, group)
