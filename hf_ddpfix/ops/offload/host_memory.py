"""What the host can spare for pinned offload buffers: physical and available memory, the default cap.

Contract: plain reads of the operating system (``sysconf``, Linux ``/proc/meminfo``) and of
``LOCAL_WORLD_SIZE``; every function answers ``None`` (or "no objection") where a figure cannot be read,
never raises. ``HostPool`` (``ops/offload/host_pool.py``) asks these before it allocates a slab.
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "DEFAULT_HOST_FRACTION",
    "default_max_bytes",
    "host_available_bytes",
    "leaves_too_little",
    "physical_bytes",
    "release_torch_host_cache",
]

# Default cap: a quarter of the machine's physical memory, split among the processes on the node
# (LOCAL_WORLD_SIZE, as torchrun sets it). Pinned pages cannot be swapped; the data loader, the
# optimizer's host state and the OS need the rest. Llama-8B at 32K tokens offloads 8 GiB per rank.
DEFAULT_HOST_FRACTION = 0.25


def physical_bytes() -> int | None:
    """The machine's physical memory in bytes (None where ``sysconf`` cannot tell)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def default_max_bytes(fraction: float = DEFAULT_HOST_FRACTION, env: dict[str, str] | None = None) -> int | None:
    """``fraction`` of physical host memory divided by ``LOCAL_WORLD_SIZE`` (None when unknown)."""
    env = os.environ if env is None else env
    total = physical_bytes()
    if total is None:
        return None
    try:
        local = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return int(total * fraction) // local


def host_available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def leaves_too_little(size: int, min_free_fraction: float) -> bool:
    """True when allocating ``size`` more bytes would leave less than ``min_free_fraction`` of physical
    memory available. False when the check is off (fraction 0) or a figure cannot be read."""
    if not min_free_fraction:
        return False
    available, total = host_available_bytes(), physical_bytes()
    if available is None or total is None:
        return False
    return available - size < min_free_fraction * total


def release_torch_host_cache() -> None:
    """Return torch's cached pinned blocks to the driver (the slabs a pool dropped sit there otherwise)."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is not None:
        try:
            empty()
        except RuntimeError:  # no accelerator runtime: nothing cached
            pass
