"""QLoRA (bitsandbytes NF4 base + LoRA) under DeepSpeed ZeRO-3 with the HF Trainer (2 gloo processes, CPU).

Run:  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/qlora_zero3.py --model-dir DIR --case train|refuse

DIR holds a tiny Llama saved with `save_pretrained`; every rank reloads it in NF4 on the CPU.

One case per launch (accelerate allows one DeepSpeed `Accelerator` per process):
1. `--case train`: uint8 storage (the default), ZeRO-3 with bf16 on, under `patch_trainer()`: the plan is silent; 4 steps
   train (finite losses, every LoRA tensor moves) and every 4-bit weight is partitioned: the bytes a
   rank holds (`ds_tensor`) sum to exactly 1/world of the quantized bytes.
2. `--case refuse`: float32 storage, ZeRO-3 with bf16 on: under `patch_trainer()` the plan raises `QuantStorageError` before
   any step (fix: `bnb_4bit_quant_storage=torch.bfloat16`); the stock Trainer fails at its first step
   ("invalid for input of size": DeepSpeed's bf16 cast converted the packed bytes).

Prints ``QLORA_ZERO3_OK``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig, LlamaForCausalLM, Trainer, TrainingArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import padded_collate, rank_log, teardown  # noqa: E402

from hf_ddpfix import patch_trainer, unpatch_trainer  # noqa: E402
from hf_ddpfix.integrations.quantized import quantization_facts  # noqa: E402
from hf_ddpfix.plan import QuantStorageError  # noqa: E402

STEPS = 4
DS_CONFIG = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # tiny model: shard everything
    "bf16": {"enabled": True},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
}


def make_args(out: str) -> TrainingArguments:
    # built before the model: TrainingArguments(deepspeed=...) turns on ZeRO-3 awareness in from_pretrained
    return TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=STEPS, report_to=[],
                             use_cpu=True, save_strategy="no", learning_rate=1e-2, weight_decay=0.1,
                             max_grad_norm=0.2, remove_unused_columns=False, disable_tqdm=True, seed=0,
                             logging_steps=1, bf16=True, deepspeed=DS_CONFIG)


def load(model_dir: str, storage: torch.dtype):
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_quant_storage=storage, bnb_4bit_compute_dtype=torch.float32)
    model = LlamaForCausalLM.from_pretrained(model_dir, quantization_config=q)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))


def dataset() -> Dataset:
    lengths = (7, 12, 16, 9, 20, 5, 14, 11)
    return Dataset.from_list([{"input_ids": [(i * 7 + j * 3) % 240 + 1 for j in range(lengths[i % 8])]}
                              for i in range(32)])


def partitioned_quant_bytes(model) -> int:
    """Bytes of the 4-bit weights this rank holds after ZeRO-3 partitioning (its `ds_tensor` slices)."""
    import bitsandbytes as bnb

    total = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            part = m.weight.ds_tensor
            total += part.numel() * part.element_size()
    return total


def train_uint8(a, args, log) -> None:
    """Case 1: uint8 storage under a bf16 ZeRO-3 engine trains, the 4-bit bytes are partitioned."""
    import deepspeed

    model = load(a.model_dir, torch.uint8)
    full_bytes = quantization_facts(model).quant_bytes
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), data_collator=padded_collate)
    trainer.train()
    plan = trainer.hf_ddpfix_plan
    assert "ZeRO-3 partitions the 4-bit weights (uint8" in plan.quantization.reason, plan.report()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), losses
    held = partitioned_quant_bytes(trainer.model_wrapped)
    assert held * dist.get_world_size() == full_bytes, (held, full_bytes)
    with deepspeed.zero.GatheredParameters([p for p in model.parameters() if p.requires_grad]):
        moved = sum(not torch.equal(init[n], p.detach()) for n, p in model.named_parameters() if n in init)
    assert moved == len(init), f"only {moved}/{len(init)} LoRA tensors moved"
    log(f"uint8 storage, ZeRO-3 bf16: 4-bit bytes held {held} of {full_bytes}; losses "
        f"{[round(x, 4) for x in losses]}")


def refuse_float32(a, args, log) -> None:
    """Case 2: float32 storage under a bf16 engine: refused before training; stock fails at step 1.

    One Trainer for both attempts: accelerate allows one DeepSpeed `Accelerator` per process.
    """
    model = load(a.model_dir, torch.float32)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), data_collator=padded_collate)
    try:
        trainer.train()
    except QuantStorageError as err:
        assert "bnb_4bit_quant_storage=torch.bfloat16" in str(err), err
        assert trainer.state.global_step == 0
        log(f"float32 storage, ZeRO-3 bf16: QuantStorageError before step 1: {str(err)[:90]}")
    else:
        raise AssertionError("float32 storage under a bf16 ZeRO-3 engine was not refused")
    unpatch_trainer()
    try:
        trainer.train()
    except RuntimeError as err:
        assert "invalid for input of size" in str(err), err
        log(f"stock on the same set-up fails at step 1: {str(err)[:70]}")
    else:
        raise AssertionError("stock trained float32 storage under bf16 ZeRO-3 (the refusal would be unfounded)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--case", choices=["train", "refuse"], required=True)
    p.add_argument("--out", default="/tmp/qlora_zero3_run")
    a = p.parse_args()
    args = make_args(a.out)
    log = rank_log(args.process_index)

    patch_trainer()
    try:
        (train_uint8 if a.case == "train" else refuse_float32)(a, args, log)
    finally:
        unpatch_trainer()
    log("QLORA_ZERO3_OK")
    teardown()


if __name__ == "__main__":
    main()
