"""Sequence parallelism (Ulysses): the pure pieces (sharding, masks, KV replication, the loss), the
attention-interface wrapper, and one launch per group size (2 and 4 gloo processes) comparing attention,
gradients and the loss with one process on the full sequence (tests/scripts/sp_parity.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from hf_ddpfix.ops.sequence_parallel import (
    attention_mask_from_documents,
    document_ids,
    kv_replication,
    shard_batch,
    shard_loss_sum,
    valid_target_count,
)

torch.set_num_threads(1)


def test_shards_concatenate_to_the_padded_full_sequence_with_labels_shifted_before_sharding():
    ids = torch.arange(1, 14)[None]  # 13 tokens, N = 4: 3 pad tokens
    labels = ids.clone()
    shards = [shard_batch(ids, sp_size=4, sp_rank=r, labels=labels, pad_token_id=0) for r in range(4)]
    assert torch.equal(torch.cat([s.input_ids for s in shards], 1), torch.cat([ids, torch.zeros(1, 3, dtype=int)], 1))
    assert torch.equal(torch.cat([s.position_ids for s in shards], 1), torch.arange(16)[None])
    shift = torch.cat([s.shift_labels for s in shards], 1)
    assert shift[0, :12].tolist() == list(range(2, 14))  # token t predicts t+1, across shard borders
    assert shift[0, 12:].tolist() == [-100] * 4  # the last real token and the padding carry no loss
    assert shards[0].documents[0, -3:].tolist() == [-1, -1, -1]  # padding is never a key


def test_padding_off_with_a_length_not_divisible_raises_naming_the_setting():
    with pytest.raises(ValueError, match="not divisible by sequence_parallel=4"):
        shard_batch(torch.ones(1, 13, dtype=torch.long), sp_size=4, sp_rank=0, pad_to_multiple=False)


def test_padded_tokens_never_become_targets_even_with_a_label():
    ids = torch.tensor([[5, 6, 7, 0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    s = shard_batch(ids, sp_size=1, sp_rank=0, labels=ids.clone(), attention_mask=mask)
    assert s.shift_labels.tolist() == [[6, 7, -100, -100]]
    assert int(valid_target_count(ids.clone(), mask)) == 2


def test_document_mask_is_causal_within_documents_and_keeps_the_diagonal_for_padding():
    pos = torch.tensor([[0, 1, 2, 0, 1, 5]])
    docs = document_ids(pos, torch.tensor([[1, 1, 1, 1, 1, 0]]))
    assert docs.tolist() == [[0, 0, 0, 1, 1, -1]]
    m = attention_mask_from_documents(docs)[0, 0]
    assert m[4].tolist() == [False, False, False, True, True, False]  # second document only
    assert m[5].tolist() == [False] * 5 + [True]  # a pad row attends to itself: never all-masked (no NaN)
    assert attention_mask_from_documents(document_ids(torch.arange(6)[None])) is None  # plain causal


def test_packed_documents_follow_transformers_rule_only_without_an_attention_mask():
    """transformers reads restarting position ids as packed documents only when no attention_mask is given
    (`create_causal_mask`, 5.0-5.24); with a mask, stock attends across them. The shard's documents, and so
    the attention mask Ulysses builds, must do the same, also per row of a merged group batch (found in review:
    the text path split documents whatever the mask said, a silent difference from stock)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_ddpfix.integrations.sequence_parallel.trainer import merge_batches
    from hf_ddpfix.ops.sequence_parallel.inputs import PACKED_ROWS

    ids, pos = torch.arange(1, 9).view(1, 8), torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    ones = torch.ones_like(ids)
    assert shard_batch(ids, sp_size=2, sp_rank=0, position_ids=pos).documents.tolist() == [[0] * 4 + [1] * 4]
    assert shard_batch(ids, sp_size=2, sp_rank=0, position_ids=pos, attention_mask=ones).documents.tolist() == [[0] * 8]
    merged = merge_batches([{"input_ids": ids, "labels": ids, "position_ids": pos},
                            {"input_ids": ids, "labels": ids, "position_ids": pos, "attention_mask": ones}])
    assert merged[PACKED_ROWS].tolist() == [True, False]
    docs = shard_batch(merged["input_ids"], sp_size=2, sp_rank=0, position_ids=merged["position_ids"],
                       attention_mask=merged["attention_mask"], packed_rows=merged[PACKED_ROWS]).documents
    assert docs.tolist() == [[0] * 4 + [1] * 4, [0] * 8]
    # behaviour, not only ids: stock's logits (no cache, as in training) with and without a mask equal a run
    # under our documents' mask; the two stock runs differ (so the rule is what is tested)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="sdpa")).eval()
    runs = []
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": ones}):
            stock = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits  # training: no cache
            documents = shard_batch(ids, sp_size=1, sp_rank=0, position_ids=pos, **kwargs).documents
            mask = attention_mask_from_documents(documents)
            ours = model(input_ids=ids, position_ids=pos, use_cache=False,
                         attention_mask=mask if mask is not None else ones).logits
            assert torch.allclose(stock, ours, atol=1e-6), kwargs
            runs.append(stock)
    assert not torch.allclose(*runs, atol=1e-3)


