"""A user's own TRL DPO script, written for GPUs with no hf_ddpfix in it: a small Qwen2 built from a config, LoRA,
an in-memory preference set, ``DPOTrainer``; at the end it saves the adapter and the tokenizer into ``--out`` (where
the real run keeps its results) and a small ``torch.save`` of its own. tests/test_rehearse_examples.py rehearses it
(``hf-ddpfix rehearse -- accelerate launch --config_file accelerate_configs/ddp_cpu.yaml <this> --out DIR``) with and
without ``--stock`` and checks that ``DIR``'s earlier bytes are unchanged.
"""

import argparse
import os

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import DPOConfig, DPOTrainer

WORDS = "good bad yes no sun rain cold warm tea milk red blue go stop up down left right fast slow".split()


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def preferences(n: int = 48) -> Dataset:
    """Prompts of varying length; the chosen answer repeats the prompt's first word, the rejected one does not."""
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(n):
        prompt = [WORDS[(i * k) % len(WORDS)] for k in range(1, 3 + i % 4)]
        rows["prompt"].append(" ".join(prompt))
        rows["chosen"].append(" ".join([prompt[0]] * (1 + i % 3)))
        rows["rejected"].append(" ".join([WORDS[(i + 7) % len(WORDS)]] * (2 + i % 2)))
    return Dataset.from_dict(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="dpo-run")
    a = p.parse_args()
    torch.manual_seed(0)
    tok = tokenizer()
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id))
    args = DPOConfig(output_dir=a.out, max_steps=200, per_device_train_batch_size=2, learning_rate=5e-4,
                     weight_decay=0.01, max_grad_norm=1.0, beta=0.1, max_length=32, logging_steps=1,
                     save_steps=50, report_to=[], bf16=torch.cuda.is_available(), seed=0,
                     gradient_checkpointing=True, disable_tqdm=True)
    trainer = DPOTrainer(model=model, args=args, train_dataset=preferences(), processing_class=tok,
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))
    trainer.train()
    trainer.save_model(os.path.join(a.out, "final"))
    tok.save_pretrained(os.path.join(a.out, "final"))
    if trainer.is_world_process_zero():
        torch.save({"step": trainer.state.global_step}, os.path.join(a.out, "state.pt"))
    print(f"DONE dpo rank={os.environ.get('RANK', '0')} steps={trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
