"""Persistent buffers under accelerate's ``cpu_ram_efficient_loading`` (FSDP2): broadcast, then loaded as stock loads
non-persistent ones.

accelerate 1.15's ``fsdp2_prepare_model`` with ``cpu_ram_efficient_loading`` moves the model to the meta device,
shards it, and ``fsdp2_load_full_state_dict`` broadcasts rank 0's ``state_dict`` into the shards, reading
``.device_mesh`` of every entry: a persistent buffer (Gemma 4's 60 ``layer_scalar``, BART's ``final_logits_bias``) is
a ``state_dict`` entry ``fully_shard`` leaves a plain tensor, so stock fails there (``'Tensor' object has no attribute
'device_mesh'``). Its non-persistent buffers it handles: it copies them before the move to meta and registers them
again afterwards, on the device.

So, before accelerate prepares the model (:func:`keep_persistent_buffers_loadable`): every persistent buffer is
broadcast from rank 0 (where transformers loaded the checkpoint; the other ranks hold meta placeholders under that
setting) and registered again as non-persistent (``register_buffer(..., persistent=False)``, public): accelerate then
carries its value through the preparation as a non-persistent one. Once the model is wrapped (train begin) each is
registered persistent again, with the value it holds, so ``state_dict`` and checkpoints list it as before — as under
``cpu_ram_efficient_loading: false``, where the buffer stays a plain tensor of the wrapped model too.

Guarantees: every rank ends with rank 0's value (one broadcast per buffer, in the same order on every rank: names in
module order); nothing is done outside FSDP2 with ``cpu_ram_efficient_loading`` (or for a 4-bit model, which accelerate
loads another way, or a model already wrapped); persistence restored at train begin or on the stack's exit.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..._compat import fsdp_module_units
from ...ops import feature_counts

__all__ = ["keep_persistent_buffers_loadable", "persistent_buffer_names"]

logger = logging.getLogger("hf_ddpfix")


def persistent_buffer_names(model: nn.Module) -> tuple[str, ...]:
    """The qualified names of ``model``'s persistent buffers (``state_dict`` entries that are no parameter)."""
    keys = set(model.state_dict(keep_vars=True))
    return tuple(n for n, _ in model.named_buffers() if n in keys)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, local = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), local


class _Restore(TrainerCallback):
    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        self.model, self.names, self.done = model, names, False

    def restore(self) -> None:
        if self.done:
            return
        self.done = True
        for name in self.names:
            try:
                owner, local = _owner(self.model, name)
            except AttributeError:  # the model was changed under us: nothing to restore there
                continue
            value = getattr(owner, local, None)
            if isinstance(value, torch.Tensor):
                owner.register_buffer(local, value, persistent=True)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.restore()


def keep_persistent_buffers_loadable(trainer: Any, plugin: Any, stack: ExitStack, log: Any = None) -> int:
    """Before accelerate's FSDP2 preparation of ``trainer.model`` with ``plugin.cpu_ram_efficient_loading``: broadcast
    every persistent buffer from rank 0 and register it non-persistent until train begin (module docstring). Returns
    how many buffers were handled (0: nothing to do). ``log(line)`` reports them (rank 0)."""
    import torch.distributed as dist

    model = trainer.model
    if not getattr(plugin, "cpu_ram_efficient_loading", False) or int(getattr(plugin, "fsdp_version", 1)) != 2:
        return 0
    if fsdp_module_units(model):  # already wrapped: accelerate loads nothing
        return 0
    if any(type(p).__name__ == "Params4bit" for p in model.parameters()):  # accelerate skips that loading path
        return 0
    names = persistent_buffer_names(model)
    if not names:
        return 0
    device = torch.device(trainer.args.device)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for name in names:
        owner, local = _owner(model, name)
        buf = getattr(owner, local)
        value = buf.detach().to(device, copy=True) if rank0 else torch.empty(buf.shape, dtype=buf.dtype, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(value, src=0)
        home = buf.device if buf.device.type != "meta" else device
        owner.register_buffer(local, value.to(home), persistent=False)
    callback = _Restore(model, names)
    trainer.add_callback(callback)
    stack.callback(trainer.remove_callback, callback)
    stack.callback(callback.restore)
    feature_counts.record_amount("fsdp", "persistent_buffers_broadcast", len(names))
    if log is not None:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        log(f"fsdp: {len(names)} persistent buffers ({shown}) broadcast from rank 0 and loaded as non-persistent "
            "through accelerate's cpu_ram_efficient_loading; persistent again at train begin")
    return len(names)
