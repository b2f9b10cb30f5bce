"""TRL trainers under 2-process DDP: hf_ddpfix (``patch_trainer()``) vs stock, same data, one process group.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/trainer_zoo.py [--cases sft_vlm,sft_text,sft_text_unfused,sft_packing,dpo_text,reward_text]

Stock is the setting that trains: non-reentrant checkpointing, ``find_unused_parameters=True`` (what the
stock Trainer picks for a PeftModel). The hf_ddpfix run asks for reentrant checkpointing (the plan corrects
it) and must end within 1e-6 of stock on every rank (bit-equal here: the math is unchanged), with the
``parameter_usage`` counts showing every loss was seen at ``accelerator.backward``. Every case uses AdamW
with weight decay and gradient clipping; lengths vary between batches.

- ``sft_vlm``: ``SFTTrainer`` (TRL 1.x: its fused LM head, the loss is ``-log_probs``, not the model's
  logits; TRL 0.24: the model's own ``loss``) on a tiny Qwen2-VL, LoRA on every linear layer incl. the vision tower, rank 0 with an image and
  rank 1 text-only every step (issue: a gloo size mismatch at step 2 before the tie moved to the loss).
- ``sft_text`` / ``sft_text_unfused`` (``compute_loss_func``: the loss from the model's logits) /
  ``sft_packing`` (``packing=True``: BFD packing, padding-free rows with ``position_ids``) on a tiny Llama.
- ``dpo_text``: ``DPOTrainer`` (the reference model is the adapter disabled); ``reward_text``:
  ``RewardTrainer`` (sequence classification head, trained through ``modules_to_save``).
Prints ``TRAINER_ZOO_OK`` after all cases.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))

from fixtures import BUILDERS, add_lora, make_batch, teardown, trainable_weights  # noqa: E402
from trl_sft import WORDS, build_tokenizer  # noqa: E402

from hf_ddpfix import patch_trainer, unpatch_trainer  # noqa: E402
from hf_ddpfix.ops import feature_counts  # noqa: E402

STEPS = 3
COMMON = dict(max_steps=STEPS, per_device_train_batch_size=1, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5,
              use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0, data_seed=0, disable_tqdm=True,
              dataloader_num_workers=0)


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


def _vlm_collate(rows: list[dict]) -> dict:
    (i,) = [r["i"] for r in rows]
    batch = make_batch(i % 2 == 0, 100 + i)
    n = 12 + (i // 2) % 3  # variable lengths between steps (the image tokens sit at 3..8)
    for k in ("input_ids", "labels", "mm_token_type_ids"):
        if k in batch:
            batch[k] = batch[k][:, :n]
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return batch


def sft_vlm(out: str, patched: bool) -> Any:
    """Row i goes to rank i % 2 (one row per rank per step, in order): rank 0's rows have an image."""
    from datasets import Dataset as HFDataset
    from torch.utils.data import SequentialSampler
    from trl import SFTConfig, SFTTrainer

    class InOrder(SFTTrainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

    model = add_lora(BUILDERS["qwen2_vl"](0))
    args = SFTConfig(output_dir=out, remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True},
                     **_ckpt(patched), **COMMON)
    return InOrder(model=model, args=args, train_dataset=HFDataset.from_dict({"i": list(range(2 * STEPS))}), data_collator=_vlm_collate,
                   processing_class=build_tokenizer())


def _sft_text(out: str, patched: bool, **cfg: Any) -> Any:
    from datasets import Dataset as HFDataset
    from trl import SFTConfig, SFTTrainer

    tok = build_tokenizer()
    extra = {}
    if cfg.pop("unfused", False):
        def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
            logits = outputs.logits[:, :-1].float()
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

        extra["compute_loss_func"] = loss_func
    args = SFTConfig(output_dir=out, max_length=32, **_ckpt(patched), **{**COMMON, **cfg})
    return SFTTrainer(model=_tiny_llama(tok), args=args, processing_class=tok, peft_config=_lora(),
                      train_dataset=HFDataset.from_dict({"text": _sentences(24)}), **extra)


def dpo_text(out: str, patched: bool) -> Any:
    from datasets import Dataset as HFDataset
    from trl import DPOConfig, DPOTrainer

    tok = build_tokenizer()
    p, c, r = _sentences(24), _sentences(24, 3), _sentences(24, 9)
    data = HFDataset.from_dict({"prompt": p, "chosen": c, "rejected": r})
    args = DPOConfig(output_dir=out, max_length=48, **_ckpt(patched), **COMMON)
    return DPOTrainer(model=_tiny_llama(tok), args=args, processing_class=tok, peft_config=_lora(), train_dataset=data)


