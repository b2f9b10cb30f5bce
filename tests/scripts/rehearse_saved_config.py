"""A user's LoRA fine-tuning script for a real checkpoint, as written for GPUs: `from_pretrained(<folder>)`, bf16,
LoRA on the attention, the HF Trainer. tests/test_rehearse.py points it at a folder holding only the config.json of
a real model's shape (Qwen2.5-VL-7B, Llama-3.2-11B-Vision): `hf-ddpfix rehearse` builds it shrunk.

    hf-ddpfix rehearse -- accelerate launch --config_file accelerate_configs/ddp_cpu.yaml \\
        tests/scripts/rehearse_saved_config.py --model DIR
"""

import argparse
import json
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForImageTextToText, Trainer, TrainingArguments


class Rows(torch.utils.data.Dataset):
    """Token rows; with `image` set, every other row carries one 56x56 image (4 x 4 patches of 14 px, 2 x 2
    merge: 4 image tokens) in Qwen2.5-VL's packed layout."""

    def __init__(self, config, n: int = 64, image: bool = False):
        self.config, self.n, self.image = config, n, image

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(10, 1000, (12 + i % 5,), generator=g)
        row = {"input_ids": ids, "labels": ids.clone()}
        if self.image and i % 2 == 0:
            v = self.config.vision_config
            tokens = torch.full((4,), self.config.image_token_id)
            row["input_ids"] = torch.cat([torch.tensor([self.config.vision_start_token_id]), tokens,
                                          torch.tensor([self.config.vision_end_token_id]), ids])
            row["labels"] = torch.cat([torch.full((6,), -100), ids])
            dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
            row["pixel_values"] = torch.randn(16, dim, generator=g)
            row["image_grid_thw"] = torch.tensor([[1, 4, 4]])
        return row


def collate(rows):
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for k, r in enumerate(rows):
        m = len(r["input_ids"])
        ids[k, :m], labels[k, :m], mask[k, :m] = r["input_ids"], r["labels"], 1
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    imgs = [r for r in rows if "pixel_values" in r]
    if imgs:
        batch["pixel_values"] = torch.cat([r["pixel_values"] for r in imgs])
        batch["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in imgs])
    return batch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--images", action="store_true")
    p.add_argument("--out", default=None, help="where the real run keeps its results (final adapter, metrics)")
    a = p.parse_args()
    model = AutoModelForImageTextToText.from_pretrained(a.model, dtype=torch.bfloat16,
                                                        attn_implementation="flash_attention_2")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(output_dir="/nonexistent/real-run", max_steps=1000, per_device_train_batch_size=2,
                             bf16=True, learning_rate=1e-4, save_strategy="no", logging_steps=1,
                             report_to="wandb", remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(model.config, image=a.images), data_collator=collate)
    result = trainer.train()
    if a.out:  # as a real script saves: the adapter, a state dict, metrics, each read back
        trainer.save_model(os.path.join(a.out, "final"))
        if trainer.is_world_process_zero():
            torch.save({"step": trainer.state.global_step}, os.path.join(a.out, "extra.pt"))
            with open(os.path.join(a.out, "metrics.json"), "w") as f:
                json.dump(result.metrics, f)
            assert torch.load(os.path.join(a.out, "extra.pt"))["step"] == trainer.state.global_step
            assert os.path.isfile(os.path.join(a.out, "final", "adapter_config.json"))


if __name__ == "__main__":
    try:
        main()
    finally:
        from hf_ddpfix.ops.dist import destroy_default_group

        destroy_default_group()
