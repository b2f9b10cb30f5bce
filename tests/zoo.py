"""The model zoo: tiny random-weight configs of every family hf_ddpfix is tested on (nothing downloaded).

Each :class:`ZooEntry` builds a LoRA model (random A and B, so every adapter gets a non-zero gradient
from the first step) and makes one-sample batches with or without an image, with variable sequence
lengths. ``tests/scripts/usage_zoo.py`` trains them under DDP, ``usage_fsdp.py`` under FSDP2, and
``scripts/supported_models.py`` turns what they test into the README's supported-models table.

What can go unused in a step, per family (the oracle the plan tests use; observed, not predicted):
- VLMs (LoRA on the vision tower too): the tower and projector on a text-only step.
- Mllama (LoRA on the language model only): the cross-attention layers on a text-only step.
- Qwen3-MoE: nothing (fused expert tensors get a gradient whenever any expert gets a token).
- BART with LayerDrop: random encoder/decoder layers, different per rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from fixtures import SMALL_TEXT, qwen_vl
from torch import nn

SEQ = (12, 16)  # sequence lengths alternate between these (variable lengths across steps and ranks)
IMG = 200  # image placeholder token id in every VLM config below (text tokens are drawn below 190)

_LLAMA_TEXT = dict(SMALL_TEXT, max_position_embeddings=512, eos_token_id=0, bos_token_id=0, pad_token_id=0)
_ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class ZooEntry:
    """One family: how to build it, what LoRA targets, how to make a batch.

    Attributes:
        name: family key (``"llama"``, ``"qwen2_5_vl"``...).
        title: the model as the README names it.
        build: ``seed -> HF model`` (random weights from a tiny config).
        lora: extra ``LoraConfig`` kwargs (``target_modules`` / ``target_parameters``).
        batch: ``(has_image, seed, seq_len) -> batch dict`` (one sample, labels included).
        vlm: the model takes images (mixed image / text steps are tested).
        can_go_unused: what the family may leave unused in a step (documentation and plan oracle).
        setup: called on the built model before LoRA (e.g. Mllama's cross-attention gates).
    """

    name: str
    title: str
    build: Callable[[int], nn.Module]
    lora: dict
    batch: Callable[[bool, int, int], dict[str, torch.Tensor]]
    vlm: bool = False
    can_go_unused: str = "nothing"
    setup: Callable[[nn.Module], None] | None = None
    notes: list[str] = field(default_factory=list)

    def model(self, seed: int = 0, save_base_to: str | None = None) -> nn.Module:
        """The LoRA model (random adapters), in train mode. ``save_base_to``: the base model is saved there
        (``save_pretrained``) before the adapters are added (saving draws no random numbers)."""
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        hf = self.build(seed)
        if self.setup is not None:
            self.setup(hf)
        if save_base_to is not None:
            hf.save_pretrained(save_base_to)
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **self.lora)
        return get_peft_model(hf, cfg).train()


def _ids(seed: int, seq: int) -> tuple[torch.Generator, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return g, torch.randint(1, 190, (1, seq), generator=g)


def _text_batch(has_image: bool, seed: int, seq: int) -> dict[str, torch.Tensor]:
    _, ids = _ids(seed, seq)
    return {"input_ids": ids, "labels": ids.clone()}


def _with_image_tokens(ids: torch.Tensor, n: int, start: int = 2) -> torch.Tensor:
    ids = ids.clone()
    ids[0, start : start + n] = IMG
    return ids


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[ids == IMG] = -100
    return labels


# --- text models ------------------------------------------------------------------------------------


def _llama(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_LLAMA_TEXT))


def _qwen3(seed: int) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_LLAMA_TEXT, head_dim=16))


def _qwen3_moe(seed: int) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**_LLAMA_TEXT, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1)
    return Qwen3MoeForCausalLM(cfg)


def _bart(seed: int) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        vocab_size=256, d_model=64, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        encoder_layerdrop=0.4, decoder_layerdrop=0.4, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )
    return BartForConditionalGeneration(cfg)


def _bart_batch(has_image: bool, seed: int, seq: int) -> dict[str, torch.Tensor]:
    g, ids = _ids(seed, seq)
    return {"input_ids": ids, "labels": torch.randint(3, 190, (1, seq // 2), generator=g)}


# --- VLMs -------------------------------------------------------------------------------------------


def _llava(seed: int) -> nn.Module:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    cfg = LlavaConfig(text_config={**_LLAMA_TEXT, "model_type": "llama"}, vision_config=vision,
                      image_token_id=IMG, vision_feature_layer=-1)
    return LlavaForConditionalGeneration(cfg)


def _pixel_batch(n_tokens: int, size: int, extra: Callable[[torch.Generator], dict] | None = None):
    def batch(has_image: bool, seed: int, seq: int) -> dict[str, torch.Tensor]:
        g, ids = _ids(seed, seq)
        out: dict[str, torch.Tensor] = {}
        if has_image:
            ids = _with_image_tokens(ids, n_tokens)
            out["pixel_values"] = torch.randn(1, 3, size, size, generator=g)
            if extra is not None:
                out.update(extra(g))
        out["input_ids"] = ids
        out["labels"] = _labels(ids)
        return out

    return batch


def _gemma3(seed: int) -> nn.Module:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(_LLAMA_TEXT, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=7)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMG,
                       boi_token_index=201, eoi_token_index=202)
    return Gemma3ForConditionalGeneration(cfg)


def _gemma3_batch(has_image: bool, seed: int, seq: int) -> dict[str, torch.Tensor]:
    b = _pixel_batch(4, 28)(has_image, seed, seq)
    b["token_type_ids"] = (b["input_ids"] == IMG).long()
    return b


def _internvl(seed: int) -> nn.Module:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=[28, 28], patch_size=[7, 7])
    text = {**_LLAMA_TEXT, "model_type": "qwen2"}
    cfg = InternVLConfig(vision_config=vision, text_config=text, image_token_id=IMG, image_seq_length=4)
    return InternVLForConditionalGeneration(cfg)


def _mistral3(seed: int) -> nn.Module:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=7, head_dim=16)
    text = {**_LLAMA_TEXT, "model_type": "mistral", "head_dim": 16}
    cfg = Mistral3Config(vision_config=vision, text_config=text, image_token_index=IMG, spatial_merge_size=2,
                         vision_feature_layer=-1)
    return Mistral3ForConditionalGeneration(cfg)


def _mllama(seed: int) -> nn.Module:
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                  attention_heads=2, image_size=28, patch_size=14, max_num_tiles=2, vision_output_dim=64,
                  intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1], [1, 2]])
    text = dict(_LLAMA_TEXT, num_hidden_layers=3, cross_attention_layers=[1])
    cfg = MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMG)
    return MllamaForConditionalGeneration(cfg)


def _mllama_setup(model: nn.Module) -> None:
    """Cross-attention gates start at 0 (tanh(0) = 0: the layers would contribute nothing); open them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "cross_attn_attn_gate" in name or "cross_attn_mlp_gate" in name:
                p.fill_(0.5)


def _mllama_batch(has_image: bool, seed: int, seq: int) -> dict[str, torch.Tensor]:
    g, ids = _ids(seed, seq)
    out: dict[str, torch.Tensor] = {}
    if has_image:
        ids = _with_image_tokens(ids, 1)
        out["pixel_values"] = torch.randn(1, 1, 2, 3, 28, 28, generator=g)
        out["aspect_ratio_ids"] = torch.tensor([[2]])
        out["aspect_ratio_mask"] = torch.tensor([[[1, 1]]])
        mask = torch.zeros(1, seq, 1, 2, dtype=torch.long)
        mask[:, 2:, :, :] = 1
        out["cross_attention_mask"] = mask
    out["input_ids"] = ids
    out["labels"] = _labels(ids)
    return out


# --- Qwen VLMs (grid-based towers) ------------------------------------------------------------------

_QTOK = dict(image_token_id=IMG, video_token_id=201, vision_start_token_id=202, vision_end_token_id=203)


def _qwen_vl(name: str) -> Callable[[int], nn.Module]:
    """fixtures' Qwen-VL config for ``name`` with this zoo's text config and token ids."""
    return functools.partial(qwen_vl, name, text=_LLAMA_TEXT, tokens=_QTOK)


def _qwen_batch(patch_dim: int):
    def batch(has_image: bool, seed: int, seq: int) -> dict[str, torch.Tensor]:
        g, ids = _ids(seed, seq)
        out: dict[str, torch.Tensor] = {}
        if has_image:  # a 4x4-patch image -> 4 merged tokens
            ids = ids.clone()
            ids[0, 2] = 202
            ids[0, 3:7] = IMG
            ids[0, 7] = 203
            out["pixel_values"] = torch.randn(16, patch_dim, generator=g)
            out["image_grid_thw"] = torch.tensor([[1, 4, 4]])
            out["mm_token_type_ids"] = (ids == IMG).long()
        out["input_ids"] = ids
        out["labels"] = _labels(ids)
        return out

    return batch


_VLM_LORA = dict(target_modules=_ATTN_MLP + ["qkv", "proj", "fc1", "fc2", "linear_fc1", "linear_fc2",
                                              "out_proj", "linear_1", "linear_2"])
_VISION_UNUSED = "vision tower and projector on a text-only step"

ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry("llama", "Llama 2/3", _llama, dict(target_modules=_ATTN_MLP), _text_batch),
        ZooEntry("qwen3", "Qwen3", _qwen3, dict(target_modules=_ATTN_MLP), _text_batch),
        ZooEntry("qwen3_moe", "Qwen3-MoE (LoRA on the fused expert tensors)", _qwen3_moe,
                 dict(target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]), _text_batch,
                 can_go_unused="nothing: fused expert tensors get a gradient whenever any expert gets a token"),
        ZooEntry("bart_layerdrop", "BART with encoder/decoder LayerDrop", _bart,
                 dict(target_modules=["q_proj", "v_proj", "fc1", "fc2", "lm_head"]), _bart_batch,
                 can_go_unused="random encoder/decoder layers (LayerDrop), different per rank"),
        ZooEntry("mllama", "Llama 3.2 Vision (Mllama), LoRA on the language model", _mllama,
                 dict(target_modules=r".*language_model.*\.(q_proj|v_proj)"), _mllama_batch, vlm=True,
                 can_go_unused="cross-attention layers on a text-only step", setup=_mllama_setup),
        ZooEntry("gemma3", "Gemma 3", _gemma3, _VLM_LORA, _gemma3_batch, vlm=True,
                 can_go_unused=_VISION_UNUSED + "; SigLIP's pooling head on every step (it runs, its output "
                 "never reaches the loss)"),
        ZooEntry("llava", "LLaVA", _llava, _VLM_LORA, _pixel_batch(4, 28), vlm=True, can_go_unused=_VISION_UNUSED),
        ZooEntry("internvl", "InternVL", _internvl, _VLM_LORA, _pixel_batch(4, 28), vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("mistral3", "Mistral 3 (Pixtral tower)", _mistral3, _VLM_LORA,
                 _pixel_batch(4, 28, lambda g: {"image_sizes": torch.tensor([[28, 28]])}), vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("qwen2_vl", "Qwen2-VL", _qwen_vl("qwen2_vl"), _VLM_LORA, _qwen_batch(1176), vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("qwen2_5_vl", "Qwen2.5-VL", _qwen_vl("qwen2_5_vl"), _VLM_LORA, _qwen_batch(1176), vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("qwen3_vl", "Qwen3-VL", _qwen_vl("qwen3_vl"), _VLM_LORA, _qwen_batch(1536), vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("qwen3_vl_moe", "Qwen3-VL-MoE", _qwen_vl("qwen3_vl_moe"), _VLM_LORA, _qwen_batch(1536), vlm=True,
                 can_go_unused=_VISION_UNUSED),
    ]
}


def seq_len(step: int, micro: int, rank: int) -> int:
    """Variable sequence lengths: differ across steps, micro-batches and ranks."""
    return SEQ[(step + micro + rank) % 2]


# --- VLMs with no hand-written hf_ddpfix family (the ZeRO dummy is built from their config) ----------


def _idefics3(seed: int, smol: bool = False) -> nn.Module:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7)
    config_cls, model_cls = (SmolVLMConfig, SmolVLMForConditionalGeneration) if smol else (
        Idefics3Config, Idefics3ForConditionalGeneration)
    cfg = config_cls(vision_config=vision, text_config={**_LLAMA_TEXT, "model_type": "llama"}, scale_factor=2,
                     image_token_id=IMG)
    return model_cls(cfg)


def _paligemma(seed: int) -> nn.Module:
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=7, projection_dim=64)
    text = dict(_LLAMA_TEXT, model_type="gemma", head_dim=16)
    return PaliGemmaForConditionalGeneration(PaliGemmaConfig(vision_config=vision, text_config=text,
                                                             image_token_index=IMG, projection_dim=64))


def _idefics3_batch(has_image: bool, seed: int, seq: int) -> dict[str, torch.Tensor]:
    """One 28x28 image -> 16 patches -> 4 tokens after the pixel shuffle (scale 2); ``[1, 1, 3, 28, 28]``."""
    b = _pixel_batch(4, 28)(has_image, seed, seq)
    if "pixel_values" in b:
        b["pixel_values"] = b["pixel_values"][:, None]
    return b


def _paligemma_batch(has_image: bool, seed: int, seq: int) -> dict[str, torch.Tensor]:
    """16 image tokens (28 / 7 squared); ``token_type_ids`` 0 on the image and prefix (no labels there)."""
    b = _pixel_batch(16, 28)(has_image, seed, seq + (8 if has_image else 0))
    b["token_type_ids"] = torch.ones_like(b["input_ids"])
    b["token_type_ids"][b["input_ids"] == IMG] = 0
    return b


#: VLMs outside the hand-written family table, for the ZeRO "from config" dummy (not in :data:`ZOO`, whose
#: every entry the DDP / FSDP zoo scripts train).
ZERO_DISCOVERED: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry("idefics3", "Idefics3", _idefics3, _VLM_LORA, _idefics3_batch, vlm=True, can_go_unused=_VISION_UNUSED),
        ZooEntry("smolvlm", "SmolVLM", functools.partial(_idefics3, smol=True), _VLM_LORA, _idefics3_batch, vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("paligemma", "PaliGemma", _paligemma, _VLM_LORA, _paligemma_batch, vlm=True,
                 can_go_unused=_VISION_UNUSED),
    ]
}


