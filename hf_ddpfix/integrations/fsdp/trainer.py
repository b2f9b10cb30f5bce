"""Appliers for the Trainer's FSDP2 path: what the plan decided, put where accelerate reads it.

- :func:`apply_fsdp_units`: the unit classes handed to accelerate's plugin before ``prepare`` wraps the model
  (``transformer_cls_names_to_wrap``, read by ``fsdp2_prepare_auto_wrap_policy``; accelerate 1.15). Not undone:
  accelerate reads it once, when it wraps, and the wrapped model keeps its units.
- :func:`rescope_on_wrap`: accelerate shards the model inside ``train()``, after the plan attached its
  :class:`~hf_ddpfix.integrations.usage.ParameterUsage`; at ``on_train_begin`` (the model is wrapped by then:
  transformers 5.23 ``_inner_training_loop``) the ties are re-scoped onto the units accelerate really made
  (every ``FSDPModule``: the blocks, the embedding, ``[norm, head]``, the root), so each unit ties what this
  rank did not use in its own forward, before FSDP reshards it.
- :func:`join_tied_holders`: while accelerate wraps the model, every module holding a tied tensor joins the
  group made for the first of them (``_compat.join_shared_holders``; the plan's ``fsdp_shared``).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any

from transformers import TrainerCallback

from ..._compat import fsdp_module_units, fsdp_plugin, join_shared_holders, set_fsdp_wrap_classes
from ...ops import feature_counts
from ..usage import ParameterUsage

__all__ = ["apply_fsdp_units", "join_tied_holders", "rescope_on_wrap"]

logger = logging.getLogger("hf_ddpfix")


def apply_fsdp_units(trainer: Any, classes: tuple[str, ...]) -> bool:
    """Make accelerate's transformer policy wrap exactly ``classes`` (may be empty: embedding, head and root
    units only). Returns False (nothing done) when the trainer has no FSDP plugin."""
    plugin = fsdp_plugin(trainer)
    if plugin is None:
        return False
    set_fsdp_wrap_classes(plugin, classes)
    return True


class _Rescope(TrainerCallback):
    def __init__(self, trainer: Any, usage: ParameterUsage, log: Any) -> None:
        self.trainer, self.usage, self.log = trainer, usage, log

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        units = fsdp_module_units(self.trainer.model)
        if not units:  # not wrapped (accelerate chose another path): the root scope stays
            logger.warning("parameter_usage: the model has no FSDP2 unit at train begin; ties stay on the root")
            return
        self.usage.set_units(units)
        feature_counts.record_amount("fsdp", "units", len(units))
        owned = sum(1 for s in self.usage.scopes if s.slots)
        if self.log is not None:
            self.log(f"fsdp: accelerate made {len(units)} FSDP2 units; parameter_usage ties per unit "
                     f"({owned} hold trainable parameters, {len(self.usage.slots)} tensors watched)")


def rescope_on_wrap(trainer: Any, usage: ParameterUsage, stack: ExitStack, log: Any = None) -> None:
    """At train begin, re-scope ``usage`` onto the FSDP2 units accelerate made; the callback is removed on
    ``stack``'s exit. ``log(line)`` reports the units (rank 0)."""
    callback = _Rescope(trainer, usage, log)
    trainer.add_callback(callback)
    stack.callback(trainer.remove_callback, callback)


class _JoinedReport(TrainerCallback):
    def __init__(self, context: Any, joined: list[tuple[str, ...]], log: Any) -> None:
        self.context, self.joined, self.log = context, joined, log

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.context.__exit__(None, None, None)  # the model is wrapped: fully_shard is torch's own again
        names = [n for group in self.joined for n in group]
        feature_counts.record_amount("fsdp", "tied_holders_joined", len(names))
        if self.log is not None:
            self.log("fsdp: tied tensors kept in one FSDP group each; joined: " + (", ".join(names) or "none"))


def join_tied_holders(trainer: Any, stack: ExitStack, log: Any = None) -> list[tuple[str, ...]]:
    """While ``stack`` is open, accelerate's FSDP2 preparation of ``trainer.model`` puts every module holding a
    tied tensor into one group (``fsdp_shared``); undone at train begin (accelerate has wrapped the model) or on
    ``stack``'s exit, whichever comes first. Returns the list that fills, per widened group, with the names
    of the modules that joined; at train begin (the model is wrapped) ``log(line)`` reports them (rank 0)."""
    context = join_shared_holders(trainer.model)
    joined = stack.enter_context(context)
    callback = _JoinedReport(context, joined, log)
    trainer.add_callback(callback)
    stack.callback(trainer.remove_callback, callback)
    return joined
