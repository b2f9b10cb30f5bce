"""FallbackWatch and the feature metrics: a requested feature that falls back is warned once per reason
(rank 0 only) or, strict, raised at that call; unrequested features are only counted; the counts reach
train()'s metrics and never log_history."""

from __future__ import annotations

import logging

import pytest

from hf_ddpfix.config.options import DDPFixConfig
from hf_ddpfix.ops import feature_counts
from hf_ddpfix.plan.resolve import resolve_plan
from hf_ddpfix.plan.types import RunFacts
from hf_ddpfix.runtime.feature_report import (
    FallbackWatch,
    FeatureFallbackError,
    feature_metrics,
    requested_features,
)


def _plan(**options):
    return resolve_plan(RunFacts(), DDPFixConfig(**options))


@pytest.fixture(autouse=True)
def _clean():
    feature_counts.reset()
    yield
    feature_counts.reset()


def test_requested_features_are_the_plan_decisions_that_are_on():
    on = requested_features(_plan(long_context="all", tiled_mlp="4"))
    assert on["long_context"] and on["tiled_mlp"]
    assert "tiled_loss" not in requested_features(_plan(long_context="all"))


def test_a_requested_fallback_is_warned_once_per_reason_on_rank_0(caplog):
    watch = FallbackWatch(_plan(long_context="all")).attach()
    try:
        with caplog.at_level(logging.WARNING, logger="hf_ddpfix"):
            for _ in range(3):
                feature_counts.record_fallback("long_context", "keyword arguments ['cache']")
            feature_counts.record_fallback("long_context", "KV cache")
            feature_counts.record_fallback("tiled_loss", "not requested: counted only")
    finally:
        watch.remove()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "['cache']" in lines[0] and "transformers " in lines[0], lines
    assert feature_metrics()["hf_ddpfix/long_context/fell_back"] == 4


def test_other_ranks_do_not_warn(caplog):
    watch = FallbackWatch(_plan(long_context="all"), is_rank0=False).attach()
    try:
        with caplog.at_level(logging.WARNING, logger="hf_ddpfix"):
            feature_counts.record_fallback("long_context", "KV cache")
    finally:
        watch.remove()
    assert not caplog.records


def test_strict_raises_at_the_fallback_and_names_reason_and_version():
    watch = FallbackWatch(_plan(long_context="all"), strict=True).attach()
    try:
        with pytest.raises(FeatureFallbackError, match=r"keyword arguments \['cache'\].*transformers \d"):
            feature_counts.record_fallback("long_context", "keyword arguments ['cache']")
        feature_counts.record_fallback("tiled_mlp", "not requested: no raise")
    finally:
        watch.remove()
    watch.remove()  # idempotent


def test_strict_trainer_run_raises_when_the_long_context_layer_cannot_run(tmp_path):
    """End to end: attention dropout in training makes every layer call run stock (padding no longer does:
    right-padded batches run the patched path per document); strict turns that into an error."""
    pytest.importorskip("peft")
    from fixtures import lora, padded_collate, tiny_llama, variable_length_ids
    from transformers import TrainingArguments

    from hf_ddpfix.trainer import DDPFixTrainer

    model = lora(tiny_llama(attn_implementation="sdpa", use_cache=False, attention_dropout=0.1))
    data = [{"input_ids": ids} for ids in variable_length_ids(4)]
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1, per_device_train_batch_size=2,
                             save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    trainer = DDPFixTrainer(model=model, args=args, train_dataset=data, data_collator=padded_collate,
                            ddpfix_config=DDPFixConfig(long_context="all", strict=True))
    with pytest.raises(FeatureFallbackError, match="attention dropout"):
        trainer.train()


def test_a_fallback_at_attach_time_is_in_the_plan_the_report_prints():
    """A feature the runtime cannot attach (a discovered VLM family whose dummy failed its trial) is off in
    the plan logged before step 1, with its reason; the ZeRO stabiliser takes its evaluation sync with it."""
    from dataclasses import replace

    from hf_ddpfix.plan.types import Decision
    from hf_ddpfix.runtime.feature_report import attach_fallbacks

    plan = replace(_plan(long_context="all"), vlm_stabilizer=Decision(True, "dummy image"),
                   vlm_eval_sync=Decision(True, "agree"))
    assert plan.with_attach_fallbacks(attach_fallbacks()) is plan  # nothing fell back: the same plan
    feature_counts.record_fallback("stabilizer", "aya_vision (from config): no dummy image runs")
    fixed = plan.with_attach_fallbacks(attach_fallbacks())
    assert fixed.vlm_stabilizer.value is False and fixed.vlm_eval_sync.value is False
    assert fixed.long_context.value == plan.long_context.value
    report = fixed.report()
    line = next(ln for ln in report.splitlines() if "vlm_stabilizer" in ln)
    assert "= off" in line and "no dummy image runs" in line and "before step 1" in line, line
    assert "corrected: vlm_stabilizer: on -> off" in report
