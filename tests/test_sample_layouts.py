"""Companion inputs of the structural batch builder and the config gaps of the shrinker (issue 45).

One fixed family per class of failure, built tiny from its default config by the rehearsal's checked shrinker:
``sample_batch`` must give the companion input the family's ``forward`` needs beside the text / pixels, and the
model must run forward on it with a finite loss.

- config gap: Step3p7's default config sets no ``sliding_window`` while its model builds a sliding mask
  (:func:`~hf_ddpfix.rehearse.shrink_check.give_unset_field`);
- a box per token: UDOP's ``bbox``;
- an image position mask with its placeholder tokens: Kosmos-2's ``image_embeds_position_mask``;
- a per-image cross-attention mask: Idefics' ``image_attention_mask``;
- flattened patch rows with their ids and patch mask: Pix2Struct's ``flattened_patches``;
- config-sized vectors: PI0's robot ``state`` and ``actions`` (and its nested VLM config's image tokens);
- video frames through ``get_video_features`` with the video token: InstructBLIP-Video.

Shown failing (2026-12-02): with ``hf_ddpfix/integrations/vision/sample.py``, ``shrink.py`` and
``shrink_check.py`` reverted to 507f765 (before the companion inputs and the config repairs) all 8 tests fail:
Step3p7 "Could not find a `sliding_window` argument in the config, or it is not set" (and no
``give_unset_field``), UDOP ``KeyError: 'bbox'``, Kosmos-2 / Idefics / Pix2Struct / PI0 "no image layout built
from the config runs" (PI0: "missing 1 required positional argument: 'state'"), InstructBLIP-Video's
``video_token_id`` still ``None``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import AutoConfig

from hf_ddpfix.integrations.vision.sample import sample_batch
from hf_ddpfix.rehearse.family_sweep import families, size_family
from hf_ddpfix.rehearse.shrink_check import shrink_checked


def _tiny(model_type: str):  # noqa: ANN202
    """The family's tiny model, as the sweep builds it; skipped (with the reason) where the installed transformers
    does not ship the family or cannot build it tiny (transformers 5.0: no Step3p7 or PI0; its Pix2Struct default
    config does not build), which the sweep's own records on that release name."""
    shipped = families()
    if model_type not in shipped:
        pytest.skip(f"transformers {transformers.__version__} does not ship {model_type}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = size_family(model_type, shipped[model_type])
        if not rec.get("meta_params"):
            pytest.skip(f"{model_type} is not built tiny on transformers {transformers.__version__}: {rec['reason']}")
        cls = getattr(transformers, rec["class"])
        return shrink_checked(AutoConfig.for_model(model_type), cls, small_images=True)


def _runs(model: torch.nn.Module, batch: dict) -> None:
    with torch.no_grad():
        loss = model(**batch).loss
    assert loss is not None and loss.isfinite()


def test_an_unset_sliding_window_the_model_needs_is_given():
    checked = _tiny("step3p7")
    assert (checked.text, checked.image) == ("ok", "ok")
    assert any("sliding_window: None -> " in line for line in checked.shrunk.lines)
    assert checked.model.config.get_text_config(decoder=True).sliding_window > 0


def test_give_unset_field_reads_layer_types_and_the_masking_error():
    from transformers import Gemma3TextConfig

    from hf_ddpfix.rehearse.config_gaps import give_unset_field

    cfg = Gemma3TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                           max_position_embeddings=1024)
    cfg.sliding_window = None
    lines: list[str] = []
    assert give_unset_field(cfg, "", lines) and cfg.sliding_window == 1024 and len(lines) == 1
    assert not give_unset_field(cfg, "", lines)  # set now: nothing to do
    other = Gemma3TextConfig(num_hidden_layers=2, layer_types=["full_attention"] * 2)
    other.sliding_window = None
    assert not give_unset_field(other, "", [])  # no sliding layer, no error: left unset
    assert give_unset_field(other, "ValueError: Could not find a `sliding_window` argument in the config, or it "
                            "is not set", []) and other.sliding_window > 0


def test_a_box_per_token():
    checked = _tiny("udop")
    for image in (False, True):
        batch = sample_batch(checked.model, image=image)
        assert batch["bbox"].shape == (*batch["input_ids"].shape, 4) and batch["bbox"].is_floating_point()
        _runs(checked.model, batch)


