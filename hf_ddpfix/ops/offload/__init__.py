"""Activation offload: checkpoint inputs moved to host memory between forward and backward.

One concept, one folder (pure torch, like the rest of ``ops/``):

- :mod:`.offload`: ``ActivationOffload``, the saved-tensor hook pair and a step's bookkeeping;
  ``SaveOnCpuScope``, stock's blocking offload for accelerators the asynchronous path does not support.
- :mod:`.policy`: which storages move and whether a step copies at all.
- :mod:`.transfer`: one storage's copy out and back (side streams, events, host buffers).
- :mod:`.host_pool`: the bounded (pinned) host pool the copies land in.
- :mod:`.host_memory`: what the host can spare (physical / available memory, the default cap).
- :mod:`.stats`: ``OffloadStats``, the per-step counters.
- :mod:`.budget`: ``plan_offload_budget``, the pre-flight device/host budget (pure arithmetic).

The names below are the folder's public API; the modules' other names are internal.
"""

from .budget import OffloadBudget, OffloadBudgetError, max_tokens, plan_offload_budget
from .host_memory import DEFAULT_HOST_FRACTION, default_max_bytes, host_available_bytes
from .host_pool import HostPool, HostPoolStats
from .offload import ActivationOffload
from .policy import (
    DEFAULT_MIN_BYTES,
    DEFAULT_MIN_LAYER_BYTES,
    DEFAULT_PRESSURE_FRACTION,
    accelerator_available,
)
from .save_on_cpu import SaveOnCpuScope
from .stats import OffloadStats

__all__ = [
    "DEFAULT_HOST_FRACTION",
    "DEFAULT_MIN_BYTES",
    "DEFAULT_MIN_LAYER_BYTES",
    "DEFAULT_PRESSURE_FRACTION",
    "ActivationOffload",
    "HostPool",
    "HostPoolStats",
    "OffloadBudget",
    "OffloadBudgetError",
    "OffloadStats",
    "SaveOnCpuScope",
    "accelerator_available",
    "default_max_bytes",
    "host_available_bytes",
    "max_tokens",
    "plan_offload_budget",
]
