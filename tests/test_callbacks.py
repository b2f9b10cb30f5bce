"""callbacks.py: plan report once on rank 0, replica-sync check, memory/throughput keys in the logs."""

import logging
import re
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
import torch
from launch import torchrun
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_ddpfix import DDPFixConfig, RunFacts, resolve_plan
from hf_ddpfix.callbacks import (
    DEFAULT_SYNC_CHECK_STEPS,
    FeatureCountsCallback,
    MemoryThroughputCallback,
    PlanReportCallback,
    ReplicaSyncCallback,
    default_callbacks,
    install_callbacks,
    param_checksums,
)

PLAN = resolve_plan(RunFacts(parallel="ddp", world_size=2, is_peft=True))


def test_plan_report_logs_once_and_only_on_world_process_zero(caplog):
    caplog.set_level(logging.INFO, logger="hf_ddpfix")
    cb = PlanReportCallback(PLAN)
    cb.on_train_begin(None, SimpleNamespace(is_world_process_zero=False), None)
    assert not caplog.records
    cb = PlanReportCallback(PLAN)
    for _ in range(2):
        cb.on_train_begin(None, SimpleNamespace(is_world_process_zero=True), None)
    assert [r.getMessage() for r in caplog.records] == [PLAN.report()]


def test_default_callbacks_follow_plan_and_config():
    kinds = [type(c) for c in default_callbacks(PLAN, DDPFixConfig())]
    assert kinds == [PlanReportCallback, ReplicaSyncCallback, MemoryThroughputCallback, FeatureCountsCallback]
    sync = next(c for c in default_callbacks(PLAN) if isinstance(c, ReplicaSyncCallback))
    assert sync.every_n_steps == DEFAULT_SYNC_CHECK_STEPS
    off = default_callbacks(PLAN, DDPFixConfig(sync_check_steps=0, log_plan=False))
    assert [type(c) for c in off] == [MemoryThroughputCallback, FeatureCountsCallback]
    single = resolve_plan(RunFacts())
    assert ReplicaSyncCallback not in [type(c) for c in default_callbacks(single)]
    assert default_callbacks(PLAN, DDPFixConfig(sync_check_steps=7))[1].every_n_steps == 7


def test_checksums_are_exact_and_sensitive():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model[1].bias.requires_grad_(False)
    names, sums = param_checksums(model)
    assert names == ["0.weight", "0.bias", "1.weight"] and sums.dtype == torch.float64 and sums.shape == (6,)
    assert torch.equal(sums, param_checksums(model)[1])
    with torch.no_grad():
        model[0].bias[0] += 1e-6
    changed = param_checksums(model)[1] != sums
    assert changed[2:4].all() and not changed[:2].any() and not changed[4:].any()


def test_replica_sync_is_a_noop_without_a_process_group():
    cb = ReplicaSyncCallback(every_n_steps=1)
    cb.on_step_end(None, SimpleNamespace(global_step=1), None, model=torch.nn.Linear(2, 2))
    assert cb.checks == 0
    with pytest.raises(ValueError):
        ReplicaSyncCallback(every_n_steps=-1)


