"""The Trainer's FSDP2 path (accelerate's ``fully_shard`` through ``Trainer.train``): one folder per concept.

- :mod:`.units` — :class:`FsdpFacts`: the block classes the model really has and which of them a rank may
  skip (read by :func:`hf_ddpfix.plan.fsdp.decide_fsdp_units`); :func:`.units.unit_classes`, the one choice of
  unit classes, and its view for plain ``fully_shard`` loops (:func:`.units.fsdp_wrap_plan`).
- :mod:`.wrap` — the subtrees a rank may skip (so that ranks with and without images, or LayerDrop, or
  cross-attention, issue the same collectives) and LayerDrop stacks.
- :mod:`.trainer` — the appliers: the plan's unit classes handed to accelerate's plugin before it wraps, and
  the parameter-usage ties re-scoped onto the units accelerate made once it has wrapped the model.

The pure decisions live in :mod:`hf_ddpfix.plan.fsdp`.
"""

from .trainer import apply_fsdp_units, join_tied_holders, rescope_on_wrap
from .units import FsdpFacts, fsdp_facts, fsdp_wrap_plan, gather_fsdp_facts, repeated_block_classes
from .wrap import layerdrop_stacks, skippable_subtrees

__all__ = ["FsdpFacts", "apply_fsdp_units", "fsdp_facts", "fsdp_wrap_plan", "gather_fsdp_facts", "join_tied_holders", "layerdrop_stacks",
           "repeated_block_classes", "rescope_on_wrap", "skippable_subtrees"]
