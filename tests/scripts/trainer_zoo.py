"""TRL trainers and the plain Trainer with losses of its own, 2 gloo processes, one process group: hf_ddpfix vs stock on the same data, through both entry
points, under DDP and DeepSpeed ZeRO-2/3, and what an FSDP2 request becomes on a CPU-only machine.

Run (the zero-code route: ``patches/`` first on PYTHONPATH, as the README tells a user):
    PYTHONPATH=patches:. DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \
        --nproc_per_node=2 tests/scripts/trainer_zoo.py --route patches --zero 2,3 --out /tmp/zoo.json
Without ``patches/`` on the path use ``--route patch_trainer`` (DDP runs through ``patch_trainer()`` only).

Stock is the setting that trains: non-reentrant checkpointing, ``find_unused_parameters=True`` (what the
stock Trainer picks for a PeftModel; False for ``head_in_compute_loss``, where True fails: STOCK_FU). The hf_ddpfix runs ask for reentrant checkpointing (the plan corrects
it under DDP) and must end within 1e-6 of stock DDP on every rank (bit-equal here: the math is unchanged),
with the ``parameter_usage`` counts showing every loss was seen at ``accelerator.backward``; under ZeRO-2/3
within 1e-5 of stock DDP (DeepSpeed's own reduction and optimizer arithmetic). Every case uses AdamW with
weight decay and gradient clipping; lengths vary between batches.

Order in the process (each step needs the one before; DeepSpeed last: once a DeepSpeed TrainingArguments
exists, accelerate stays in DeepSpeed mode for the rest of the process):

1. ``--route patches``: every case trained by hf_ddpfix with **no call** in this script: ``patches/
   sitecustomize.py`` patched the Trainer when ``transformers.trainer`` was first imported (checked).
2. ``unpatch_trainer()``; every case trained stock (the reference).
3. ``patch_trainer()``; EXPLICIT_CASES (one per trainer class: SFT, DPO, Reward, GRPO; every case with
   ``--route patch_trainer``) trained by hf_ddpfix through the explicit call (the function the hook calls,
   here called after TRL's trainer classes exist). Both routes are compared with stock.
4. ``--fsdp-probe``: a stock Trainer given ``fsdp=True, fsdp_config={"version": 2}`` on this CPU-only
   machine: which distributed type accelerate picks and what wraps the model (it trains plain DDP).
5. ``--zero 2,3``: the ZERO_CASES under ``patch_trainer()`` with DeepSpeed ZeRO-2 then ZeRO-3, against a
   stock DDP run in fp32 (made in step 2; see FP32).

Cases:
- ``sft_vlm``: ``SFTTrainer`` (TRL 1.x: its fused LM head, the loss is ``-log_probs``, not the model's
  logits; TRL 0.24: the model's own ``loss``) on a tiny Qwen2-VL, LoRA on every linear layer incl. the vision
  tower, rank 0 with an image and rank 1 text-only every step (issue: a gloo size mismatch at step 2 before
  the tie moved to the loss).
- ``sft_text`` / ``sft_text_unfused`` (``compute_loss_func``: the loss from the model's logits) /
  ``sft_packing`` (``packing=True``: BFD packing, padding-free rows with ``position_ids``) on a tiny Llama.
- ``sft_reenable``: a trainer that switches checkpointing off and back on with the user's arguments
  around a reference forward every step (TRL >= 1.0's DPOTrainer does): see :func:`sft_reenable`.
- ``dpo_text``: ``DPOTrainer`` (the reference model is the adapter disabled); ``dpo_vlm``: ``DPOTrainer`` on a
  tiny Qwen2.5-VL through TRL's own vision collator and a Qwen2.5-VL processor (PIL images, rank 0's prompts
  with an image, rank 1's text-only), LoRA incl. the vision tower; ``reward_text``: ``RewardTrainer``
  (sequence classification head, trained through ``modules_to_save``); ``grpo_text``: GRPO with a rule reward
  and generation on CPU.
- ``head_in_forward``, ``head_in_compute_loss``, ``some_outputs``: the plain ``Trainer`` with a ``compute_loss``
  of its own (trainer_heads.py; stock's setting that trains: trainer_heads.STOCK_FU).

Every rank prints one ``ZOO {json}`` line per comparison; rank 0 writes them all to ``--out`` (the results
the Trainers table in docs/trainers.md is rendered from: scripts/trainers_table.py). Prints ``TRAINER_ZOO_OK`` after
all cases.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))

import trainer_heads  # noqa: E402
from fixtures import BUILDERS, add_lora, make_batch, teardown, trainable_weights, zero_config  # noqa: E402
from trl_sft import WORDS, build_tokenizer  # noqa: E402

from hf_ddpfix import patch_trainer, unpatch_trainer  # noqa: E402
from hf_ddpfix.ops import feature_counts  # noqa: E402

STEPS = 3
DDP_TOL, ZERO_TOL = 1e-6, 1e-5
COMMON = dict(max_steps=STEPS, per_device_train_batch_size=1, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5,
              use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0, data_seed=0, disable_tqdm=True,
              dataloader_num_workers=0)
ZERO_CASES = ("sft_text", "sft_vlm", "dpo_text", "dpo_vlm", "reward_text")
# TRL's configs default to bf16=True. On the CPU that is bf16 autocast over fp32 weights under DDP, while
# DeepSpeed (its "auto" bf16 section) casts the model to bf16 and keeps fp32 master weights: a different
# arithmetic by design (first-step loss 4.5456 vs 4.5428 on the same weights and data, sft_text). The ZeRO
# runs and their stock DDP reference therefore run in fp32.
FP32 = {"bf16": False}
# AdamW turns DeepSpeed's rounding into visible weight differences where a gradient element is near zero (its
# update is lr * m / (sqrt(v) + eps)): under ZeRO-3 with mixed image/text ranks one element ends 2e-5 from
# stock DDP (sft_vlm: a LoRA A element of the patch embedding; Mistral 3: one LM LoRA B element), while plain
# SGD (an update linear in the gradient) on the same data agrees within 3e-8. So the ZeRO-3 VLM cells also run
# SGD and must agree within SGD_TOL there; with AdamW they are held to ADAM_TOL instead of ZERO_TOL.
SGD = {"optim": "sgd"}
SGD_TOL, ADAM_TOL = 1e-7, 5e-5
# the DDP runs through patch_trainer() next to patches/ (--route patches): one case per trainer class
EXPLICIT_CASES = ("sft_vlm", "dpo_vlm", "reward_text", "grpo_text", "head_in_compute_loss")


def _ckpt(patched: bool) -> dict[str, Any]:
    return {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": patched}}


def _sentences(n: int, offset: int = 0) -> list[str]:
    return [" ".join(WORDS[(i * k + 5 + offset) % len(WORDS)] for k in range(1, 3 + (i * 7) % 11 + 1)) for i in range(n)]


def _tiny_llama(tok: Any, cls_name: str = "LlamaForCausalLM", **extra: Any) -> Any:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **extra)
    return getattr(transformers, cls_name)(cfg)


def _lora(task: str = "CAUSAL_LM", **kw: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type=task, init_lora_weights=False, **kw)


def _in_order(cls: type) -> type:
    """``cls`` with a sequential sampler: row i goes to rank i % 2 (one row per rank per step, in order)."""
    from torch.utils.data import SequentialSampler

    class InOrder(cls):  # type: ignore[misc, valid-type]
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

    return InOrder


def _vlm_collate(rows: list[dict]) -> dict:
    (i,) = [r["i"] for r in rows]
    batch = make_batch(i % 2 == 0, 100 + i)
    n = 12 + (i // 2) % 3  # variable lengths between steps (the image tokens sit at 3..8)
    for k in ("input_ids", "labels", "mm_token_type_ids"):
        if k in batch:
            batch[k] = batch[k][:, :n]
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return batch


def sft_vlm(out: str, patched: bool, extra: dict) -> Any:
    """Row i goes to rank i % 2: rank 0's rows have an image, rank 1's none (``STEPS`` x accumulation rows each)."""
    from datasets import Dataset as HFDataset
    from trl import SFTConfig, SFTTrainer

    model = add_lora(BUILDERS["qwen2_vl"](0))
    args = SFTConfig(output_dir=out, remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True},
                     **_ckpt(patched), **COMMON, **extra)
    rows = 2 * STEPS * args.gradient_accumulation_steps
    return _in_order(SFTTrainer)(model=model, args=args, train_dataset=HFDataset.from_dict({"i": list(range(rows))}),
                                 data_collator=_vlm_collate, processing_class=build_tokenizer())


def _sft_text(out: str, patched: bool, extra: dict, **cfg: Any) -> Any:
    from datasets import Dataset as HFDataset
    from trl import SFTConfig, SFTTrainer

    tok = build_tokenizer()
    kw = {}
    if cfg.pop("unfused", False):
        def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
            logits = outputs.logits[:, :-1].float()
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

        kw["compute_loss_func"] = loss_func
    args = SFTConfig(output_dir=out, max_length=32, **_ckpt(patched), **{**COMMON, **cfg, **extra})
    return SFTTrainer(model=_tiny_llama(tok), args=args, processing_class=tok, peft_config=_lora(),
                      train_dataset=HFDataset.from_dict({"text": _sentences(24)}), **kw)


def sft_reenable(out: str, patched: bool, extra: dict) -> Any:
    """SFT whose ``compute_loss`` first runs a no-grad reference forward with checkpointing switched off
    and back on with the user's arguments (what TRL >= 1.0's DPOTrainer does around its reference
    forward): the hf_ddpfix run's corrected checkpoint function is replaced by the user's reentrant one
    every step, which hf_ddpfix must re-install before the training forward (trl 1.0 + transformers 5.0
    failed with static_graph's "Your training graph has changed" at step 2 without it)."""
    from datasets import Dataset as HFDataset
    from trl import SFTConfig, SFTTrainer

    from hf_ddpfix._compat import checkpointing_args, disable_model_checkpointing, enable_model_checkpointing

    class Reenables(SFTTrainer):
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            inner = self.accelerator.unwrap_model(model)
            with torch.no_grad():
                disable_model_checkpointing(inner)
                inner(input_ids=inputs["input_ids"])
                enable_model_checkpointing(inner, checkpointing_args(self.args)[1])
            return super().compute_loss(model, inputs, *args, **kwargs)

    tok = build_tokenizer()
    args = SFTConfig(output_dir=out, max_length=32, **_ckpt(patched), **COMMON, **extra)
    return Reenables(model=_tiny_llama(tok), args=args, processing_class=tok, peft_config=_lora(),
                     train_dataset=HFDataset.from_dict({"text": _sentences(24)}))


def dpo_text(out: str, patched: bool, extra: dict) -> Any:
    from datasets import Dataset as HFDataset
    from trl import DPOConfig, DPOTrainer

    tok = build_tokenizer()
    p, c, r = _sentences(24), _sentences(24, 3), _sentences(24, 9)
    data = HFDataset.from_dict({"prompt": p, "chosen": c, "rejected": r})
    args = DPOConfig(output_dir=out, max_length=48, **_ckpt(patched), **COMMON, **extra)
    return DPOTrainer(model=_tiny_llama(tok), args=args, processing_class=tok, peft_config=_lora(), train_dataset=data)


def image_only_processor() -> Any:
    """Qwen2.5-VL's processor over the offline tokenizer and image processor of examples/_offline_vlm.py,
    without its video processor: transformers builds that one only with torchvision, which the test stack
    does not install (the processor's constructor then fails on ``VIDEO_PROCESSOR_MAPPING``). The image
    path (token expansion, ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``) is the stock one."""
    import _offline_vlm as ov
    from transformers import ProcessorMixin, Qwen2_5_VLProcessor

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                     **kwargs: Any) -> None:
            self.image_token, self.video_token = ov.IMAGE_PAD, ov.VIDEO_PAD
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2_5_VLProcessor(image_processor=ov.build_image_processor(), tokenizer=ov.build_tokenizer())