def test_an_all_masked_shard_contributes_exactly_zero_not_nan():
    logits = torch.randn(1, 4, 10, requires_grad=True)
    loss = shard_loss_sum(logits, torch.full((1, 4), -100))
    loss.backward()
    assert loss.item() == 0.0 and not torch.isnan(logits.grad).any()


def test_shard_loss_sums_divided_by_one_count_equal_the_token_mean():
    logits, labels = torch.randn(2, 8, 10), torch.randint(0, 10, (2, 8))
    labels[0, :5] = -100
    full = F.cross_entropy(logits[:, :-1].reshape(-1, 10), labels[:, 1:].reshape(-1), ignore_index=-100)
    shards = [shard_batch(torch.zeros(2, 8, dtype=torch.long), sp_size=2, sp_rank=r, labels=labels) for r in range(2)]
    parts = [shard_loss_sum(logits[:, s.local_slice()], s.shift_labels) for s in shards]
    assert torch.allclose(sum(parts) / valid_target_count(labels), full, atol=1e-6)


@pytest.mark.parametrize(("heads", "kv", "n", "want"), [(8, 4, 2, 1), (8, 2, 4, 2), (4, 1, 4, 4), (32, 8, 8, 1)])
def test_kv_heads_are_replicated_only_when_fewer_than_or_not_divisible_by_n(heads, kv, n, want):
    assert kv_replication(heads, kv, n) == want


@pytest.mark.parametrize(("heads", "kv", "n", "match"), [(6, 6, 4, "not divisible"), (12, 3, 8, "not divisible"),
                                                         (8, 8, 3, "not divisible")])
def test_heads_that_cannot_be_split_raise_naming_sequence_parallel(heads, kv, n, match):
    with pytest.raises(ValueError, match=match):
        kv_replication(heads, kv, n)


def test_attention_wrapper_falls_back_unchanged_outside_a_batch_counts_it_and_undoes():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_ddpfix.integrations.sequence_parallel import install_ulysses_attention
    from hf_ddpfix.ops import feature_counts

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    handle = install_ulysses_attention("sdpa")
    try:
        assert install_ulysses_attention("sdpa").removed  # idempotent: no second wrapper
        wrapped = ALL_ATTENTION_FUNCTIONS["sdpa"]
        assert wrapped is not before and wrapped.__wrapped__ is before
        feature_counts.reset()
        q = torch.randn(1, 2, 5, 4)
        module = torch.nn.Module()
        out, _ = wrapped(module, q, q, q, None, scaling=0.5)
        ref, _ = before(module, q, q, q, None, scaling=0.5)
        assert torch.equal(out, ref)
        assert feature_counts.snapshot()["sequence_parallel"].fell_back == 1
    finally:
        handle.remove()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        install_ulysses_attention("eager")


def _has(name: str) -> bool:
    import transformers

    return hasattr(transformers, name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [2, 4])
