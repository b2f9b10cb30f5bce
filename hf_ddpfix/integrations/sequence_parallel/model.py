"""One sequence-sharded forward of a causal LM: shard the batch (`ops.sequence_parallel.shard_batch`),
run the model on this rank's slice with Ulysses attention active, and return the summed loss of this
rank's tokens for the caller to divide by the global count of valid tokens.

With `model_loss=True` the model computes that sum itself: it is called with `labels` and
`shift_labels` (the labels shifted on the full sequence, this rank's slice) and `num_items_in_batch=1`,
so transformers' `ForCausalLMLoss` (or hf_ddpfix's tiled loss head, when `patch_model_loss` is on the
model: the full `[tokens, vocab]` logits of the shard never exist) returns the token sum. Without it the
logits are taken and `shard_loss_sum` sums them (the same fp32 cross-entropy).

Guarantees (tests/scripts/sp_parity.py, 2 and 4 gloo processes): the sum over the SP group of
`sharded_causal_lm_loss(...) / count` and the summed gradients equal one process on the full sequence to
<= 2e-6 (loss) and 1.2e-6 (gradients) (plain, right-padded, prompt-masked with an all-masked shard, packed
documents, a length not divisible by N, batch 2).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...ops.sequence_parallel.inputs import PACKED_ROWS, shard_batch
from ...ops.sequence_parallel.loss import shard_loss_sum
from .attention import activate_batch, sequence_parallel_batch

__all__ = ["sharded_causal_lm_loss"]


def sharded_causal_lm_loss(model: nn.Module, batch: Mapping[str, Any], *, group: dist.ProcessGroup | None = None,
                           pad_token_id: int = 0, pad_to_multiple: bool = True,
                           keep_active: bool = False, model_loss: bool = False) -> tuple[torch.Tensor, Any]:
    """Forward this rank's slice of `batch` (every rank of `group` holds the same full batch).

    Args:
        model: a causal LM (or a peft model around one) whose attention runs through the wrapped interface
            (`install_ulysses_attention`); it must return `logits`.
        batch: `input_ids` `[B, S]`, `labels` (unshifted; required), optional `attention_mask`, `position_ids`.
        group: the SP group (default: the world).
        keep_active: leave the batch active after the forward (`activate_batch`), so a checkpointed
            backward recomputes the same sharded attention; the caller ends it (`deactivate_batch`).
        model_loss: let the model's own loss (or the tiled loss head patched on it) sum the shard's
            cross-entropy (the model's forward must take transformers' loss keywords); `outputs.logits` is
            then `None` under the tiled loss.

    Returns:
        `(loss_sum, outputs)`: this rank's summed cross-entropy (fp32 scalar, 0 for a shard without a
        valid label) and the model's outputs on the slice.
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if batch.get("labels") is None:
        raise ValueError("sequence parallelism: the batch has no `labels` (the loss is computed per shard)")
    shard = shard_batch(batch["input_ids"], sp_size=n, sp_rank=r, labels=batch["labels"],
                        attention_mask=batch.get("attention_mask"), position_ids=batch.get("position_ids"),
                        pad_token_id=pad_token_id, pad_to_multiple=pad_to_multiple,
                        packed_rows=batch.get(PACKED_ROWS))
    extra = {k: v for k, v in batch.items()
             if k not in ("input_ids", "labels", "attention_mask", "position_ids", PACKED_ROWS)}
    if model_loss:  # the model sums: num_items_in_batch=1 turns ForCausalLMLoss's division into the identity
        target = shard.shift_labels.contiguous()  # ForCausalLMLoss views it flat
        extra.update(labels=target, shift_labels=target, num_items_in_batch=1)
    if keep_active:
        activate_batch(shard.documents, group)
        outputs = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False, **extra)
    else:
        with sequence_parallel_batch(shard.documents, group):
            outputs = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False, **extra)
    assert shard.shift_labels is not None
    if model_loss:
        return outputs.loss, outputs
    return shard_loss_sum(outputs.logits, shard.shift_labels), outputs
