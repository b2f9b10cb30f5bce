"""Every option asked on explicitly either runs or says so: table-driven over `OPTIONS` x run contexts on the pure
plan (`resolve_plan`), no processes. A future option is covered automatically: its asked value is derived from
its own parser, and an option that is neither a plan decision nor classified in `NOT_A_DECISION` fails.

"Says so" = the option is in `Plan.not_applied`, the report has a line naming it, that it was asked (with where
from) and why not; `not_applied_warning(plan)` (the one warning a run logs) names it. Or the plan refuses the
run with a `PlanError` naming the setting, where `EXPECTED_REFUSALS` names that refusal (any other fails).
A default run (nothing asked) says nothing.

"Runs" is judged from what ran, not from the plan's own decision, wherever a run can show it:
`test_an_option_asked_on_in_a_trainer_run_is_applied_exactly_when_its_counters_moved` trains a one-process
Trainer per option that has a counter (`feature_report.RAN_COUNTER`) and judges "applied" from
`feature_counts` (a feature planned on whose counters stay 0 is not applied, and fails unless the plan said so).
"""

from __future__ import annotations

import logging
import re

import pytest

from hf_ddpfix.config.options import OPTIONS, DDPFixConfig, env_name
from hf_ddpfix.integrations.deepspeed.zero import DeepSpeedFacts
from hf_ddpfix.integrations.fsdp import FsdpFacts
from hf_ddpfix.plan.asked import asked_options, not_applied_warning
from hf_ddpfix.plan.resolve import resolve_plan
from hf_ddpfix.plan.types import Plan, PlanError, RunFacts

_VLM = dict(is_vlm=True, vlm_adapter="qwen2_5_vl", trainable_vision_params=True)
_CKPT = dict(checkpointing="non_reentrant", accelerator_available=True, rank_device="cuda:0")
_FSDP_TEXT = FsdpFacts(no_split=("LlamaDecoderLayer",), present=("LlamaDecoderLayer",))
_FSDP_VLM = FsdpFacts(no_split=("Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"),
                      present=("Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"), skippable=("Qwen2_5_VLVisionBlock",),
                      folded=("model.visual",))


def _zero(stage: int, **kw) -> RunFacts:
    return RunFacts(parallel="deepspeed", world_size=2, zero_stage=stage, is_peft=True,
                    deepspeed=DeepSpeedFacts(stage=stage, version="0.19.8"), **kw)


CONTEXTS: dict[str, RunFacts] = {
    "single text": RunFacts(is_peft=True),
    "single text ckpt": RunFacts(is_peft=True, **_CKPT),
    "single vlm": RunFacts(is_peft=True, **_VLM),
    "ddp text": RunFacts(parallel="ddp", world_size=2, is_peft=True),
    "ddp text ckpt": RunFacts(parallel="ddp", world_size=2, is_peft=True, **_CKPT),
    "ddp vlm ckpt": RunFacts(parallel="ddp", world_size=2, is_peft=True, **_CKPT, **_VLM),
    "fsdp2 text": RunFacts(parallel="fsdp", world_size=2, fsdp_version=2, fsdp=_FSDP_TEXT, is_peft=True, **_CKPT),
    "fsdp2 vlm": RunFacts(parallel="fsdp", world_size=2, fsdp_version=2, fsdp=_FSDP_VLM, is_peft=True, **_CKPT, **_VLM),
    "zero2 text": _zero(2, **_CKPT),
    "zero2 vlm": _zero(2, **_CKPT, **_VLM),
    "zero3 text": _zero(3, **_CKPT),
    "zero3 vlm": _zero(3, **_CKPT, **_VLM),
}

#: Options that are no plan decision of their own, and where each runs (the test's own oracle, not the plan's):
#: a new such option fails `test_every_option_is_a_decision_or_classified` until it is added here.
NOT_A_DECISION = {
    "static_graph_with_checkpointing": lambda f, p: bool(p.static_graph.value) and bool(p.checkpointing.value),
    "assume_checkpointing": lambda f, p: f.parallel == "ddp",  # read by DDP's static-graph decision only
    "strict": lambda f, p: True,
    "log_plan": lambda f, p: True,
    "offload_min_layer_mib": lambda f, p: p.offload_activations.value is True,
    "offload_host_gib": lambda f, p: p.offload_activations.value is True,
    "sync_check_steps": lambda f, p: f.parallel == "ddp" and f.world_size > 1,  # compares DDP replicas
}

# spellings tried, in order, to ask an option on through its environment variable: the first its parser takes
# and that asks for something ("2" before "1": sequence_parallel=1 means off)
_CANDIDATES = ("2", "1", "all", "non_reentrant", "shard")