class _Recorder(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


def test_memory_throughput_keys_reach_reporters_and_count_non_padding_tokens(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    data = [{"input_ids": list(range(1, 13))} for _ in range(8)]

    def collate(batch):
        ids = torch.tensor([b["input_ids"] for b in batch])
        mask = torch.ones_like(ids)
        mask[:, -4:] = 0  # 8 real tokens per row
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                             remove_unused_columns=False)
    recorder = _Recorder()
    trainer = Trainer(model=LlamaForCausalLM(cfg), args=args, train_dataset=data, data_collator=collate,
                      callbacks=[recorder])
    mem = MemoryThroughputCallback()
    with ExitStack() as stack:
        install_callbacks(trainer, [mem], stack)
        assert trainer.callback_handler.callbacks[0] is mem
        trainer.train()
    assert mem not in trainer.callback_handler.callbacks  # detached after the run
    assert mem.tokens() == 3 * 2 * 8
    step_logs = [s for s in recorder.seen if "loss" in s]
    assert len(step_logs) == 3
    for logs in step_logs:  # a later callback (a reporter) sees our keys
        assert logs["hf_ddpfix/peak_mem_gb"] > 0 and logs["hf_ddpfix/tokens_per_sec"] > 0
        assert logs["hf_ddpfix/tokens_per_sec"] == logs["hf_ddpfix/tokens_per_sec_rank"]  # single process
    # ... but what the Trainer stores stays stock (log-only values)
    assert not any(k.startswith("hf_ddpfix/") for h in trainer.state.log_history for k in h)
    assert "on_log" not in vars(recorder)  # the reporter's wrapper was removed with the run
    summary = [s for s in recorder.seen if "train_runtime" in s][0]
    assert summary["hf_ddpfix/tokens_per_sec_rank"] > 0 and "hf_ddpfix/tokens_per_sec" not in summary


@pytest.mark.multiprocess
def test_replica_sync_and_cross_rank_metrics_under_ddp(tmp_path):
    """Identical replicas pass 3 checks; two weights nudged on rank 1 raise on BOTH ranks, naming the larger
    drift first, the last good check (step 2), with rank 0's model saved under output_dir first."""
    done = torchrun("ops_sync.py", timeout=150, env={"OPS_OUT": str(tmp_path)})
    out = done.stdout
    assert sorted(re.findall(r"CLEAN rank=(\d) checks=3", out)) == ["0", "1"], out[-3000:]
    nudged = re.search(r"NUDGED rank=1 (\S+)", out).group(1)
    diverged = re.findall(r"DIVERGED rank=(\d) step=(\d+) first=(\S+) n=2", out)
    assert sorted(diverged) == [("0", "4", nudged), ("1", "4", nudged)], out[-3000:]
    assert "NOT_DETECTED" not in out
    assert sorted(re.findall(r"REPORT rank=(\d) last_good=2 saved=True", out)) == ["0", "1"], out[-3000:]


def _resume_trainer(out, steps, resume=None):
    from fixtures import lora, padded_collate, tiny_llama, variable_length_ids
    from transformers import TrainingArguments

    from hf_ddpfix import DDPFixTrainer

    model = lora(tiny_llama(num_hidden_layers=1), targets=["q_proj"])
    data = [{"input_ids": ids} for ids in variable_length_ids(16)]
    collate = padded_collate

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=steps, save_steps=2,
                             use_cpu=True, report_to=[], logging_steps=1, disable_tqdm=True, seed=0,
                             remove_unused_columns=False, learning_rate=1e-2, weight_decay=0.1)
    trainer = DDPFixTrainer(model=model, args=args, train_dataset=data, data_collator=collate)
    result = trainer.train(resume_from_checkpoint=resume)
    return trainer, result


def test_resumed_run_stores_what_an_uninterrupted_run_stores(tmp_path):
    """transformers' resume tests (TrainerResumeTrainingTest) compare log_history of an uninterrupted and a
    resumed run: with hf_ddpfix active nothing time- or memory-dependent may enter what the Trainer stores."""
    import json

    full, full_result = _resume_trainer(tmp_path / "run", 4)
    resumed, resumed_result = _resume_trainer(tmp_path / "run", 4, resume=str(tmp_path / "run" / "checkpoint-2"))
    timing = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}

    def stored(entries):
        return [{k: v for k, v in e.items() if k not in timing} for e in entries]

    assert stored(full.state.log_history) == stored(resumed.state.log_history)
    for entries in (full.state.log_history, resumed.state.log_history):
        assert not any(k.startswith("hf_ddpfix/") for e in entries for k in e)
    state = json.loads((tmp_path / "run" / "checkpoint-4" / "trainer_state.json").read_text())
    assert not any(k.startswith("hf_ddpfix/") for e in state["log_history"] for k in e)
    assert not any(k.startswith("hf_ddpfix/") for k in (*full_result.metrics, *resumed_result.metrics))