def test_ulysses_attention_and_a_lora_llama_match_one_process_on_the_full_sequence(tmp_path, nproc):
    from launch import torchrun

    out = tmp_path / "sp.json"
    torchrun("sp_parity.py", str(out), nproc=nproc, timeout=300)
    records = json.loads(out.read_text())
    cases = {r["case"] for r in records}
    assert {"model/plain", "model/right_padded", "model/prompt_masked", "model/packed", "model/not_divisible",
            "model/batch2", "gradcheck/all_to_all_fp64", "fsdp2/right_padded", "fsdp2/packed",
            "fsdp2/not_divisible", "model/backward_on_another_thread"} <= cases
    assert all(r["params_sharded"] for r in records if r["case"].startswith("fsdp2/"))  # FSDP2 really sharded
    assert sum(c.startswith("attention/") for c in cases) >= 6
    assert all(r["ok"] for r in records), [r for r in records if not r["ok"]]
    masked = next(r for r in records if r["case"] == "model/prompt_masked")
    assert 0 in masked["shards_with_loss"] and not masked["nan"]  # an all-masked shard really ran
    # VLMs (vision LoRA included): the tower, image merge and 3-D positions on the full sequence
    vlm = {f"vlm/qwen2_5_vl/{c}" for c in ("image_across_shards", "text_only", "two_grids", "mixed_padded_prompt_masked",
                                           "image_across_shards_checkpointed")}
    assert vlm <= cases
    if nproc == 2:  # long-context layers under Ulysses: patched on every rank, attention sharded (sp_parity.py)
        assert {"long_context/plain", "long_context/right_padded", "long_context/packed"} <= cases
    if nproc == 2:  # the other tested families (the 4-process launch runs Qwen2.5-VL only)
        assert any(c.startswith("vlm/qwen2_vl/") for c in cases)
        assert any(c.startswith("vlm/qwen3_vl/") for c in cases) or not _has("Qwen3VLForConditionalGeneration")
    assert all(r["vision_lora_grads"] > 0 for r in records if r["case"].startswith("vlm/") and "text_only" not in r["case"])
    # VLMs outside the Qwen table, sharded by structure (tests/scripts/sp_vlm_cases.py): loss <= 2e-6 (measured 1.4e-6,
    # 3 ulps), every gradient incl. vision LoRA <= 1e-6 (measured 3.3e-7); Gemma 3 with its own image-block and
    # sliding masks (checkpointed too), Mistral 3 with a sliding window that cuts, Idefics2's connector attention
    # unsharded (checkpointed too); counters judged on every rank
    families = ("llava", "gemma3", "internvl", "mistral3", "idefics2") if nproc == 2 else ("gemma3",)
    cuts = ("image_across_shards", "two_images", "text_only", "mixed_padded_prompt_masked")
    checkpointed = {"vlm_any/gemma3/image_across_shards_checkpointed"} | (
        {"vlm_any/idefics2/image_across_shards_checkpointed"} if nproc == 2 else set())
    assert {f"vlm_any/{f}/{c}" for f in families for c in cuts} | checkpointed <= cases
    for r in (r for r in records if r["case"].startswith("vlm_any/")):
        assert r["ok"] and r["loss_diff"] <= 2e-6 and r["grad_diff"] <= 1e-6, r
        assert (r["vision_lora_grads"] > 0) == ("text_only" not in r["case"]), r


# ------------------------------------------------------------------------------------------------ the plan


def _facts(**kw):
    from hf_ddpfix.integrations.sequence_parallel.facts import SequenceParallelFacts
    from hf_ddpfix.plan.types import RunFacts

    sp = {k: kw.pop(k) for k in ("attn_implementation", "num_heads", "num_kv_heads", "parallelism_sp_size",
                                 "parallelism_sp_backend", "parallelism_sp_attn", "parallelism_config_available")
          if k in kw}
    base = dict(attn_implementation="sdpa", num_heads=32, num_kv_heads=8)
    return RunFacts(**{"parallel": "ddp", "world_size": 8, **kw}, sequence_parallel=SequenceParallelFacts(**{**base, **sp}))


def test_plan_says_n_the_data_parallel_degree_and_heads_per_rank():
    from hf_ddpfix.config.options import DDPFixConfig
    from hf_ddpfix.plan.resolve import resolve_plan

    plan = resolve_plan(_facts(), DDPFixConfig.from_env({}, sequence_parallel=4))
    d = plan.sequence_parallel
    assert d.value == "N=4 DP=2" and d.changed
    assert "8 of 32 heads/rank" in d.reason and "2 data-parallel group(s)" in d.reason
    assert "sequence_parallel" in plan.report()
    assert resolve_plan(_facts(), DDPFixConfig()).sequence_parallel.value is None  # unset: nothing changes