#: option -> (contexts, a regular expression the PlanError must match): the refusals the plan is meant to make.
#: sequence_parallel: one process cannot share a sequence; the RunFacts above name no attention implementation.
EXPECTED_REFUSALS: dict[str, tuple[tuple[str, ...], str]] = {
    "sequence_parallel": (tuple(CONTEXTS), r"sequence_parallel=2 \(HF_DDPFIX_SEQUENCE_PARALLEL\): (hf_ddpfix's Ulysses "
                          r"sequence parallelism shares each sequence between N processes \(this run: single"
                          r"|attention implementation None cannot be sharded)"),
}


def _asked_value(name: str) -> str:
    for raw in _CANDIDATES:
        try:
            config = DDPFixConfig.from_env({env_name(name): raw})
        except ValueError:
            continue
        if name in asked_options(config):
            return raw
    raise AssertionError(f"no spelling in {_CANDIDATES} asks {name} on: add one to _CANDIDATES")


def _applied(name: str, facts: RunFacts, plan: Plan) -> bool:
    decisions = plan.decisions()
    if name in decisions:
        value = decisions[name].value
        return bool(value) and value != "deepspeed"  # "deepspeed": DeepSpeed's own Ulysses, not hf_ddpfix's
    return NOT_A_DECISION[name](facts, plan)


def test_every_option_is_a_decision_or_classified():
    plan = resolve_plan(RunFacts())
    missing = [n for n in OPTIONS if n not in plan.decisions() and n not in NOT_A_DECISION]
    assert not missing, f"classify {missing} in NOT_A_DECISION (where does it run?)"


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("name", list(OPTIONS))
def test_an_option_asked_on_runs_or_says_so(name, context):
    facts = CONTEXTS[context]
    raw = _asked_value(name)
    config = DDPFixConfig.from_env({env_name(name): raw})
    try:
        plan = resolve_plan(facts, config)
    except PlanError as err:  # refused before training, naming the setting: only where that refusal is expected
        contexts, message = EXPECTED_REFUSALS.get(name, ((), ""))
        assert context in contexts, f"{name} refused in {context!r}, which EXPECTED_REFUSALS does not name: {err}"
        assert name in str(err) and re.match(message, str(err)), err
        return
    assert context not in EXPECTED_REFUSALS.get(name, ((),))[0], f"{name} in {context!r}: expected a refusal"
    report, warning = plan.report(), not_applied_warning(plan)
    if _applied(name, facts, plan):
        assert name not in plan.not_applied, (plan.not_applied, report)
        assert warning is None or name not in warning.split(":")[0], warning
        return
    assert name in plan.not_applied, f"{name}={raw} asked, not applied, not said:\n{report}"
    lines = [ln for ln in report.splitlines() if ln.strip().startswith(f"! {name} ")]
    assert len(lines) == 1, report
    assert " asked " in lines[0] and f"({env_name(name)}=" in lines[0], lines[0]  # the setting, where it was asked
    why = lines[0].split("):", 1)[-1].strip()
    assert why, lines[0]
    assert warning is not None and f"{name} " in warning and env_name(name) in warning, warning


@pytest.mark.parametrize("context", list(CONTEXTS))
def test_a_default_run_says_nothing(context):
    plan = resolve_plan(CONTEXTS[context], DDPFixConfig.from_env({}))
    assert plan.not_applied == {} and not_applied_warning(plan) is None
    assert "asked" not in plan.report() and "\n ! " not in plan.report()


def test_the_stabiliser_asked_in_one_process_says_why():
    config = DDPFixConfig.from_env({"HF_DDPFIX_VLM_STABILIZER": "1"})
    plan = resolve_plan(RunFacts(is_peft=True, **_VLM), config)
    line = next(ln for ln in plan.report().splitlines() if "vlm_stabilizer" in ln)
    assert line.startswith(" ! vlm_stabilizer") and "= off" in line, line
    assert "asked on (HF_DDPFIX_VLM_STABILIZER=1): not needed: single process" in line, line
    text = resolve_plan(RunFacts(is_peft=True), config).report()
    assert "asked on (HF_DDPFIX_VLM_STABILIZER=1): a text-only model" in text, text


def test_an_argument_and_a_compat_variable_are_named():
    plan = resolve_plan(RunFacts(), DDPFixConfig.from_env({}, hang_guard=True))
    assert "asked on (argument hang_guard=True)" in plan.not_applied["hang_guard"]
    plan = resolve_plan(RunFacts(), DDPFixConfig.from_env({"UNSLOTH_TILED_MLP": "1"}))
    assert plan.tiled_mlp.value == "arctic" and "tiled_mlp" not in plan.not_applied  # runs: nothing to say
    plan = resolve_plan(_zero(3), DDPFixConfig.from_env({"UNSLOTH_TILED_MLP": "1"}))
    assert "asked arctic (UNSLOTH_TILED_MLP)" in plan.not_applied["tiled_mlp"], plan.not_applied