def dpo_vlm(out: str, patched: bool, extra: dict) -> Any:
    """DPO on a tiny Qwen2.5-VL through TRL's ``DataCollatorForVisionPreference`` (PIL images, processor):
    row i goes to rank i % 2; rank 0's prompts carry a drawn shape, rank 1's are text-only; chosen /
    rejected answers of different lengths. LoRA on every linear layer, vision tower included."""
    import random

    import _offline_vlm as ov
    from datasets import Dataset as HFDataset
    from trl import DPOConfig, DPOTrainer

    rng = random.Random(0)
    rows: dict[str, list] = {"images": [], "prompt": [], "chosen": [], "rejected": []}
    for i in range(2 * STEPS):
        colour, shape = list(ov.COLOURS)[i % 4], ov.SHAPES[i % 3]
        if i % 2 == 0:
            rows["images"].append([ov.draw_shape(colour, shape, rng)])
            rows["prompt"].append(f"{ov.VISION_START}{ov.IMAGE_PAD}{ov.VISION_END} {ov.IMAGE_PROMPT}")
        else:
            rows["images"].append([])
            rows["prompt"].append(f"count from {ov.NUMBERS[i]} :")
        rows["chosen"].append(f" a {colour} {shape}" + " big" * (i % 3))
        rows["rejected"].append(f" a {list(ov.COLOURS)[(i + 1) % 4]} {ov.SHAPES[(i + 1) % 3]} " + "one " * (1 + i % 2))
    processor = image_only_processor()
    model = ov.build_model(processor.tokenizer, seed=0)
    args = DPOConfig(output_dir=out, max_length=None, **_ckpt(patched), **COMMON, **extra)
    return _in_order(DPOTrainer)(model=model, args=args, processing_class=processor, peft_config=_lora(),
                                 train_dataset=HFDataset.from_dict(rows))


