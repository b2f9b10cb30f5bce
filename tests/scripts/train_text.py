"""Tiny Llama LoRA fine-tune under hf_ddpfix; saves the trainable weights (rank 0) for comparison.

Run with torchrun (any process count): the global batch is `--global-batch` split over the ranks, so a
1-process run with the same global batch is the reference a 2-process DDP run must match.
"""

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import Trainer, TrainingArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import lora_llama, teardown, trainable_weights  # noqa: E402

from hf_ddpfix import DDPFixTrainer, patch_trainer  # noqa: E402
from hf_ddpfix._compat import checkpointing_training_args  # noqa: E402
from hf_ddpfix.ops import feature_counts  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--entry", choices=["patch", "subclass", "stock"], default="patch")
p.add_argument("--ckpt", choices=["off", "reentrant", "non_reentrant"], default="reentrant")
p.add_argument("--global-batch", type=int, default=2)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--out", required=True)
a = p.parse_args()

world = int(os.environ.get("WORLD_SIZE", 1))


class _Warnings(logging.Filter):
    """Every hf_ddpfix log record at WARNING or above on this rank (a plain run must have none). A filter, not a
    handler: a handler on the "hf_ddpfix" logger would stand in for hf_ddpfix's own output (no plan printed)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            self.messages.append(record.getMessage())
        return True


warned = _Warnings()
logging.getLogger("hf_ddpfix").addFilter(warned)
if a.entry == "patch":
    patch_trainer()
model = lora_llama(targets=("q_proj", "v_proj"), random_lora=False)
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
weights = trainable_weights(model)
counts = {k: v.amounts for k, v in feature_counts.snapshot().items()}
warnings_by_rank = [warned.messages]
if dist.is_initialized():
    warnings_by_rank = [None] * world
    dist.all_gather_object(warnings_by_rank, warned.messages)
    gathered = [None] * world
    dist.all_gather_object(gathered, weights)
    for other in gathered[1:]:
        assert all(torch.equal(weights[n], other[n]) for n in weights), "ranks diverged"
if int(os.environ.get("RANK", 0)) == 0:
    torch.save({"weights": weights, "plan": getattr(trainer, "hf_ddpfix_plan", None), "counts": counts,
                "warnings": warnings_by_rank}, a.out)
    print("SAVED", a.out, flush=True)
del trainer, model  # drop the DDP reducer before its process group goes (exit abort otherwise)
teardown()
