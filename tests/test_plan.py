"""resolve_plan: one test per row of the REFERENCES.md §1 failure table, plus overrides and strict mode."""

from pathlib import Path

import pytest

from hf_ddpfix import DDPFixConfig, PlanError, RunFacts, resolve_plan


def ddp(**kw):
    base = dict(parallel="ddp", world_size=2, is_peft=True)
    base.update(kw)
    return RunFacts(**base)


def cfg(**env):
    return DDPFixConfig.from_env({k: str(v) for k, v in env.items()})


NO_USAGE = cfg(HF_DDPFIX_PARAMETER_USAGE=0)  # the plan without the parameter-usage mechanism


def assert_not_known_bad(plan, facts):
    """The combinations of the stock failure table never come out of the plan."""
    kw = plan.ddp_kwargs()
    if plan.parallel != "ddp":
        return
    unused = (facts.trainable_vision_params and not plan.vlm_stabilizer.value) or facts.conditional_params
    unused = unused and not plan.parameter_usage.value  # the mechanism ties every unused parameter in
    assert not (plan.checkpointing.value == "reentrant" and kw["find_unused_parameters"])
    assert not (unused and not kw["find_unused_parameters"] and not plan.hang_guard.value)
    assert not (unused and kw["static_graph"])
    assert not (facts.grad_accum_steps > 1 and kw["static_graph"])


# --- row: no checkpointing, fu=True -> works; we still drop the useless fu=True for LoRA -------------
def test_row_no_checkpointing_lora_gets_fu_false_and_static_graph():
    f = ddp(checkpointing="off")
    plan = resolve_plan(f)
    assert plan.ddp_kwargs() == {"find_unused_parameters": False, "static_graph": True}
    assert plan.find_unused_parameters.changed  # stock picks True for a PeftModel
    assert_not_known_bad(plan, f)


# --- row: fu=False + trainable vision params, ranks differ -> hang; all text -> reduction error ------
def test_row_fu_false_with_trainable_vision_and_no_adapter_falls_back_to_fu_true():
    f = ddp(checkpointing="non_reentrant", is_vlm=True, trainable_vision_params=True, user_find_unused=False)
    plan = resolve_plan(f, NO_USAGE)
    assert plan.ddp_kwargs() == {"find_unused_parameters": True, "static_graph": False}
    assert "find_unused_parameters=False" in plan.corrections[0]
    assert_not_known_bad(plan, f)


def test_row_fu_false_with_trainable_vision_and_stabiliser_keeps_fu_false():
    f = ddp(checkpointing="non_reentrant", is_vlm=True, trainable_vision_params=True, vlm_adapter="qwen2_5_vl",
            user_find_unused=False)
    plan = resolve_plan(f, NO_USAGE)
    assert plan.vlm_stabilizer.value is True
    assert plan.ddp_kwargs() == {"find_unused_parameters": False, "static_graph": True}
    assert plan.corrections == ()


# --- row: reentrant + fu=True -> "ready only once" ---------------------------------------------------
@pytest.mark.parametrize("user_fu", [None, True])
def test_row_reentrant_with_find_unused_switches_to_non_reentrant(user_fu):
    f = ddp(checkpointing="reentrant", user_reentrant=True, user_find_unused=user_fu)
    plan = resolve_plan(f)
    assert plan.checkpointing.value == "non_reentrant"
    assert any("use_reentrant=True" in c for c in plan.corrections)
    assert_not_known_bad(plan, f)


def test_row_reentrant_with_find_unused_raises_in_strict_mode():
    with pytest.raises(PlanError, match="ready only once"):
        resolve_plan(ddp(checkpointing="reentrant", user_reentrant=True, user_find_unused=True), cfg(HF_DDPFIX_STRICT=1))


# --- row: reentrant + fu=False, text -> works (kept when forced) --------------------------------------
def test_row_reentrant_fu_false_text_works_when_reentrant_is_forced():
    plan = resolve_plan(ddp(checkpointing="reentrant"), cfg(HF_DDPFIX_CHECKPOINTING="reentrant"))
    assert plan.checkpointing.value == "reentrant"
    assert plan.ddp_kwargs()["find_unused_parameters"] is False


def test_strict_keeps_explicit_reentrant_when_it_works():
    plan = resolve_plan(ddp(checkpointing="reentrant", user_reentrant=True), cfg(HF_DDPFIX_STRICT=1))
    assert plan.checkpointing.value == "reentrant" and plan.ddp_kwargs()["find_unused_parameters"] is False


