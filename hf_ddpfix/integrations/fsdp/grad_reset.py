"""The step-end reset both FSDP2 dummies share (the tower dummy, :mod:`.dummy`; the cross-attention dummy,
:mod:`.cross_attention`): a dummy's exact-zero gradients become stock DDP's "unused" (``grad = None``) in a step
where no rank saw an image. Its own module so that neither dummy imports the other for it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...ops.dist import collective_device, dist_ready

__all__ = ["reset_grads_unless_any_rank_saw"]


def reset_grads_unless_any_rank_saw(local: bool, modules: list[nn.Module], process_group: Any = None) -> bool:
    """One MAX all-reduce of ``local`` (this rank saw an image this step) over ``process_group``; where no rank did,
    every trainable parameter of ``modules`` gets ``grad = None`` (the dummy's exact zeros become stock DDP's
    "unused": AdamW skips them, no weight decay). Returns whether some rank saw one. Without a process group: local."""
    if dist_ready(process_group):
        flag = torch.tensor([int(local)], dtype=torch.int32, device=collective_device(process_group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        seen = bool(flag.item())
    else:
        seen = local
    if not seen:
        for mod in modules:
            for p in mod.parameters():
                if p.requires_grad:
                    p.grad = None
    return seen
