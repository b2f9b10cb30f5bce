"""accelerate's FSDP2 plugin as the Trainer holds it: which wrap policy it runs and which classes it wraps.

Read against accelerate 1.15 (``utils/fsdp_utils.py``: ``fsdp2_prepare_model``,
``fsdp2_prepare_auto_wrap_policy``; ``utils/dataclasses.py``: ``FullyShardedDataParallelPlugin``):

- the plugin lives at ``trainer.accelerator.state.fsdp_plugin`` from ``Trainer.__init__`` on; the model is
  wrapped later, inside ``train()`` (or the first ``evaluate()``), by ``accelerator.prepare``;
- ``auto_wrap_policy`` is torch's ``transformer_auto_wrap_policy`` / ``size_based_auto_wrap_policy`` function
  (a ``functools.partial`` of it once ``set_auto_wrap_policy`` ran) or ``None`` (no wrap);
- under the transformer policy, ``fsdp2_prepare_auto_wrap_policy`` wraps every module whose class is named in
  ``plugin.transformer_cls_names_to_wrap`` (``None`` until prepare fills it from ``_no_split_modules``; set from
  ``fsdp_transformer_layer_cls_to_wrap`` / ``FSDP_TRANSFORMER_CLS_TO_WRAP`` by the user), and raises
  ``ValueError("Could not find the transformer layer class X in the model.")`` for a name the model lacks;
- it then carves the input embedding (untied) and ``[final norm, output embedding]`` into units of their own and
  shards the root last; every unit is then an instance of ``torch.distributed.fsdp.FSDPModule``.

Fallbacks: no plugin (not an FSDP run) → ``None`` / nothing changed.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["fsdp_module_units", "fsdp_plugin", "fsdp_wrap_classes", "fsdp_wrap_policy", "set_fsdp_wrap_classes"]

_OURS = "_hf_ddpfix_wrap_classes"  # the class names hf_ddpfix set on the plugin (so they are not "the user's")


def fsdp_plugin(trainer: Any) -> Any | None:
    """The Trainer's ``FullyShardedDataParallelPlugin``, or ``None`` (not an FSDP run)."""
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    return getattr(state, "fsdp_plugin", None)


def fsdp_wrap_policy(plugin: Any) -> str:
    """``"transformer_based_wrap"``, ``"size_based_wrap"``, ``"no_wrap"`` or the policy's own name."""
    import functools

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    fn = getattr(plugin, "auto_wrap_policy", None)
    if isinstance(fn, functools.partial):
        fn = fn.func
    if fn is None:
        return "no_wrap"
    if fn is transformer_auto_wrap_policy:
        return "transformer_based_wrap"
    if fn is size_based_auto_wrap_policy:
        return "size_based_wrap"
    return getattr(fn, "__name__", type(fn).__name__)


def fsdp_wrap_classes(plugin: Any) -> tuple[tuple[str, ...] | None, bool]:
    """(the class names the plugin will wrap, or ``None`` when prepare will take ``_no_split_modules``;
    whether hf_ddpfix set them). Names the user gave (``fsdp_transformer_layer_cls_to_wrap``) come back with
    ``False``; after accelerate's prepare filled them in from ``_no_split_modules`` they read as the user's
    too, but the model is wrapped by then and prepare does not wrap it again."""
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if names is None:
        return None, False
    ours = getattr(plugin, _OURS, None)
    return tuple(names), ours is not None and tuple(ours) == tuple(names)


def set_fsdp_wrap_classes(plugin: Any, names: tuple[str, ...]) -> None:
    """Make accelerate's transformer policy wrap exactly the modules of these classes (before prepare)."""
    plugin.transformer_cls_names_to_wrap = list(names)
    setattr(plugin, _OURS, tuple(names))


def fsdp_module_units(model: nn.Module) -> list[nn.Module]:
    """Every FSDP2 unit in ``model`` (modules ``fully_shard`` was applied to, the root included), in
    ``named_modules`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]
