"""Stock's blocking activation offload as a ``pack_scope`` provider (``SaveOnCpuScope``).

The fallback of ``ops/offload/offload.py``'s asynchronous ``ActivationOffload`` on accelerators that path does
not support (MPS, XPU): the same hooks and copies transformers installs for ``offload=True``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["SaveOnCpuScope"]


class SaveOnCpuScope:
    """Stock's offload as a ``pack_scope`` provider: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
    around each checkpoint call, exactly what transformers' ``activation_checkpointing_kwargs={"offload":
    True}`` installs (transformers 5.23 ``_activation_checkpointing_enable``). Used on accelerators the
    asynchronous path does not support (MPS, XPU) so a run keeps the memory stock's offload freed.

    Args:
        device_type: the accelerator type (``"mps"``, ``"xpu"``, ...) the saved tensors come from.

    Guarantees: the same hooks and copies as stock (blocking); no pool, no streams.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def pack_scope(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=self.device_type)
