"""Small torch.distributed helpers shared by the ops and the integrations."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def world_size(group: Any = None) -> int:
    """World size of ``group``; 1 without an initialised process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def dist_ready(group: Any = None) -> bool:
    """True when collectives over ``group`` mean something (initialised, more than one rank)."""
    return world_size(group) > 1


def collective_device(group: Any = None) -> torch.device:
    """Where a collective's tensor must live: the current CUDA device for NCCL, else CPU (gloo)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_flags(flags: list[bool], group: Any = None) -> list[list[bool]]:
    """Every rank's ``flags`` (one row per rank, in rank order) with one ``all_gather`` of a byte each;
    ``[flags]`` without a process group of more than one rank. Every rank must pass the same length."""
    if not dist_ready(group):
        return [list(flags)]
    local = torch.tensor([bool(f) for f in flags], dtype=torch.uint8, device=collective_device(group))
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return [[bool(v) for v in t.tolist()] for t in gathered]