def test_forced_reentrant_with_unused_vision_params_cannot_work():
    f = ddp(checkpointing="reentrant", is_vlm=True, trainable_vision_params=True)
    with pytest.raises(PlanError, match="non_reentrant"):
        resolve_plan(f, cfg(HF_DDPFIX_CHECKPOINTING="reentrant", HF_DDPFIX_PARAMETER_USAGE=0))
    # with parameter_usage the unused vision parameters are tied in: reentrant + fu=False works
    plan = resolve_plan(f, cfg(HF_DDPFIX_CHECKPOINTING="reentrant"))
    assert plan.checkpointing.value == "reentrant" and plan.parameter_usage.value is True
    assert plan.ddp_kwargs() == {"find_unused_parameters": False, "static_graph": True}


# --- row: non-reentrant + fu=True -> works for every data mix ----------------------------------------
def test_row_non_reentrant_vlm_without_adapter_uses_the_safe_fallback():
    f = ddp(checkpointing="non_reentrant", is_vlm=True, trainable_vision_params=True)
    plan = resolve_plan(f, NO_USAGE)
    assert plan.checkpointing.value == "non_reentrant"
    assert plan.ddp_kwargs() == {"find_unused_parameters": True, "static_graph": False}
    assert "no adapter" in plan.vlm_stabilizer.reason


# --- rows: static graph ------------------------------------------------------------------------------
def test_row_static_graph_with_changing_graph_is_corrected():
    f = ddp(checkpointing="non_reentrant", is_vlm=True, trainable_vision_params=True, user_static_graph=True)
    plan = resolve_plan(f, NO_USAGE)
    assert plan.static_graph.value is False and "graph changes" in plan.static_graph.reason
    assert any("static_graph=True" in c for c in plan.corrections)
    with pytest.raises(PlanError):
        resolve_plan(f, cfg(HF_DDPFIX_STRICT=1, HF_DDPFIX_PARAMETER_USAGE=0))


def test_row_static_graph_with_gradient_accumulation_is_corrected():
    f = ddp(checkpointing="non_reentrant", grad_accum_steps=2, user_static_graph=True)
    plan = resolve_plan(f)
    assert plan.static_graph.value is False and "expect_autograd_hooks_" in plan.static_graph.reason
    assert_not_known_bad(plan, f)


def test_row_static_graph_with_fixed_graph_is_kept():
    plan = resolve_plan(ddp(checkpointing="reentrant", user_static_graph=True), cfg(HF_DDPFIX_STRICT=1))
    assert plan.ddp_kwargs()["static_graph"] is True


# --- row: offload without an accelerator -> crash ---------------------------------------------------
def test_row_offload_without_accelerator_is_a_logged_no_op():
    plan = resolve_plan(ddp(checkpointing="non_reentrant", offload_requested=True, accelerator_available=False))
    assert plan.offload_activations.value is False and "no accelerator" in plan.offload_activations.reason


def test_offload_with_accelerator_is_ours():
    plan = resolve_plan(ddp(checkpointing="non_reentrant", offload_requested=True, accelerator_available=True))
    assert plan.offload_activations.value is True


def test_offload_needs_checkpointing():
    plan = resolve_plan(ddp(checkpointing="off", accelerator_available=True), cfg(HF_DDPFIX_OFFLOAD_ACTIVATIONS=1))
    assert plan.offload_activations.value is False and "checkpointing is off" in plan.offload_activations.reason


# --- MoE: conditional params --------------------------------------------------------------------------
def test_conditional_params_keep_find_unused_and_forbid_static_graph():
    f = ddp(checkpointing="non_reentrant", conditional_params=True)
    plan = resolve_plan(f, NO_USAGE)
    assert plan.ddp_kwargs() == {"find_unused_parameters": True, "static_graph": False}
    # with parameter_usage (default) unused experts are tied in: fu=False and static graph are safe
    assert resolve_plan(f).ddp_kwargs() == {"find_unused_parameters": False, "static_graph": True}


# --- environment overrides ----------------------------------------------------------------------------
def test_unsloth_disable_static_graph():
    plan = resolve_plan(ddp(checkpointing="non_reentrant"), cfg(UNSLOTH_DISABLE_DDP_STATIC_GRAPH=1))
    assert plan.static_graph.value is False and "UNSLOTH_DISABLE_DDP_STATIC_GRAPH" in plan.static_graph.reason


