"""The plan: `resolve_plan(facts, config) -> Plan`, every decision for a run with its reason (pure).

`types` holds the types (`RunFacts`, `Decision`, `Plan`, the errors) and imports no rule; the rules
(`ddp`, `memory`, `quantized`, `deepspeed`) import the types; `resolve` imports the rules.
"""

from .resolve import resolve_plan
from .types import (
    CheckpointMode,
    Correct,
    Decision,
    ParallelMode,
    PlacementError,
    Plan,
    PlanError,
    QuantStorageError,
    RunFacts,
)

__all__ = [
    "CheckpointMode",
    "Correct",
    "Decision",
    "ParallelMode",
    "PlacementError",
    "Plan",
    "PlanError",
    "QuantStorageError",
    "RunFacts",
    "resolve_plan",
]
