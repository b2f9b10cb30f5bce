"""ReplicaSyncCallback + MemoryThroughputCallback under 2-process DDP (stock Trainer, tiny Llama LoRA).

Phase "clean": identical replicas; the sync check runs every 2 steps and must stay silent; the memory /
throughput keys (with their cross-rank versions) must reach the Trainer's logs.
Phase "diverge": rank 1 nudges one LoRA weight outside DDP after step 3; the check at step 4 must raise
`ReplicaDivergenceError` on BOTH ranks naming that parameter first.
"""

import gc
import os

import torch
import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_ddpfix.callbacks import MemoryThroughputCallback, ReplicaSyncCallback
from hf_ddpfix.runtime.errors import ReplicaDivergenceError

rank = int(os.environ.get("RANK", 0))
out = os.environ.get("OPS_OUT", "/tmp/ops_sync")


def build():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


ds = Dataset.from_list([{"input_ids": [(i * 7 + j * 3) % 120 for j in range(16)]} for i in range(32)])


def collate(batch):
    ids = torch.tensor([b["input_ids"] for b in batch])
    return {"input_ids": ids, "labels": ids.clone()}


class Nudge(TrainerCallback):
    """After optimizer step 3, rank 1 changes two trainable weights without DDP knowing: the first by 1e-3,
    the last by 1e-1 (the error must name the larger drift first)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 3 and rank == 1:
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            with torch.no_grad():
                params[0][1].add_(1e-3)
                params[-1][1].add_(1e-1)
            print(f"NUDGED rank={rank} {params[-1][0]}", flush=True)


def run(extra, sync):
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=6, report_to=[],
                             use_cpu=True, save_strategy="no", learning_rate=1e-2, remove_unused_columns=False,
                             disable_tqdm=True, seed=0, logging_steps=1)
    trainer = Trainer(model=build(), args=args, train_dataset=ds, data_collator=collate)
    for cb in reversed([MemoryThroughputCallback(in_history=True), *extra, sync]):
        trainer.callback_handler.callbacks.insert(0, cb)  # first: reporters see the added keys
    trainer.train()
    return trainer


sync = ReplicaSyncCallback(every_n_steps=2)
trainer = run([], sync)
train_logs = [h for h in trainer.state.log_history if "loss" in h]
assert sync.checks == 3 and sync.last_checked_step == 6, (sync.checks, sync.last_checked_step)
keys = ("hf_ddpfix/peak_mem_gb", "hf_ddpfix/peak_mem_gb_max", "hf_ddpfix/tokens_per_sec",
        "hf_ddpfix/tokens_per_sec_rank")
assert len(train_logs) == 6 and all(k in h for h in train_logs for k in keys), train_logs
assert all(h["hf_ddpfix/peak_mem_gb_max"] >= h["hf_ddpfix/peak_mem_gb"] > 0 for h in train_logs), train_logs
assert all(h["hf_ddpfix/tokens_per_sec"] > h["hf_ddpfix/tokens_per_sec_rank"] > 0 for h in train_logs), train_logs
print(f"CLEAN rank={rank} checks={sync.checks} log={ {k: train_logs[-1][k] for k in keys} }", flush=True)

sync = ReplicaSyncCallback(every_n_steps=2)
try:
    run([Nudge()], sync)
    print(f"NOT_DETECTED rank={rank}", flush=True)
except ReplicaDivergenceError as e:
    print(f"DIVERGED rank={rank} step={e.step} first={e.names[0]} n={len(e.names)}", flush=True)
    saved = e.saved_to is not None and (rank != 0 or os.path.exists(os.path.join(e.saved_to, "adapter_config.json")))
    print(f"REPORT rank={rank} last_good={e.last_good_step} saved={saved}", flush=True)
    print(f"MESSAGE rank={rank} {str(e)[:300]}", flush=True)
    del e
dist.barrier()
del trainer
gc.collect()  # drop DDP reducers before the process group goes
dist.destroy_process_group()