def test_an_image_position_mask_marks_its_placeholders():
    checked = _tiny("kosmos-2")
    batch = sample_batch(checked.model, image=True)
    mask = batch["image_embeds_position_mask"]
    assert mask.shape == batch["input_ids"].shape and int(mask.sum()) == checked.model.config.latent_query_num
    _runs(checked.model, batch)


def test_a_per_image_cross_attention_mask():
    checked = _tiny("idefics")
    batch = sample_batch(checked.model, image=True)
    n_images = batch["pixel_values"].shape[1]
    assert batch["image_attention_mask"].shape == (*batch["input_ids"].shape, n_images)
    _runs(checked.model, batch)


def test_flattened_patches_with_their_ids_and_mask():
    checked = _tiny("pix2struct")
    batch = sample_batch(checked.model, image=True)
    patches = batch["flattened_patches"]
    assert "input_ids" not in batch and batch["attention_mask"].shape == patches.shape[:2]
    assert patches[0, :, :2].min() >= 1  # 1-based row / column ids (0 marks padding)
    _runs(checked.model, batch)


def test_config_sized_state_and_action_vectors():
    checked = _tiny("pi0")
    cfg = checked.model.config
    batch = sample_batch(checked.model, image=True)
    assert batch["state"].shape == (1, cfg.max_state_dim)
    assert batch["actions"].shape == batch["noise"].shape == (1, cfg.chunk_size, cfg.max_action_dim)
    assert torch.equal(sample_batch(checked.model, image=True, seed=3)["timestep"], batch["timestep"])
    vlm = cfg.vlm_config  # the nested VLM's image tokens, as many as it names: the tower's features are used
    assert int((batch["input_ids"] == vlm.image_token_id).sum()) == vlm.text_config.num_image_tokens
    _runs(checked.model, batch)


@pytest.mark.parametrize("model_type", ["instructblipvideo"])
def test_video_frames_through_the_video_features(model_type: str):
    checked = _tiny(model_type)
    cfg = checked.model.config
    assert cfg.video_token_id is not None  # the default config's unset video token given
    batch = sample_batch(checked.model, image=True)
    assert batch["pixel_values"].dim() == 5
    assert int((batch["input_ids"] == cfg.video_token_id).sum()) == cfg.num_query_tokens * batch["pixel_values"].shape[1]
    _runs(checked.model, batch)


def test_the_zero_dummy_takes_the_anyres_tiles_the_pinpoints_give():
    """The ZeRO dummy found by structure (``VisionAdapter.verify``), LoRA on every linear as the cells run it:
    LLaVA-NeXT's native-size image is cut into the base tile plus the tiles its ``image_grid_pinpoints`` pick
    (``anyres_tiles``). Shown failing (2026-12-02, before that layout): "no dummy built from vision_config runs
    through the tower" ("split_with_sizes expects split_sizes to sum exactly to 2 ... got [3]"), so its ZeRO-3 cell
    stopped mixed ranks and its explicit-list FSDP2 cell was refused (both now equal to stock DDP: the cells file)."""
    from peft import LoraConfig, get_peft_model

    from hf_ddpfix.integrations.vision.families import find_vision_adapter

    model = _tiny("llava_next").model
    model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear")).base_model.model
    adapter = find_vision_adapter(model, zero=True)
    assert adapter is not None
    adapter.verify()
    assert (adapter.pixel_ndim, adapter.pixel_tiles) == (5, 3)


#: family -> what its image layout must carry (a keyword the rule found, or the layout's name): one per rule of
#: ``integrations/vision/layouts.py`` no earlier rule covered (each family took no image before, 2026-12-02)
_LAYOUT_RULES = {
    "fuyu": "patch rows (1,",  # bare patch rows [1, N, C*P*P] for a linear patch embedding
    "video_llama_3": "image_merge_sizes",  # a keyword only the inner model's get_image_features requires
    "gemma4": "image_position_ids",  # patch rows with their (x, y) grid positions, pooled k x k
    "t5gemma2": "pixels (1, 3, ",  # the tower's config nested in the encoder's: its image size, not 224 px
    "deepseek_vl_hybrid": "high_res_pixel_values",  # a second tower's pixels at its own config's size
    "molmo2": "image_token_pooling",  # one crop's patch rows and the patch indices each token pools
    "inkling2_loop": "tokens x",  # a channels-last crop per image token, the grid in tokens (transformers 5.24)
    "ovis2_5": "between boundary tokens",  # one image-start and one image-end token around them (transformers 5.25)
}


