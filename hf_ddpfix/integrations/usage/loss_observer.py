"""FSDP2's loss observer: under FSDP2 each unit ties in its own forward, so the loss given to backward is read
to add what it really reaches (a head called in ``compute_loss`` outside the model's forward), and to move to the
loss any unit's ties it does not reach (a loss built from another output than the one tied).

Wired by ``runtime/attach.py`` around ``accelerator.backward`` when the usage tracker runs without ``at_loss`` (FSDP2).

Why the move (TRL 1.16's ``SFTTrainer`` on a VLM with image and text-only ranks, docs/fsdp.md "Trainers"): TRL's
fused LM head returns ``loss`` and ``log_probs`` and SFTTrainer back-propagates ``-log_probs``; the text-only rank
tied the vision tower's LoRA (folded into the root unit) into ``loss``, the tie never reached backward, and that
rank's root reduce-scatter lacked the gradients the image rank had: a gloo size mismatch or a hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..._compat import is_ddp_sink_node
from ...ops import feature_counts
from ...ops.autograd_reach import reachable_leaf_ids_split
from ...ops.zero_tie import ZeroTie, is_zero_tie_node
from .step import StepRecord

__all__ = ["observe_loss"]


def observe_loss(loss: Any, step: StepRecord, index: Callable[[], dict[int, int]]) -> tuple[float | None, Any]:
    """Read ``loss`` before backward; returns ``(seconds walked or None, the loss to back-propagate)``.

    - Adds to ``step``'s pending usage every watched parameter ``loss`` really reaches (``index()``: tensor id ->
      slot), counted as ``parameter_usage / used_at_loss``: a head called in ``compute_loss``, which
      ``ParameterUsage.finalize`` would otherwise reset to ``None`` (tests/test_fsdp_trainer_zoo.py). Additions
      only (a resharded unit's parameters are not the tensors its graph holds: the forward's prediction covers them).
    - Every pending tie of ``step.unit_ties`` whose node ``loss`` does not reach, made in a forward whose graph ``loss`` does
      reach (``loss`` reaches one of its output tensors), is tied into the loss instead (exact-zero gradients for the
      same tensors, a bitwise copy of ``loss``), counted as ``parameter_usage / ties_moved_to_loss``: so the rank
      reduce-scatters the same gradients as a rank that used them. A forward the loss does not reach at all keeps
      its ties unreached. ``step.unit_ties`` is emptied (and with the step, at finalize).
    No collective; ``loss`` is returned as is unless a tie moved."""
    pending, step.unit_ties.pending = step.unit_ties.pending, []
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or (step.pending_forwards == 0 and not pending):
        return None, loss
    t0, ids, nodes = time.perf_counter(), index(), set()
    real, _ = reachable_leaf_ids_split([loss], is_zero_tie_node, is_ddp_sink_node, real_nodes=nodes, side_nodes=nodes)
    added = {ids[i] for i in real if i in ids} - step.pending_used
    if added:
        step.pending_used |= added
        feature_counts.record_amount("parameter_usage", "used_at_loss", len(added))
    moved = [e for node, extras, witness in pending if node not in nodes and witness & nodes for e in extras]
    if moved:
        loss = ZeroTie.tie(loss, moved)
        feature_counts.record_amount("parameter_usage", "ties_moved_to_loss", len(moved))
    return time.perf_counter() - t0, loss
