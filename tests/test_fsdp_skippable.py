"""``fsdp_skippable`` (issue 36): the plan folds a subtree a rank may skip into the enclosing FSDP2 unit only while
cheap, else shards it and runs the dummy image; an explicit wrap list naming tower classes is honoured with the dummy.

One process: the pure cost decision (hf_ddpfix/plan/fsdp_skippable.py), the option, and the plan on tiny models.
Multi-process (through the FSDP test device, 2 gloo processes, ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: torch checks
every collective's fingerprint across ranks): :func:`test_tower_units_with_the_dummy_like_stock_ddp`.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from fixtures import prediction_diff
from launch import ROOT, accelerate_launch, fsdp_device_env, torchrun
from zoo import MORE_VLMS, ZERO_DISCOVERED, ZERO_LOADED, ZOO

from hf_ddpfix.config.options import DDPFixConfig
from hf_ddpfix.integrations.fsdp import gather_fsdp_facts
from hf_ddpfix.plan.fsdp import decide_fsdp_skippable, decide_fsdp_units, fsdp_unit_classes
from hf_ddpfix.plan.fsdp_skippable import (
    FOLD_FLOOR_BYTES,
    MAX_REASON,
    SkippableFacts,
    decide_skippable,
    fold_budget,
)
from hf_ddpfix.plan.resolve import resolve_plan
from hf_ddpfix.plan.types import RunFacts

GiB = 2**30
# Llama-3.2-90B-Vision-shaped (issue 36): 20.1 B parameters folded (37.5 GiB bf16) of ~88 B
MLLAMA_90B = dict(folded_bytes=int(37.5 * GiB), total_bytes=int(88e9 * 2), tower_params=900_000_000,
                  dummy_tokens=1601)


def test_budget_is_a_tenth_of_a_ranks_shard_with_a_64_mib_floor():
    assert fold_budget(0, 8) == FOLD_FLOOR_BYTES == 64 * 2**20
    assert fold_budget(int(176e9), 8) == int(0.1 * 176e9 / 8)


@pytest.mark.parametrize("world", [8, 64])
def test_auto_shards_what_exceeds_the_budget_and_folds_what_fits(world):
    big = SkippableFacts(world_size=world, dummy="mllama", **MLLAMA_90B)
    d = decide_skippable(big, "auto")
    assert d.value == "shard" and d.changed and "> budget" in d.reason and "37.5 GiB" in d.reason
    small = SkippableFacts(folded_bytes=10 * 2**20, total_bytes=int(16e9), world_size=world, dummy="llava",
                           tower_params=300_000_000, dummy_tokens=576)
    d = decide_skippable(small, None)
    assert d.value == "fold" and "<= budget" in d.reason and "dummy 576 tok" in d.reason
    # guarantee: under auto a fold never exceeds the budget
    for folded in (2**20, 63 * 2**20, 65 * 2**20, GiB, 40 * GiB):
        f = SkippableFacts(folded_bytes=folded, total_bytes=int(16e9), world_size=world, dummy="x", dummy_tokens=1,
                           tower_params=1)
        assert (decide_skippable(f).value == "fold") == (folded <= fold_budget(int(16e9), world))


def test_forced_modes_the_explicit_wrap_list_and_no_dummy():
    f = SkippableFacts(world_size=8, dummy="qwen2_5_vl", **MLLAMA_90B)
    assert decide_skippable(f, "fold").value == "fold" and "forced" in decide_skippable(f, "fold").reason
    tiny = SkippableFacts(folded_bytes=2**20, total_bytes=2**30, world_size=2, dummy="llava", dummy_tokens=4,
                          tower_params=10)
    assert decide_skippable(tiny, "shard").value == "shard"
    user = SkippableFacts(folded_bytes=2**20, total_bytes=2**30, world_size=2, dummy="llava", user_shards=True)
    assert decide_skippable(user, "fold").value == "shard" and "explicit wrap list" in decide_skippable(user).reason
    none = SkippableFacts(world_size=8, no_dummy="no stabiliser adapter for this family", **MLLAMA_90B)
    d = decide_skippable(none, "shard")
    assert d.value == "fold" and "no dummy (no stabiliser" in d.reason
    assert decide_skippable(SkippableFacts(folded_bytes=0, total_bytes=1, world_size=2)).value is None


def test_the_plan_line_stays_short_and_bad_values_name_the_setting(monkeypatch):
    f = SkippableFacts(world_size=64, dummy="qwen2_5_vl_long_family_name", **MLLAMA_90B)
    for mode in ("auto", "fold", "shard"):
        reason = decide_skippable(f, mode).reason
        assert len(reason) <= MAX_REASON and "docs/plan.md#fsdp_skippable" in reason, reason
        assert len(f"   {'fsdp_skippable':<23} = {'shard':<14} {reason}") <= 160
    with pytest.raises(ValueError, match="fsdp_skippable='both'.*allowed: auto, fold, shard"):
        decide_skippable(f, "both")
    monkeypatch.setenv("HF_DDPFIX_FSDP_SKIPPABLE", "sometimes")
    with pytest.raises(ValueError, match="HF_DDPFIX_FSDP_SKIPPABLE='sometimes'.*allowed: auto, fold, shard"):
        DDPFixConfig.from_env()
    monkeypatch.setenv("HF_DDPFIX_FSDP_SKIPPABLE", "Shard")
    assert DDPFixConfig.from_env().fsdp_skippable == "shard"


class _Trainer:
    def __init__(self, plugin):
        self.accelerator = type("A", (), {"state": type("S", (), {"fsdp_plugin": plugin})()})()


def _plugin(**kw):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **kw)


def _run(facts, **kw) -> RunFacts:
    base = dict(parallel="fsdp", world_size=2, fsdp_version=2, is_peft=True, checkpointing="non_reentrant",
                is_vlm=True, trainable_vision_params=True)
    return RunFacts(**{**base, **kw}, fsdp=facts)


ENTRIES = {**ZOO, **ZERO_DISCOVERED, **ZERO_LOADED, **MORE_VLMS}


@pytest.mark.parametrize("name", ["qwen2_5_vl", "llava", "gemma3", "paligemma", "vipllava"])
def test_shard_makes_tower_units_and_turns_the_dummy_on(name):
    model = ENTRIES[name].model(0)
    facts = gather_fsdp_facts(_Trainer(_plugin()), model)
    assert facts.dummy and facts.shardable_bytes > 0 and facts.total_bytes > facts.shardable_bytes
    auto = resolve_plan(_run(facts))  # tiny towers: within the 64 MiB floor, folded as before
    assert auto.fsdp_skippable.value == "fold" and not set(fsdp_unit_classes(auto.fsdp_units)) & set(facts.skippable)
    plan = resolve_plan(_run(facts), DDPFixConfig(fsdp_skippable="shard"))
    assert plan.fsdp_skippable.value == "shard"
    assert set(fsdp_unit_classes(plan.fsdp_units)) & set(facts.skippable), plan.fsdp_units
    assert plan.vlm_stabilizer.value is True and plan.vlm_eval_sync.value is True
    # the dummy is the stabiliser's: disabled, the plan folds and says why
    off = resolve_plan(_run(facts), DDPFixConfig(fsdp_skippable="shard", vlm_stabilizer=False))
    assert off.fsdp_skippable.value == "fold" and "vlm_stabilizer disabled" in off.fsdp_skippable.reason


def test_an_explicit_wrap_list_naming_tower_blocks_is_honoured_with_the_dummy():
    model = ZOO["llava"].model(0)
    plugin = _plugin(transformer_cls_names_to_wrap=["LlamaDecoderLayer", "CLIPEncoderLayer"])
    facts = gather_fsdp_facts(_Trainer(plugin), model)
    plan = resolve_plan(_run(facts))
    assert plan.fsdp_units.value is False and "run the llava dummy there" in plan.fsdp_units.reason
    assert plan.fsdp_skippable.value == "shard" and "explicit wrap list" in plan.fsdp_skippable.reason
    assert plan.vlm_stabilizer.value is True


def test_mllama_shards_its_cross_attention_layers_and_layerdrop_stays_folded():
    facts = gather_fsdp_facts(_Trainer(_plugin()), ZOO["mllama"].model(0))
    assert facts.dummy == "mllama" and not facts.no_dummy and facts.dummy_tokens == 10  # 5 patches x 2 tiles
    assert "MllamaCrossAttentionDecoderLayer" in facts.skippable and not facts.fold_only
    d = decide_fsdp_skippable(_run(facts), DDPFixConfig(fsdp_skippable="shard"))
    assert d.value == "shard" and "forced" in d.reason, d
    units = decide_fsdp_units(_run(facts), DDPFixConfig(fsdp_skippable="shard"))
    assert {"MllamaCrossAttentionDecoderLayer", "MllamaVisionEncoderLayer"} <= set(fsdp_unit_classes(units))
    assert "run the mllama dummy there" in units.reason
    auto = resolve_plan(_run(facts))  # tiny: within the 64 MiB floor, folded (and says both costs)
    assert auto.fsdp_skippable.value == "fold" and "dummy 10 tok" in auto.fsdp_skippable.reason
    # 90B-shaped facts: over the budget, sharded by cost
    assert decide_skippable(SkippableFacts(world_size=8, dummy=facts.dummy, **MLLAMA_90B)).value == "shard"
    drop = gather_fsdp_facts(_Trainer(_plugin()), ENTRIES["opt_layerdrop"].model(0)
                             if "opt_layerdrop" in ENTRIES else __import__("zoo").MORE_TEXT["opt_layerdrop"].model(0))
    assert decide_fsdp_skippable(_run(drop, is_vlm=False), DDPFixConfig(fsdp_skippable="shard")).value is None


def test_a_cross_attention_value_projection_with_a_bias_folds_and_says_why():
    """Zero states add exactly zero only without a bias on v_proj / o_proj: a model that has one gets no dummy."""
    model = ZOO["mllama"].model(0)
    cross = [m for n, m in model.named_modules() if n.endswith("layers.1.cross_attn.v_proj")][0]
    base = getattr(cross, "base_layer", cross)
    base.bias = torch.nn.Parameter(torch.zeros(base.out_features))
    facts = gather_fsdp_facts(_Trainer(_plugin()), model)
    assert facts.dummy == "" and facts.no_dummy == "cross-attention v_proj has a bias (zero states add non-zero)"
    assert decide_fsdp_skippable(_run(facts), DDPFixConfig(fsdp_skippable="shard")).value != "shard"


@pytest.mark.parametrize("checkpointing", [False, True])
def test_cross_attention_dummy_is_exactly_zero(checkpointing):
    """One process, Mllama (LoRA on the language model, cross-attention layer 1 of 3): a text-only forward and
    backward with :class:`CrossAttentionDummy` attached runs the tower and the cross-attention layer (their LoRA
    gets gradients, all exactly zero), and the loss, the logits and every other gradient equal stock's bit for bit;
    ``finalize`` (no image seen) resets the dummy's gradients to None; greedy ``generate()`` (prefill + cached
    decode steps) gives stock's tokens."""
    from hf_ddpfix.integrations.fsdp.cross_attention import CrossAttentionDummy

    entry = ZOO["mllama"]
    model = entry.model(0).train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    batch = entry.batch(False, 3, 9)

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    logits, grads = step()
    dummy = CrossAttentionDummy(model).attach()
    logits2, grads2 = step()
    assert dummy.dummy_runs == 1 and torch.equal(logits, logits2)
    extra = set(grads2) - set(grads)
    assert extra and all(".layers.1.cross_attn." in n for n in extra), extra
    assert all(torch.equal(grads[n], grads2[n]) for n in grads) and all(not grads2[n].any() for n in extra)
    assert dummy.finalize() is False and all(p.grad is None for m in dummy.parts() for p in m.parameters())
    prompt = {k: v for k, v in batch.items() if k != "labels"}
    model.eval()
    with torch.no_grad():
        ids = model.generate(**prompt, max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
        dummy.remove()
        ref = model.generate(**prompt, max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    assert torch.equal(ids, ref)


class _Peer:
    """A second rank for one process: ``dist.all_reduce(MAX)`` folds its bytes into ours (no process group)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: object) -> None:
        self.bytes: torch.Tensor | None = None
        self.calls = 0

        class Work:
            def wait(self) -> None:
                return None

        def all_reduce(tensor: torch.Tensor, op: object = None, group: object = None, async_op: bool = False) -> Work:
            self.calls += 1
            assert self.bytes is not None and self.bytes.shape == tensor.shape, (self.bytes, tensor)
            tensor.copy_(torch.maximum(tensor, self.bytes))
            return Work()

        monkeypatch.setattr(module, "dist_ready", lambda group=None: True)
        monkeypatch.setattr(module, "collective_device", lambda group=None: torch.device("cpu"))
        monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)


def test_the_dummys_image_flag_rides_in_the_usage_agreement_and_only_a_text_rank_reads_it(monkeypatch):
    """Issue 48: the FSDP2 dummy's "some rank saw an image" is one more byte of the usage agreement's all-reduce
    (``StepImages.fold_into``), no collective of its own. A rank that passed an image knows the answer and does not
    read; a text rank reads the agreement once and resets the tower's gradients to ``None`` exactly where the other
    rank saw no image either; the trainable-set flag bytes keep their place (read late). Fails with the byte left
    out of ``UsageAgreement.agree`` (a KeyError / shape mismatch) or the reset skipped (grads not None)."""
    from hf_ddpfix.integrations.fsdp.grad_reset import StepImages
    from hf_ddpfix.integrations.usage import agreement as agreement_module
    from hf_ddpfix.integrations.usage.agreement import UsageAgreement

    peer = _Peer(monkeypatch, agreement_module)
    tower = torch.nn.Linear(2, 2)

    class Dummy(StepImages):
        process_group = None

        def __init__(self) -> None:
            self._step_images, self._step_forwards = False, 0

        def _reset_modules(self) -> list[torch.nn.Module]:
            return [tower]

    class Usage:  # what fold_into needs of a ParameterUsage
        agreement = UsageAgreement()
        step_seen = None

    dummy, usage = Dummy(), Usage()
    dummy.fold_into(usage)
    n = 3
    # (this rank saw an image, the other rank did) -> (reads, tower grads kept)
    for mine, other, reads, kept in ((True, False, 0, True), (False, True, 1, True), (False, False, 1, False)):
        tower.weight.grad = torch.zeros(2, 2)
        dummy._step_images, dummy._step_forwards = mine, 2
        peer.bytes = torch.tensor([1] * n + [0, 1] + [int(other)], dtype=torch.uint8)  # used all; flag not set
        before = usage.agreement.reads
        unused, flags = usage.agreement.agree(set(), n, None, flag=False, seen=usage.step_seen())
        assert unused == set() and flags == (False, False)
        assert usage.agreement.reads - before == reads, (mine, other)
        if not reads:  # the trainable-set flag bytes in place: read late, "no rank changed its set"
            assert usage.agreement.late_flags() == (False, False)
        assert dummy.finalize_step() is (mine or other)
        assert (tower.weight.grad is not None) is kept, (mine, other)
    assert peer.calls == 3  # the agreement's all-reduce only: the dummy issued none
    dummy._step_forwards = 0
    assert usage.step_seen() is None and dummy.finalize_step() is None  # no forward: nothing carried, no collective


SCRIPT = ROOT / "tests" / "scripts" / "fsdp_trainer.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# Qwen2.5-VL (accumulation 2), Gemma 3 (reentrant asked: the plan runs it non-reentrant), LLaVA,
# LLaVA-OneVision (any-resolution base + tile), SmolVLM (its 5-D pixel layout
# discovered from the config); Mllama (cross-attention layers and its tower as units: the cross-attention dummy,
# hf_ddpfix/integrations/fsdp/cross_attention.py); GLM-4V: its dummy found by structure (no registry entry; issue 45
# item 1). VipLLaVA, Command A Vision, Aya Vision and PaliGemma (LLaVA's dummy path: get_image_features on one
# native-size image) left this launch for CI time (2026-12-02); their plan-level shard test stays in the fast tier
# and their FSDP2 cells (the plan's units and the explicit list, equal to stock DDP) in the family sweep's cells file.
SHARDED = "qwen2_5_vl,gemma3,llava,llava_onevision,smolvlm,mllama,glm4v"
# issue 45 item 2: a family without a dummy (Janus) with the ``<DecoderLayer>,<VisionBlock>`` list its users write:
# the plan folds the vision block out of the list (it crashed at the first mixed step, as stock); and GLM-4V under
# DDP with the stabiliser's dummy (parameter_usage off), in the stock launch
FOLDED, DDP_DUMMY = "janus:explicit", "glm4v:ddpdummy"
TOL = 1.5e-7  # tests/test_fsdp_trainer.py's FSDP2-vs-DDP spread; measured here 3.0e-8 to 1.2e-7 (SmolVLM)
PRED_TOL = 1e-5  # predict() logits (gathered) vs stock DDP: tests/test_fsdp_trainer.py measured 0 to 3.6e-6
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
GENERATE = "qwen2_5_vl,llava,mllama"  # also generate() after train(): image prompt on rank 0, text on rank 1, 3 / 6 tokens  # torch compares every collective's fingerprint across ranks


@pytest.mark.multiprocess
def test_tower_units_with_the_dummy_like_stock_ddp(tmp_path):
    """Through ``accelerate launch --config_file fsdp.yaml`` (the FSDP test device, 2 gloo processes, DETAIL
    collective checks): every family of :data:`SHARDED` twice in one launch, once with an explicit
    ``fsdp_transformer_layer_cls_to_wrap`` naming the vision blocks (tests/scripts/fsdp_trainer.py
    ``tower_wrap_list``) and once with the plan's own units under ``fsdp_skippable=shard``; the tower blocks are
    FSDP2 units, rank 0 / rank 1 / neither / both have an image by step (an all-text step), then ``evaluate()`` and
    ``predict()`` on mixed batches, and ``generate()`` after training (:data:`GENERATE`). Weights equal stock DDP's
    (``find_unused_parameters=True``, DDP as ddp_cpu.yaml gives, launched by the forked torchrun: 37.4 s on
    2026-12-02 where ``accelerate launch`` took 116.6 s in CI; same data) within ``TOL``, evaluation and prediction losses within 1e-5 (measured <= 9.5e-7), and ``predict()``'s
    gathered logits within ``PRED_TOL`` (measured 0 to 1.3e-6 over these families, 2026-12-02; shown able to fail
    with ``PRED_TOL = 1e-7``: 9 of 10 families exceed it).

    The fix is real: the same launch for LLaVA with the dummy and parameter_usage disabled
    (``HF_DDPFIX_VLM_STABILIZER=0 HF_DDPFIX_PARAMETER_USAGE=0``: the plan then keeps the explicit list "as in stock";
    with parameter_usage on it folds the tower classes out of the list instead, issue 45) fails with torch's "Detected mismatch between collectives". For
    Mllama, a build whose cross-attention dummy injects nothing (``CrossAttentionDummy._inject`` returning ``None``)
    fails at its first mixed step (by hand, 2026-11-29: DETAIL "Collectives differ ... Tensor shapes: 129vs 8448");
    with it, Mllama ends bit-equal to stock DDP (0.0), generate() too.

    Issue 45, in the same launches: GLM-4V (its dummy found by structure, no registry entry) in :data:`SHARDED`
    (measured 2026-12-02: 1.1e-7 from stock DDP with either wrap, 4 dummies on rank 0), GLM-4V under DDP with the
    stabiliser's dummy (``parameter_usage`` off, the stock launch: bit-equal to stock DDP, 2 dummies), and Janus (no
    dummy) with the ``LlamaDecoderLayer,JanusVisionEncoderLayer`` list its users write: the plan folds the vision
    block out of the list and the run ends 3.0e-8 from stock DDP (evaluation 4.8e-7); with the list kept as given
    (``_user_units`` broken on purpose, by hand 2026-12-02) the same run fails at its first mixed step with
    "Detected mismatch between collectives" (all-gather 7376 vs 20544 elements).

    Wall (2 cores, 2026-11-28): 136 s lightly loaded (fixed 18 runs + stock DDP 9 + no dummy 1), 319 s loaded;
    2026-11-29 with Mllama (fixed 20 runs + stock DDP 10 + no dummy 1): 241 s (pytest), beside other jobs; 2026-12-02
    with issue 45's runs (fixed 23 + stock DDP 13 + no dummy 1): 542 s on the shared box at load ~10."""
    t0 = time.time()
    fixed = accelerate_launch("fsdp.yaml", SCRIPT, "--mode", "fixed", "--out", str(tmp_path), "--families", SHARDED,
                              "--wraps", "explicit,shard", "--generate", GENERATE, "--extra-runs", FOLDED, timeout=900, env=fsdp_device_env({**OFFLINE, **DETAIL}),
                              extra=("--mixed_precision", "no"))
    log = "\n".join(ln for ln in fixed.stdout.splitlines() if not ln.startswith("full plan:"))  # the cut lines only
    n = len(SHARDED.split(","))
    assert "[fsdp_device] accelerate FSDP2 on CPU/gloo" in log and "FSDP_TRAINER_OK" in log, log[-4000:]
    assert len(re.findall(r"fsdp_skippable\s+= shard\s+fold .* explicit wrap list", log)) == n, log[-6000:]
    assert len(re.findall(r"fsdp_skippable\s+= shard\s+fold .*; forced", log)) == n, log[-6000:]
    assert fixed.stdout.count("run the") >= n and "vlm_stabilizer          = on" in log, log[-6000:]  # whole reasons
    stock = torchrun(SCRIPT, "--mode", "stock", "--out", str(tmp_path), "--families", SHARDED + ",janus", "--generate",
                     GENERATE, "--extra-runs", DDP_DUMMY, timeout=600, env=OFFLINE)  # DDP, forked (test_fsdp_trainer.py)
    assert "FSDP_TRAINER_OK" in stock.stdout, stock.stdout[-4000:]
    for wrap in ("explicit", "shard"):
        for name in SHARDED.split(","):
            ours, ref = torch.load(tmp_path / f"fixed-{wrap}-{name}.pt"), torch.load(tmp_path / f"stock-{name}.pt")
            tower = [u for u in ours["units"] if re.search(r"vision|visual", u)]
            assert ours["wrapped"].startswith("FSDP") and len(tower) >= 2 and not ref["units"], (wrap, name, ours)
            if name == "mllama":  # the cross-attention decoder layer (layers.1) is a unit of its own
                assert any(u.endswith("language_model.layers.1") for u in ours["units"]), ours["units"]
            diff = max((ours["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
            assert diff <= TOL, f"{wrap} {name}: max |W_fsdp2 - W_ddp| = {diff:.2e} > {TOL:.0e}"
            for key in ("eval_loss", "predict_loss"):
                assert abs(ours[key] - ref[key]) <= 1e-5, (wrap, name, key, ours[key], ref[key])
            pred = prediction_diff(ours["predictions"], ref["predictions"])  # the gathered logits, not only the loss
            print(f"predict() logits vs stock DDP: {name} {pred:.2e}")
            assert pred <= PRED_TOL, f"{name}: predict() logits differ from stock DDP's by {pred:.2e} > {PRED_TOL:.0e}"
            if name in GENERATE.split(","):  # greedy tokens per rank (ranks ran 3 and 6 decode forwards)
                assert [g.shape[-1] for g in ours["generated"]] == [3, 6], (name, ours["generated"])
                assert all(torch.equal(a, b) for a, b in zip(ours["generated"], ref["generated"], strict=True))
    # GLM-4V: the structure-found dummy ran on the image-less steps (rank 0 saves: 2 text-only training steps, then
    # evaluation forwards) under FSDP2 (both wraps) and under DDP (parameter_usage off: the stabiliser)
    ours = {w: torch.load(tmp_path / f"fixed-{w}-glm4v.pt") for w in ("explicit", "shard", "ddpdummy")}
    assert all(o["dummies"] >= 2 for o in ours.values()), {w: o["dummies"] for w, o in ours.items()}
    ref = torch.load(tmp_path / "stock-glm4v.pt")
    assert not ours["ddpdummy"]["units"], ours["ddpdummy"]["wrapped"]  # DDP, not FSDP
    diff = max((ours["ddpdummy"]["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
    assert diff <= TOL, f"glm4v DDP with the dummy: max |W - W_stock_ddp| = {diff:.2e}"
    # Janus (no dummy) with its users' list: the vision block folded out of the list (no unit in the vision model),
    # trained to stock DDP's weights
    assert re.search(r"fsdp_units\s+= LlamaDecoderLayer\s+explicit fsdp_transformer_layer_cls_to_wrap less "
                     r"JanusVisionEncoderLayer", log), log[-6000:]
    janus, ref = torch.load(tmp_path / "fixed-explicit-janus.pt"), torch.load(tmp_path / "stock-janus.pt")
    assert janus["wrapped"].startswith("FSDP") and not [u for u in janus["units"] if "vision_model" in u], janus["units"]
    diff = max((janus["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
    assert diff <= TOL, f"janus explicit: max |W_fsdp2 - W_ddp| = {diff:.2e} > {TOL:.0e}"
    for key in ("eval_loss", "predict_loss"):
        assert abs(janus[key] - ref[key]) <= 1e-5, ("janus", key, janus[key], ref[key])
    off = accelerate_launch("fsdp.yaml", SCRIPT, "--mode", "fixed", "--out", str(tmp_path / "off"), "--families",
                            "llava", "--wraps", "explicit", timeout=600, check=False, extra=("--mixed_precision", "no"),
                            env=fsdp_device_env({**OFFLINE, **DETAIL, "HF_DDPFIX_VLM_STABILIZER": "0",
                                                 "HF_DDPFIX_PARAMETER_USAGE": "0"}))
    assert off.returncode != 0 and "FSDP_TRAINER_OK" not in off.stdout, off.stdout[-4000:]
    assert "Detected mismatch between collectives" in off.stdout, off.stdout[-4000:]
    print(f"wall {time.time() - t0:.0f} s")
