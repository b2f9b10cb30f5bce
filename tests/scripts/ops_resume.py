"""Tiny Llama LoRA under hf_ddpfix that checkpoints every 2 steps and resumes after a crash.

Run under `torchrun --max-restarts=1` (PET_MAX_RESTARTS=1). With `--crash-at K`, rank 1 calls
`os._exit(1)` right after optimizer step K on the FIRST attempt only (TORCHELASTIC_RESTART_COUNT=0);
torchrun then restarts the whole group, which resumes from the newest complete checkpoint.
Rank 0 saves the final trainable weights to `--weights`; the final adapter goes to `--final` through
`save_model_atomic` (rank 0 writes it, into place by rename).
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_ddpfix import patch_trainer
from hf_ddpfix.callbacks import ReplicaSyncCallback
from hf_ddpfix.runtime.checkpoints import last_complete_checkpoint, save_model_atomic

p = argparse.ArgumentParser()
p.add_argument("--run-dir", required=True)
p.add_argument("--final", required=True)
p.add_argument("--weights", required=True)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--crash-at", type=int, default=0)
p.add_argument("--resume-from", default=None, help="resume from this checkpoint (default: last complete one)")
a = p.parse_args()

rank = int(os.environ.get("RANK", 0))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
patch_trainer()
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# lora_dropout > 0: the restored run must also replay each rank's RNG stream (rng_state_{rank}.pth)
model = get_peft_model(LlamaForCausalLM(cfg),
                       LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
ds = Dataset.from_list([{"input_ids": [(i * 7 + j * 3) % 120 for j in range(16)]} for i in range(64)])


def collate(batch):
    ids = torch.tensor([b["input_ids"] for b in batch])
    return {"input_ids": ids, "labels": ids.clone()}


class CrashOnce(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if a.crash_at and state.global_step == a.crash_at and rank == 1 and attempt == 0:
            print(f"CRASHING rank={rank} step={state.global_step}", flush=True)
            os._exit(1)


args = TrainingArguments(output_dir=a.run_dir, per_device_train_batch_size=2, max_steps=a.steps,
                         save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, learning_rate=1e-2,
                         remove_unused_columns=False, disable_tqdm=True, seed=0, data_seed=0, logging_steps=1,
                         dataloader_num_workers=0)
trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate,
                  callbacks=[CrashOnce(), ReplicaSyncCallback(every_n_steps=2)])
resume = a.resume_from or last_complete_checkpoint(a.run_dir)
print(f"ATTEMPT rank={rank} attempt={attempt} resume={os.path.basename(resume) if resume else None}", flush=True)
trainer.train(resume_from_checkpoint=resume)
if save_model_atomic(trainer, a.final):
    print(f"FINAL_WRITTEN rank={rank} attempt={attempt}", flush=True)
weights = {n: w.detach().clone() for n, w in model.named_parameters() if w.requires_grad}
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, weights)
assert all(torch.equal(weights[n], g[n]) for g in gathered for n in weights), "ranks diverged"
if rank == 0:
    torch.save(weights, a.weights)
    print("SAVED", a.weights, flush=True)
dist.barrier()
del trainer, model
gc.collect()  # drop the DDP reducer before its process group goes
dist.destroy_process_group()
