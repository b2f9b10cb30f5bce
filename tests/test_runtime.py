"""The appliers: checkpoint function switched, offload wired around each training step, all undone."""

import dataclasses

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import hf_ddpfix.trainer as trainer_mod
from hf_ddpfix import DDPFixTrainer
from hf_ddpfix._compat import checkpointing_training_args
from hf_ddpfix.integrations.checkpointing import CheckpointFunction, detect_checkpointing

LAYERS, BATCH, SEQ, HIDDEN = 3, 2, 16, 64


def build(tmp_path, ckpt_kwargs):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ds = Dataset.from_list([{"input_ids": [(i + j) % 120 for j in range(SEQ)]} for i in range(8)])

    def collate(batch):
        ids = torch.tensor([b["input_ids"] for b in batch])
        return {"input_ids": ids, "labels": ids.clone()}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=2,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             **checkpointing_training_args(True, ckpt_kwargs))
    return model, DDPFixTrainer(model=model, args=args, train_dataset=ds, data_collator=collate)


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_reentrant_request_runs_our_function_in_single_process(tmp_path):
    model, trainer = build(tmp_path, {"use_reentrant": True})
    trainer.train()
    assert detect_checkpointing(model) == "reentrant"  # single process: kept as asked
    funcs = {type(m._gradient_checkpointing_func) for m in model.modules() if hasattr(m, "gradient_checkpointing")}
    assert funcs == {CheckpointFunction}
    assert "training_step" not in vars(trainer)


def test_offload_is_wired_around_each_step_and_removed_after(tmp_path, monkeypatch):
    """With an accelerator the plan turns offload on; on CPU the offload only counts what it would move."""
    real = trainer_mod.gather_facts
    monkeypatch.setattr(trainer_mod, "gather_facts",
                        lambda tr: dataclasses.replace(real(tr), accelerator_available=True))
    ref_model, ref = build(tmp_path / "ref", {"use_reentrant": False})
    ref.train()
    model, trainer = build(tmp_path / "off", {"use_reentrant": False, "offload": True})
    trainer.train()
    rt = trainer.hf_ddpfix_runtime
    assert trainer.hf_ddpfix_plan.offload_activations.value is True and rt.offload is not None
    # every checkpointed layer's input went through the hooks (on CPU, below the 1 MiB threshold: kept)
    assert rt.offload.stats.packed_tensors == LAYERS
    assert rt.offload.stats.packed_bytes == LAYERS * BATCH * SEQ * HIDDEN * 4
    assert "training_step" not in vars(trainer)
    a, b = trainable(ref_model), trainable(model)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_offload_on_cpu_is_a_logged_no_op(tmp_path):
    model, trainer = build(tmp_path, {"use_reentrant": False, "offload": True})
    trainer.train()  # stock transformers crashes here in pin_memory on a machine without an accelerator
    assert trainer.hf_ddpfix_plan.offload_activations.value is False
    assert "no accelerator" in trainer.hf_ddpfix_plan.offload_activations.reason
    assert trainer.hf_ddpfix_runtime.offload is None


@pytest.mark.parametrize("ckpt", [{"use_reentrant": False}])
def test_plan_is_logged_once_on_rank0(tmp_path, caplog, ckpt):
    model, trainer = build(tmp_path, ckpt)
    with caplog.at_level("INFO", logger="hf_ddpfix"):
        trainer.train()
    assert sum("hf_ddpfix plan" in r.message for r in caplog.records) == 1


def test_a_process_launched_as_one_of_several_that_trains_alone_is_named_before_step_1(tmp_path, monkeypatch, caplog):
    """`accelerate launch --config_file ddp_cpu.yaml` on a script without `use_cpu=True`: every rank gets
    WORLD_SIZE=2 but its Trainer sees world size 1 (measured, facts.launch_world_mismatch). Faked in one process: the
    launch's environment set after a single-process Trainer is built. A warning naming `use_cpu` (every process),
    a PlanError under strict before step 1, nothing when WORLD_SIZE says 1. Shown failing by making
    `launch_world_mismatch` return None (no warning, strict trains)."""
    from hf_ddpfix import DDPFixConfig
    from hf_ddpfix.plan.types import PlanError

    trainer, strict, one = (build(tmp_path / name, {"use_reentrant": False})[1] for name in ("a", "strict", "one"))
    trainer.args.use_cpu = False  # as the user's script wrote it (the CPU is chosen anyway: no accelerator here)
    strict.ddpfix_config = DDPFixConfig(strict=True)
    monkeypatch.setenv("WORLD_SIZE", "2")  # after the Trainers (and their accelerate state) were built
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level("WARNING", logger="hf_ddpfix"):
        trainer.train()
    said = [r.message for r in caplog.records if "WORLD_SIZE=2" in r.message]
    assert len(said) == 1 and "rank 1 of WORLD_SIZE=2" in said[0] and "trains alone" in said[0], said
    if not torch.accelerator.is_available():
        assert "use_cpu=True" in said[0] and "no accelerator" in said[0], said
    with pytest.raises(PlanError, match="WORLD_SIZE=2"):
        strict.train()
    assert strict.state.global_step == 0
    monkeypatch.setenv("WORLD_SIZE", "1")
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_ddpfix"):
        one.train()
    assert not [r for r in caplog.records if "WORLD_SIZE" in r.message]
