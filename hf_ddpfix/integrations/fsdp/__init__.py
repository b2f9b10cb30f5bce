"""The Trainer's FSDP2 path (accelerate's ``fully_shard`` through ``Trainer.train``): one folder per concept.

- :mod:`.units` — :class:`FsdpFacts`: the block classes the model really has and which of them a rank may
  skip (read by :func:`hf_ddpfix.plan.fsdp.decide_fsdp_units`).
- :mod:`.trainer` — the appliers: the plan's unit classes handed to accelerate's plugin before it wraps, and
  the parameter-usage ties re-scoped onto the units accelerate made once it has wrapped the model.

The pure decisions live in :mod:`hf_ddpfix.plan.fsdp`; plain ``fully_shard`` loops use
:func:`hf_ddpfix.integrations.vision.fsdp_wrap.fsdp_wrap_plan`.
"""

from .trainer import apply_fsdp_units, join_tied_holders, rescope_on_wrap
from .units import FsdpFacts, gather_fsdp_facts, repeated_block_classes

__all__ = ["FsdpFacts", "apply_fsdp_units", "gather_fsdp_facts", "join_tied_holders", "repeated_block_classes", "rescope_on_wrap"]