def reward_text(out: str, patched: bool, extra: dict) -> Any:
    from datasets import Dataset as HFDataset
    from trl import RewardConfig, RewardTrainer

    tok = build_tokenizer()
    data = HFDataset.from_dict({"chosen": _sentences(24, 3), "rejected": _sentences(24, 9)})
    model = _tiny_llama(tok, "LlamaForSequenceClassification", num_labels=1)
    args = RewardConfig(output_dir=out, max_length=48, **_ckpt(patched), **COMMON, **extra)
    return RewardTrainer(model=model, args=args, processing_class=tok, peft_config=_lora("SEQ_CLS"),
                         train_dataset=data)


def grpo_text(out: str, patched: bool, extra: dict) -> Any:
    """GRPO with a rule-based reward (completion length mod 3), generation on CPU with the policy itself."""
    from datasets import Dataset as HFDataset
    from trl import GRPOConfig, GRPOTrainer

    tok = build_tokenizer()
    tok.padding_side = "left"

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(len(c.split()) % 3) for c in completions]

    common = {**COMMON, "per_device_train_batch_size": 2}
    args = GRPOConfig(output_dir=out, num_generations=2, max_completion_length=6, temperature=1.0,
                      beta=0.0, **_ckpt(patched), **common, **extra)
    return GRPOTrainer(model=_tiny_llama(tok), args=args, processing_class=tok, peft_config=_lora(),
                       reward_funcs=reward, train_dataset=HFDataset.from_dict({"prompt": _sentences(24)}))


