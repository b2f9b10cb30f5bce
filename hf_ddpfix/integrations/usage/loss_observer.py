"""FSDP2's loss observer: under FSDP2 each unit ties in its own forward, so the loss given to backward is read
only to add what it really reaches (a head called in ``compute_loss`` outside the model's forward).

Wired by ``runtime.py`` around ``accelerator.backward`` when the usage tracker runs without ``at_loss`` (FSDP2)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..._compat import is_ddp_sink_node
from ...ops import feature_counts
from ...ops.autograd_reach import reachable_leaf_ids_split
from ...ops.zero_tie import is_zero_tie_node

if TYPE_CHECKING:
    from .step import StepRecord


def observe_loss(loss: Any, step: StepRecord, index: Callable[[], dict[int, int]]) -> float | None:
    """Add to ``step``'s pending usage every watched parameter ``loss`` really reaches (``index()``: tensor id ->
    slot), counted as ``parameter_usage / used_at_loss``: a head called in ``compute_loss``, which
    ``ParameterUsage.finalize`` would otherwise reset to ``None`` (tests/test_fsdp_trainer_zoo.py). Additions only
    (a resharded unit's parameters are not the tensors its graph holds: the forward's prediction covers them).
    Returns the seconds the walk took, or ``None`` when nothing was walked (no pending forward, no graph).
    Guarantees: no tie, no collective, ``loss`` untouched."""
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or step.pending_forwards == 0:
        return None
    t0, ids = time.perf_counter(), index()
    real, _ = reachable_leaf_ids_split([loss], is_zero_tie_node, is_ddp_sink_node)
    added = {ids[i] for i in real if i in ids} - step.pending_used
    if added:
        step.pending_used |= added
        feature_counts.record_amount("parameter_usage", "used_at_loss", len(added))
    return time.perf_counter() - t0
