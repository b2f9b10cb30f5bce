"""The GPU suite's device: CUDA on a GPU machine, or on the CPU a stand-in that plays one (a fake CUDA).

Every memory read, cap and synchronisation of ``benchmarks/gpu_suite.py`` and its workers goes through
:func:`device`, so the suite's GPU-only branches (the memory cap, the peak reads, the OOM stop of the ladder) run
in CI against the stand-in: it reports memory from a linear model of the tokens a trial *stands for* and raises
``torch.OutOfMemoryError`` where it is told to. Nothing it reports is a measurement.

The stand-in is on when ``GPU_SUITE_STAND_IN`` holds a JSON object (``benchmarks/gpu_suite.py --dry-run`` sets
:data:`DRY_RUN_SPEC`): ``name``, ``total_gib`` (the device's memory), ``base_gib`` and ``gib_per_ktok`` (the peak a
trial of ``tokens`` reports: ``base + gib_per_ktok * tokens / 1024``), ``oom_tokens`` (``{family: tokens}``: a trial
of that family at that many tokens or more raises OOM at its first step, whatever the memory model says). A peak
over the cap (``cap(gib)``, ``set_per_process_memory_fraction``'s stand-in) or the total raises OOM too.

Guarantees: without ``GPU_SUITE_STAND_IN`` and without CUDA, :func:`device` is ``None`` (the suite refuses to
measure); with CUDA and no stand-in, every call is the ``torch.cuda`` call it names.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

__all__ = ["DRY_RUN_SPEC", "ENV", "CudaDevice", "StandInCuda", "device"]

ENV = "GPU_SUITE_STAND_IN"
GIB = 1 << 30
#: The dry run's stand-in: a 141 GB device; a trial's peak grows 0.5 GiB per 1K tokens above 20 GiB; Llama trials
#: run out of memory from 64K tokens (the ladder climbs one rung, then stops at its OOM), Qwen3 from 32K (its
#: first rung), so the dry run stays short.
DRY_RUN_SPEC = {"name": "stand-in CUDA device (CPU; no figure is a measurement)", "total_gib": 141.0,
                "base_gib": 20.0, "gib_per_ktok": 0.5, "oom_tokens": {"llama": 65536, "qwen3": 32768}}


class CudaDevice:
    """CUDA device 0: every method is the ``torch.cuda`` call it names."""

    stand_in = False

    def __init__(self) -> None:
        self.torch_device = torch.device("cuda", 0)

    def name(self) -> str:
        return torch.cuda.get_device_name(0)

    def total_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(0).total_memory)

    def cap(self, gib: float) -> None:
        """Allow this process at most ``gib`` GiB (an 80 GB GPU on a larger one)."""
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GIB / self.total_bytes()))

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(0))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(0)

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(0))

    def synchronize(self) -> None:
        torch.cuda.synchronize(0)

    def step(self, family: str, tokens: int) -> None:
        """Called at the start of every timed step of a trial of ``tokens`` tokens: on CUDA the allocator raises
        OOM by itself."""


class StandInCuda(CudaDevice):
    """The fake CUDA of the module docstring (tensors stay on the CPU)."""

    stand_in = True

    def __init__(self, spec: dict[str, Any]) -> None:
        self.torch_device = torch.device("cpu")
        self.spec = spec
        self._cap = float(spec["total_gib"]) * GIB
        self._peak = 0

    def name(self) -> str:
        return str(self.spec["name"])

    def total_bytes(self) -> int:
        return int(float(self.spec["total_gib"]) * GIB)

    def cap(self, gib: float) -> None:
        self._cap = min(self.total_bytes(), gib * GIB)

    def allocated_bytes(self) -> int:
        return int(float(self.spec["base_gib"]) * GIB)

    def reset_peak(self) -> None:
        self._peak = self.allocated_bytes()

    def peak_bytes(self) -> int:
        return self._peak

    def synchronize(self) -> None:
        pass

    def step(self, family: str, tokens: int) -> None:
        """Record the modelled peak of a step of ``tokens`` tokens; raise OOM where told or over the cap."""
        peak = int((float(self.spec["base_gib"]) + float(self.spec["gib_per_ktok"]) * tokens / 1024) * GIB)
        told = (self.spec.get("oom_tokens") or {}).get(family)
        if (told is not None and tokens >= told) or peak > self._cap:
            raise torch.OutOfMemoryError(f"CUDA out of memory (stand-in device): a step of {tokens} tokens "
                                         f"({family}) needs {peak / GIB:.1f} GiB, cap {self._cap / GIB:.1f} GiB")
        self._peak = max(self._peak, peak)


def device() -> CudaDevice | None:
    """The stand-in when ``GPU_SUITE_STAND_IN`` is set, else CUDA device 0 when there is one, else ``None``."""
    spec = os.environ.get(ENV)
    if spec:
        return StandInCuda(json.loads(spec))
    return CudaDevice() if torch.cuda.is_available() else None