CASES: dict[str, Callable[[str, bool, dict], Any]] = {
    "sft_vlm": sft_vlm,
    "sft_text": lambda out, p, x: _sft_text(out, p, x),
    "sft_text_unfused": lambda out, p, x: _sft_text(out, p, x, unfused=True),
    "sft_packing": lambda out, p, x: _sft_text(out, p, x, packing=True),
    "sft_reenable": sft_reenable,
    "dpo_text": dpo_text,
    "dpo_vlm": dpo_vlm,
    "reward_text": reward_text,
    "grpo_text": grpo_text,
    # the plain Trainer with a loss that is not the model's output (trainer_heads.py)
    **{name: (lambda out, p, x, name=name: trainer_heads.build_trainer(name, out, p, x)) for name in trainer_heads.STOCK_FU},
}
VLM_CASES = ("sft_vlm", "dpo_vlm")
STOCK_FU = {**{case: True for case in CASES}, **trainer_heads.STOCK_FU}  # the stock setting that trains


class Run:
    """One training: the trained weights, DDP's ``find_unused_parameters`` (None under DeepSpeed), the
    feature counts and the plan's checkpointing / stabiliser decisions (None for stock)."""

    def __init__(self, case: str, patched: bool, out: str, extra: dict | None = None) -> None:
        feature_counts.reset()
        if extra and "deepspeed" in extra:
            # as in a fresh process: the previous ZeRO-3 run's config stays registered (accelerate's state holds
            # it), so a model built before this case's arguments would otherwise be built under zero.Init
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        trainer = CASES[case](out, patched, extra or {})
        start = trainable_weights(trainer.model)
        trainer.train()
        fu = getattr(trainer.model_wrapped, "find_unused_parameters", None)
        self.fu = None if fu is None else bool(fu)
        self.weights = trainable_weights(trainer.model)
        self.moved = sum(1 for k in self.weights if not torch.equal(self.weights[k], start[k]))
        assert self.moved > 0, f"{case}: no trainable tensor moved (a comparison of untrained weights proves nothing)"
        self.counts = feature_counts.snapshot()
        plan = getattr(trainer, "hf_ddpfix_plan", None)
        self.plan = None if plan is None else {"checkpointing": plan.checkpointing.value,
                                               "vlm_stabilizer": plan.vlm_stabilizer.value}
        dist.barrier()
        del trainer
        gc.collect()


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _check_vlm_ties(rank: int, case: str, vision: list[str], amounts: dict[str, int]) -> int:
    """Every step the loss given to backward on the text-only rank (1) must hold a zero tie of every
    vision tensor the loss does not reach, and rank 0's (with an image) none. Where that tie is made
    depends on the TRL release: when the loss is the model's own ``loss`` output (trl 0.24: labels go to
    the model) the tie made at the output is already in it (``output_ties_in_loss``); when TRL computes
    the loss itself from hidden states (trl 1.x fused LM head) the output tie is not in it and the tie
    at the loss adds it (``ties_at_loss``). Either way the sum is steps x unused tensors."""
    expected = STEPS * len(vision) if rank == 1 else 0
    in_loss = amounts.get("ties_at_loss", 0) + amounts.get("output_ties_in_loss", 0)
    assert vision and in_loss == expected, (case, rank, len(vision), amounts)
    return in_loss


