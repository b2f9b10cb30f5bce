"""What the sequence-parallel plan needs to know about a run, read from the model and the Trainer
(read-only): the size asked for and where, the attention implementation, the head counts, and the
accelerate `ParallelismConfig` when one is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..._compat import (
    attn_implementation,
    model_attn_implementation,
    parallelism_config_available,
    parallelism_sp_settings,
)
from .vision import vision_sequence_parallel_support

__all__ = ["SequenceParallelFacts", "gather_sequence_parallel_facts"]


@dataclass(frozen=True)
class SequenceParallelFacts:
    """Attributes:
        attn_implementation: the text model's `config._attn_implementation` ("sdpa", "eager", ...), or None.
        num_heads / num_kv_heads: the text model's attention heads, None when the config does not say.
        parallelism_sp_size: `TrainingArguments.parallelism_config.sp_size` (None: no parallelism config).
        parallelism_sp_backend: its `sp_backend` ("deepspeed" is DeepSpeed's own Ulysses engine).
        parallelism_sp_attn: its `sp_handler.sp_attn_implementation` (the attention DeepSpeed's engine wraps).
        parallelism_config_available: the installed accelerate / transformers take
            `TrainingArguments(parallelism_config=ParallelismConfig(sp_size=N))` (accelerate >= 1.12).
        vision_family: a VLM whose text decoder hf_ddpfix shards after the image merge (e.g. "qwen2_5_vl").
        vision_refusal: why a VLM cannot be sharded (`vision.vision_sequence_parallel_support`), else None.
    """

    attn_implementation: str | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    parallelism_sp_size: int | None = None
    parallelism_sp_backend: str | None = None
    parallelism_sp_attn: str | None = None
    parallelism_config_available: bool = True
    vision_family: str | None = None
    vision_refusal: str | None = None


def _text_config(model: nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    for key in ("text_config", "language_config"):
        sub = getattr(cfg, key, None)
        if sub is not None:
            return sub
    return cfg


def gather_sequence_parallel_facts(trainer: Any, model: nn.Module) -> SequenceParallelFacts:
    cfg = _text_config(model)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    impl = attn_implementation(cfg) or model_attn_implementation(model)
    sp, backend, attn = parallelism_sp_settings(trainer)
    family, refusal = vision_sequence_parallel_support(model)
    return SequenceParallelFacts(
        vision_family=family.name if family is not None else None, vision_refusal=refusal or None,
        attn_implementation=impl, num_heads=heads, num_kv_heads=kv, parallelism_sp_size=sp,
        parallelism_sp_backend=backend, parallelism_sp_attn=attn,
        parallelism_config_available=parallelism_config_available(),
    )