def reward_text(out: str, patched: bool) -> Any:
    from datasets import Dataset as HFDataset
    from trl import RewardConfig, RewardTrainer

    tok = build_tokenizer()
    data = HFDataset.from_dict({"chosen": _sentences(24, 3), "rejected": _sentences(24, 9)})
    model = _tiny_llama(tok, "LlamaForSequenceClassification", num_labels=1)
    args = RewardConfig(output_dir=out, max_length=48, **_ckpt(patched), **COMMON)
    return RewardTrainer(model=model, args=args, processing_class=tok, peft_config=_lora("SEQ_CLS"),
                         train_dataset=data)


def grpo_text(out: str, patched: bool) -> Any:
    """GRPO with a rule-based reward (completion length mod 3), generation on CPU with the policy itself."""
    from datasets import Dataset as HFDataset
    from trl import GRPOConfig, GRPOTrainer

    tok = build_tokenizer()
    tok.padding_side = "left"

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(len(c.split()) % 3) for c in completions]

    common = {**COMMON, "per_device_train_batch_size": 2}
    args = GRPOConfig(output_dir=out, num_generations=2, max_completion_length=6, temperature=1.0,
                      beta=0.0, **_ckpt(patched), **common)
    return GRPOTrainer(model=_tiny_llama(tok), args=args, processing_class=tok, peft_config=_lora(),
                       reward_funcs=reward, train_dataset=HFDataset.from_dict({"prompt": _sentences(24)}))


CASES: dict[str, Callable[[str, bool], Any]] = {
    "sft_vlm": sft_vlm,
    "sft_text": lambda out, p: _sft_text(out, p),
    "sft_text_unfused": lambda out, p: _sft_text(out, p, unfused=True),
    "sft_packing": lambda out, p: _sft_text(out, p, packing=True),
    "dpo_text": dpo_text,
    "reward_text": reward_text,
    "grpo_text": grpo_text,
}


def run(case: str, patched: bool, out: str) -> tuple[dict[str, torch.Tensor], bool]:
    if patched:
        patch_trainer()
    else:
        unpatch_trainer()
    try:
        trainer = CASES[case](out, patched)
        start = trainable_weights(trainer.model)
        trainer.train()
    finally:
        unpatch_trainer()
    fu = bool(trainer.model_wrapped.find_unused_parameters)
    weights = trainable_weights(trainer.model)
    moved = sum(1 for k in weights if not torch.equal(weights[k], start[k]))
    assert moved > 0, f"{case}: no trainable tensor moved (a comparison of untrained weights proves nothing)"
    del trainer
    gc.collect()
    return weights, fu


def _check_vlm_ties(rank: int, vision: list[str], amounts: dict[str, int]) -> None:
    """Every step the loss given to backward on the text-only rank (1) must hold a zero tie of every
    vision tensor the loss does not reach, and rank 0's (with an image) none. Where that tie is made
    depends on the TRL release: when the loss is the model's own ``loss`` output (trl 0.24: labels go to
    the model) the tie made at the output is already in it (``output_ties_in_loss``); when TRL computes
    the loss itself from hidden states (trl 1.x fused LM head) the output tie is not in it and the tie
    at the loss adds it (``ties_at_loss``). Either way the sum is steps x unused tensors."""
    expected = STEPS * len(vision) if rank == 1 else 0
    in_loss = amounts.get("ties_at_loss", 0) + amounts.get("output_ties_in_loss", 0)
    assert vision and in_loss == expected, (rank, len(vision), amounts)
    print(f"[rank {rank}] sft_vlm: vision tensors tied into the backward loss {in_loss} = {STEPS} steps x "
          f"{len(vision) if rank == 1 else 0} unused", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    with tempfile.TemporaryDirectory() as out:
        for case in a.cases.split(","):
            stock, stock_fu = run(case, False, out)
            feature_counts.reset()
            fixed, fixed_fu = run(case, True, out)
            counts = feature_counts.snapshot().get("parameter_usage")
            diff = max((stock[k] - fixed[k]).abs().max().item() for k in stock)
            moved = sum(1 for k in stock if not torch.equal(stock[k], fixed[k]))
            print(f"[rank {rank}] {case}: stock fu={stock_fu}, hf_ddpfix fu={fixed_fu}, max |fix - stock| = "
                  f"{diff:.1e} ({moved} tensors differ) counts={counts.as_dict() if counts else None}", flush=True)
            assert diff <= 1e-6, f"{case}: hf_ddpfix vs stock differ by {diff:.2e}"
            assert stock_fu and not fixed_fu, (stock_fu, fixed_fu)
            assert counts is not None and counts.ran >= STEPS and not counts.fallbacks, counts
            if case == "sft_vlm":
                _check_vlm_ties(rank, [k for k in fixed if ".visual." in k], counts.amounts)
    print(f"[rank {rank}] TRAINER_ZOO_OK", flush=True)
    teardown()


if __name__ == "__main__":
    main()
