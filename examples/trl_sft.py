"""A plain TRL `SFTTrainer` LoRA script with no hf_ddpfix code in it: the zero-code-change demo.

Tiny random-weight Llama + peft LoRA + an offline word-level tokenizer + an in-memory dataset, with
reentrant activation checkpointing, which stock DDP cannot train ("Expected to mark a variable ready
only once": the PeftModel gets find_unused_parameters=True and reentrant checkpointing re-fires the hooks).

Stock (fails under DDP; works as a single process):
    torchrun --nproc_per_node=2 examples/trl_sft.py
With hf_ddpfix, unchanged script, every Trainer in the process patched by `patches/sitecustomize.py`:
    PYTHONPATH=patches torchrun --nproc_per_node=2 examples/trl_sft.py
Without CUDA both commands run as 2 gloo CPU processes (`--cpu`, on by default there); with GPUs they use
them, nothing to change.

`--dump-weights DIR` writes each rank's trainable weights to DIR/rank{R}.pt (used by tests/test_patches.py).
"""

import argparse
import os

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from hf_ddpfix import checkpointing_training_args  # importing hf_ddpfix patches nothing
from hf_ddpfix.ops.dist import destroy_default_group

WORDS = ("the a cat dog bird sat ran flew on under over mat rug tree and then quickly slowly home "
         "red blue green big small").split()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer built in memory (no download): ids 0-2 are <pad>, <eos>, <unk>."""
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_dataset(n: int = 64) -> Dataset:
    """Deterministic little sentences: the same on every rank and every run."""
    texts = []
    for i in range(n):
        w = [WORDS[(i * k + 3) % len(WORDS)] for k in (1, 3, 5, 7, 11, 13, 17, 19)]
        texts.append(" ".join(["the", *w[:3], "on", "the", *w[3:]]))
    return Dataset.from_dict({"text": texts})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", default="trl_sft_out")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cpu", action="store_true", default=not torch.cuda.is_available())
    p.add_argument("--dump-weights", default=None)
    a = p.parse_args()

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    args = SFTConfig(
        output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=2, learning_rate=1e-2,
        **checkpointing_training_args(True, {"use_reentrant": True}),  # named for the installed transformers
        max_length=32, use_cpu=a.cpu, report_to=[], save_strategy="no", logging_steps=1, seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=build_dataset(), processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    if a.dump_weights:
        os.makedirs(a.dump_weights, exist_ok=True)
        weights = {n: w.detach().cpu().clone() for n, w in trainer.model.named_parameters() if w.requires_grad}
        torch.save(weights, os.path.join(a.dump_weights, f"rank{os.environ.get('RANK', '0')}.pt"))
    plan = getattr(trainer, "hf_ddpfix_plan", None)  # set only when hf_ddpfix patched the Trainer
    print(f"DONE rank={os.environ.get('RANK', '0')} hf_ddpfix={'on' if plan is not None else 'off'}", flush=True)


if __name__ == "__main__":
    try:
        main()
    finally:  # end the process group here: one left to interpreter shutdown can abort a finished run (gloo)
        destroy_default_group()