def test_the_warning_lists_every_setting_once():
    config = DDPFixConfig.from_env({"HF_DDPFIX_VLM_STABILIZER": "1", "HF_DDPFIX_HANG_GUARD": "1",
                                    "HF_DDPFIX_SYNC_CHECK_STEPS": "10"})
    warning = not_applied_warning(resolve_plan(RunFacts(), config))
    assert warning is not None and warning.count("\n") == 3, warning
    for name in ("vlm_stabilizer", "hang_guard", "sync_check_steps"):
        assert warning.count(f"  {name} ") == 1, warning


def test_the_offload_settings_run_where_the_offload_runs():
    config = DDPFixConfig.from_env({"HF_DDPFIX_OFFLOAD_ACTIVATIONS": "1", "HF_DDPFIX_OFFLOAD_MIN_LAYER_MIB": "8",
                                    "HF_DDPFIX_OFFLOAD_HOST_GIB": "4"})
    plan = resolve_plan(CONTEXTS["ddp text ckpt"], config)
    assert plan.offload_activations.value is True and plan.not_applied == {}, plan.report()
    plan = resolve_plan(CONTEXTS["ddp text"], config)  # no checkpointing: nothing to offload
    assert set(plan.not_applied) == {"offload_activations", "offload_min_layer_mib", "offload_host_gib"}


def _train(tmp_path, config, steps=1):
    pytest.importorskip("peft")
    from fixtures import lora, padded_collate, tiny_llama, variable_length_ids
    from transformers import TrainingArguments

    from hf_ddpfix.trainer import DDPFixTrainer

    model = lora(tiny_llama(attn_implementation="sdpa", use_cache=False))
    data = [{"input_ids": ids} for ids in variable_length_ids(4)]
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=steps, per_device_train_batch_size=2,
                             save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    trainer = DDPFixTrainer(model=model, args=args, train_dataset=data, data_collator=padded_collate,
                            ddpfix_config=config)
    trainer.train()
    return trainer


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "hf_ddpfix"]