def test_unsloth_disable_static_graph_for_checkpointing_only_applies_when_checkpointing():
    c = cfg(UNSLOTH_DISABLE_DDP_STATIC_GRAPH_FOR_GRAD_CHECKPOINT=1)
    assert resolve_plan(ddp(checkpointing="non_reentrant"), c).static_graph.value is False
    assert resolve_plan(ddp(checkpointing="off"), c).static_graph.value is True


def test_unsloth_use_gradient_checkpointing_counts_as_checkpointed():
    c = cfg(UNSLOTH_USE_GRADIENT_CHECKPOINTING=1, UNSLOTH_DISABLE_DDP_STATIC_GRAPH_FOR_GRAD_CHECKPOINT=1)
    plan = resolve_plan(ddp(checkpointing="off"), c)
    assert plan.static_graph.value is False and "assumed on" in plan.checkpointing.reason


def test_forced_find_unused_from_env():
    plan = resolve_plan(ddp(checkpointing="off"), cfg(HF_DDPFIX_FIND_UNUSED_PARAMETERS=1))
    assert plan.ddp_kwargs()["find_unused_parameters"] is True
    assert "HF_DDPFIX_FIND_UNUSED_PARAMETERS" in plan.find_unused_parameters.reason


def test_forced_non_reentrant_applies_to_single_process_too():
    plan = resolve_plan(RunFacts(checkpointing="reentrant"), cfg(HF_DDPFIX_CHECKPOINTING="non_reentrant"))
    assert plan.checkpointing.value == "non_reentrant" and plan.ddp_kwargs() == {}


# --- non-DDP modes ----------------------------------------------------------------------------------------
def test_single_process_changes_nothing():
    plan = resolve_plan(RunFacts(checkpointing="reentrant", is_peft=True))
    assert plan.ddp_kwargs() == {} and plan.checkpointing.value == "reentrant"
    assert plan.find_unused_parameters.value is None


def test_fsdp_vlm_needs_stabiliser_even_with_frozen_tower():
    f = RunFacts(parallel="fsdp", world_size=2, checkpointing="reentrant", is_vlm=True, vlm_adapter="qwen2_vl")
    plan = resolve_plan(f)
    assert plan.vlm_stabilizer.value is True and plan.checkpointing.value == "non_reentrant"
    assert plan.ddp_kwargs() == {}


def test_forced_fu_false_without_stabiliser_is_honoured_with_the_hang_guard():
    c = cfg(HF_DDPFIX_VLM_STABILIZER=0, HF_DDPFIX_FIND_UNUSED_PARAMETERS=0, HF_DDPFIX_PARAMETER_USAGE=0)
    f = ddp(checkpointing="non_reentrant", is_vlm=True, vlm_adapter="qwen2_5_vl", trainable_vision_params=True)
    plan = resolve_plan(f, c)
    assert plan.ddp_kwargs() == {"find_unused_parameters": False, "static_graph": False}
    assert plan.hang_guard.value is True and plan.corrections == ()
    assert resolve_plan(f).hang_guard.value is False  # default: parameter usage ties them in, nothing to guard
    frozen = ddp(checkpointing="non_reentrant", is_vlm=True)
    assert resolve_plan(frozen, c).hang_guard.value is False


def test_report_marks_changes_and_lists_corrections():
    plan = resolve_plan(ddp(checkpointing="reentrant", user_reentrant=True, user_find_unused=True))
    text = plan.report()
    assert text.startswith("hf_ddpfix plan (ddp, world size 2)")
    assert " * checkpointing" in text and "corrected:" in text


@pytest.mark.parametrize("ckpt", ["off", "reentrant", "non_reentrant"])
@pytest.mark.parametrize("fu", [None, True, False])
@pytest.mark.parametrize("static", [None, True, False])
@pytest.mark.parametrize("vlm", [None, "qwen2_5_vl", "unknown"])
@pytest.mark.parametrize("ga", [1, 2])
def test_no_known_bad_combination_comes_out(ckpt, fu, static, vlm, ga):
    f = ddp(checkpointing=ckpt, user_find_unused=fu, user_static_graph=static, grad_accum_steps=ga,
            is_vlm=vlm is not None, trainable_vision_params=vlm is not None,
            vlm_adapter=vlm if vlm != "unknown" else None, user_reentrant=True if ckpt == "reentrant" else None)
    assert_not_known_bad(resolve_plan(f), f)


