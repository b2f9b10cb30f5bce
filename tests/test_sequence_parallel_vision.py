"""Sequence parallelism for vision-language models, one process: cutting the decoder's inputs after the
image merge, merging a group's image batches, which VLMs are sharded or refused (plan), the vision tower's
attention left on the full sequence, and the decoder call contract the hook relies on. The 2- and 4-process
parity (loss and every gradient, vision LoRA included) is in tests/scripts/sp_parity.py ("vlm/*"), the
Trainer run in tests/scripts/sp_trainer.py (--vlm)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_ddpfix.ops.sequence_parallel import language_model_documents, shard_language_model_inputs

torch.set_num_threads(1)


def _shards(n: int, **kw):
    return [shard_language_model_inputs(sp_size=n, sp_rank=r, **kw) for r in range(n)]


def test_cut_after_the_merge_concatenates_to_the_padded_inputs_with_3d_positions_and_deepstack_rows():
    b, s, e, n = 2, 7, 3, 4  # 7 tokens over 4 ranks: 1 pad token
    embeds = torch.randn(b, s, e)
    pos = torch.randint(0, 9, (3, b, s))
    visual = torch.zeros(b, s, dtype=torch.bool)
    visual[0, 2:5] = True  # an image across the borders of ranks 0 | 1 | 2 (2 tokens per rank)
    visual[1, 1] = True
    deep = [torch.arange(4.0)[:, None].expand(4, e).clone()]  # row k = the k-th visual token (row-major)
    shards = _shards(n, inputs_embeds=embeds, position_ids=pos, visual_pos_masks=visual, deepstack_visual_embeds=deep)
    assert torch.equal(torch.cat([x.inputs_embeds for x in shards], 1), torch.cat([embeds, torch.zeros(b, 1, e)], 1))
    got_pos = torch.cat([x.position_ids for x in shards], -1)
    assert torch.equal(got_pos[..., :s], pos) and torch.equal(got_pos[..., s], pos[..., -1] + 1)
    assert torch.equal(torch.cat([x.visual_pos_masks for x in shards], 1)[:, :s], visual)
    # each rank keeps the deepstack rows of exactly its visual tokens, in row-major order
    rows = [x.deepstack_visual_embeds[0][:, 0].tolist() for x in shards]
    assert rows == [[3.0], [0.0, 1.0], [2.0], []]  # rank 0: row 1's token 1 (feature 3); rank 1: row 0's 2, 3 ...
    assert all(x.padded_length == 8 and x.length == 7 for x in shards)
    assert shards[0].documents[:, -1].tolist() == [-1, -1]  # the pad token is never a key


def test_default_positions_are_the_full_sequence_arange_not_the_shards():
    shards = _shards(2, inputs_embeds=torch.randn(1, 6, 2))
    assert [x.position_ids.tolist() for x in shards] == [[[0, 1, 2]], [[3, 4, 5]]]


def test_documents_follow_the_decoders_mask_rule():
    text = torch.tensor([[0, 1, 2, 0, 1, 2]])
    four = torch.cat([text[None], torch.zeros(3, 1, 6, dtype=torch.long)])
    kw = dict(batch=1, length=6, text_positions_from_2d=False)
    # packed documents only from 4-row positions (text row first) and only without a 2-D mask
    assert language_model_documents(four, None, **kw).tolist() == [[0, 0, 0, 1, 1, 1]]
    assert language_model_documents(four, torch.ones(1, 6), **kw).tolist() == [[0] * 6]
    # 3 rotary rows carry no text positions; 2-D ones do only where the decoder reads them so (Qwen3-VL)
    assert language_model_documents(four[1:], None, **kw).tolist() == [[0] * 6]
    assert language_model_documents(text, None, **kw).tolist() == [[0] * 6]
    assert language_model_documents(text, None, **{**kw, "text_positions_from_2d": True}).tolist() == [[0, 0, 0, 1, 1, 1]]
    assert language_model_documents(None, torch.tensor([[1, 1, 1, 1, 0, 0]]), **kw).tolist() == [[0, 0, 0, 0, -1, -1]]


def test_a_deepstack_feature_of_the_wrong_length_raises():
    visual = torch.tensor([[True, False, True, False]])
    with pytest.raises(ValueError, match="3 rows for 2 visual tokens"):
        shard_language_model_inputs(torch.randn(1, 4, 2), sp_size=2, sp_rank=0, visual_pos_masks=visual,
                                    deepstack_visual_embeds=[torch.randn(3, 2)])


def test_merge_keeps_images_in_token_order_and_pads_rows():
    from hf_ddpfix.integrations.sequence_parallel.vision import merge_vision_batches

    a = {"input_ids": torch.ones(1, 5, dtype=torch.long), "labels": torch.ones(1, 5, dtype=torch.long),
         "pixel_values": torch.zeros(16, 3), "image_grid_thw": torch.tensor([[1, 4, 4]]),
         "mm_token_type_ids": torch.tensor([[0, 1, 1, 0, 0]])}
    b = {"input_ids": torch.full((2, 3), 2), "labels": torch.full((2, 3), 2), "mm_token_type_ids": torch.zeros(2, 3, dtype=torch.long)}
    c = {"input_ids": torch.full((1, 4), 3), "labels": torch.full((1, 4), 3), "pixel_values": torch.ones(8, 3),
         "image_grid_thw": torch.tensor([[1, 2, 4]]), "mm_token_type_ids": torch.tensor([[1, 1, 0, 0]])}
    m = merge_vision_batches([a, b, c])
    assert m["input_ids"].shape == (4, 5) and "attention_mask" not in m  # no batch had a mask: right padding is causal-invisible
    assert m["labels"][1].tolist() == [2, 2, 2, -100, -100]
    assert m["pixel_values"][:16].sum() == 0 and m["pixel_values"][16:].sum() == 24  # a's image, then c's
    assert m["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4]]
    assert m["mm_token_type_ids"][3].tolist() == [1, 1, 0, 0, 0]
    a2 = dict(a, attention_mask=torch.ones(1, 5, dtype=torch.long))
    assert merge_vision_batches([a2, b])["attention_mask"][1].tolist() == [1, 1, 1, 0, 0]
    # a family without grids (LLaVA & co.): whole images [N, C, H, W] and their sizes, concatenated in batch order
    img = [{"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3, dtype=torch.long),
            "pixel_values": torch.full((k, 3, 2, 2), float(k)), "image_sizes": torch.full((k, 2), k)} for k in (2, 1)]
    m = merge_vision_batches([img[0], {"input_ids": torch.ones(1, 2, dtype=torch.long),
                                       "labels": torch.ones(1, 2, dtype=torch.long)}, img[1]])
    assert m["pixel_values"][:, 0, 0, 0].tolist() == [2.0, 2.0, 1.0] and m["image_sizes"][:, 0].tolist() == [2, 2, 1]


@pytest.mark.parametrize(("change", "match"), [
    (lambda b: b.update(cross_attention_mask=torch.ones(1)), "not sharded"),
    (lambda b: b.pop("mm_token_type_ids"), "mm_token_type_ids is in some batches"),
    (lambda b: b.update(image_grid_thw=torch.tensor([[1, 2, 2]])), "pixel_values without image_grid_thw"),
    (lambda b: b.update(pixel_values=torch.zeros(1, 2, 3, 4, 4)), "cannot be concatenated"),
])
def test_merge_refuses_what_it_cannot_keep_exact(change, match):
    from hf_ddpfix.integrations.sequence_parallel.vision import merge_vision_batches

    batches = [{"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3, dtype=torch.long),
                "mm_token_type_ids": torch.zeros(1, 3, dtype=torch.long)} for _ in range(2)]
    if match == "cannot be concatenated":  # Idefics-style [B, images, C, H, W] with another number of images per row
        batches[0]["pixel_values"] = torch.zeros(1, 1, 3, 4, 4)
    change(batches[1])
    with pytest.raises(ValueError, match=match):
        merge_vision_batches(batches)


# ------------------------------------------------------------------------------------- support and plan


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_tested_qwen_families_are_sharded(family):
    from fixtures import BUILDERS

    from hf_ddpfix.integrations.sequence_parallel.vision import vision_sequence_parallel_support

    model = BUILDERS[family](0)
    if model is None:
        pytest.skip(f"this transformers has no {family}")
    fam, reason = vision_sequence_parallel_support(model)
    assert fam is not None and fam.name == family and reason == ""


@pytest.mark.parametrize("name", ["llava", "gemma3", "internvl", "mistral3"])
def test_vlms_whose_images_enter_the_decoders_inputs_embeds_are_sharded_by_structure(name):
    """No table: the text decoder (model.language_model / get_decoder()) takes only decoder inputs, a tower exists,
    no M-RoPE. Its tower is the module whose attention stays unsharded."""
    from zoo import ZOO

    from hf_ddpfix.integrations.sequence_parallel.vision import vision_sequence_parallel_support, vision_tower

    model = ZOO[name].build(0)
    fam, reason = vision_sequence_parallel_support(model)
    assert fam is not None and fam.structural and fam.name == model.config.model_type and reason == "", reason
    assert vision_tower(model) is model.model.vision_tower


def test_other_vlms_are_refused_naming_the_model_and_why_and_text_models_are_not_vlms():
    from fixtures import build_qwen3_vl_moe, tiny_llama
    from zoo import ZOO

    from hf_ddpfix.integrations.sequence_parallel.vision import vision_sequence_parallel_support

    assert vision_sequence_parallel_support(tiny_llama()) == (None, "")
    fam, reason = vision_sequence_parallel_support(ZOO["mllama"].build(0))  # image features through cross-attention
    assert fam is None and "MllamaForConditionalGeneration" in reason and "cross_attention_states" in reason
    moe = build_qwen3_vl_moe(0)
    if moe is not None:  # M-RoPE outside the tested table
        fam, reason = vision_sequence_parallel_support(moe)
        assert fam is None and type(moe).__name__ in reason and "M-RoPE" in reason and "qwen2_5_vl" in reason


def test_a_prepared_decoder_mask_is_padded_with_masked_keys_and_self_attending_pad_rows():
    import torch

    from hf_ddpfix.integrations.sequence_parallel.vision import pad_prepared_mask

    m = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    m[0, 0, 0, 2] = True  # a bidirectional block
    out = pad_prepared_mask(m, 4)
    assert out.shape == (1, 1, 4, 4) and torch.equal(out[..., :3, :3], m)
    assert out[0, 0, 3].tolist() == [False, False, False, True] and not out[0, 0, :3, 3].any()
    assert pad_prepared_mask(None, 4) is None
    with pytest.raises(NotImplementedError, match="boolean"):
        pad_prepared_mask(torch.zeros(1, 1, 3, 3), 4)


def test_the_sliding_window_on_the_documents_mask_is_transformers_overlay():
    import torch

    from hf_ddpfix.integrations.sequence_parallel.attention import _Batch
    from hf_ddpfix.ops.sequence_parallel import attention_mask_from_documents

    docs = torch.tensor([[0, 0, 0, 0, 1, 1, -1, -1]])
    got = _Batch(None, attention_mask_from_documents(docs), 8).windowed(3)[0, 0]
    q, k = torch.arange(8)[:, None], torch.arange(8)[None, :]
    want = (k <= q) & (k > q - 3) & (docs[0][:, None] == docs[0][None, :]) & (docs[0] >= 0)[None, :]
    assert torch.equal(got, want | torch.eye(8, dtype=torch.bool))
    causal = _Batch(None, None, 5).windowed(2)[0, 0]
    assert causal[4].tolist() == [False, False, False, True, True]


def _facts(parallel="ddp", **sp):
    from hf_ddpfix.integrations.sequence_parallel.facts import SequenceParallelFacts
    from hf_ddpfix.plan.types import RunFacts

    return RunFacts(parallel=parallel, world_size=2, sequence_parallel=SequenceParallelFacts(
        attn_implementation="sdpa", num_heads=4, num_kv_heads=2, **sp))


def test_plan_refuses_a_vlm_it_cannot_shard_naming_the_reason_and_says_so_for_one_it_can():
    from hf_ddpfix.config.options import DDPFixConfig
    from hf_ddpfix.plan.resolve import resolve_plan
    from hf_ddpfix.plan.types import PlanError

    cfg = DDPFixConfig.from_env({}, sequence_parallel=2)
    with pytest.raises(PlanError, match="sequence_parallel=2 .*MllamaForConditionalGeneration .*cross-attention"):
        resolve_plan(_facts(vision_refusal="MllamaForConditionalGeneration (model_type 'mllama'): its text decoder "
                            "takes ['cross_attention_states']: image features reach it besides inputs_embeds (e.g. "
                            "cross-attention)"), cfg)
    d = resolve_plan(_facts(vision_family="qwen2_5_vl"), cfg).sequence_parallel
    assert d.value == "N=2 DP=1" and "qwen2_5_vl: vision tower, image merge and position ids (3-D for M-RoPE) on" \
        in d.reason
    d = resolve_plan(dataclasses.replace(_facts(vision_family="llava", parallel="deepspeed"), zero_stage=2),
                     cfg).sequence_parallel
    assert d.value == "N=2 DP=1" and "llava: vision tower" in d.reason
    for stage in (1, 3):
        with pytest.raises(PlanError, match=f"llava under DeepSpeed ZeRO stage {stage}: .* tested under DDP and ZeRO-2"):
            resolve_plan(dataclasses.replace(_facts(vision_family="llava", parallel="deepspeed"), zero_stage=stage),
                         cfg)
    with pytest.raises(PlanError, match="qwen2_5_vl under FSDP: .* tested under DDP and ZeRO-2"):
        resolve_plan(_facts(vision_family="qwen2_5_vl", parallel="fsdp"), cfg)
    off = resolve_plan(_facts(vision_refusal="x"), DDPFixConfig()).sequence_parallel  # not asked for: no error
    assert off.value is None


def test_facts_read_the_vision_family_from_the_model():
    from fixtures import add_lora, build_qwen2_5_vl
    from zoo import _llava

    from hf_ddpfix.integrations.sequence_parallel.facts import gather_sequence_parallel_facts

    got = gather_sequence_parallel_facts(None, add_lora(build_qwen2_5_vl(0)))
    assert got.vision_family == "qwen2_5_vl" and got.vision_refusal is None
    got = gather_sequence_parallel_facts(None, _llava(0))
    assert got.vision_family == "llava" and got.vision_refusal is None
    from zoo import ZOO

    assert "cross_attention" in (gather_sequence_parallel_facts(None, ZOO["mllama"].build(0)).vision_refusal or "")


# ------------------------------------------------------------------------------------ the tower's attention


def test_the_towers_attention_runs_unchanged_while_a_sharded_batch_is_active():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_ddpfix.integrations.sequence_parallel.attention import (
        activate_batch,
        deactivate_batch,
        install_ulysses_attention,
        keep_full_sequence,
    )
    from hf_ddpfix.ops import feature_counts

    handle = install_ulysses_attention("sdpa")
    tower = torch.nn.Module()
    undo = keep_full_sequence([tower])
    try:
        feature_counts.reset()
        activate_batch(torch.zeros(1, 8, dtype=torch.long))  # a sharded batch is active (no group needed here)
        q = torch.randn(1, 2, 5, 4)
        out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](tower, q, q, q, None, scaling=0.5)
        ref, _ = ALL_ATTENTION_FUNCTIONS["sdpa"].__wrapped__(tower, q, q, q, None, scaling=0.5)
        assert torch.equal(out, ref)
        c = feature_counts.snapshot()["sequence_parallel"]
        assert c.amounts == {"full_sequence_attention_calls": 1} and not c.fallbacks and c.ran == 0
    finally:
        deactivate_batch()
        undo()
        handle.remove()


# ------------------------------------------------------------------------------- the decoder call contract


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_decoder_is_called_once_with_the_merged_embeddings_and_only_keywords_the_hook_cuts_or_passes(family):
    """What the hook relies on (transformers 5.x): the VLM calls its text decoder once, by keywords, with
    `inputs_embeds` [B, S, E] that already hold the image features (not `input_ids`), and nothing per-token
    besides what `VisionSequenceSharding` cuts."""
    from fixtures import BUILDERS, PATCH_DIM, sp_vlm_batches

    from hf_ddpfix.integrations.sequence_parallel import vision as v

    model = BUILDERS[family](0)
    if model is None:
        pytest.skip(f"this transformers has no {family}")
    from hf_ddpfix.integrations.vision.parts import vlm_parts

    fam, _ = v.vision_sequence_parallel_support(model)
    assert fam is not None and fam.name == family
    lm = model.get_submodule(vlm_parts(model).language_model)
    calls = []
    handle = lm.register_forward_pre_hook(lambda m, a, k: calls.append((a, dict(k))), with_kwargs=True)
    try:
        batch = sp_vlm_batches(PATCH_DIM[family])["image_across_shards"]
        with torch.no_grad():
            model(**batch, use_cache=False)
    finally:
        handle.remove()
    assert len(calls) == 1
    args, kw = calls[0]
    assert args == () and kw.get("input_ids") is None and kw["inputs_embeds"].shape[:2] == batch["input_ids"].shape
    passed = {k for k, x in kw.items() if x is not None}
    assert passed <= set(v._CUT) | set(v._CUT_PER_TOKEN) | set(fam.cut_keywords) | set(v._PASS_KEYWORDS), passed
    pos = kw["position_ids"]  # transformers 5.0: from input_ids; 5.2+: from mm_token_type_ids
    assert pos is not None and pos.dim() == 3 and pos.shape[-1] == batch["input_ids"].shape[1]  # 3-D, full sequence
    emb = model.get_input_embeddings()(batch["input_ids"])
    image = batch["input_ids"] == model.config.image_token_id
    assert not torch.equal(kw["inputs_embeds"][image], emb[image])  # image features already scattered in


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_documents_rule_is_the_installed_decoders_own(family):
    """Without a 2-D mask the decoder finds packed documents in its text positions; which rows it reads them
    from changed between releases (5.0's Qwen3-VL: row 0 of 3-row M-RoPE ids, where an image's tokens share
    a temporal position). Observed on the installed decoder: the mask its attention gets for 3-row ids whose row
    0 repeats, vs the documents `VisionSequenceSharding` uses."""
    from fixtures import BUILDERS

    from hf_ddpfix.integrations.sequence_parallel.vision import reads_text_positions_from_rotary_rows

    model = BUILDERS[family](0)
    if model is None:
        pytest.skip(f"this transformers has no {family}")
    lm = model.model.language_model
    masks = []
    attn = lm.layers[0].self_attn
    handle = attn.register_forward_pre_hook(lambda m, a, k: masks.append(k.get("attention_mask")), with_kwargs=True)
    row0 = torch.tensor([0, 1, 2, 2, 2, 3, 4, 5])  # an image's 3 tokens share a temporal position
    pos = torch.stack([row0, torch.arange(8), torch.arange(8)])[:, None]
    try:
        with torch.no_grad():
            lm(inputs_embeds=torch.randn(1, 8, lm.config.hidden_size), position_ids=pos, use_cache=False)
    finally:
        handle.remove()
    mask = masks[0]
    if mask is None:
        blocked = False  # plain causal
    else:
        m = mask[0, 0, 5, 0]
        blocked = (not bool(m)) if mask.dtype == torch.bool else bool(m < 0)
    flag = bool(reads_text_positions_from_rotary_rows(lm))
    docs = language_model_documents(pos, None, batch=1, length=8, text_positions_from_2d=flag,
                                    text_positions_from_3_rows=flag)
    assert blocked == bool(docs[0, 5] != docs[0, 0]), (family, blocked, flag, docs.tolist())


def test_a_vlm_sp_cannot_handle_is_a_plan_error_from_the_model_itself():
    """Facts read from a real Mllama (images through cross-attention) -> the plan: a PlanError naming the model and
    why, before any step; LLaVA from the same path is planned with its family named."""
    from zoo import ZOO

    from hf_ddpfix.config.options import DDPFixConfig
    from hf_ddpfix.integrations.sequence_parallel.facts import gather_sequence_parallel_facts
    from hf_ddpfix.plan.resolve import resolve_plan
    from hf_ddpfix.plan.types import PlanError, RunFacts

    cfg = DDPFixConfig.from_env({}, sequence_parallel=2)
    for name in ("mllama", "llava"):
        sp = dataclasses.replace(gather_sequence_parallel_facts(None, ZOO[name].build(0)), attn_implementation="sdpa")
        facts = RunFacts(parallel="ddp", world_size=2, sequence_parallel=sp)
        if name == "mllama":
            with pytest.raises(PlanError, match="MllamaForConditionalGeneration .*cross_attention_states.*without "
                                                "sequence parallelism"):
                resolve_plan(facts, cfg)
        else:
            d = resolve_plan(facts, cfg).sequence_parallel
            assert d.value == "N=2 DP=1" and "llava: vision tower, image merge" in d.reason
