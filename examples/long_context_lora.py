"""Long-context LoRA on a Llama shape with hf_ddpfix: the set-up, with a pre-flight memory check.

What it turns on (all through ``DDPFixConfig``, the same options as the ``HF_DDPFIX_*`` variables):

- non-reentrant activation checkpointing (each layer keeps only its input until its backward),
- ``offload_activations=True``: those layer inputs go to pinned host memory asynchronously,
- ``tiled_loss="on"``: ``lm_head`` + cross-entropy in chunks (no ``tokens x vocab`` logits),
- ``long_context="all"``: RMSNorm saving bf16 input + fp32 rstd, flash attention per KV-head group,
  and the token-wise parts of every decoder layer in 2K-token tiles (one Llama-8B layer: 345 -> 53
  KiB/token of working set, ``python benchmarks/long_context.py --ledger``).

Before training, :func:`hf_ddpfix.ops.offload.plan_offload_budget` checks the device and host
budgets for the requested length and stops with ``OffloadBudgetError`` (which budget, how many GiB,
the longest sequence that fits) instead of failing an hour in. It models the offload as the Trainer
runs it: every layer input but the last goes to the host pool, whose cap is a quarter of physical
memory per local rank (``hf_ddpfix.ops.offload.host_pool.default_max_bytes``).

Run (CPU, tiny random model, a few seconds)::

    python examples/long_context_lora.py --tiny --seq 512 --max-steps 2

On one 80 GB GPU, Llama-8B shape with random bf16 weights (no download), 128K tokens (256K needs 62 GiB
of pinned host memory, more than the pool's default cap on a 125 GiB host: the pre-flight says so)::

    PYTORCH_ALLOC_CONF=expandable_segments:True python examples/long_context_lora.py --seq 131072

Use ``--model-path`` for real weights (``AutoModelForCausalLM.from_pretrained``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from hf_ddpfix import DDPFixConfig, DDPFixTrainer, checkpointing_training_args
from hf_ddpfix.ops.dist import destroy_default_group
from hf_ddpfix.ops.offload.budget import plan_offload_budget
from hf_ddpfix.ops.offload.host_pool import default_max_bytes

GIB = 1 << 30
# Per-token device working set besides the stored layer inputs, all features on: one Llama-8B layer's
# forward/recompute/backward (53 KiB, the ledger) + prefetched input, embedding output, loss-head input
# and its gradient (4 x 8 KiB); scaled by hidden size for other shapes.
WORKING_BYTES_PER_HIDDEN_UNIT = (53 + 32) * 1024 / 4096


def build(args: argparse.Namespace) -> torch.nn.Module:
    if args.model_path:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.bfloat16, attn_implementation="sdpa")
    else:
        shape = (dict(hidden_size=64, intermediate_size=160, num_attention_heads=8, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=256) if args.tiny else
                 dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=32, vocab_size=128256))
        cfg = LlamaConfig(**shape, max_position_embeddings=max(args.seq, 8192), attn_implementation="sdpa",
                          use_cache=False)
        torch.manual_seed(0)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(old)
    with warnings.catch_warnings():  # peft 0.21 reads transformers 5.23's deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))


def preflight(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Fail before training when the device or host budget cannot hold ``args.seq`` tokens."""
    cfg = model.config
    if torch.cuda.is_available():
        device_budget = int(torch.cuda.get_device_properties(0).total_memory * 0.95)
        fixed = torch.cuda.memory_allocated(0) + 2 * GIB  # weights + CUDA context / allocator slack
    else:
        device_budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        fixed = sum(p.numel() * p.element_size() for p in model.parameters())
    layer_bytes = args.seq * cfg.hidden_size * 2
    host_cap = default_max_bytes() or 0  # the offload pool's cap (issue 11's default)
    budget = plan_offload_budget(
        layers=cfg.num_hidden_layers, tokens=args.seq, layer_bytes=layer_bytes, device_budget_bytes=device_budget,
        host_budget_bytes=host_cap if torch.cuda.is_available() else device_budget, fixed_device_bytes=fixed,
        working_bytes_per_token=WORKING_BYTES_PER_HIDDEN_UNIT * cfg.hidden_size,
        # max_keep=None: the Trainer's offload keeps as many inputs on the device as fit (keep_on_device="auto")
    )
    print("pre-flight:", budget.describe(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random model (CPU demo)")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--max-steps", type=int, default=3)
    ap.add_argument("--output-dir", default="/tmp/long_context_lora")
    args = ap.parse_args()

    model = build(args)
    preflight(model, args)
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(3, model.config.vocab_size, (args.seq,), generator=gen).tolist()),
             "labels": ids} for _ in range(args.max_steps)]
    training_args = TrainingArguments(
        args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=1, learning_rate=1e-4,
        weight_decay=0.01, max_grad_norm=1.0, bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
        **checkpointing_training_args(True, {"use_reentrant": False}),  # the switch's name on this transformers
        logging_steps=1, save_strategy="no", report_to=[],
    )
    # offload only where there is device memory to free (on the CPU it is a no-op the plan would warn about)
    config = DDPFixConfig(offload_activations=torch.accelerator.is_available() or None, tiled_loss="on",
                          long_context="all")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = DDPFixTrainer(model=model, args=training_args, train_dataset=data, ddpfix_config=config)
        result = trainer.train()
    # what each requested feature really ran (rank-local counts; fell_back > 0 means stock code ran)
    counts = json.dumps({k: v for k, v in result.metrics.items() if k.startswith("hf_ddpfix/")}, sort_keys=True)
    sys.stdout.write(f"feature counts: {counts}\n")  # one write per line: the ranks share stdout
    sys.stdout.flush()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    peak = f", peak {torch.cuda.max_memory_allocated() / GIB:.1f} GiB" if torch.cuda.is_available() else ""
    print(f"trained {args.max_steps} steps of {args.seq} tokens: losses {[round(x, 4) for x in losses]}{peak}", flush=True)


if __name__ == "__main__":
    try:
        main()
    finally:  # end the process group here: one left to interpreter shutdown can abort a finished run (gloo)
        destroy_default_group()