def test_explicit_find_unused_is_kept_while_something_can_go_unused():
    f = ddp(checkpointing="non_reentrant", is_vlm=True, trainable_vision_params=True, vlm_adapter="qwen2_5_vl",
            user_find_unused=True)
    # without parameter_usage the stabiliser covers the vision tower only: a skipped LM layer (Mllama's
    # cross-attention, LayerDrop) could still go unused, so the explicit True stays
    plan = resolve_plan(f, NO_USAGE)
    assert plan.ddp_kwargs() == {"find_unused_parameters": True, "static_graph": False} and not plan.corrections
    # with parameter_usage an explicit True is kept too (it works; the mechanism is then not attached)
    kept = resolve_plan(f)
    assert kept.ddp_kwargs()["find_unused_parameters"] is True and kept.parameter_usage.value is False
    moe = ddp(checkpointing="non_reentrant", is_vlm=True, trainable_vision_params=True, vlm_adapter="qwen3_vl_moe",
              user_find_unused=True, conditional_params=True)
    assert resolve_plan(moe, NO_USAGE).ddp_kwargs()["find_unused_parameters"] is True
    assert resolve_plan(f, cfg(HF_DDPFIX_STRICT=1)).ddp_kwargs()["find_unused_parameters"] is True
    # text models keep an explicit True as well
    assert resolve_plan(ddp(checkpointing="off", user_find_unused=True)).ddp_kwargs()["find_unused_parameters"]
    # only reentrant checkpointing, where fu=True fails, turns it off (the mechanism makes fu=False work)
    re = ddp(checkpointing="reentrant", user_reentrant=True, user_find_unused=True, is_vlm=True,
             trainable_vision_params=True)
    plan = resolve_plan(re, cfg(HF_DDPFIX_CHECKPOINTING="reentrant"))
    assert plan.parameter_usage.value is True and plan.ddp_kwargs()["find_unused_parameters"] is False


def test_plan_log_says_how_every_parameter_is_used_and_the_cost():
    text = resolve_plan(ddp(checkpointing="non_reentrant")).report()
    assert "parameter_usage" in text and "exact-zero" in text and "docs/plan.md#parameter_usage" in text
    section = (Path(__file__).resolve().parents[1] / "docs" / "plan.md").read_text().split("### parameter_usage")[1]
    assert "Cost:" in section.split("\n### ")[0]  # the cost lives in the linked section (a plan line fits a terminal)
    off = resolve_plan(ddp(checkpointing="non_reentrant"), NO_USAGE)
    assert off.ddp_kwargs()["find_unused_parameters"] is True  # stock's choice for a PeftModel is kept
    assert "parameter_usage is off" in off.find_unused_parameters.reason


def test_deepspeed_without_readable_config_keeps_stock():
    """No DeepSpeed facts (config unreadable): nothing DeepSpeed-specific is applied. The ZeRO rules
    themselves are tested in tests/test_deepspeed.py."""
    f = RunFacts(parallel="deepspeed", world_size=2, checkpointing="reentrant", is_vlm=True,
                 trainable_vision_params=True, vlm_adapter="qwen2_5_vl")
    plan = resolve_plan(f)
    assert plan.ddp_kwargs() == {} and plan.vlm_stabilizer.value is False
    assert "stock" in plan.vlm_stabilizer.reason and plan.checkpointing.value == "reentrant"
    assert plan.deepspeed.value == "unknown" and plan.zero3_leaf_modules.value is None


# --- one spelling of "off" (the Plan docstring's convention) ------------------------------------------

_OFF_WORDS = {"", "off", "none", "false", "no", "0", "disabled"}


