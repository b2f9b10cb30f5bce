"""Sequence parallelism, pure torch: Ulysses all-to-all attention, sharding a batch with what must be
computed on the full sequence, and the token-exact loss."""

from .inputs import IGNORE_INDEX, SequenceShard, attention_mask_from_documents, document_ids, shard_batch
from .loss import ddp_loss_scale, shard_loss_rows, shard_loss_sum, valid_target_count
from .multimodal import LanguageModelShard, language_model_documents, shard_language_model_inputs
from .ulysses import heads_to_sequence, kv_replication, sequence_to_heads, ulysses_attention

__all__ = ["IGNORE_INDEX", "LanguageModelShard", "SequenceShard", "attention_mask_from_documents", "ddp_loss_scale",
           "document_ids", "heads_to_sequence", "kv_replication", "language_model_documents", "sequence_to_heads",
           "shard_batch", "shard_language_model_inputs", "shard_loss_rows", "shard_loss_sum", "ulysses_attention",
           "valid_target_count"]
