"""``OffloadStats``: what one ``ActivationOffload.step()`` did, as plain counters.

Contract: a dataclass of ints and one string, reset when a step begins (``steps`` and
``pool_allocated`` carry over); ``ActivationOffload`` is its only writer. Bytes are storage bytes (what
a copy moves). Tests and benchmarks read it to check exactly what was copied, kept, deduplicated,
skipped and restored, and how big the host pools grew.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["OffloadStats"]


@dataclass
class OffloadStats:
    """Counters for one ``step()`` (reset when the next step begins), plus pool state.

    Bytes are storage bytes: what a copy moves. ``would_offload_bytes`` counts the bytes an accelerator
    run moves to the host on every device type (on CUDA it equals ``offloaded_bytes``; on CPU nothing
    is copied and ``offloaded_bytes`` stays 0).
    """

    steps: int = 0  # step() contexts completed since construction (cumulative)
    packed_tensors: int = 0  # tensors the pack hook saw
    packed_bytes: int = 0
    offloaded_tensors: int = 0  # storages actually copied to host buffers
    offloaded_bytes: int = 0
    would_offload_bytes: int = 0  # storages that were (or on an accelerator would be) moved to the host
    kept_tensors: int = 0  # offloadable storages left on the device because backward needs them first
    kept_bytes: int = 0
    deduped_tensors: int = 0  # packs that reused a storage already recorded this step
    skipped_small: int = 0  # below min_bytes
    skipped_params: int = 0  # parameters, buffers or views of them
    skipped_views: int = 0  # views that do not cover their whole storage
    skipped_other: int = 0  # subclasses, sparse/quantized/conj tensors, unsupported devices
    skipped_pool: int = 0  # the host pool refused (cap reached, host allocation failed): kept on device
    skipped_policy: int = 0  # storages left on the device because this step's layers are too small to pay
    policy: str = ""  # this step's offload decision and its reason (set at the first packed storage)
    restored_tensors: int = 0  # host-to-device copies (prefetched or on demand)
    prefetched_tensors: int = 0
    pool_buffers: int = 0  # host buffers still handed out at step exit (0 after a normal backward)
    pool_bytes: int = 0  # host bytes the pools hold at step exit (slabs, in use or idle)
    pool_need_bytes: int = 0  # the most host bytes any step had in use at once (the pools' P)
    pool_peak_bytes: int = 0  # the most host bytes the pools ever held
    pool_max_held_over_need: float = 0.0  # the pools' largest held / need at any moment (<= 2, HostPool)
    keep_on_device: int = 0  # this step's N: the last N checkpoints' inputs stay on the device
    pool_allocated: int = 0  # host slabs ever allocated (cumulative; flat once the pool is warm)
    in_flight: int = 0  # host buffers still owned by a live saved tensor at step exit (0 after backward)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
