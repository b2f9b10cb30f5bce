"""The plan's FSDP2 decisions (hf_ddpfix/plan/fsdp.py) and the facts they read (integrations/fsdp/units.py), in one
process: which classes become units, what is folded, when the dummy image and the evaluation sync are not needed.
The multi-process proof is tests/test_fsdp_trainer.py."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn
from zoo import MORE_VLMS, ZERO_DISCOVERED, ZOO

from hf_ddpfix.config.options import DDPFixConfig
from hf_ddpfix.integrations.fsdp import FsdpFacts, gather_fsdp_facts, repeated_block_classes
from hf_ddpfix.plan.fsdp import (
    check_fsdp_loading,
    decide_fsdp_shared,
    decide_fsdp_units,
    fsdp_unit_classes,
    fsdp_units_ours,
)
from hf_ddpfix.plan.resolve import resolve_plan
from hf_ddpfix.plan.types import PlanError, RunFacts


def _facts(fsdp: FsdpFacts, **kw) -> RunFacts:
    base = dict(parallel="fsdp", world_size=2, fsdp_version=2, is_peft=True, checkpointing="non_reentrant")
    return RunFacts(**{**base, **kw}, fsdp=fsdp)


class _Trainer:
    """The one attribute the facts read: ``accelerator.state.fsdp_plugin``."""

    def __init__(self, plugin):
        self.accelerator = type("A", (), {"state": type("S", (), {"fsdp_plugin": plugin})()})()


def _plugin(**kw):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **kw)


@pytest.mark.parametrize("name, lacking", [("gemma3", "SiglipTextEmbeddings"), ("llava", "CLIPTextEmbeddings"),
                                           ("aya_vision", "SiglipTextEmbeddings"), ("llava_next", "CLIPTextEmbeddings"),
                                           ("paligemma", "SiglipTextEmbeddings")])
def test_units_are_the_decoder_layers_when_no_split_modules_names_classes_the_model_lacks(name, lacking):
    model = {**ZOO, **ZERO_DISCOVERED, **MORE_VLMS}[name].model(0)
    facts = gather_fsdp_facts(_Trainer(_plugin()), model)
    assert lacking not in facts.present
    # transformers 5.23 names the absent class; 5.0 names none for LLaVA / Aya Vision and only present classes
    # for Gemma 3: the units must be the decoder layers either way
    names_it = lacking in facts.no_split
    decision = decide_fsdp_units(_facts(facts, is_vlm=True), DDPFixConfig())
    classes = fsdp_unit_classes(decision)
    # changed from stock where the classes differ from _no_split_modules (5.0's LLaVA-NeXT names the layer only)
    assert fsdp_units_ours(decision) and decision.changed == (tuple(classes) != tuple(facts.no_split))
    assert len(classes) == 1 and classes[0].endswith("DecoderLayer"), decision
    assert "folded" in decision.reason
    assert (f"not in the model: {lacking}" in decision.reason) == names_it, decision.reason
    have = {type(m).__name__ for m in model.modules()}
    assert set(classes) <= have and not set(classes) & set(facts.skippable)


def test_vision_blocks_never_become_units_and_the_stabiliser_and_eval_sync_stand_down():
    model = ZOO["qwen2_5_vl"].model(0)
    facts = gather_fsdp_facts(_Trainer(_plugin()), model)
    assert "Qwen2_5_VLVisionBlock" in facts.present and "Qwen2_5_VLVisionBlock" in facts.skippable
    assert facts.folded == ("model.visual",)
    plan = resolve_plan(_facts(facts, is_vlm=True, trainable_vision_params=True, vlm_adapter="qwen2_5_vl"))
    assert plan.fsdp_units.value == "Qwen2_5_VLDecoderLayer"
    assert plan.parameter_usage.value is True and "per FSDP unit" in plan.parameter_usage.reason
    assert plan.vlm_stabilizer.value is False and "no unit of their own" in plan.vlm_stabilizer.reason
    assert plan.vlm_eval_sync.value is False and "same units in the same order" in plan.vlm_eval_sync.reason
    assert "safe fallback" not in plan.report()


def test_a_model_without_no_split_modules_gets_its_repeated_blocks():
    model = ZOO["llama"].model(0)
    assert repeated_block_classes(model) == ["LlamaDecoderLayer"]
    facts = FsdpFacts(no_split=(), present=(), repeated=("LlamaDecoderLayer",))
    decision = decide_fsdp_units(_facts(facts), DDPFixConfig())
    assert decision.value == "LlamaDecoderLayer" and "is empty: classes of its repeated blocks" in decision.reason


def test_layerdrop_stacks_are_folded_into_the_root():
    model = ZOO["bart_layerdrop"].model(0)
    facts = gather_fsdp_facts(_Trainer(_plugin()), model)
    decision = decide_fsdp_units(_facts(facts), DDPFixConfig())
    assert decision.value == "root" and fsdp_unit_classes(decision) == ()
    assert "only blocks a rank may skip" in decision.reason


def test_layerdrop_is_found_by_structure_on_any_model():
    """A module's ``layerdrop`` rate > 0 folds its stacks (OPT: the decoder's; a Llama given one the same way);
    a rate of 0 or none folds nothing."""
    from zoo import MORE_TEXT

    from hf_ddpfix.integrations.fsdp.wrap import layerdrop_stacks

    opt = MORE_TEXT["opt_layerdrop"].model(0)
    assert [type(m[0]).__name__ for m in layerdrop_stacks(opt)] == ["OPTDecoderLayer"]
    facts = gather_fsdp_facts(_Trainer(_plugin()), opt)
    decision = decide_fsdp_units(_facts(facts), DDPFixConfig())
    assert decision.value == "root" and "model.decoder.layers" in decision.reason
    assert facts.folded_bytes == 4 * sum(p.numel() for p in opt.base_model.model.model.decoder.layers.parameters())
    assert "cost: their parameters (563 KiB) are all-gathered whole on every rank" in decision.reason
    llama = ZOO["llama"].model(0)
    assert layerdrop_stacks(llama) == []
    inner = llama.base_model.model.model
    inner.layerdrop = 0.2  # a model keeping its rate on the module, not in its config
    assert layerdrop_stacks(llama) == [inner.layers]
    inner.layerdrop = 0.0
    assert layerdrop_stacks(llama) == []


def test_an_explicit_class_list_is_honoured_where_no_rank_may_skip_its_classes():
    safe = FsdpFacts(user_classes=("Qwen2_5_VLDecoderLayer",), skippable=("Qwen2_5_VLVisionBlock",))
    plan = resolve_plan(_facts(safe, is_vlm=True, trainable_vision_params=True, vlm_adapter="qwen2_5_vl"))
    assert plan.fsdp_units.value is False and "explicit fsdp_transformer_layer_cls_to_wrap kept" in plan.fsdp_units.reason
    assert plan.vlm_stabilizer.value is False  # no unit in the tower


#: a family without a dummy and the ``<DecoderLayer>,<VisionBlock>`` list its users write (issue 45: GLM-4V before it
#: had a dummy died at step 2, gloo "41088 vs 12224 bytes", as in stock)
NO_DUMMY = FsdpFacts(user_classes=("Glm4vTextDecoderLayer", "Glm4vVisionBlock"), no_split=("Glm4vTextDecoderLayer",
                     "Glm4vVisionBlock"), present=("Glm4vTextDecoderLayer", "Glm4vVisionBlock"),
                     skippable=("Glm4vVisionBlock",), fold_only=("Glm4vVisionBlock",), folded=("model.visual",),
                     folded_bytes=3 * 2**20, total_bytes=40 * 2**20, no_dummy="no dummy image from the config")


def test_an_explicit_list_naming_classes_no_dummy_runs_is_folded_out_with_its_cost():
    """Issue 45, item 2: a class of the user's list with an instance in a subtree a rank may skip, which no dummy
    runs, is folded out of the list (the plan's units = the list less it, applied as the plan's own units are), the
    cost said; the stabiliser and the evaluation sync then stand down, consistently with the units. Fails when the
    list is kept as given (``_user_units`` returning ``Decision(False)``: checked by hand 2026-12-02)."""
    plan = resolve_plan(_facts(NO_DUMMY, is_vlm=True, trainable_vision_params=True))
    units = plan.fsdp_units
    assert fsdp_units_ours(units) and units.changed and fsdp_unit_classes(units) == ("Glm4vTextDecoderLayer",)
    assert "explicit fsdp_transformer_layer_cls_to_wrap less Glm4vVisionBlock" in units.reason, units.reason
    assert "(model.visual) that no dummy runs (no dummy image from the config)" in units.reason
    assert "cost: their parameters (3.0 MiB) are all-gathered whole on every rank" in units.reason
    assert plan.fsdp_skippable.value == "fold" and "no dummy" in plan.fsdp_skippable.reason
    assert plan.parameter_usage.value is True
    assert plan.vlm_stabilizer.value is False and plan.vlm_eval_sync.value is False, plan.report(width=None)
    # nothing left of the list but risky classes: the root (accelerate's embedding and head units)
    only = decide_fsdp_units(_facts(dataclasses.replace(NO_DUMMY, user_classes=("Glm4vVisionBlock",)), is_vlm=True),
                             DDPFixConfig())
    assert only.value == "root" and "no class left" in only.reason
    # parameter_usage disabled: folding cannot keep the reduce-scatters equal; the list is kept, said so
    off = resolve_plan(_facts(NO_DUMMY, is_vlm=True, trainable_vision_params=True), DDPFixConfig(parameter_usage=False))
    assert off.fsdp_units.value is False and "parameter_usage is disabled" in off.fsdp_units.reason
    assert "mixed batches fail" in off.fsdp_units.reason and off.fsdp_skippable.value is None


def test_an_explicit_list_on_real_models_folds_what_no_dummy_runs_and_keeps_what_one_does():
    """Real tiny models and the lists users write (tests/scripts/fsdp_trainer.py ``tower_wrap_list``): Janus (no
    dummy) loses its vision encoder layer; LLaVA (a dummy) keeps its tower blocks and runs the dummy there, but with
    the stabiliser disabled they are folded out; OPT's LayerDrop decoder layer is folded out (root). The guarantee:
    no class the plan hands accelerate lies in a subtree a rank may skip unless the dummy runs it. Fails (Janus, LLaVA
    disabled, OPT) when ``_user_units`` keeps every list (checked by hand 2026-12-02)."""
    import sys

    from launch import ROOT

    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from fsdp_trainer import tower_wrap_list
    from zoo import MORE_TEXT

    def plan(model, config=None, **kw):
        facts = gather_fsdp_facts(_Trainer(_plugin(transformer_cls_names_to_wrap=tower_wrap_list(model))), model)
        return facts, resolve_plan(_facts(facts, **kw), config or DDPFixConfig())

    facts, janus = plan(MORE_VLMS["janus"].model(0), is_vlm=True, trainable_vision_params=True)
    assert "JanusVisionEncoderLayer" in facts.user_classes and "JanusVisionEncoderLayer" in facts.fold_only
    classes = fsdp_unit_classes(janus.fsdp_units)
    assert "LlamaDecoderLayer" in classes and not set(classes) & set(facts.skippable), janus.fsdp_units
    assert janus.vlm_stabilizer.value is False and janus.vlm_eval_sync.value is False
    facts, llava = plan(ZOO["llava"].model(0), is_vlm=True, trainable_vision_params=True, vlm_adapter="llava")
    assert llava.fsdp_units.value is False and llava.fsdp_skippable.value == "shard"
    assert llava.vlm_stabilizer.value is True and llava.vlm_eval_sync.value is True
    facts, off = plan(ZOO["llava"].model(0), DDPFixConfig(vlm_stabilizer=False), is_vlm=True,
                      trainable_vision_params=True, vlm_adapter="llava")
    assert not set(fsdp_unit_classes(off.fsdp_units)) & set(facts.skippable) and fsdp_units_ours(off.fsdp_units)
    assert "vlm_stabilizer disabled" in off.fsdp_units.reason and off.fsdp_skippable.value == "fold"
    assert off.vlm_stabilizer.value is False and off.vlm_eval_sync.value is False
    facts, opt = plan(MORE_TEXT["opt_layerdrop"].model(0))
    assert facts.user_classes == ("OPTDecoderLayer",) and opt.fsdp_units.value == "root", opt.fsdp_units
    assert "LayerDrop: a random per-layer skip has no dummy" in opt.fsdp_units.reason


def test_an_explicit_list_with_a_dummy_keeps_the_tower_units_and_folds_only_layerdrop():
    """Shard (a dummy runs the tower) and a LayerDrop class in the same list: the tower block keeps its unit (the
    dummy runs it), the LayerDrop class is folded out; the dummy decisions hold. Fails when the list is kept (by hand
    2026-12-02)."""
    facts = FsdpFacts(user_classes=("Dec", "VisBlock", "DropLayer"), skippable=("DropLayer", "VisBlock"),
                      fold_only=("DropLayer",), folded=("model.visual", "model.drop"), folded_bytes=5 * 2**20,
                      shardable_bytes=4 * 2**20, total_bytes=40 * 2**20, dummy="fam", dummy_tokens=4, tower_params=10)
    plan = resolve_plan(_facts(facts, is_vlm=True, trainable_vision_params=True, vlm_adapter="fam"))
    assert plan.fsdp_skippable.value == "shard" and fsdp_unit_classes(plan.fsdp_units) == ("Dec", "VisBlock")
    assert "less DropLayer" in plan.fsdp_units.reason and "(1.0 MiB)" in plan.fsdp_units.reason
    assert "run the fam dummy there" in plan.fsdp_units.reason
    assert plan.vlm_stabilizer.value is True and plan.vlm_eval_sync.value is True


@pytest.mark.parametrize("name, lacking", [("gemma3", "SiglipTextEmbeddings"), ("llava", "CLIPTextEmbeddings")])
def test_parameter_usage_off_drops_the_classes_the_model_lacks_from_accelerates_default(name, lacking):
    """Issue 45: with ``parameter_usage`` off the plan does not choose the units, but accelerate's default from
    ``_no_split_modules`` names classes the model lacks ("Could not find the transformer layer class" in
    prepare): the classes that exist are handed to accelerate instead, said so; with tower blocks among them the
    evaluation sync is not called unnecessary. Fails when ``_accelerates_units`` keeps accelerate's default (by hand
    2026-12-02)."""
    from hf_ddpfix.plan.vision import decide_eval_sync, fsdp_eval_sync

    model = {**ZOO, **MORE_VLMS}[name].model(0)
    facts = gather_fsdp_facts(_Trainer(_plugin()), model)
    if lacking not in facts.no_split:
        pytest.skip(f"this transformers' {name} names no absent class")
    run = _facts(facts, is_vlm=True, trainable_vision_params=True, vlm_adapter=name)
    config = DDPFixConfig(parameter_usage=False)
    units = decide_fsdp_units(run, config)
    have = {type(m).__name__ for m in model.modules()}
    assert fsdp_units_ours(units) and set(fsdp_unit_classes(units)) == set(facts.present) <= have, units
    assert f"less what the model lacks: {lacking}" in units.reason and "Could not find" in units.reason
    assert "not needed" not in fsdp_eval_sync(run, units, decide_eval_sync(run, config)).reason


def test_explicit_classes_from_the_plugin_are_the_users_and_ours_are_not():
    from hf_ddpfix._compat import fsdp_wrap_classes, set_fsdp_wrap_classes

    plugin = _plugin(transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    assert fsdp_wrap_classes(plugin) == (("LlamaDecoderLayer",), False)
    assert gather_fsdp_facts(_Trainer(plugin), ZOO["llama"].model(0)).user_classes == ("LlamaDecoderLayer",)
    mine = _plugin()
    set_fsdp_wrap_classes(mine, ("LlamaDecoderLayer",))
    assert fsdp_wrap_classes(mine) == (("LlamaDecoderLayer",), True)
    assert gather_fsdp_facts(_Trainer(mine), ZOO["llama"].model(0)).user_classes is None


def test_other_policies_and_parameter_usage_off_keep_accelerates_units():
    size = decide_fsdp_units(_facts(FsdpFacts(policy="size_based_wrap", folded=("model.visual",))), DDPFixConfig())
    assert size.value is False and "size_based_wrap decides the units" in size.reason
    off = decide_fsdp_units(_facts(FsdpFacts(present=("LlamaDecoderLayer",))), DDPFixConfig(parameter_usage=False))
    assert off.value is False and "parameter_usage disabled" in off.reason
    assert decide_fsdp_units(_facts(FsdpFacts(), fsdp_version=1), DDPFixConfig()).value is None
    assert decide_fsdp_units(RunFacts(parallel="ddp", world_size=2), DDPFixConfig()).value is None


def test_a_tied_tensor_held_beyond_the_embeddings_joins_one_fsdp_group():
    """BART: ``model.shared``'s weight is also ``encoder.embed_tokens``', ``decoder.embed_tokens``' and (LoRA around
    it) ``lm_head``'s; accelerate keeps only the input / output embedding together, so the plan has every holder
    join one group. A tie between the input and output embedding only (OPT, Llama) needs nothing."""
    import dataclasses

    facts = gather_fsdp_facts(_Trainer(_plugin()), ZOO["bart_layerdrop"].model(0))
    assert facts.carved == ("model.shared", "lm_head") and facts.wrapped_tied_head == "lm_head", facts
    assert ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens",
            "lm_head.base_layer") in facts.shared, facts.shared
    decision = decide_fsdp_shared(_facts(facts))
    assert decision.value is True and decision.changed, decision
    assert "model.encoder.embed_tokens, model.decoder.embed_tokens" in decision.reason, decision.reason
    plan = resolve_plan(_facts(facts))
    assert plan.fsdp_shared.value is True and plan.fsdp_units.value == "root"  # LayerDrop stacks folded
    assert decide_fsdp_shared(_facts(dataclasses.replace(facts, wrapped=True))).value is False
    assert decide_fsdp_shared(RunFacts(parallel="ddp", world_size=2)).value is None
    for name in ("opt_layerdrop", "llama"):
        from zoo import MORE_TEXT

        other = gather_fsdp_facts(_Trainer(_plugin()), {**ZOO, **MORE_TEXT}[name].model(0))
        assert decide_fsdp_shared(_facts(other)).value is None, (name, other.shared, other.carved)
        assert resolve_plan(_facts(other)).fsdp_shared.value is None


def test_cpu_ram_efficient_loading_that_accelerate_cannot_prepare_is_refused_before_step_one():
    """accelerate 1.15's ``cpu_ram_efficient_loading`` fails in stock for BART: its persistent ``final_logits_bias``
    (no DTensor: ``'Tensor' object has no attribute 'device_mesh'``) and LoRA around the tied ``lm_head``
    (``tie_weights``: ``KeyError: attribute 'weight' already exists``). The plan refuses the tied head, naming the
    setting; the persistent buffers it handles (broadcast, loaded as non-persistent: integrations/fsdp/buffers.py,
    said in ``fsdp_units``; trained under fsdp.yaml in tests/test_fsdp_trainer.py); without that loading, with a
    4-bit base (accelerate skips the path) or for Llama nothing is refused."""
    import dataclasses

    bart = gather_fsdp_facts(_Trainer(_plugin()), ZOO["bart_layerdrop"].model(0))
    assert bart.persistent_buffers == ("base_model.model.final_logits_bias",) and not bart.ram_efficient
    check_fsdp_loading(_facts(bart))  # the loading is off: nothing to refuse
    on = dataclasses.replace(bart, ram_efficient=True)
    with pytest.raises(PlanError, match="fsdp_cpu_ram_efficient_loading: false") as err:
        resolve_plan(_facts(on))
    assert "final_logits_bias" not in str(err.value) and "lm_head" in str(err.value), err.value
    buffers_only = _facts(dataclasses.replace(on, wrapped_tied_head=""))
    assert "final_logits_bias" in check_fsdp_loading(buffers_only)
    assert "broadcast from rank 0" in resolve_plan(buffers_only).fsdp_units.reason
    with pytest.raises(PlanError, match="attribute 'weight' already exists"):
        check_fsdp_loading(_facts(dataclasses.replace(on, persistent_buffers=())))
    check_fsdp_loading(_facts(dataclasses.replace(on, params4bit=True)))
    check_fsdp_loading(RunFacts(parallel="ddp", world_size=2, fsdp=on))
    llama = gather_fsdp_facts(_Trainer(_plugin()), ZOO["llama"].model(0))
    check_fsdp_loading(_facts(dataclasses.replace(llama, ram_efficient=True)))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.proj(x)


class _Prefix(nn.Module):
    """A sub-model returning a cache, as a decoder does with ``use_cache=True``."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x, use_cache=False):  # noqa: ANN001, ANN201
        from types import SimpleNamespace

        return SimpleNamespace(past_key_values=[layer(x) for layer in self.layers])


