"""Token-exact loss for sequence parallelism: every rank sums the cross-entropy of its own tokens and
divides by one global count of valid tokens, so the sum over the SP group (and over data-parallel groups
and gradient-accumulation micro-batches) is the token mean one process computes on the whole batch.

The count is known from the batch before the step (like the Trainer's `num_items_in_batch`): no host sync.

Guarantees (tests/test_sequence_parallel.py): a shard whose labels are all -100 contributes exactly 0
(never NaN); `sum over shards of shard_loss_sum(...) / count` equals the single-process token mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .inputs import IGNORE_INDEX

__all__ = ["ddp_loss_scale", "shard_loss_rows", "shard_loss_sum", "valid_target_count"]


def valid_target_count(labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Number of tokens that carry a loss in unshifted `labels` `[B, S]` (position t predicts labels[t+1])."""
    target = labels[:, 1:] != IGNORE_INDEX
    if attention_mask is not None:
        target = target & (attention_mask[:, 1:] != 0)
    return target.sum()


def shard_loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) cross-entropy of a shard: `logits` `[B, s, V]`, `shift_labels` `[B, s]`
    (already shifted on the full sequence). Computed in fp32; 0 when no label is valid."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(logits.device),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def shard_loss_rows(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """`[B]` summed cross-entropy of each row of a shard (fp32; 0 for a row without a valid label):
    `logits` `[B, s, V]`, `shift_labels` `[B, s]` already shifted on the full sequence."""
    per_token = F.cross_entropy(logits.float().transpose(1, 2), shift_labels.to(logits.device),
                                ignore_index=IGNORE_INDEX, reduction="none")
    return per_token.sum(1)


def ddp_loss_scale(world_size: int) -> float:
    """The factor the per-rank loss is multiplied by before backward under DDP.

    DDP averages gradients over all `world_size` ranks; the exact gradient is the *sum* of every rank's
    gradient of its own `shard_loss_sum / global_count` (each SP rank holds different tokens, each DP group
    different samples). Multiplying by `world_size` turns DDP's mean into that sum.
    """
    return float(world_size)