# --- VLMs loaded with from_pretrained under ZeRO-3 (zero.Init) in tests/scripts/zero3_loaded.py -------

_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=2, image_size=28, patch_size=7)
_COHERE2 = dict(_LLAMA_TEXT, model_type="cohere2", head_dim=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"])


def _aya_vision(seed: int) -> nn.Module:
    """SigLIP tower (16 patches), pixel-shuffle projector (downsample 2: 4 tokens), Cohere2 LM."""
    from transformers import AyaVisionConfig, AyaVisionForConditionalGeneration

    return AyaVisionForConditionalGeneration(AyaVisionConfig(
        vision_config=_SIGLIP, text_config=_COHERE2, downsample_factor=2, image_token_index=IMG, vision_feature_layer=-1))


def _cohere2_vision(seed: int) -> nn.Module:
    """SigLIP tower, pixel-shuffle + SwiGLU projector (4 tokens), Cohere2 LM."""
    from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration

    return Cohere2VisionForConditionalGeneration(Cohere2VisionConfig(
        vision_config=_SIGLIP, text_config=_COHERE2, downsample_factor=2, image_token_id=IMG))


def _vipllava(seed: int) -> nn.Module:
    """CLIP tower (2x2 patches, CLS dropped: 4 tokens), projector over two hidden layers, Llama LM."""
    from transformers import VipLlavaConfig, VipLlavaForConditionalGeneration

    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    return VipLlavaForConditionalGeneration(VipLlavaConfig(
        vision_config=vision, text_config={**_LLAMA_TEXT, "model_type": "llama"}, image_token_index=IMG,
        vision_feature_layers=[-2, -1]))


def _idefics2(seed: int) -> nn.Module:
    """Idefics2: SigLIP-like tower, a perceiver resampler connector (4 latents -> 4 image tokens), Mistral text;
    ``_no_split_modules`` names attention / MLP classes of the tower and the connector."""
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7)
    perceiver = dict(hidden_size=64, resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2,
                     resampler_head_dim=16, num_key_value_heads=2)
    cfg = Idefics2Config(vision_config=vision, perceiver_config=perceiver, image_token_id=IMG,
                         text_config={**_LLAMA_TEXT, "model_type": "mistral"})
    return Idefics2ForConditionalGeneration(cfg)


