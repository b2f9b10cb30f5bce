"""Sequence parallelism glue for transformers: Ulysses attention through the attention interface, and a
sequence-sharded causal-LM forward."""

from .attention import FEATURE, install_ulysses_attention, sequence_parallel_batch
from .model import sharded_causal_lm_loss

__all__ = ["FEATURE", "install_ulysses_attention", "sequence_parallel_batch", "sharded_causal_lm_loss"]
