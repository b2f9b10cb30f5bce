"""Tiny Qwen2.5-VL LoRA (vision tower included) under the HF Trainer on fixed per-rank data layouts.

`--layout mixed`: rank 0 always has an image, rank 1 never. `--layout late`: no rank has an image for
the first 3 steps, then every sample has one. Batches go to ranks in order (sequential sampler,
batch 1 per rank), so the layout is exact. `--entry stock` is the reference (stock Trainer: a
PeftModel gets find_unused_parameters=True); `--entry patch` runs under hf_ddpfix (stabiliser,
find_unused_parameters=False). Rank 0 saves the trainable weights.
"""

import argparse
import os
import sys

import torch
from datasets import Dataset
from torch.utils.data import SequentialSampler
from transformers import Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import (  # noqa: E402
    add_lora,
    assert_same_across_ranks,
    build_qwen2_5_vl,
    image_collate,
    make_batch,
    teardown,
    trainable_weights,
)

from hf_ddpfix import patch_trainer  # noqa: E402
from hf_ddpfix._compat import checkpointing_training_args  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--entry", choices=["patch", "stock"], required=True)
p.add_argument("--layout", choices=["mixed", "late"], required=True)
p.add_argument("--ckpt", choices=["off", "non_reentrant"], default="non_reentrant")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--out", required=True)
a = p.parse_args()
if a.entry == "patch":
    patch_trainer()

world = int(os.environ.get("WORLD_SIZE", 1))
n = a.steps * world
has_image = [(i % 2 == 0) if a.layout == "mixed" else (i >= 3 * world) for i in range(n)]
rows = []
for i in range(n):
    b = make_batch(has_image[i], seed=i)
    rows.append({"input_ids": b["input_ids"][0].tolist(),
                 "pixel_values": b["pixel_values"].tolist() if has_image[i] else None,
                 "image_grid_thw": b["image_grid_thw"].tolist() if has_image[i] else None})


class InOrder(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


model = add_lora(build_qwen2_5_vl(0))
kw = {}
if a.ckpt != "off":
    kw = checkpointing_training_args(True, {"use_reentrant": False})
args = TrainingArguments(output_dir=a.out + ".run", per_device_train_batch_size=1, max_steps=a.steps,
                         report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2, weight_decay=0.1,
                         max_grad_norm=1.0, remove_unused_columns=False, disable_tqdm=True, seed=0,
                         logging_steps=1, **kw)
trainer = InOrder(model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=image_collate)
trainer.train()
wrapped = trainer.model_wrapped
weights = trainable_weights(model)
assert_same_across_ranks(weights, "train_vlm")
if int(os.environ.get("RANK", 0)) == 0:
    torch.save({"weights": weights, "find_unused": wrapped.find_unused_parameters,
                "static_graph": wrapped.static_graph}, a.out)
    print("SAVED", flush=True)
del trainer, model, wrapped  # drop the DDP reducer before its process group goes (exit abort otherwise)
teardown()