def _every_kind_of_run():
    import dataclasses

    from hf_ddpfix.integrations.deepspeed.zero import DeepSpeedFacts
    from hf_ddpfix.integrations.fsdp import FsdpFacts
    from hf_ddpfix.integrations.quantized import QuantFacts

    nf4 = QuantFacts("bnb_4bit", 14, 36864, "bfloat16", "bfloat16", "nf4", "bfloat16")
    zero = {s: DeepSpeedFacts(stage=s, version="0.19.8", moe_blocks=("my.Block",)) for s in (2, 3)}
    zero[3.1] = DeepSpeedFacts(stage=3, version="0.19.8")  # ZeRO-3 without MoE: no leaf modules
    runs = []
    for ckpt in ("off", "reentrant", "non_reentrant"):
        for vlm in (False, True):
            common = dict(checkpointing=ckpt, is_peft=True, is_vlm=vlm, trainable_vision_params=vlm,
                          vlm_adapter="qwen2_5_vl" if vlm else None)
            runs += [RunFacts(parallel="single", **common), RunFacts(parallel="ddp", world_size=2, **common),
                     RunFacts(parallel="ddp", world_size=2, grad_accum_steps=2, conditional_params=True,
                              accelerator_available=True, offload_requested=True, rank_device="cuda:0", **common),
                     RunFacts(parallel="fsdp", world_size=2, fsdp_version=2, quant=nf4,
                              shard_cast_dtype="bfloat16", **common),
                     RunFacts(parallel="deepspeed", world_size=2, **common)]
            runs += [RunFacts(parallel="deepspeed", world_size=2, zero_stage=int(s), deepspeed=ds, **common)
                     for s, ds in zero.items()]
            wraps = [FsdpFacts(no_split=("Layer", "Block"), present=("Layer", "Block"), skippable=("Block",),
                               folded=("model.visual",)), FsdpFacts(user_classes=("Layer",))]
            tied = FsdpFacts(shared=(("model.shared", "model.encoder.embed_tokens", "lm_head"),),
                             carved=("model.shared", "lm_head"))  # BART: a tie beyond the embeddings
            wraps += [tied, dataclasses.replace(tied, wrapped=True)]
            runs += [RunFacts(parallel="fsdp", world_size=2, fsdp_version=2, fsdp=w, **common) for w in wraps]
    return runs


_CONFIGS = [
    {}, {"HF_DDPFIX_PARAMETER_USAGE": 0},
    {"HF_DDPFIX_TILED_MLP": "auto", "HF_DDPFIX_TILED_LOSS": "on", "HF_DDPFIX_LONG_CONTEXT": "on"},
    {"HF_DDPFIX_TILED_MLP": "off", "HF_DDPFIX_TILED_LOSS": "off", "HF_DDPFIX_LONG_CONTEXT": "off",
     "HF_DDPFIX_VLM_STABILIZER": 0, "HF_DDPFIX_HANG_GUARD": 0, "HF_DDPFIX_STATIC_GRAPH": 0,
     "HF_DDPFIX_OFFLOAD_ACTIVATIONS": 0, "HF_DDPFIX_FIND_UNUSED_PARAMETERS": 0, "HF_DDPFIX_EVAL_OUTPUTS": 0},
    {"HF_DDPFIX_OFFLOAD_ACTIVATIONS": 1, "HF_DDPFIX_CHECKPOINTING": "non_reentrant", "HF_DDPFIX_ZERO_SKIP_UNUSED": 1},
    {"HF_DDPFIX_PARAMETER_USAGE": 0, "HF_DDPFIX_VLM_STABILIZER": 0, "HF_DDPFIX_FIND_UNUSED_PARAMETERS": 0},
]


def test_every_decision_spells_off_one_way():
    """Every field of every resolved plan: `None` (does not arise, no reason, not in the report), `False`
    (off, with a reason), or `True` / a string naming how it is on - never "off", "none" or ""."""
    import dataclasses

    from hf_ddpfix.plan import Decision, Plan

    fields = {f.name for f in dataclasses.fields(Plan) if f.type in (Decision, "Decision")}
    seen: dict[str, set[str]] = {name: set() for name in fields}
    for env in _CONFIGS:
        for facts in _every_kind_of_run():
            plan = resolve_plan(facts, cfg(**env))
            assert set(plan.decisions()) == fields  # the report and this check cover every decision field
            report = plan.report()
            for name, d in plan.decisions().items():
                where = f"{name} of {facts.parallel} run ({facts.checkpointing}, vlm={facts.is_vlm}, {env}): {d}"
                if d.value is None:
                    assert d.reason == "" and f" {name} " not in report, where
                    seen[name].add("None")
                    continue
                assert d.reason, where
                assert isinstance(d.value, (bool, str)), where
                if isinstance(d.value, str):
                    assert d.value.strip().lower() not in _OFF_WORDS, where
                seen[name].add(repr(d.value) if isinstance(d.value, bool) else "str")
                assert bool(d.value) == (d.text != "off"), where
                assert f" {name:<23} = {d.text} " in report, where
    # the sweep reaches the off state of every decision that can be off, and an "on" state of each
    # sequence_parallel: on only for DDP + sdpa facts, a PlanError elsewhere (tests/test_sequence_parallel.py)
    # fsdp_skippable: two variants (fold / shard), no off state; its sweep is tests/test_fsdp_skippable.py
    for name in fields - {"quantization", "deepspeed", "sequence_parallel", "fsdp_skippable"}:
        assert "False" in seen[name] and ({"True", "str"} & seen[name]), (name, seen[name])
