"""TRL trainers for tests/scripts/sp_losses.py (the trainer's own loss under sequence parallelism): KTO, ORPO, CPO,
GRPO, SFT with packing and with completion-only loss, each on the tiny LoRA Llama of sp_losses.py (fp64 by default),
TRL's defaults otherwise; and models without an LM head ("head-whole" route): TRL's RewardTrainer on a Qwen2
sequence-classification model, the plain Trainer on a Llama one with class labels. Every builder takes `(over, opt, batch, dtype)`: the config overrides of the case, the
optimizer settings, the per-device batch and the model dtype, and returns the trainer (2 optimizer steps, gradient
accumulation 2, logging every step)."""

from __future__ import annotations

from typing import Any

import torch

#: what every TRL config here shares (the one-process reference and the SP runs alike)
COMMON = dict(output_dir="/tmp/sp_losses", max_steps=2, gradient_accumulation_steps=2, use_cpu=True, report_to=[],
              save_strategy="no", logging_steps=1, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
              ddp_find_unused_parameters=False)


def _words(i: int, n: int, shift: int = 3) -> str:
    from trl_sft import WORDS

    return " ".join(WORDS[(i * k + shift) % len(WORDS)] for k in range(1, n + 1))


def _model(tok: Any, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, attn_implementation="sdpa")).to(dtype)


def _lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                      init_lora_weights=False)


def _pairs(n: int = 48) -> dict[str, list[str]]:
    return {"prompt": [_words(i, 2 + i % 5) for i in range(n)], "chosen": [" " + _words(i + 7, 2 + i % 7) for i in range(n)],
            "rejected": [" " + _words(i + 11, 3 + i % 4) for i in range(n)]}


def kto(over: dict, opt: dict, batch: int, dtype: torch.dtype) -> Any:
    """TRL's KTOTrainer on unpaired (prompt, completion, label) rows, the reference = the adapter disabled."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer
    from trl_sft import build_tokenizer

    tok = build_tokenizer()
    rows = {"prompt": [_words(i, 2 + i % 5) for i in range(48)],
            "completion": [" " + _words(i + 7, 2 + i % 7) for i in range(48)], "label": [i % 3 != 0 for i in range(48)]}
    args = KTOConfig(per_device_train_batch_size=batch, max_length=32, **COMMON, **opt, **over)
    return KTOTrainer(model=_model(tok, dtype), args=args, train_dataset=Dataset.from_dict(rows), processing_class=tok,
                      peft_config=_lora())


def _experimental(name: str) -> Any:
    import importlib
    import warnings

    with warnings.catch_warnings():  # TRL's experimental-API warning
        warnings.simplefilter("ignore")
        return importlib.import_module(f"trl.experimental.{name}")


def _preference(name: str, over: dict, opt: dict, batch: int, dtype: torch.dtype) -> Any:
    """TRL's experimental ``name`` trainer (ORPO, CPO) on the preference pairs, LoRA on the tiny model."""
    from datasets import Dataset
    from trl_sft import build_tokenizer

    m = _experimental(name)
    tok = build_tokenizer()
    prefix = name.upper()
    args = getattr(m, f"{prefix}Config")(per_device_train_batch_size=batch, max_length=32, **COMMON, **opt, **over)
    return getattr(m, f"{prefix}Trainer")(model=_model(tok, dtype), args=args, train_dataset=Dataset.from_dict(_pairs()),
                                          processing_class=tok, peft_config=_lora())


def orpo(over: dict, opt: dict, batch: int, dtype: torch.dtype) -> Any:
    """TRL's ORPOTrainer (trl.experimental.orpo): the chosen NLL plus the odds-ratio term, from the model's logits."""
    return _preference("orpo", over, opt, batch, dtype)


def cpo(over: dict, opt: dict, batch: int, dtype: torch.dtype) -> Any:
    """TRL's CPOTrainer (trl.experimental.cpo): sigmoid preference loss on the policy's logits, no reference."""
    return _preference("cpo", over, opt, batch, dtype)