def test_plan_reads_the_env_variable_and_parallelism_config():
    from hf_ddpfix.config.options import DDPFixConfig
    from hf_ddpfix.plan.resolve import resolve_plan

    cfg = DDPFixConfig.from_env({"HF_DDPFIX_SEQUENCE_PARALLEL": "2"})
    assert resolve_plan(_facts(), cfg).sequence_parallel.value == "N=2 DP=4"
    got = resolve_plan(_facts(parallelism_sp_size=8, parallelism_sp_backend="torch"), DDPFixConfig())
    assert got.sequence_parallel.value == "N=8 DP=1 via parallelism_config"
    assert "ParallelismConfig" in got.sequence_parallel.reason and "stand down" in got.sequence_parallel.reason
    with pytest.raises(ValueError, match="HF_DDPFIX_SEQUENCE_PARALLEL='x'"):
        DDPFixConfig.from_env({"HF_DDPFIX_SEQUENCE_PARALLEL": "x"})


def test_under_fsdp2_the_plan_shards_the_sequence_and_says_so():
    """The Trainer path under accelerate's FSDP2 (run in tests/test_fsdp_features.py)."""
    from hf_ddpfix.config.options import DDPFixConfig
    from hf_ddpfix.plan.resolve import resolve_plan

    d = resolve_plan(_facts(parallel="fsdp", fsdp_version=2), DDPFixConfig.from_env({}, sequence_parallel=2))
    d = d.sequence_parallel
    assert d.value == "N=2 DP=4" and "under FSDP2 the parameters are sharded over all 8 ranks" in d.reason, d


@pytest.mark.parametrize(("facts", "n", "match"), [
    (dict(attn_implementation="eager"), 2, "attn_implementation='sdpa'"),
    (dict(num_heads=6, num_kv_heads=6), 4, "6 attention heads are not divisible by sequence_parallel=4"),
    (dict(world_size=6), 4, "world size 6 is not a multiple of 4"),
    (dict(parallel="single", world_size=1), 2, "shares each sequence between N processes.*FSDP2"),
    (dict(parallel="fsdp", fsdp_version=1), 2, "FSDP1 is not tested with sequence parallelism"),
    (dict(parallelism_sp_size=4, parallelism_sp_backend="torch"), 2, "contradicts ParallelismConfig"),
    (dict(parallelism_sp_size=4, parallelism_sp_backend="deepspeed", parallel="deepspeed"), 2,
     r"sequence_parallel=2 \(argument\) contradicts ParallelismConfig\(sp_size=4\)"),
])
def test_combinations_that_cannot_work_are_a_plan_error_naming_setting_and_fix(facts, n, match):
    from hf_ddpfix.config.options import DDPFixConfig
    from hf_ddpfix.plan.resolve import resolve_plan
    from hf_ddpfix.plan.types import PlanError

    with pytest.raises(PlanError, match=match) as err:
        resolve_plan(_facts(**facts), DDPFixConfig.from_env({}, sequence_parallel=n))
    assert "sequence_parallel" in str(err.value)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("nproc", "ga"), [(2, 2), (4, 3)])
