"""Two gloo processes: TRL 1.16 ``SFTTrainer`` with ``tiled_loss="on"`` trains like TRL's own loss path.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/trl_tiled_loss.py --out /tmp/trl_tiled_loss.json

TRL installs its own fused LM head and calls ``model(..., fused_lm_head=True)``, then reads
``outputs.log_probs``; hf_ddpfix's patched forward must leave those calls to TRL's head (before the fix
it swallowed the keyword and returned no ``log_probs``: AttributeError). Each rank trains a tiny LoRA
Llama for 4 steps on sentences of different lengths (dynamic padding), AdamW with weight decay,
gradients clipped, twice in one process group: the stock ``SFTTrainer`` (the reference: TRL's own loss
path) and the same trainer under ``patch_trainer(tiled_loss="on")``. Checks: every logged loss equal
within 1e-5, final LoRA weights equal within 1e-6 on every rank, the tiled loss was installed and
stood down on every training forward with the fused-head reason.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

from trl_sft import WORDS, build_tokenizer  # noqa: E402

STEPS = 4


def dataset():
    from datasets import Dataset

    texts = []
    for i in range(48):
        n = 3 + (i * 7) % 17  # 3..19 words: every batch pads to its own length
        texts.append(" ".join(WORDS[(i * k + 5) % len(WORDS)] for k in range(1, n + 1)))
    return Dataset.from_dict({"text": texts})


def train(tmp: str, tiled: bool) -> dict:
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from hf_ddpfix import patch_trainer, unpatch_trainer

    torch.manual_seed(0)
    tok = build_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id))
    args = SFTConfig(
        output_dir=tmp, max_steps=STEPS, per_device_train_batch_size=3, learning_rate=1e-2, weight_decay=0.1,
        max_grad_norm=0.5, max_length=32, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    if tiled:
        patch_trainer(tiled_loss="on")
    try:
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=dataset(), processing_class=tok,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        )
        trainer.train()
    finally:
        if tiled:
            unpatch_trainer()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = torch.cat([p.detach().reshape(-1) for _, p in sorted(trainer.model.named_parameters())
                         if p.requires_grad])
    out = {"losses": losses, "weights": weights}
    if tiled:
        rt = trainer.hf_ddpfix_runtime
        handle = rt.tiled_loss
        out["installed"] = handle is not None
        out["stood_down"] = handle.stood_down if handle is not None else {}
        out["tiled_calls"] = handle.calls if handle is not None else -1
        out["plan_tiled_loss"] = str(trainer.hf_ddpfix_plan.tiled_loss.value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ref = train(os.path.join(tmp, "ref"), tiled=False)
            got = train(os.path.join(tmp, "tiled"), tiled=True)
        loss_diff = max((abs(x - y) for x, y in zip(ref["losses"], got["losses"], strict=True)), default=0.0)
        weight_diff = float((ref["weights"] - got["weights"]).abs().max())
        rec = {
            "rank": rank,
            "steps": len(got["losses"]),
            "loss_max_abs_diff": loss_diff,
            "weight_max_abs_diff": weight_diff,
            "installed": got["installed"],
            "stood_down": got["stood_down"],
            "tiled_calls": got["tiled_calls"],
            "plan_tiled_loss": got["plan_tiled_loss"],
            "losses_ref": ref["losses"],
            "losses_tiled": got["losses"],
        }
        recs = [None] * dist.get_world_size()
        dist.all_gather_object(recs, rec)
        if rank == 0:
            with open(a.out, "w") as f:
                json.dump(recs, f, indent=1)
            print("TRL_TILED_LOSS", json.dumps(recs), flush=True)
    finally:
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
