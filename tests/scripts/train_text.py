"""Tiny Llama LoRA fine-tune under hf_ddpfix; saves the trainable weights (rank 0) for comparison.

Run with torchrun (any process count): the global batch is `--global-batch` split over the ranks, so a
1-process run with the same global batch is the reference a 2-process DDP run must match.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hf_ddpfix import DDPFixTrainer, patch_trainer
from hf_ddpfix._compat import checkpointing_training_args

p = argparse.ArgumentParser()
p.add_argument("--entry", choices=["patch", "subclass", "stock"], default="patch")
p.add_argument("--ckpt", choices=["off", "reentrant", "non_reentrant"], default="reentrant")
p.add_argument("--global-batch", type=int, default=2)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--out", required=True)
a = p.parse_args()

world = int(os.environ.get("WORLD_SIZE", 1))
if a.entry == "patch":
    patch_trainer()
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
ds = Dataset.from_list([{"input_ids": [(i * 7 + j * 3) % 240 for j in range(24)]} for i in range(32)])


def collate(batch):
    ids = torch.tensor([b["input_ids"] for b in batch])
    return {"input_ids": ids, "labels": ids.clone()}


kw = {}
if a.ckpt != "off":
    kw = checkpointing_training_args(True, {"use_reentrant": a.ckpt == "reentrant"})
args = TrainingArguments(output_dir=a.out + ".run", per_device_train_batch_size=a.global_batch // world,
                         max_steps=a.steps, report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2,
                         remove_unused_columns=False, disable_tqdm=True, seed=0, logging_steps=1, **kw)
cls = DDPFixTrainer if a.entry == "subclass" else Trainer
trainer = cls(model=model, args=args, train_dataset=ds, data_collator=collate)
trainer.train()
weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
if dist.is_initialized():
    gathered = [None] * world
    dist.all_gather_object(gathered, weights)
    for other in gathered[1:]:
        assert all(torch.equal(weights[n], other[n]) for n in weights), "ranks diverged"
if int(os.environ.get("RANK", 0)) == 0:
    torch.save({"weights": weights, "plan": getattr(trainer, "hf_ddpfix_plan", None)}, a.out)
    print("SAVED", a.out, flush=True)
if dist.is_initialized():
    dist.barrier()
    del trainer, model
    gc.collect()  # drop the DDP reducer before its process group goes (exit abort otherwise)
    dist.destroy_process_group()