def compare(case: str, column: str, route: str, stock: Run, fixed: Run, rank: int, tol: float) -> dict:
    """Judge ``fixed`` against ``stock`` on this rank (asserts) and return the record (max over ranks)."""
    diff = max((stock.weights[k] - fixed.weights[k]).abs().max().item() for k in stock.weights)
    differ = sum(1 for k in stock.weights if not torch.equal(stock.weights[k], fixed.weights[k]))
    usage = fixed.counts.get("parameter_usage")
    rec: dict[str, Any] = {"case": case, "column": column, "route": route, "max_diff": _max_over_ranks(diff),
                           "tensors_differ": int(_max_over_ranks(float(differ))), "tensors": len(stock.weights),
                           "moved": fixed.moved, "stock_fu": stock.fu, "fixed_fu": fixed.fu, "plan": fixed.plan}
    assert diff <= tol, f"{case} {column} {route}: hf_ddpfix vs stock differ by {diff:.2e} (> {tol:.0e})"
    if column == "DDP":
        assert stock.fu is STOCK_FU[case] and fixed.fu is False, (case, stock.fu, fixed.fu)
        assert usage is not None and usage.ran >= STEPS and not usage.fallbacks, (case, route, usage)
        if case in trainer_heads.STOCK_FU:
            trainer_heads.check_counts(case, usage.amounts)
            rec["ties_at_loss"] = usage.amounts.get("ties_at_loss", 0)
        if case in VLM_CASES:
            vision = [k for k in fixed.weights if ".visual." in k]
            rec["vision_ties_in_loss"] = int(_max_over_ranks(_check_vlm_ties(rank, case, vision, usage.amounts)))
            rec["vision_tensors"] = len(vision)
        if case == "sft_reenable":  # re-installed before each step's training forward
            ckpt = fixed.counts.get("checkpointing")
            reinstalled = ckpt.amounts.get("reinstalled", 0) if ckpt else 0
            assert reinstalled == STEPS, (route, reinstalled, ckpt)
            rec["reinstalled"] = reinstalled
    else:
        assert fixed.fu is None and fixed.plan is not None, (case, column, fixed.fu)
        if case in VLM_CASES:  # the ZeRO dummy image ran on the text-only rank, once per step
            stab = fixed.counts.get("stabilizer")
            dummies = stab.amounts.get("train_dummies", 0) if stab else 0
            assert fixed.plan["vlm_stabilizer"] is True and dummies == (STEPS if rank == 1 else 0), (case, column, stab)
            rec["dummies_rank1"] = int(_max_over_ranks(float(dummies)))
    print(f"[rank {rank}] ZOO {json.dumps({**rec, 'max_diff_rank': diff})}", flush=True)
    return rec


