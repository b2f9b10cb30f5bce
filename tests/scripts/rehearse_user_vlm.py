"""A user's own VLM fine-tuning script, written from scratch for GPUs with no hf_ddpfix in it: a small LLaVA (CLIP
tower + Llama) built from a config, LoRA on the attention of tower and language model, captions of random images,
the HF Trainer; a callback saves the adapter into ``--out`` after every step (where the real run keeps its results),
and ``--crash-at N`` makes rank 0 raise at step N (a user's bug that only rank 0 hits: its metrics logging).
tests/test_rehearse_examples.py rehearses it with ``--crash-at 2``: FAILED (exit 1), rank 0, its step and this file's
frame; the adapter it saved at step 1 redirected into the rehearsal folder, the earlier results byte-identical.
"""

import argparse
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

IMAGE_TOKEN, TOKENS_PER_IMAGE = 3, 4  # 28 px / 14 px patches: 2 x 2 patches, the CLS token dropped ("default")


class Captions(torch.utils.data.Dataset):
    """An image then 6-12 caption tokens; labels only on the caption."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        caption = torch.randint(10, 200, (6 + i % 7,), generator=g)
        ids = torch.cat([torch.full((TOKENS_PER_IMAGE,), IMAGE_TOKEN), caption])
        labels = torch.cat([torch.full((TOKENS_PER_IMAGE,), -100), caption])
        return {"input_ids": ids, "labels": labels, "pixel_values": torch.randn(3, 28, 28, generator=g)}


def collate(rows):
    n = max(len(r["input_ids"]) for r in rows)
    out = {"input_ids": torch.zeros(len(rows), n, dtype=torch.long), "labels": torch.full((len(rows), n), -100),
           "attention_mask": torch.zeros(len(rows), n, dtype=torch.long),
           "pixel_values": torch.stack([r["pixel_values"] for r in rows])}
    for k, r in enumerate(rows):
        m = len(r["input_ids"])
        out["input_ids"][k, :m], out["labels"][k, :m], out["attention_mask"][k, :m] = r["input_ids"], r["labels"], 1
    return out


class SaveAndLog(TrainerCallback):
    def __init__(self, out: str, crash_at: int):
        self.out, self.crash_at = out, crash_at

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            model.save_pretrained(os.path.join(self.out, "latest"))
            if state.global_step == self.crash_at:
                raise ValueError(f"my logging bug at step {state.global_step}")  # rank 0 only


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="vlm-run")
    p.add_argument("--crash-at", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, image_size=28, patch_size=14),
        text_config=LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, pad_token_id=0),
        image_token_index=IMAGE_TOKEN, vision_feature_layer=-1)
    model = get_peft_model(LlavaForConditionalGeneration(config),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(output_dir=a.out, max_steps=100, per_device_train_batch_size=2, learning_rate=1e-3,
                             weight_decay=0.01, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                             report_to=[], remove_unused_columns=False, bf16=torch.cuda.is_available())
    trainer = Trainer(model=model, args=args, train_dataset=Captions(), data_collator=collate,
                      callbacks=[SaveAndLog(a.out, a.crash_at)])
    trainer.train()
    trainer.save_model(os.path.join(a.out, "final"))


if __name__ == "__main__":
    main()