#: VLMs no other test names, loaded the way users load a checkpoint (``from_pretrained`` under a ZeRO-3
#: config, i.e. built partitioned by ``zero.Init``); their dummy image is discovered from the config.
ZERO_LOADED: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry("aya_vision", "Aya Vision", _aya_vision, _VLM_LORA, _pixel_batch(4, 28), vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("cohere2_vision", "Command A Vision (Cohere2-Vision)", _cohere2_vision, _VLM_LORA,
                 _pixel_batch(4, 28), vlm=True, can_go_unused=_VISION_UNUSED),
        ZooEntry("vipllava", "VipLLaVA", _vipllava, _VLM_LORA, _pixel_batch(4, 28), vlm=True,
                 can_go_unused=_VISION_UNUSED),
    ]
}


_CLIP14 = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)


def _llava_next(seed: int) -> nn.Module:
    """LLaVA-NeXT: any-resolution tiles (one 28x28 grid pinpoint: base + 1 tile of 2x2 patches), an
    ``image_newline`` parameter per row of the tile grid: 4 + 2 x (2 + 1) = 10 image tokens."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    return LlavaNextForConditionalGeneration(LlavaNextConfig(
        vision_config=_CLIP14, text_config={**_LLAMA_TEXT, "model_type": "llama"}, image_token_index=IMG,
        image_grid_pinpoints=[[28, 28]], vision_feature_layer=-1))


def _llava_onevision(seed: int) -> nn.Module:
    """LLaVA-OneVision: any-resolution base image + one 28x28 tile of 2x2 patches (CLS dropped), an
    ``image_newline`` per row, Qwen2 text: 10 image tokens, as :func:`_llava_next_batch` gives."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    return LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(
        vision_config=_CLIP14, text_config={**_LLAMA_TEXT, "model_type": "qwen2"}, image_token_index=IMG,
        image_grid_pinpoints=[[28, 28]], vision_feature_layer=-1, vision_feature_select_strategy="default"))


