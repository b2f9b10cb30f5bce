"""The plan: `resolve_plan(facts, config) -> Plan`, every decision for a run with its reason (pure).

`types` holds the types (`RunFacts`, `Decision`, `Plan`, the errors) and imports no rule; the rules, one module
per decision under every engine (`checkpointing`, `usage`, `vision`, `memory`, ...) or per engine-only decision
(`ddp`, `fsdp`, `deepspeed`), import the types; `resolve` calls each rule module once (docs/design.md "The plan").
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
