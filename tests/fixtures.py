"""Shared test fixtures: tiny random-weight models, LoRA, batches, collators, gloo set-up.

Every test and test script builds its models here (nothing is downloaded; each model builds in < 1 s).
Import it as ``from fixtures import ...``: pytest puts ``tests/`` on ``sys.path`` (conftest.py), and the
scripts under ``tests/scripts`` insert it themselves (``sys.path.insert(0, <tests dir>)``).

- Text: :func:`tiny_llama_config`, :func:`tiny_llama`, :func:`lora`, :func:`padded_collate`,
  :func:`variable_length_ids`.
- VLMs (Qwen family, the stabiliser's adapters): :data:`BUILDERS`, :data:`PATCH_DIM`, :func:`add_lora`,
  :func:`make_batch`. The wider model zoo of the usage tests is ``tests/zoo.py``.
- Processes: :func:`init_gloo`, :func:`teardown`.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# --------------------------------------------------------------------------------------------- text

TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1)


def tiny_llama_config(**overrides: Any) -> Any:
    """A tiny ``LlamaConfig`` (vocab 64, hidden 32, 2 layers, GQA 2:1) with ``overrides`` applied."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **overrides})


def tiny_llama(seed: int = 0, **overrides: Any) -> nn.Module:
    """A ``LlamaForCausalLM`` from :func:`tiny_llama_config`, weights drawn after ``torch.manual_seed(seed)``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides))


def lora(model: nn.Module, targets: Sequence[str] = ("q_proj", "v_proj"), r: int = 2, **kwargs: Any) -> nn.Module:
    """``get_peft_model(model, LoraConfig(r, target_modules=targets, **kwargs))``."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), **kwargs))


def variable_length_ids(n: int, vocab: int = 60, lengths: Sequence[int] = (6, 9, 12, 7), seed: int = 0) -> list[list[int]]:
    """``n`` token-id lists whose lengths cycle through ``lengths`` (variable lengths across batches)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def padded_collate(batch: Sequence[dict[str, Any]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids`` to the longest row; ``attention_mask`` marks real tokens and ``labels``
    are ``-100`` on padding (so the loss counts real tokens only)."""
    rows = [list(b["input_ids"]) for b in batch]
    n = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (n - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


# --------------------------------------------------------------------------------------------- processes


def init_gloo() -> tuple[int, int]:
    """Initialise the default process group on gloo (under torchrun); returns ``(rank, world_size)``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def teardown(*objects: Any) -> None:
    """Drop DDP/FSDP state before destroying the process group (avoids a rare abort at process exit)."""
    for obj in objects:
        del obj
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- VLMs

IMAGE, VIDEO, VSTART, VEND = 250, 251, 252, 253
# cell.py's targets, plus Qwen3-VL's vision MLP / merger names (linear_fc1/2)
LORA_TARGETS = [
    "q_proj",
    "v_proj",
    "qkv",
    "proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "linear_fc1",
    "linear_fc2",
]
SEQ = 16

_TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
    eos_token_id=0,
    bos_token_id=0,
)
_TOKENS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND
)


def build_qwen2_5_vl(seed: int = 0) -> nn.Module:
    """Tiny Qwen2.5-VL (cell.py's config): window attention with one full-attention block."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2_5_VLConfig(
        text_config=_TEXT,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            fullatt_block_indexes=[1],
            window_size=56,
        ),
        **_TOKENS,
    )
    return Qwen2_5_VLForConditionalGeneration(cfg)


def build_qwen2_vl(seed: int = 0) -> nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2VLConfig(
        text_config=_TEXT,
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        **_TOKENS,
    )
    return Qwen2VLForConditionalGeneration(cfg)


def _qwen3_text(moe: bool) -> dict:
    t = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_id=0,
        bos_token_id=0,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
    )
    if moe:
        t.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    return t


_QWEN3_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0],
)


def build_qwen3_vl(seed: int = 0) -> nn.Module | None:
    try:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    except ImportError:
        return None
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(text_config=_qwen3_text(False), vision_config=_QWEN3_VISION, **_TOKENS)
    )


def build_qwen3_vl_moe(seed: int = 0) -> nn.Module | None:
    try:
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    except ImportError:
        return None
    torch.manual_seed(seed)
    return Qwen3VLMoeForConditionalGeneration(
        Qwen3VLMoeConfig(text_config=_qwen3_text(True), vision_config=_QWEN3_VISION, **_TOKENS)
    )


BUILDERS: dict[str, Callable[[int], nn.Module | None]] = {
    "qwen2_vl": build_qwen2_vl,
    "qwen2_5_vl": build_qwen2_5_vl,
    "qwen3_vl": build_qwen3_vl,
    "qwen3_vl_moe": build_qwen3_vl_moe,
}
PATCH_DIM = {"qwen2_vl": 1176, "qwen2_5_vl": 1176, "qwen3_vl": 1536, "qwen3_vl_moe": 1536}  # C*tp*p*p


def add_lora(model: nn.Module, dropout: float = 0.0) -> nn.Module:
    """LoRA on every linear layer, vision tower included (what "all-linear" users do). Random A and B
    (init_lora_weights=False) so every adapter gets a non-zero gradient from the first step."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=LORA_TARGETS, init_lora_weights=False
    )
    return get_peft_model(model, cfg)


def make_batch(has_image: bool, seed: int, patch_dim: int = 1176) -> dict[str, torch.Tensor]:
    """One sample; with an image: a 4x4-patch image -> 4 merged image tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 240, (1, SEQ), generator=g)
    batch: dict[str, torch.Tensor] = {}
    if has_image:
        ids[0, 3] = VSTART
        ids[0, 4:8] = IMAGE
        ids[0, 8] = VEND
        batch["pixel_values"] = torch.randn(16, patch_dim, generator=g)
        batch["image_grid_thw"] = torch.tensor([[1, 4, 4]])
        batch["mm_token_type_ids"] = (ids == IMAGE).long()
    batch["input_ids"] = ids
    batch["labels"] = ids.clone()
    return batch