@pytest.mark.parametrize("model_type", [pytest.param(m, marks=pytest.mark.slow) if m in ("deepseek_vl_hybrid", "molmo2")
                                        else m for m in _LAYOUT_RULES])
def test_an_image_layout_found_by_keyword_and_config(model_type: str):
    """The layout rule the family needs, and the model trains on it (forward + backward with an image, and without).
    Shown failing (2026-12-02): on the package at 12d7679 (before layouts.py) all six fail: "no image layout built
    from the config runs" (Gemma 4: "its config has no vision_config", before ``give_vision_config``); Inkling-2
    Loop (transformers 5.24 only) fails the same way without the token-crop candidate."""
    from hf_ddpfix.integrations.vision.sample import image_layout

    checked = _tiny(model_type)
    layout = image_layout(checked.model)
    assert _LAYOUT_RULES[model_type] in " ".join(layout.notes) + " ".join(layout.pixels), (layout.notes, layout.pixels)
    for image in (True, False):
        loss = checked.model(**sample_batch(checked.model, image=image)).loss
        assert loss.isfinite()
        loss.backward()


def test_image_tokens_go_between_the_boundary_tokens_a_model_counts():
    """A model that counts the begin / end tokens around each image (Ovis2.5 on transformers 5.25, "Expected 1
    visual boundary tokens"; here a LLaVA taught to count them, on every stack) gets its image tokens between the
    pair its config names; a model that takes the image without them keeps the layout without them (the control).
    Shown failing (2026-12-03, sample.py without boundary tokens): "no image layout built from the config runs"."""
    import functools

    from hf_ddpfix.integrations.vision.sample import image_bounds, image_layout

    tiny = _tiny("llava").model  # its layout is kept per model already (the shrinker's check ran it): fresh ones
    tiny.config.image_start_token_id, tiny.config.image_end_token_id = 40, 41
    plain, model = type(tiny)(tiny.config), type(tiny)(tiny.config)
    assert image_bounds(plain.config) == (40, 41) and image_layout(plain).bounds is None  # not needed: not written
    inner = model.forward

    @functools.wraps(inner)
    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if kwargs.get("pixel_values") is not None:
            for token in (40, 41):
                if int((kwargs["input_ids"] == token).sum()) != 1:
                    raise ValueError(f"Expected 1 visual boundary tokens with id {token}")
        return inner(*args, **kwargs)

    model.forward = counting
    batch = sample_batch(model, image=True)
    ids = batch["input_ids"][0].tolist()
    begin, end = ids.index(40), ids.index(41)
    inside = ids[begin + 1:end]
    assert inside and set(inside) == {model.config.image_token_id}, ids
    assert ids.count(model.config.image_token_id) == len(inside)  # every image token between the pair
    _runs(model, batch)
    assert 40 not in sample_batch(model, image=False)["input_ids"]  # a text-only batch: no pair


def test_a_text_only_default_config_gets_its_declared_vision_config():
    """``give_vision_config`` (the sweep only): Gemma 4's default config leaves ``vision_config`` ``None`` while its
    class declares one (its image checkpoints carry a tower); it is built from the declared defaults. Another
    optional tower stays as it is (Nemotron-H Omni's ``audio_config``, which does not build from its defaults), and
    a config that sets its tower is not touched. Shown failing (2026-12-02): with ``TOWER_CONFIG_KEYS`` holding
    ``audio_config`` too, Gemma 4 gets an audio tower built first (its line assert fails)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_ddpfix.rehearse.config_gaps import give_vision_config

    if "gemma4" not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} ships no Gemma 4")
    cfg, lines = AutoConfig.for_model("gemma4"), []
    assert cfg.vision_config is None and give_vision_config(cfg, lines)
    assert cfg.vision_config.patch_size > 0 and "vision_config: None ->" in lines[0]
    assert not give_vision_config(cfg, lines) and len(lines) == 1  # set now
    if "nemotron_h_omni" in CONFIG_MAPPING_NAMES:
        omni = AutoConfig.for_model("nemotron_h_omni")
        audio = getattr(omni, "audio_config", None)
        give_vision_config(omni, [])
        assert getattr(omni, "audio_config", None) is audio


def test_a_linear_width_the_image_path_shows_wrong_is_set():
    """``give_linear_width``: Llama 4's default config breaks two relations its checkpoints hold (the vision MLP
    width = the pixel-shuffled width, ``vision_output_dim`` = the projector's input). From torch's error the tower's
    width field equal to the linear's input width takes the width that reaches it; the text config is never
    changed, and an error naming no linear changes nothing. The shrunk family then takes an image (the sweep).
    Shown failing (2026-12-02): with the ``node is text`` guard removed the text config's ``hidden_size`` and
    ``intermediate_size_mlp`` (both 128) are widened too."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_ddpfix.rehearse.config_gaps import give_linear_width
    from hf_ddpfix.rehearse.shrink import shrink_config

    if "llama4" not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} ships no Llama 4")
    cfg = shrink_config(AutoConfig.for_model("llama4")).config
    cfg.text_config.hidden_size = 128  # a text width equal to the wrong one: must stay
    lines: list[str] = []
    assert not give_linear_width(cfg, "ValueError: Image features and image tokens do not match", lines)
    assert give_linear_width(cfg, "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x256 and 128x4096)", lines)
    assert cfg.vision_config.intermediate_size == 256 and cfg.text_config.hidden_size == 128, lines
    assert all(line.startswith("vision_config.") for line in lines), lines