def fsdp_probe(out: str, rank: int) -> dict:
    """A stock ``Trainer`` asked for FSDP2 (``fsdp=True``, ``fsdp_config={"version": 2}``) on this machine:
    what accelerate runs. The environment variables TrainingArguments sets for FSDP are put back after."""
    from datasets import Dataset as HFDataset
    from transformers import Trainer, TrainingArguments

    env = dict(os.environ)
    tok = build_tokenizer()
    try:
        args = TrainingArguments(output_dir=out, fsdp=True, fsdp_config={"version": 2}, **COMMON)
        ids = [tok(s)["input_ids"] for s in _sentences(4)]
        trainer = Trainer(model=_tiny_llama(tok), args=args,
                          train_dataset=HFDataset.from_dict({"input_ids": ids, "labels": ids}))
        trainer.train()
        rec = {"case": "fsdp2_request", "column": "FSDP2", "route": "stock",
               "accelerator": torch.accelerator.current_accelerator() is not None and torch.accelerator.is_available(),
               "distributed_type": str(trainer.accelerator.distributed_type).rsplit(".", 1)[-1],
               "fsdp_enabled": bool(trainer.is_fsdp_enabled), "wrapper": type(trainer.model_wrapped).__name__}
    finally:
        os.environ.clear()
        os.environ.update(env)
    del trainer
    gc.collect()
    print(f"[rank {rank}] ZOO {json.dumps(rec)}", flush=True)
    return rec


def _hook_route_active() -> str:
    """Where the patching ``sitecustomize`` was loaded from, after checking that it patched the Trainer at
    the first import of ``transformers.trainer`` with no call from this script."""
    import transformers.trainer  # noqa: F401  (the hook fires here if it has not yet)

    from hf_ddpfix.trainer import is_patched

    site = getattr(sys.modules.get("sitecustomize"), "__file__", "") or ""
    assert os.path.basename(os.path.dirname(site)) == "patches" and is_patched(), (
        f"--route patches needs patches/ first on PYTHONPATH (sitecustomize: {site!r}, patched: {is_patched()})")
    return site


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--route", choices=("patches", "patch_trainer"), default="patch_trainer",
                    help="patches: every case through patches/ (no call), EXPLICIT_CASES also through "
                         "patch_trainer(); patch_trainer: every case through patch_trainer() only")
    ap.add_argument("--zero", default="", help="ZeRO stages to run ZERO_CASES under, e.g. 2,3 (DS_ACCELERATOR=cpu)")
    ap.add_argument("--fsdp-probe", action="store_true")
    ap.add_argument("--out", default=None, help="rank 0 writes every record here (JSON)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    cases = a.cases.split(",")
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as out:
        hooked: dict[str, Run] = {}
        if a.route == "patches":
            print(f"[rank {rank}] Trainer patched at import by {_hook_route_active()}", flush=True)
            for case in cases:
                hooked[case] = Run(case, True, out)
        unpatch_trainer()
        stock = {case: Run(case, False, out) for case in cases}
        zero_cases = [c for c in ZERO_CASES if c in cases] if a.zero else []
        stock_fp32 = {case: Run(case, False, out, FP32) for case in zero_cases}  # the ZeRO reference
        stock_sgd = {case: Run(case, False, out, {**FP32, **SGD}) for case in zero_cases if case in VLM_CASES}
        for case in hooked:
            records.append(compare(case, "DDP", "patches", stock[case], hooked[case], rank, DDP_TOL))
        hooked.clear()
        patch_trainer()
        explicit = cases if a.route == "patch_trainer" else [c for c in EXPLICIT_CASES if c in cases]
        for case in explicit:
            records.append(compare(case, "DDP", "patch_trainer", stock[case], Run(case, True, out), rank, DDP_TOL))
        unpatch_trainer()
        if a.fsdp_probe:
            records.append(fsdp_probe(out, rank))
        for stage in [int(s) for s in a.zero.split(",") if s]:
            patch_trainer()
            for case in zero_cases:
                ds = {"deepspeed": zero_config(stage), **FP32}
                fixed = Run(case, True, out, ds)
                sgd = None
                if stage == 3 and case in stock_sgd:  # see ADAM_TOL
                    sgd = compare(case, "ZeRO-3 SGD", "patch_trainer", stock_sgd[case], Run(case, True, out, {**ds, **SGD}),
                                  rank, SGD_TOL)
                rec = compare(case, f"ZeRO-{stage}", "patch_trainer", stock_fp32[case], fixed, rank,
                              ZERO_TOL if sgd is None else ADAM_TOL)
                records.append({**rec, "sgd_max_diff": sgd["max_diff"]} if sgd else rec)
            unpatch_trainer()
    if rank == 0 and a.out:
        import transformers
        import trl

        versions = {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}
        if a.zero:
            import deepspeed

            versions["deepspeed"] = deepspeed.__version__
        with open(a.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "versions": versions, "steps": STEPS, "records": records},
                      f, indent=1)
    print(f"[rank {rank}] TRAINER_ZOO_OK", flush=True)
    teardown()


if __name__ == "__main__":
    main()