class _CacheReader(nn.Module):
    """PI0's shape, no PI0: the prefix's KV cache feeds another stack in the training forward."""

    def __init__(self):
        super().__init__()
        self.prefix, self.expert = _Prefix(), nn.ModuleList([_Block()])

    def forward(self, x):  # noqa: ANN001, ANN201
        cache = self.prefix(x, use_cache=True).past_key_values
        return self.expert[0](x + sum(cache))


def test_units_inside_a_sub_model_whose_kv_cache_another_part_reads_are_refused_before_step_1():
    """PI0 (its VLM run with ``use_cache=True``, the action expert reading that cache): under FSDP2 with the plan's
    units it failed in backward ("setStorage ... storage of size 0", the family cells 2026-12-02): the cache carries
    gradients into the VLM's decoder layers around their outputs, so their units never all-gather for backward. Now a
    ``PlanError`` before step 1 names the sub-model, for the plan's units and a user's list alike; a toy of the same
    shape (no PI0 anywhere) is found by structure; units outside the sub-model, or no cache read, pass.
    Shown failing (2026-12-02) without ``check_fsdp_cache_units`` in ``decide_fsdp``: no raise."""
    import torch
    import transformers
    from transformers import AutoConfig

    from hf_ddpfix.integrations.fsdp.units import cache_fed_submodels

    toy = _CacheReader()
    assert cache_fed_submodels(toy) == ["prefix"] and cache_fed_submodels(_Prefix()) == []
    facts = gather_fsdp_facts(_Trainer(_plugin()), toy)
    with pytest.raises(PlanError, match=r"prefix runs with use_cache=True .* units of _Block"):
        resolve_plan(_facts(dataclasses.replace(facts, user_classes=("_Block",))))
    resolve_plan(_facts(dataclasses.replace(facts, cache_fed_classes=())))  # no unit inside: nothing to refuse
    if not hasattr(transformers, "PI0ForConditionalGeneration"):
        return  # transformers 5.0 ships no PI0
    with torch.device("meta"):
        pi0 = transformers.PI0ForConditionalGeneration(AutoConfig.for_model("pi0"))
    facts = gather_fsdp_facts(_Trainer(_plugin()), pi0)
    assert facts.cache_fed == ("model.vlm",)
    for f in (facts, dataclasses.replace(facts, user_classes=("GemmaDecoderLayer", "SiglipEncoderLayer"))):
        with pytest.raises(PlanError, match=r"model\.vlm runs with use_cache=True .*GemmaDecoderLayer"):
            resolve_plan(_facts(f))