def test_widths_derived_from_the_text_width_follow_its_cut():
    """Config only (fast): MiniMax-M3-VL derives ``merged_hidden_size`` = text hidden x ``spatial_merge_size**2``
    (24576 in the default) on its top config, which has no hidden of its own; Molmo2's adapter names the text width
    ``text_hidden_size`` (3584 in the default, beside a text width of 4096) and reads the tower's layers by index
    from the adapter's config (``vision_feature_layer`` [24, 18] beside, not inside, the tower's). Shown failing
    (2026-12-02): without ``_keep_text_widths`` the first two asserts fail; with ``_keep_feature_taps`` reading only
    a node's own ``vision_config`` the third (2 layers)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_ddpfix.rehearse.shrink import shrink_config

    if "minimax_m3_vl" in CONFIG_MAPPING_NAMES:
        m = shrink_config(AutoConfig.for_model("minimax_m3_vl")).config
        merge = m.vision_config.spatial_merge_size
        assert m.merged_hidden_size == m.text_config.hidden_size * merge ** 2, m.merged_hidden_size
    if "molmo2" in CONFIG_MAPPING_NAMES:
        mo = shrink_config(AutoConfig.for_model("molmo2")).config
        assert mo.adapter_config.text_hidden_size == mo.text_config.hidden_size
        assert mo.vision_config.num_hidden_layers > max(mo.adapter_config.vision_feature_layer)


def test_the_tower_config_is_found_where_an_encoder_holds_it():
    """``parts.tower_config``, the one lookup the plan, the dummy and the batch builder share: a model config's own
    ``vision_config``; the one an ``encoder`` config holds (T5Gemma 2: before, the plan called it "not a
    vision-language model", gave its SigLIP layers FSDP2 units of their own, and its 2-process FSDP2 cells crashed
    mid-run in gloo with mixed image / text ranks, both wrap modes; now the tower folds and both cells equal stock
    DDP); an image encoder's own config (VisionEncoderDecoder's ViT); never a text encoder's (a BERT-to-BERT
    EncoderDecoder). Shown failing (2026-12-02) with ``tower_config`` reading ``vision_config`` only: the T5Gemma 2
    and VisionEncoderDecoder asserts fail."""
    from transformers import (
        AutoConfig,
        BertConfig,
        EncoderDecoderConfig,
        VisionEncoderDecoderConfig,
        ViTConfig,
    )
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_ddpfix.integrations.vision.parts import tower_config

    assert tower_config(AutoConfig.for_model("llava")).model_type == "clip_vision_model"
    if "t5gemma2" in CONFIG_MAPPING_NAMES:
        t5 = AutoConfig.for_model("t5gemma2")
        assert tower_config(t5) is t5.encoder.vision_config
    ved = VisionEncoderDecoderConfig.from_encoder_decoder_configs(ViTConfig(), BertConfig())
    assert tower_config(ved) is ved.encoder
    assert tower_config(EncoderDecoderConfig.from_encoder_decoder_configs(BertConfig(), BertConfig())) is None
    assert tower_config(BertConfig()) is None
