"""LoRA fine-tuning of a Qwen2.5-VL model with the HF Trainer under DDP, made to work by hf_ddpfix.

The default run is fully offline: a tiny random-weight Qwen2.5-VL learns to caption PIL-drawn shapes
("a red circle") while also learning a text-only task ("count from three : four five six"), with LoRA
on every linear layer (vision tower included) and non-reentrant activation checkpointing. A step where
no rank sees an image leaves the vision LoRA unused; `patch_trainer()` plans around it (its plan is printed
at the start). Demonstration: `--checkpointing reentrant` asks for the combination stock DDP + LoRA breaks
on ("Expected to mark a variable ready only once"): hf_ddpfix corrects it (the plan says so), and adding
`--no-fix` shows the stock failure.
The default run takes about a minute on 2 CPU cores and reaches ~0.97 caption accuracy (chance 0.29).

Run it:

    # 2 processes on the CPU (gloo), any machine
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml examples/qwen_vl_lora.py
    # or, the same without accelerate's launcher
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/qwen_vl_lora.py
    # GPUs (one process per GPU; set num_processes in the yaml)
    accelerate launch --config_file accelerate_configs/ddp.yaml examples/qwen_vl_lora.py
    # FSDP2 (accelerate runs FSDP on accelerators only: on a CPU-only machine this script says so and
    # stops; the test suite runs this line on the CPU through its FSDP test device, docs/fsdp.md)
    accelerate launch --config_file accelerate_configs/fsdp.yaml examples/qwen_vl_lora.py
    # one process
    python examples/qwen_vl_lora.py
    # QLoRA: 4-bit NF4 base (bitsandbytes; on the CPU too) + LoRA, under DDP
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml examples/qwen_vl_lora.py --qlora
    # DeepSpeed ZeRO-2 / ZeRO-3 (on a CPU-only machine deepspeed picks its CPU accelerator by itself)
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/qwen_vl_lora.py
    # continue from the last checkpoint of the same set-up, up to a larger step count
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml examples/qwen_vl_lora.py \
        --resume --max-steps 400

    # a real model and dataset (needs the Hub or local copies)
    accelerate launch --config_file accelerate_configs/ddp.yaml examples/qwen_vl_lora.py --model Qwen/Qwen2.5-VL-3B-Instruct \
        --dataset path/or/name --per-device-batch-size 4 --lr 2e-4 --max-steps 1000

`--dataset` is anything `datasets.load_dataset` opens, with columns `image` (a PIL image, or None for a
text-only row) and `text` (the target caption / answer); an optional `prompt` column holds the
question (default: "Describe the image."). A held-out split of `--eval-size` rows is carved out.

Output: progress bar and the hf_ddpfix plan on rank 0, checkpoints every `--save-steps` steps, the
adapter (adapter_model.safetensors + adapter_config.json) in `--output-dir` (default: one folder per
set-up, `outputs/qwen_vl_lora/<model>-<lora|qlora>-r<rank>-<ddp|single|zero2|zero3>`, so `--resume`
finds only its own set-up's checkpoints; a folder of another set-up is refused with the reason; under
`--qlora` the seeded base sits in `base_model/` there, where the adapter's config points), and a last line
`RESULT {"eval_loss": ..., "caption_accuracy": ..., "chance": ..., "global_step": ...}` from rank 0.
`caption_accuracy` is teacher-forced: the fraction of scored caption tokens (colour and shape words
for the synthetic data; every answer token for `--dataset`) whose argmax prediction is right.
The offline base model is random but seeded: the same `--seed` rebuilds it, so the adapter is usable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _offline_vlm when run as a script

import _offline_vlm as offline  # noqa: E402
from _run_setup import (  # noqa: E402
    output_dir_for,
    quiet_known_upstream_notices,
    quiet_repeated_upstream_warnings,
    record_setup,
    refuse,
    saved_base,
)

quiet_known_upstream_notices()  # before peft / deepspeed are imported (docs/examples.md: what a run prints)

from hf_ddpfix import checkpointing_training_args  # noqa: E402  (importing hf_ddpfix patches nothing)

# LoRA on every linear layer: language model, vision blocks and the vision->text merger (Qwen2.5-VL names).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "qkv", "attn.proj", "merger.mlp.0", "merger.mlp.2"]


def sampling_training_args(strategy: str) -> dict:
    """`TrainingArguments` keywords for the training sampler: `train_sampling_strategy` on transformers
    5.23+, the older `group_by_length` flag on 5.0-5.22 (the same two behaviours)."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "train_sampling_strategy" in names:
        return {"train_sampling_strategy": strategy}
    return {"group_by_length": strategy == "group_by_length"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="hub id or local path (uses AutoProcessor); default: tiny offline Qwen2.5-VL")
    p.add_argument("--dataset", default=None,
                   help="datasets.load_dataset name/path with image/text columns; default: synthetic shapes")
    p.add_argument("--dataset-split", default="train")  # the split --dataset is read from
    p.add_argument("--output-dir", default=None,  # adapter + checkpoints land here
                   help="default: outputs/qwen_vl_lora/<set-up>, one folder per set-up (see setup_of)")
    p.add_argument("--max-steps", type=int, default=200)  # enough for the tiny model to beat chance well
    p.add_argument("--per-device-batch-size", type=int, default=8)  # 8 small samples: fast on one CPU core
    p.add_argument("--grad-accum", type=int, default=1)  # hf_ddpfix handles no_sync micro-batches too
    p.add_argument("--lr", type=float, default=3e-3)  # high for LoRA: the offline model is tiny (1e-2 diverges)
    p.add_argument("--lora-r", type=int, default=16)  # ~full rank for hidden 96; use 8-64 on real models
    p.add_argument("--seed", type=int, default=0)  # fixes the offline base weights, data and LoRA init
    p.add_argument("--save-steps", type=int, default=50)  # checkpoint cadence for --resume
    p.add_argument("--eval-steps", type=int, default=0)  # 0: evaluate only at the end (keeps CPU runs short)
    p.add_argument("--train-size", type=int, default=2000)  # synthetic samples; fresh images, ~2 epochs
    p.add_argument("--eval-size", type=int, default=120)  # held-out samples (synthetic or --dataset rows)
    p.add_argument("--checkpointing", choices=["off", "non_reentrant", "reentrant"], default="non_reentrant",
                   help="activation checkpointing (default non_reentrant); reentrant is the demonstration: the "
                        "combination stock DDP + LoRA breaks on, which hf_ddpfix corrects (--no-fix: the failure)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    p.add_argument("--no-fix", action="store_true",
                   help="stock Trainer (no patch_trainer); with --checkpointing reentrant: the stock failure")
    p.add_argument("--qlora", action="store_true",
                   help="QLoRA: 4-bit NF4 base (bitsandbytes) + LoRA; DDP configs (ddp_cpu.yaml, ddp.yaml)")
    # hf_ddpfix's memory features (each also settable by its HF_DDPFIX_* environment variable)
    p.add_argument("--offload", action="store_true",
                   help="async CPU offload of checkpointed layer inputs (a logged no-op without a GPU)")
    p.add_argument("--tiled-mlp", default=None,
                   help="TiledMLP: on (every length), auto, N shards, arctic, target, target:GB (default: off)")
    p.add_argument("--tiled-loss", default=None, help="chunked lm_head + loss: on, or N tokens per chunk")
    return p.parse_args(argv)


def rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


# --------------------------------------------------------------------------- data -> model inputs
class Encoder:
    """Turns {"image", "prompt", "answer"} into input_ids / labels / pixel_values / image_grid_thw.

    The image-token expansion is done here (one `<|image_pad|>` per merge_size**2 patches), so the same
    code serves the offline tokenizer + image processor and a real model's AutoProcessor parts.
    """

    def __init__(self, tokenizer, image_processor, image_token_id: int, vision_start_id: int, vision_end_id: int):
        self.tok, self.ip = tokenizer, image_processor
        self.merge = image_processor.merge_size
        t = tokenizer.convert_ids_to_tokens
        self.image_pad, self.vision_start, self.vision_end = t(image_token_id), t(vision_start_id), t(vision_end_id)

    def __call__(self, ex: dict) -> dict:
        out, vision = {}, ""
        if ex["image"] is not None:
            px = self.ip(images=[ex["image"].convert("RGB")], return_tensors="pt")
            out["pixel_values"], out["image_grid_thw"] = px["pixel_values"], px["image_grid_thw"]
            n_tokens = int(px["image_grid_thw"].prod()) // self.merge**2
            vision = self.vision_start + self.image_pad * n_tokens + self.vision_end
        prompt = vision + ex["prompt"]
        if self.tok.chat_template:  # real instruct models: wrap in their chat format
            prompt = self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)
        prompt_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = self.tok(ex["answer"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        out["input_ids"] = prompt_ids + answer_ids
        out["labels"] = [-100] * len(prompt_ids) + answer_ids  # loss on the answer only
        return out


class EncodedDataset(torch.utils.data.Dataset):
    """Encodes raw samples lazily (images are drawn / processed when a batch asks for them)."""

    def __init__(self, raw, encoder: Encoder):
        self.raw, self.encoder = raw, encoder

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int) -> dict:
        return self.encoder(self.raw[i])


class HubRows:
    """A `datasets.Dataset` with image/text(/prompt) columns, seen as {"image", "prompt", "answer"}."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        row = self.ds[int(i)]
        return {"image": row.get("image"), "prompt": row.get("prompt") or "Describe the image.",
                "answer": row["text"]}


def make_collator(pad_id: int, image_token_id: int):
    def collate(features: list[dict]) -> dict:
        n = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), n), pad_id, dtype=torch.long)
        labels = torch.full((len(features), n), -100, dtype=torch.long)  # padding never scores
        mask = torch.zeros((len(features), n), dtype=torch.long)
        for i, f in enumerate(features):
            k = len(f["input_ids"])
            ids[i, :k], labels[i, :k], mask[i, :k] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
        # mm_token_type_ids (1 = image token) lets Qwen-VL build its 3-D (M-RoPE) positions for images
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask,
                 "mm_token_type_ids": (ids == image_token_id).long()}
        images = [f for f in features if "pixel_values" in f]
        if images:  # an image-free batch simply has no pixel_values: hf_ddpfix keeps DDP in step
            batch["pixel_values"] = torch.cat([f["pixel_values"] for f in images])
            batch["image_grid_thw"] = torch.cat([f["image_grid_thw"] for f in images])
        return batch

    return collate


# --------------------------------------------------------------------------- metrics
def make_metrics(groups: dict[str, set[int]] | None):
    """Teacher-forced accuracy of the argmax next token at scored caption positions.

    groups: name -> token ids scored in that group (e.g. colours, shapes); None scores every label.
    """

    def preprocess(logits, labels):  # keep only the argmax: no (batch, seq, vocab) tensors are gathered
        logits = logits[0] if isinstance(logits, tuple) else logits
        return logits.argmax(-1)

    def compute(pred) -> dict:
        p, y = np.asarray(pred.predictions)[:, :-1], np.asarray(pred.label_ids)[:, 1:]  # token t predicts t+1
        out, hits, total = {}, 0, 0
        for name, ids in (groups or {"caption": None}).items():
            where = np.isin(y, list(ids)) if ids is not None else y != -100
            h, n = int((p[where] == y[where]).sum()), int(where.sum())
            out[f"{name}_accuracy"] = h / max(n, 1)
            hits, total = hits + h, total + n
        out["caption_accuracy"] = hits / max(total, 1)
        return out

    return preprocess, compute


# --------------------------------------------------------------------------- model + data
def load_4bit(source, model_class):
    """`model_class.from_pretrained(source)` with an NF4 4-bit base (bitsandbytes), each rank's whole model on
    its own device (`device_map={"": local_rank}`: what DDP needs); on a machine without an accelerator
    `device_map="cpu"` (bitsandbytes 0.50 quantizes on the CPU; `{"": 0}` there fails with "Cannot access
    accelerator device when none is available"). The storage dtype stays bitsandbytes' default (uint8): fine
    for DDP; FSDP2 / ZeRO-3 need `bnb_4bit_quant_storage` equal to the mixed-precision dtype (docs/qlora.md).
    """
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float32)
    device_map = {"": int(os.environ.get("LOCAL_RANK", 0))} if torch.accelerator.is_available() else "cpu"
    model = model_class.from_pretrained(source, quantization_config=quant, device_map=device_map,
                                        dtype=torch.bfloat16 if bf16 else torch.float32)
    # peft's defaults: checkpointing on, reentrant (stock DDP fails on it; hf_ddpfix plans around it)
    return prepare_model_for_kbit_training(model)


def build_offline(args):
    tokenizer = offline.build_tokenizer()
    image_processor = offline.build_image_processor()
    # --qlora: hidden 128, so every linear layer's input width is a multiple of bitsandbytes' 64-value block
    # (its CPU evaluation path repacks 4-bit weights and fails on the default 96: "shape '[96, 1]' is invalid")
    model = offline.build_model(tokenizer, seed=args.seed, **({"hidden": 128} if args.qlora else {}))
    if args.qlora:  # bitsandbytes quantizes while loading from disk: the seeded base is saved, then reloaded 4-bit
        model = load_4bit(saved_base(model, args), type(model))
    train_raw = offline.ShapesDataset(args.train_size, seed=args.seed)
    eval_raw = offline.ShapesDataset(args.eval_size, seed=args.seed + 10_000)  # other seeds: unseen images
    return model, tokenizer, image_processor, train_raw, eval_raw


def build_hub_model(args):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(args.model)
    dtype = torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if args.qlora:
        return load_4bit(args.model, AutoModelForImageTextToText), processor.tokenizer, processor.image_processor
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype)
    return model, processor.tokenizer, processor.image_processor


def build_hub_data(args):
    from datasets import load_dataset

    ds = load_dataset(args.dataset, split=args.dataset_split)
    missing = {"image", "text"} - set(ds.column_names)
    if missing:
        refuse(f"--dataset needs columns image and text; {args.dataset} lacks {sorted(missing)}")
    split = ds.train_test_split(test_size=args.eval_size, seed=args.seed)
    return HubRows(split["train"]), HubRows(split["test"])


def word_ids(tokenizer, words) -> set[int]:
    """Token ids of `words` as they appear inside a caption (after a space)."""
    return {i for w in words for i in tokenizer(" " + w, add_special_tokens=False)["input_ids"]}


def save_adapter(trainer, output_dir: str) -> None:
    """`trainer.save_model(output_dir)`, except under FSDP with `SHARDED_STATE_DICT` (fsdp.yaml), where
    transformers 5.23's `save_model` writes nothing (it saves only a FULL_STATE_DICT): there the adapter is
    gathered on every rank (`accelerator.get_state_dict`, a collective) and rank 0 saves it."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if plugin is None or "FULL_STATE_DICT" in str(plugin.state_dict_type):
        trainer.save_model(output_dir)
        return
    state = trainer.accelerator.get_state_dict(trainer.model)
    if trainer.is_world_process_zero():
        trainer.model.save_pretrained(output_dir, state_dict=state)


# --------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet_repeated_upstream_warnings()
    args.output_dir = output_dir_for(args)
    if args.dataset and not args.model:
        refuse("--dataset needs --model: the offline tokenizer only knows the synthetic vocabulary")
    if not args.no_fix:
        from hf_ddpfix import patch_trainer

        # before the Trainer is built; unset options come from HF_DDPFIX_* variables at train time
        patch_trainer(offload_activations=args.offload or None, tiled_mlp=args.tiled_mlp, tiled_loss=args.tiled_loss)

    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from hf_ddpfix import last_complete_checkpoint

    if args.model:
        model, tokenizer, image_processor = build_hub_model(args)
    else:
        model, tokenizer, image_processor, train_raw, eval_raw = build_offline(args)
    if args.dataset:
        train_raw, eval_raw = build_hub_data(args)
    elif args.model:
        train_raw = offline.ShapesDataset(args.train_size, seed=args.seed)
        eval_raw = offline.ShapesDataset(args.eval_size, seed=args.seed + 10_000)

    cfg = model.config
    encoder = Encoder(tokenizer, image_processor, cfg.image_token_id, cfg.vision_start_token_id,
                      cfg.vision_end_token_id)
    groups = None if args.dataset else {"colour": word_ids(tokenizer, offline.COLOURS),
                                        "shape": word_ids(tokenizer, offline.SHAPES)}
    chance = None if args.dataset else offline.chance_level()
    preprocess, compute_metrics = make_metrics(groups)

    torch.manual_seed(args.seed)
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,  # alpha = 2r: the usual LoRA scale of 2
                      lora_dropout=0.0, target_modules=LORA_TARGETS)  # no dropout: short runs, no overfitting
    with warnings.catch_warnings():  # peft 0.21 reads transformers 5.23's deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = get_peft_model(model, lora)
    # no KV cache in training (checkpointing turns it off anyway, saying so): on every (sub-)config, as the
    # language model reads its own text_config
    for config in {id(c): c for c in (model.config, getattr(model.config, "text_config", None)) if c}.values():
        config.use_cache = False
    if rank0():
        model.print_trainable_parameters()

    ckpt = args.checkpointing != "off"
    on_accelerator = torch.accelerator.is_available()
    targs = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_batch_size,
        per_device_eval_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",  # decays to ~0 at max_steps: a stable end point for eval
        warmup_steps=min(20, args.max_steps // 10),  # short warm-up: LoRA B starts at 0, little to stabilise
        weight_decay=0.0,  # LoRA on a tiny model: no regularisation needed
        logging_steps=10,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,  # the latest two checkpoints are enough to resume
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        # activation_checkpointing* on transformers 5.23+, gradient_checkpointing* before (the same switch)
        **checkpointing_training_args(ckpt, {"use_reentrant": args.checkpointing == "reentrant"} if ckpt else None),
        # Synthetic data: text-only samples are shorter than image ones, so length grouping yields mostly
        # single-modality batches (as LLaVA's modality grouping does): some steps see no image on any rank.
        # (--dataset: random order; group_by_length would encode every row once at start-up to measure it.)
        **sampling_training_args("random" if args.dataset else "group_by_length"),
        remove_unused_columns=False,  # our collator builds the model inputs itself
        use_cpu=not on_accelerator,  # without it, CPU-only ranks would each think they train alone
        bf16=on_accelerator and torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        report_to="none",  # no wandb/tensorboard lookups in an offline example
        seed=args.seed,
        data_seed=args.seed,
    )

    trainer = Trainer(
        model=model, args=targs, data_collator=make_collator(tokenizer.pad_token_id, cfg.image_token_id),
        train_dataset=EncodedDataset(train_raw, encoder), eval_dataset=EncodedDataset(eval_raw, encoder),
        processing_class=tokenizer, compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess,
    )

    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and not trainer.is_fsdp_enabled:
        # accelerate 1.15 turns a CPU launch into plain DDP (MULTI_CPU is never promoted to FSDP): say so
        refuse("FSDP needs an accelerator: this launch asks for FSDP (accelerate_configs/fsdp.yaml), but "
               "accelerate chose plain DDP (on a machine without an accelerator it never runs FSDP). To run this "
               "FSDP launch on the CPU, rehearse it: `hf-ddpfix rehearse -- accelerate launch --config_file "
               "accelerate_configs/fsdp.yaml examples/qwen_vl_lora.py` (FSDP2 on gloo, docs/rehearse.md); to "
               "train on the CPU use ddp_cpu.yaml, zero2.yaml or zero3.yaml.")

    record_setup(args, args.output_dir)
    if rank0():
        print(f"output dir: {args.output_dir}", flush=True)
    resume_from = None
    if args.resume:
        resume_from = last_complete_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
        if resume_from is None and rank0():
            print(f"--resume: no checkpoint in {args.output_dir}, starting from step 0", flush=True)
        elif rank0():
            with open(os.path.join(resume_from, "trainer_state.json")) as f:
                step = json.load(f)["global_step"]
            print(f"resumed from step {step} ({resume_from})", flush=True)

    trainer.train(resume_from_checkpoint=resume_from)
    save_adapter(trainer, args.output_dir)  # rank 0 writes adapter_model.safetensors + adapter_config.json

    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)  # printed by rank 0 only
    result = {"eval_loss": round(metrics["eval_loss"], 4),
              "caption_accuracy": round(metrics["eval_caption_accuracy"], 4),
              "chance": round(chance, 4) if chance is not None else None,
              "global_step": trainer.state.global_step}
    if groups:
        result.update({f"{g}_accuracy": round(metrics[f"eval_{g}_accuracy"], 4) for g in groups})
    if trainer.is_world_process_zero():
        print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    try:
        main()
    finally:  # end the process group here: one left to interpreter shutdown can abort a finished run (gloo)
        from hf_ddpfix.ops.dist import destroy_default_group  # ends the group only; patches nothing

        destroy_default_group()