def sft(over: dict, opt: dict, batch: int, dtype: torch.dtype) -> Any:
    """TRL's SFTTrainer: `packing=True` on plain text, or `completion_only_loss` on prompt/completion rows."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    from trl_sft import build_tokenizer

    tok = build_tokenizer()
    over = dict(over)
    if over.pop("prompt_completion", False):
        rows = {"prompt": [_words(i, 2 + i % 5) for i in range(48)],
                "completion": [" " + _words(i + 7, 2 + i % 7) for i in range(48)]}
    else:
        rows = {"text": [_words(i, 4 + (i * 7) % 9, 5) for i in range(48)]}
    args = SFTConfig(per_device_train_batch_size=batch, max_length=32, **COMMON, **opt, **over)
    return SFTTrainer(model=_model(tok, dtype), args=args, train_dataset=Dataset.from_dict(rows), processing_class=tok,
                      peft_config=_lora())


def grpo(over: dict, opt: dict, batch: int, dtype: torch.dtype) -> Any:
    """TRL's GRPOTrainer, a rule reward (completion length mod 3), generation on CPU by the policy itself."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl_sft import build_tokenizer

    tok = build_tokenizer()
    tok.padding_side = "left"

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(len(c.split()) % 3) for c in completions]

    args = GRPOConfig(per_device_train_batch_size=batch, num_generations=2, max_completion_length=6, temperature=1.0,
                      beta=0.0, **COMMON, **opt, **over)
    return GRPOTrainer(model=_model(tok, dtype), args=args, processing_class=tok, peft_config=_lora(),
                       reward_funcs=reward, train_dataset=Dataset.from_dict({"prompt": [_words(i, 2 + i % 4)
                                                                                        for i in range(48)]}))


def _score_model(family: str, pad: int, vocab: int, labels: int, dtype: torch.dtype) -> Any:
    """A tiny `<family>ForSequenceClassification` (sdpa, 2 layers, 4 heads / 2 KV heads), `pad_token_id` set."""
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=pad, num_labels=labels,
        attn_implementation="sdpa")
    return getattr(transformers, f"{family}ForSequenceClassification")(cfg).to(dtype)


def _score_lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS",
                      init_lora_weights=False)


def reward(over: dict, opt: dict, batch: int, dtype: torch.dtype) -> Any:
    """TRL's RewardTrainer (pairwise loss with a per-pair margin, `center_rewards_coefficient` 0.1 unless `over`
    says) on a Qwen2 sequence-classification model (num_labels 1), LoRA with the score head trained
    (task SEQ_CLS): chosen / rejected of unequal lengths, right padding."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer
    from trl_sft import build_tokenizer

    tok = build_tokenizer()
    rows = {"chosen": [_words(i, 3 + i % 9) for i in range(48)], "rejected": [_words(i + 5, 2 + i % 6) for i in range(48)],
            "margin": [0.25 * (i % 3) for i in range(48)]}
    over = {"center_rewards_coefficient": 0.1, **over}
    args = RewardConfig(per_device_train_batch_size=batch, per_device_eval_batch_size=2, max_length=32, **COMMON,
                        **opt, **over)
    evals = {k: v[40:] for k, v in rows.items()}  # 8 pairs: sp_losses.py evaluates them (TRL's eval metrics under SP)
    return RewardTrainer(model=_score_model("Qwen2", tok.pad_token_id, len(tok), 1, dtype), args=args,
                         train_dataset=Dataset.from_dict(rows), eval_dataset=Dataset.from_dict(evals),
                         processing_class=tok, peft_config=_score_lora())


def seqcls(over: dict, opt: dict, batch: int, dtype: torch.dtype) -> Any:
    """The plain Trainer on a Llama sequence-classification model (3 classes, the model's own cross-entropy on the
    logits pooled at the last non-pad token), LoRA + the score head, variable lengths, right padding (pad id 0)."""
    from peft import get_peft_model
    from sp_trainer import dataset
    from transformers import Trainer, TrainingArguments

    def rows_of(n: int, seed: int) -> Any:
        return dataset(n, seed).map(lambda r, i: {"labels": i % 3}, with_indices=True)

    def collate(b: list) -> dict:
        n = max(len(r["input_ids"]) for r in b)
        return {"input_ids": torch.tensor([r["input_ids"] + [0] * (n - len(r["input_ids"])) for r in b]),
                "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (n - len(r["input_ids"])) for r in b]),
                "labels": torch.tensor([r["labels"] for r in b])}

    model = get_peft_model(_score_model("Llama", 0, 256, 3, dtype), _score_lora())
    common = {k: v for k, v in COMMON.items() if k != "ddp_find_unused_parameters"}
    args = TrainingArguments(per_device_train_batch_size=batch, per_device_eval_batch_size=2, remove_unused_columns=False,
                             ddp_find_unused_parameters=False, **common, **opt, **over)
    trainer = Trainer(model=model, args=args, train_dataset=rows_of(48, 1), data_collator=collate)
    trainer.sp_eval_dataset = rows_of(8, 2)  # sp_losses.py evaluates on it (the head-whole route in evaluation)
    return trainer


BUILDERS = {"kto": kto, "orpo": orpo, "cpo": cpo, "sft2": sft, "grpo": grpo, "reward": reward, "seqcls": seqcls}