def test_trainer_with_sequence_parallel_equals_the_run_without_it_and_one_process(tmp_path, nproc, ga):
    """One process with the whole global batch, and the same world without SP, are the references. World 2: N=2;
    world 4: DP2 x SP2 with gradient accumulation 3 and unequal token counts; SGD without clipping and AdamW with
    clipping; patch_trainer(sequence_parallel=2) and HF_DDPFIX_SEQUENCE_PARALLEL=2. evaluate() and predict() run
    sharded. World 2 also: tiled MLP + tiled loss + non-reentrant checkpointing + activation offload under SP, and
    the zero-code route (patches/ on PYTHONPATH, HF_DDPFIX_SEQUENCE_PARALLEL=2, a plain Trainer)."""
    import os

    from launch import ROOT, torchrun

    one, out = tmp_path / "one.pt", tmp_path / "spt.json"
    # world 2: + composition and patches/, + Qwen2.5-VL LoRA (images on some ranks only, a step without any)
    compose = ("--compose", "--vlm") if nproc == 2 else ()
    lc = ("--long-context",)  # long-context layers under SP (Llama, Qwen3; + tiled MLP + tiled loss), fp64
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "patches"), str(ROOT)]),  # the zero-code route, as a user
           "HF_DDPFIX_SEQUENCE_PARALLEL": "2"} if compose else None  # launches it (read by the first case)
    torchrun("sp_trainer.py", str(one), "--ga", str(ga), "--single-for", str(nproc), *compose, *lc, nproc=1, timeout=300)
    torchrun("sp_trainer.py", str(out), "--sp", "2", "--ga", str(ga), "--single", str(one), *compose, *lc, nproc=nproc,
             timeout=500, env=env)
    records = json.loads(out.read_text())
    by_case = {r["case"]: r for r in records}
    lc_cases = {"trainer/long_context_llama", "trainer/long_context_qwen3", "trainer/long_context_tiled"}
    assert set(by_case) == {"trainer/sgd", "trainer/adamw_clip"} | lc_cases | (
        {"trainer/compose", "trainer/patches", "trainer/vlm"} if compose else set())
    assert all(r["ok"] for r in records), records
    micro = 2 * ga  # micro-batches per run: 2 optimizer steps x gradient accumulation
    for r in records:
        assert r["plan"] == f"N=2 DP={nproc // 2}" and r["attention_calls"] > 0
        vlm = r["case"] == "trainer/vlm"  # 3 steps, batch 1, 4 evaluation samples
        micro = (3 if vlm else 2) * ga
        assert r["sharded_batches"] == 2 * micro  # both batches of the group, every micro-batch
        assert r["ddp_find_unused_false"] == micro  # every sharded forward ran under DDP(find_unused_parameters=False)
        # transformers 5.0's Qwen-VL returns rope_deltas beside the logits, one per row of the group's padded
        # batch: its predict() runs unsharded (counted with that reason), its evaluate() sharded
        # (transformers 5.24's Qwen-VL adds image outputs on image batches only: those predict() batches run
        # unsharded the same way, counted with the field names; the others sharded)
        rope = {k for k in r["sp_fallbacks"] if vlm and k.startswith("prediction outputs [")}
        # evaluate() + predict(), both batches of the group each
        full = 2 * 2 * (4 // nproc if vlm else 8 // (2 * nproc))
        if rope:  # evaluate() sharded whole; predict() at least partly unsharded (exact either way, below)
            assert full // 2 <= r["eval_sharded_batches"] < full, (r["eval_sharded_batches"], rope)
        else:
            assert r["eval_sharded_batches"] == full
        assert r["one_process"] is not None and max(r["one_process"][k] for k in (
            "weight_diff", "loss_diff", "eval_diff", "logits_diff")) <= 1e-5  # vs one process too
        if rope:  # the unsharded prediction's attention calls, counted by the wrapper
            rope.add("no sequence-parallel batch active (unsharded forward)")
        assert set(r["sp_fallbacks"]) == rope, r["sp_fallbacks"]  # nothing else ran unsharded
    _long_context_layers_ran_sharded_on_every_rank([by_case[c] for c in sorted(lc_cases)], nproc, ga)
    # clipping measures the norm on every release, so its logged grad norms were compared (< 5.3 logs none
    # without clipping: hist_diff then requires both runs to log none)
    assert all(g is not None for g in by_case["trainer/adamw_clip"]["grad_norms_sp"])
    if compose:  # VLM: the decoder sharded after the image merge; text-only micro-batches tied by parameter_usage
        vlm = by_case["trainer/vlm"]
        assert vlm["vision_sharded_forwards"] >= 3 * ga and vlm["find_unused_parameters"] is False
        assert vlm["full_sequence_attention_calls"] > 0 and vlm["usage"]["grads_reset"] > 0  # no image in step 3
        assert vlm["vision_weights_moved"] == vlm["ref_vision_weights_moved"] > 0
        micro = 2 * ga
        ck, plain = by_case["trainer/compose"], by_case["trainer/sgd"]
        # the checkpointed backward recomputed the sharded attention of every layer of every micro-batch
        # (without the kept batch: CheckpointError); evaluation's forwards are the same in both runs
        assert ck["attention_calls"] - plain["attention_calls"] == micro * ck["layers"]
        tiled_loss, tiled_mlp, offload = (ck["counts"][k] for k in ("tiled_loss", "tiled_mlp", "offload"))
        assert tiled_loss["ran"] == micro and not tiled_loss["fallbacks"]  # the loss head ran on every shard
        assert tiled_mlp["ran"] > 0 and not tiled_mlp["fallbacks"]
        assert ck["plan_offload"] is True and offload["ran"] == micro and offload["amounts"]["copies"] > 0
        assert not offload["fallbacks"]
        patches = by_case["trainer/patches"]
        # the sitecustomize's own patch, N from the launch's environment (no hf_ddpfix call in that case)
        assert patches["patched_at_start"] and patches["env_from_launch"] and patches["via"] == "patches"


def _long_context_layers_ran_sharded_on_every_rank(records: list[dict], nproc: int, ga: int) -> None:
    """long_context="all" under SP through the Trainer (sp_trainer.py --long-context): fp64 LoRA Llama and Qwen3
    (AdamW wd 0.1, clipping 1.0), Llama + tiled MLP + tiled loss (SGD), 3-token tiles, vs stock DDP and one process:
    1e-12 (measured <= 1.6e-13); tiled 3e-9 / 2.5e-7 (measured 1.24e-9 / 1.2e-7: the head's fp32 chunks). Every rank:
    each training attention call sharded inside a patched layer, no fallback (before: ['shift_labels'] sent all stock)."""
    for r in records:
        tiled = r["case"] == "trainer/long_context_tiled"
        limit = 3e-9 if tiled else 1e-12
        assert r["weight_diff"] <= limit and r["one_process"]["weight_diff"] <= limit, r
        assert max(r["grad_norm_diff"], r["logits_diff"]) <= (2.5e-7 if tiled else 1e-12), r
        assert len(r["per_rank_trained"]) == nproc
        for m in r["per_rank_trained"]:
            assert m["long_context"]["ran"] == m["sequence_parallel"]["ran"] == 2 * 2 * 2 * ga, m  # layers x (fwd+recompute) x steps x ga
            assert (m["tiled_mlp"]["ran"] > 0 and m["tiled_loss"]["ran"] == 2 * ga) == tiled, m
            assert not any(m[k]["fallbacks"] for k in m), m


def test_parallelism_config_means_hf_ddpfix_ulysses_under_ddp_and_deepspeed_and_names_deepspeed_gaps():
    from hf_ddpfix.config.options import DDPFixConfig
    from hf_ddpfix.plan.resolve import resolve_plan

    pc = dict(parallelism_sp_size=2, parallelism_sp_backend="deepspeed")
    ddp = resolve_plan(_facts(**pc), DDPFixConfig()).sequence_parallel
    assert ddp.value == "N=2 DP=4 via parallelism_config" and "ParallelismConfig.sp_size" in ddp.reason
    same = resolve_plan(_facts(**pc), DDPFixConfig.from_env({}, sequence_parallel=2)).sequence_parallel
    assert same.value == "N=2 DP=4 via parallelism_config"  # the same N twice is no conflict
    ds = resolve_plan(_facts(parallel="deepspeed", parallelism_sp_attn="sdpa", **pc), DDPFixConfig()).sequence_parallel
    assert ds.value == "N=2 DP=4 via parallelism_config"
    assert "replaces DeepSpeed's Ulysses engine" in ds.reason and "plain data parallelism over all 8" in ds.reason
    # an attention hf_ddpfix cannot wrap: DeepSpeed's engine runs as stock, its gaps said
    fa = resolve_plan(_facts(parallel="deepspeed", parallelism_sp_attn="flash_attention_2",
                             attn_implementation="flash_attention_2", **pc), DDPFixConfig()).sequence_parallel
    assert fa.value == "deepspeed" and "sp_size x too large" in fa.reason and "mean of" in fa.reason
    fsdp = resolve_plan(_facts(parallel="fsdp", **pc), DDPFixConfig()).sequence_parallel
    assert fsdp.value is False and "left to accelerate as stock" in fsdp.reason
    plain_ds = resolve_plan(_facts(parallel="deepspeed"), DDPFixConfig.from_env({}, sequence_parallel=2))
    assert plain_ds.sequence_parallel.value == "N=2 DP=4" and "every stage averages" in plain_ds.sequence_parallel.reason
    old = resolve_plan(_facts(parallelism_config_available=False), DDPFixConfig.from_env({}, sequence_parallel=2))
    assert "has no ParallelismConfig (needs >= 1.12)" in old.sequence_parallel.reason


def test_sequence_parallel_one_is_off_with_a_reason():
    from hf_ddpfix.config.options import DDPFixConfig
    from hf_ddpfix.plan.resolve import resolve_plan

    d = resolve_plan(_facts(), DDPFixConfig.from_env({}, sequence_parallel=1)).sequence_parallel
    assert d.value is False and "whole sequences" in d.reason


# ------------------------------------------------------------------------------------------------ projection


def test_projection_is_the_one_gpu_budget_at_l_over_n_plus_the_all_to_all_buffers():
    from hf_ddpfix.ops.offload.budget import max_tokens
    from hf_ddpfix.ops.sequence_parallel.memory import (
        project_sequence_parallel,
        ulysses_buffer_bytes_per_token,
    )

    gib = 1 << 30
    shape = dict(layers=32, hidden=4096, heads=32, kv_heads=8)
    budget = dict(working_bytes_per_token=100 * 1024, fixed_device_bytes=18 * gib, device_budget_bytes=80 * gib,
                  host_budget_bytes=128 * gib)
    # Llama-8B bf16: q and the output 8 KiB, k and v 2 KiB each per token; send + receive of both exchanges
    assert ulysses_buffer_bytes_per_token(hidden=4096, heads=32, kv_heads=8, sp=8) == 2 * (8 + 2 + 2 + 8) * 1024
    assert ulysses_buffer_bytes_per_token(hidden=4096, heads=32, kv_heads=8, sp=1) == 0
    # KV heads fewer than N: replicated, so the k/v buffers grow
    assert ulysses_buffer_bytes_per_token(hidden=512, heads=8, kv_heads=2, sp=4) == 2 * (1024 + 2 * 2 * 256 + 1024)
    one = project_sequence_parallel(sp=1, **shape, **budget)
    assert one.tokens_per_rank == max_tokens(layers=32, bytes_per_token_per_layer=8192, **budget)
    rows = [project_sequence_parallel(sp=n, **shape, **budget) for n in (2, 4, 8)]
    for r in rows:
        assert r.sequence_tokens == r.sp * r.tokens_per_rank
        assert 0 < r.tokens_per_rank < one.tokens_per_rank  # the buffers cost tokens per GPU
        assert r.device_gib_per_rank <= 80 and r.host_gib_per_rank <= 128
    assert rows[-1].sequence_tokens > 7 * one.tokens_per_rank * 0.8
    with pytest.raises(ValueError, match="sp=0"):
        ulysses_buffer_bytes_per_token(hidden=4096, heads=32, kv_heads=8, sp=0)
    with pytest.raises(ValueError, match="not divisible"):
        project_sequence_parallel(sp=3, **shape, **budget)


def test_the_batch_ends_with_the_training_step_so_a_callback_forward_runs_unsharded():
    """The sharded batch stays active after the forward for the checkpointed backward; once the training step
    (forward + backward) returns it must end, or a forward a callback runs before the next micro-batch would
    go through Ulysses on unsharded input."""
    from contextlib import ExitStack
    from types import SimpleNamespace

    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_ddpfix.integrations.sequence_parallel.attention import activate_batch, active_batch
    from hf_ddpfix.integrations.sequence_parallel.trainer import attach_sequence_parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
        documents = torch.zeros(1, 8, dtype=torch.long)

        def stock_training_step(*args, **kwargs):  # what compute_loss leaves behind for the backward
            activate_batch(documents)
            return "loss"

        trainer = SimpleNamespace(compute_loss=lambda *a, **k: None, prediction_step=lambda *a, **k: None,
                                  training_step=stock_training_step, is_world_process_zero=lambda: True)
        with ExitStack() as stack:
            attach_sequence_parallel(trainer, model, sp_size=1, stack=stack)
            assert trainer.training_step() == "loss"
            assert active_batch() is None
        assert trainer.training_step is stock_training_step  # undone
    finally:
        dist.destroy_process_group()