def _llava_next_batch(has_image: bool, seed: int, seq: int) -> dict[str, torch.Tensor]:
    """10 image tokens; ``pixel_values`` ``[1, 2 tiles, 3, 28, 28]`` and ``image_sizes``."""
    b = _pixel_batch(10, 28, lambda g: {"image_sizes": torch.tensor([[28, 28]])})(has_image, seed, seq + 4)
    if "pixel_values" in b:
        b["pixel_values"] = torch.stack([b["pixel_values"][0], b["pixel_values"][0].flip(-1)])[None]
    return b


def _got_ocr2(seed: int) -> nn.Module:
    """GOT-OCR 2: a SAM-style windowed ViT (64x64 image, 16-pixel patches, one global-attention layer), a
    convolutional projector down to 1 image token, Qwen2 text."""
    from transformers import GotOcr2Config, GotOcr2ForConditionalGeneration

    vision = dict(hidden_size=32, output_channels=32, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=16, mlp_dim=64, window_size=2, global_attn_indexes=[1])
    return GotOcr2ForConditionalGeneration(GotOcr2Config(
        vision_config=vision, text_config={**_LLAMA_TEXT, "model_type": "qwen2"}, image_token_index=IMG,
        image_seq_length=1))


def _janus(seed: int) -> nn.Module:
    """Janus: a SigLIP-like understanding tower (``vision_model``) and ``aligner``; a VQ-VAE (``vqmodel``) and
    a ``generation_aligner`` / ``generation_head`` for image generation, which a captioning forward never runs
    (their LoRA tensors are unused on every rank, every step); Llama text. 16 image tokens."""
    from transformers import JanusConfig, JanusForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=7,
                  projection_dim=64, num_image_tokens=16)
    vq = dict(embed_dim=8, num_embeddings=32, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
              num_res_blocks=1, num_patches=4, projection_dim=64, image_token_embed_dim=64)
    return JanusForConditionalGeneration(JanusConfig(
        vision_config=vision, vq_config=vq, text_config={**_LLAMA_TEXT, "model_type": "llama"}, image_token_id=IMG))