def test_a_trainer_run_warns_once_for_what_was_asked_and_not_run_and_stays_silent_by_default(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_ddpfix"):
        _train(tmp_path / "a", DDPFixConfig.from_env({"HF_DDPFIX_VLM_STABILIZER": "1", "HF_DDPFIX_SYNC_CHECK_STEPS": "5"}))
    warned = _warnings(caplog)
    assert len(warned) == 1 and "vlm_stabilizer" in warned[0] and "sync_check_steps" in warned[0], warned
    assert "asked on (argument vlm_stabilizer=True): a text-only model" in warned[0], warned  # a config: an argument
    plan_log = [r.getMessage() for r in caplog.records if "hf_ddpfix plan (" in r.getMessage()]
    assert plan_log and " ! vlm_stabilizer" in plan_log[0] and " ! sync_check_steps" in plan_log[0], plan_log
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_ddpfix"):
        _train(tmp_path / "b", DDPFixConfig.from_env({}))
    assert _warnings(caplog) == []


def test_an_asked_feature_on_in_the_plan_that_never_ran_is_warned_at_the_end_of_train(tmp_path, caplog):
    """tiled_mlp=arctic shards by ceil(tokens/hidden): 12 tokens x 2 / hidden 32 is one shard, so no MLP call is
    tiled (untiled_calls, not a fallback): before, nothing said so."""
    with caplog.at_level(logging.WARNING, logger="hf_ddpfix"):
        trainer = _train(tmp_path, DDPFixConfig.from_env({"HF_DDPFIX_TILED_MLP": "arctic"}))
    assert trainer.hf_ddpfix_plan.tiled_mlp.value == "arctic"
    warned = _warnings(caplog)
    assert len(warned) == 1 and "never ran" in warned[0] and "tiled_mlp = arctic" in warned[0], warned
    assert "hf_ddpfix/tiled_mlp/ran = 0" in warned[0] and "untiled_calls=" in warned[0], warned


def test_never_ran_names_only_asked_features_that_are_on_and_counted():
    from hf_ddpfix.ops.feature_counts import FeatureCount
    from hf_ddpfix.runtime.feature_report import never_ran_warning

    plan = resolve_plan(RunFacts(), DDPFixConfig.from_env({"HF_DDPFIX_TILED_LOSS": "1", "HF_DDPFIX_TILED_MLP": "4"}))
    ran = {"tiled_loss": FeatureCount(ran=3), "tiled_mlp": FeatureCount(fallbacks={"kwargs": 2})}
    said = never_ran_warning(plan, ["tiled_loss", "tiled_mlp", "hang_guard"], ran)
    assert said is not None and "tiled_mlp = 4" in said and "kwargs (x2)" in said and "tiled_loss" not in said, said
    assert never_ran_warning(plan, [], {}) is None  # nothing asked: nothing said, whatever ran
    # long context whose layers all stayed stock but whose norms ran the op (Gemma 4) ran, in part: nothing said;
    # without a patched norm call it never ran (shown failing 2026-12-02 without ALSO_RAN: the first assert)
    plan = resolve_plan(RunFacts(), DDPFixConfig.from_env({"HF_DDPFIX_LONG_CONTEXT": "all"}))
    assert plan.long_context.value, plan.long_context
    norms = {"long_context": FeatureCount(amounts={"rms_norm_calls": 98})}
    assert never_ran_warning(plan, ["long_context"], norms) is None
    none = {"long_context": FeatureCount(amounts={"stock_no_grad_calls": 4})}
    assert "long_context" in (never_ran_warning(plan, ["long_context"], none) or "")


def test_prepare_accelerate_loop_says_which_asked_options_it_does_not_run():
    from hf_ddpfix.accelerate_loop import LOOP_RUNS
    from hf_ddpfix.plan.asked import mark_not_run_by

    config = DDPFixConfig.from_env({"HF_DDPFIX_TILED_LOSS": "1", "HF_DDPFIX_STATIC_GRAPH": "1",
                                    "HF_DDPFIX_VLM_STABILIZER": "1"})
    plan = mark_not_run_by(resolve_plan(CONTEXTS["ddp text"], config), config, LOOP_RUNS, "prepare_accelerate_loop")
    assert plan.static_graph.value is True and "static_graph" not in plan.not_applied  # the loop sets DDP kwargs
    assert plan.tiled_loss.value is False and "prepare_accelerate_loop does not run it" in plan.not_applied["tiled_loss"]
    assert "a text-only model" in plan.not_applied["vlm_stabilizer"]  # the plan's own reason kept
    assert set(plan.not_applied) == {"tiled_loss", "vlm_stabilizer"}


def test_an_option_asked_on_in_a_trainer_run_is_applied_exactly_when_its_counters_moved(tmp_path, caplog):
    """One-process Trainer runs (tiny LoRA Llama, checkpointing, 40-60 token rows: long enough for every tiled
    path), one per option with a counter: "applied" is ``feature_counts``' ``ran > 0``, not the plan's decision. An
    option that ran must not be reported as not applied; one whose counters stayed 0 must be in the plan's
    ``not_applied`` with its line (a feature planned on that never ran fails here); a refusal must be expected."""
    pytest.importorskip("peft")
    from fixtures import lora, padded_collate, tiny_llama, variable_length_ids
    from transformers import TrainingArguments

    from hf_ddpfix.ops import feature_counts
    from hf_ddpfix.runtime.feature_report import RAN_COUNTER
    from hf_ddpfix.trainer import DDPFixTrainer

    ran_somewhere = []
    for name, feature in RAN_COUNTER.items():
        raw = _asked_value(name)
        model = lora(tiny_llama(attn_implementation="sdpa", use_cache=False))
        data = [{"input_ids": ids} for ids in variable_length_ids(4, lengths=(40, 50, 60, 45))]
        args = TrainingArguments(str(tmp_path / name), use_cpu=True, report_to=[], max_steps=2,
                                 per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True,
                                 remove_unused_columns=False, gradient_checkpointing=True)
        try:
            trainer = DDPFixTrainer(model=model, args=args, train_dataset=data, data_collator=padded_collate,
                                    ddpfix_config=DDPFixConfig.from_env({env_name(name): raw}))
            trainer.train()
        except PlanError as err:
            contexts, message = EXPECTED_REFUSALS.get(name, ((), ""))
            assert "single text ckpt" in contexts, f"{name}: refused, which EXPECTED_REFUSALS does not name: {err}"
            assert re.match(message.replace("HF_DDPFIX_SEQUENCE_PARALLEL", "argument"), str(err)), err
            continue
        plan = trainer.hf_ddpfix_plan
        count = feature_counts.snapshot().get(feature)
        applied = count is not None and count.ran > 0  # what ran, not what the plan decided
        if applied:
            ran_somewhere.append(name)
            assert name not in plan.not_applied, (name, plan.not_applied)
        else:
            assert name in plan.not_applied, (f"{name}={raw}: the plan ran it ({plan.decisions()[name].value!r}) "
                                              f"but its counters stayed at 0 ({count}) and nothing said so")
            assert any(ln.strip().startswith(f"! {name} ") for ln in plan.report().splitlines()), plan.report()
    # the options this one-process run can apply did run (tiled MLP, tiled loss, long context)
    assert {"tiled_mlp", "tiled_loss", "long_context"} <= set(ran_somewhere), ran_somewhere
