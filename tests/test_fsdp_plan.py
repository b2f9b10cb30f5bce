"""The plan's FSDP2 decisions (hf_ddpfix/plan/fsdp.py) and the facts they read (integrations/fsdp/units.py), in one
process: which classes become units, what is folded, when the dummy image and the evaluation sync are not needed.
The multi-process proof is tests/test_fsdp_trainer.py."""

from __future__ import annotations

import pytest
from zoo import MORE_VLMS, ZERO_DISCOVERED, ZOO

from hf_ddpfix.config import DDPFixConfig
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


def test_an_explicit_class_list_is_honoured_and_its_risk_said():
    facts = FsdpFacts(user_classes=("Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"),
                      skippable=("Qwen2_5_VLVisionBlock",), folded=("model.visual",))
    decision = decide_fsdp_units(_facts(facts, is_vlm=True), DDPFixConfig())
    assert decision.value is False and "explicit fsdp_transformer_layer_cls_to_wrap kept" in decision.reason
    assert "Qwen2_5_VLVisionBlock lie inside subtrees a rank may skip" in decision.reason
    safe = FsdpFacts(user_classes=("Qwen2_5_VLDecoderLayer",), skippable=("Qwen2_5_VLVisionBlock",))
    plan = resolve_plan(_facts(safe, is_vlm=True, trainable_vision_params=True, vlm_adapter="qwen2_5_vl"))
    assert plan.fsdp_units.value is False and plan.vlm_stabilizer.value is False  # no unit in the tower


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
