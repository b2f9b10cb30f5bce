"""Which saved tensors ``ActivationOffload`` moves to host memory, and whether a step copies at all.

Two decisions, both made in the pack hook without a device sync:

1. **Eligible storage** (:meth:`OffloadPolicy.skip_reason`): parameters, buffers and views of them,
   tensor subclasses, non-strided / quantized / conjugate / negative-bit tensors, empty tensors,
   devices other than CPU and CUDA/ROCm, storages below ``min_bytes`` and views that do not span
   their whole storage stay where they are; each answer names the ``OffloadStats.skipped_*`` counter.
2. **When it pays** (:meth:`OffloadPolicy.pays`): a copy hides behind the layer's compute only when
   the layer is big enough. Measured on one H100 80GB (2026-11-23, 1.1B Llama shape, bf16, LoRA,
   batch 1; step time with offload / checkpointing alone): 1.57x at 2K tokens (8 MiB per layer
   input), 1.08x at 8K (32 MiB), 0.99x at 16K (64 MiB), 1.01x at 32K (128 MiB). So with
   ``min_layer_bytes`` set (the plan's ``auto`` passes ``DEFAULT_MIN_LAYER_BYTES``) a storage is
   copied only when it has at least that many bytes, or when the device was under memory pressure
   (the caching allocator reserved >= ``pressure_fraction`` of the device when the step first packed
   on it); other steps run as stock checkpointing. ``OffloadStats.policy`` says which and why.

Contract: pure torch; reads host-side allocator counters only (``torch.cuda.memory_reserved``), never
synchronizes a device; state is per step (:meth:`OffloadPolicy.begin_step`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from ..._compat import view_base
from .stats import OffloadStats

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MIN_BYTES",
    "DEFAULT_MIN_LAYER_BYTES",
    "DEFAULT_PRESSURE_FRACTION",
    "OFFLOAD_DEVICE_TYPES",
    "OffloadPolicy",
    "accelerator_available",
]

# 1 MiB: below this a copy costs more in launch latency and bookkeeping than it frees
# (DeepSpeed, axolotl and torchtune all skip tensors under ~1 MiB; REFERENCES.md §3).
DEFAULT_MIN_BYTES = 1 << 20

# 64 MiB: the smallest layer input at which the H100 measurement above showed no slowdown (0.99x at
# 16K tokens x 2048 hidden x bf16); at 32 MiB (8K) the step was 1.08x, at 8 MiB (2K) 1.57x.
DEFAULT_MIN_LAYER_BYTES = 64 << 20

# Offload whatever the size when the previous step left >= 90% of the device reserved: the copy
# costs time, running out of memory costs the run.
DEFAULT_PRESSURE_FRACTION = 0.9

OFFLOAD_DEVICE_TYPES = ("cuda",)  # ROCm builds report "cuda" too


def accelerator_available() -> bool:
    """True when a device the asynchronous offload path supports (CUDA or ROCm) is present.

    Guarantees: never initializes a device context when there is no device; False on CPU-only builds.
    """
    return torch.cuda.is_available()


class OffloadPolicy:
    """The per-storage offload decision (see the module docstring).

    Args:
        min_bytes: storages smaller than this stay where they are.
        min_layer_bytes: copy a storage only when it has at least this many bytes, unless the device is
            under memory pressure (0: always).
        pressure_fraction: the reserved fraction of device memory that counts as pressure.

    Raises:
        ValueError: a negative size or a fraction outside (0, 1], naming the argument.
    """

    def __init__(self, min_bytes: int, min_layer_bytes: int, pressure_fraction: float) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        if min_layer_bytes < 0:
            raise ValueError(f"min_layer_bytes must be >= 0, got {min_layer_bytes}")
        if not 0 < pressure_fraction <= 1:
            raise ValueError(f"pressure_fraction must be in (0, 1], got {pressure_fraction}")
        self.min_bytes = int(min_bytes)
        self.min_layer_bytes = int(min_layer_bytes)
        self.pressure_fraction = float(pressure_fraction)
        self._param_storages: set[int] = set()
        self._pressure: dict[int, bool] = {}  # per CUDA device, decided once per step
        self._warned: set[str] = set()

    def begin_step(self, module: nn.Module | None) -> None:
        """Forget the previous step: collect ``module``'s parameter and buffer storages (never copied)
        and decide memory pressure afresh."""
        self._param_storages = set()
        if module is not None:
            self._param_storages = _storage_ptrs((*module.parameters(), *module.buffers()))
        self._pressure = {}

    def skip_reason(self, t: torch.Tensor) -> str | None:
        """Why ``t`` stays where it is (the suffix of an ``OffloadStats.skipped_*`` counter), or None
        when its storage may be moved. An unsupported device type is warned about once."""
        if isinstance(t, nn.Parameter) or isinstance(view_base(t), nn.Parameter):
            return "params"
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized:
            return "other"
        if t.is_conj() or t.is_neg() or t.numel() == 0:
            return "other"
        if t.device.type != "cpu" and t.device.type not in OFFLOAD_DEVICE_TYPES:
            if t.device.type not in self._warned:
                self._warned.add(t.device.type)
                logger.warning(
                    f"ActivationOffload: {t.device.type} tensors are kept on device "
                    "(the asynchronous path supports CUDA/ROCm only)."
                )
            return "other"
        storage = t.untyped_storage()
        if storage.data_ptr() in self._param_storages:
            return "params"
        if storage.nbytes() < self.min_bytes:
            return "small"
        if not _covers_storage(t, storage.nbytes()):
            return "views"
        return None

    def pays(self, nbytes: int, device: torch.device, stats: OffloadStats) -> bool:
        """Whether a new storage of ``nbytes`` is copied this step; records the reason in ``stats.policy``."""
        if nbytes >= self.min_layer_bytes:
            if not stats.policy:
                stats.policy = (
                    "copy: always" if not self.min_layer_bytes
                    else f"copy: a checkpoint input of {nbytes / 2**20:.0f} MiB >= {self.min_layer_bytes / 2**20:.0f} MiB"
                )
            return True
        if self._under_pressure(device):
            stats.policy = f"copy: device memory >= {self.pressure_fraction:.0%} reserved (pressure)"
            return True
        if not stats.policy.startswith("copy"):
            stats.policy = (
                f"keep: checkpoint inputs < {self.min_layer_bytes / 2**20:.0f} MiB, where the copy does not "
                "hide behind the layer's compute"
            )
        return False

    def _under_pressure(self, device: torch.device) -> bool:
        """The caching allocator held >= ``pressure_fraction`` of ``device`` when this step first packed
        on it (host-side counters: no device sync). Always False off CUDA."""
        if device.type != "cuda":
            return False
        idx = device.index if device.index is not None else torch.cuda.current_device()
        hit = self._pressure.get(idx)
        if hit is None:
            total = torch.cuda.get_device_properties(idx).total_memory
            hit = self._pressure[idx] = torch.cuda.memory_reserved(idx) >= self.pressure_fraction * total
        return hit


def _covers_storage(t: torch.Tensor, storage_bytes: int) -> bool:
    """True when ``t`` spans its storage from first to last byte (contiguous, transposed, reshaped)."""
    if t.storage_offset() != 0:
        return False
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return span * t.element_size() == storage_bytes


def _storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Storage addresses of `tensors`; a DTensor (FSDP2 parameter) contributes its local shard's storage
    (the python DTensor wrapper has no storage of its own)."""
    from torch.distributed.tensor import DTensor

    ptrs = set()
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.layout == torch.strided:
            ptrs.add(local.untyped_storage().data_ptr())
    return ptrs