def _janus_batch(has_image: bool, seed: int, seq: int) -> dict[str, torch.Tensor]:
    return _pixel_batch(16, 28)(has_image, seed, seq + 16)


def _glm4v(seed: int) -> nn.Module:
    """GLM-4V (issue 45): a Qwen2-VL-like tower (patch rows + ``image_grid_thw``, 2x2 merge) no registry entry names;
    its dummy is found by structure (hf_ddpfix/integrations/vision/families.py ``_discover_family``)."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                 "partial_rotary_factor": 0.5})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, image_size=28, in_channels=3)
    cfg = Glm4vConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=201,
                      image_start_token_id=202, image_end_token_id=203, video_start_token_id=204, video_end_token_id=205)
    return Glm4vForConditionalGeneration(cfg)


#: VLMs no DDP / ZeRO test trains: the FSDP2 Trainer test checks the class of fix on families it was not built on
#: (LLaVA-NeXT, GOT-OCR 2 and Janus: no other test in the repository names them).
MORE_VLMS: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry("aya_vision", "Aya Vision", _aya_vision, _VLM_LORA, _pixel_batch(4, 28), vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("idefics2", "Idefics2", _idefics2, _VLM_LORA, _idefics3_batch, vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("llava_next", "LLaVA-NeXT", _llava_next, _VLM_LORA, _llava_next_batch, vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("llava_onevision", "LLaVA-OneVision", _llava_onevision, _VLM_LORA, _llava_next_batch, vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("got_ocr2", "GOT-OCR 2", _got_ocr2, _VLM_LORA, _pixel_batch(1, 64), vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("glm4v", "GLM-4V (a dummy found by structure)", _glm4v, _VLM_LORA, _qwen_batch(1176), vlm=True,
                 can_go_unused=_VISION_UNUSED),
        ZooEntry("janus", "Janus", _janus, _VLM_LORA, _janus_batch, vlm=True,
                 can_go_unused=_VISION_UNUSED + "; the generation aligner's LoRA on every step (image generation "
                 "only)"),
    ]
}


def _opt_layerdrop(seed: int) -> nn.Module:
    """OPT (decoder-only, tied embedding) with LayerDrop 0.4 over 4 decoder layers."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=256, hidden_size=64, num_hidden_layers=4, ffn_dim=128, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=64, layerdrop=0.4, dropout=0.0,
                    attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return OPTForCausalLM(cfg)


#: text models no DDP test trains: the FSDP2 Trainer test's LayerDrop family (BART, the zoo's own, fails in stock
#: accelerate 1.15 + torch 2.13's FSDP2 preparation before any step: docs/fsdp.md)
MORE_TEXT: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry("opt_layerdrop", "OPT with LayerDrop", _opt_layerdrop,
                 dict(target_modules=["q_proj", "v_proj", "fc1", "fc2"]), _text_batch,
                 can_go_unused="random decoder layers (LayerDrop), different per rank"),
    ]
}
