"""The trainer zoo (tests/scripts/trainer_zoo.py: TRL SFT on a VLM, DPO, Reward, a custom ``compute_loss``) under
the Trainer's FSDP2, against stock DDP (``sft_vlm_sgd``: the same with SGD). Two launches, both 2 gloo processes:

    # the reference: stock DDP (find_unused_parameters=True), fp32
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/scripts/fsdp_trainer_zoo.py \
        --mode stock-ddp --dir DIR
    # hf_ddpfix under fsdp.yaml through the FSDP test device (docs/fsdp.md)
    PYTHONPATH=hf_ddpfix/rehearse/device:. accelerate launch --config_file accelerate_configs/fsdp.yaml \
        --mixed_precision no tests/scripts/fsdp_trainer_zoo.py --mode fsdp --dir DIR

Each case is trainer_zoo's builder, unchanged (same data, AdamW with weight decay, clipping, ``STEPS`` steps), in
fp32 (trainer_zoo.FP32: TRL's configs default to bf16). ``stock-ddp``: rank 0 writes ``DIR/<case>.pt`` (the
trained weights). ``fsdp``: ``patch_trainer()``, then each case trains; a ``PlanError`` is recorded with its
reason (the test fails it unless its EXPECTED_REFUSALS names that case and message); rank 0 writes ``DIR/fsdp-<case>.pt`` ({"weights", "wrapped": the model's class, "units": FSDP2 units,
"error": the PlanError's text or None}). Prints ``FSDP_TRAINER_ZOO_OK``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from fixtures import trainable_weights  # noqa: E402
from trainer_zoo import CASES, FP32, SGD  # noqa: E402

# sft_vlm: TRL SFTTrainer (fused LM head: the loss is built from `log_probs`, not `loss`) on Qwen2-VL, rank 0
# with images, rank 1 text-only; sft_vlm_sgd: the same with SGD (an update linear in the gradient: AdamW turns
# reduce-scatter-vs-all-reduce rounding into visible differences where a gradient element is near zero)
# sft_vlm_ga2: the same with gradient accumulation 2 (two micro-batches of different lengths per step: FSDP2
# reduce-scatters at the last one only, accelerate's no_sync)
VARIANTS = {"sft_vlm_sgd": ("sft_vlm", SGD), "sft_vlm_ga2": ("sft_vlm", {"gradient_accumulation_steps": 2})}
DEFAULT = ("dpo_text", "reward_text", "head_in_compute_loss", "sft_vlm", "sft_vlm_sgd", "sft_vlm_ga2")


def train(case: str, out: str, patched: bool) -> dict:
    """``patched``: the zoo's hf_ddpfix builder (reentrant checkpointing asked); else stock's setting that trains."""
    from torch.distributed.fsdp import FSDPModule

    from hf_ddpfix.ops import feature_counts

    feature_counts.reset()
    builder, extra = VARIANTS.get(case, (case, {}))
    trainer = CASES[builder](out, patched, {**FP32, **extra})
    trainer.train()
    usage = feature_counts.snapshot().get("parameter_usage")
    print(f"[rank {os.environ.get('RANK', 0)}] {case} parameter_usage: "
          f"{None if usage is None else (usage.ran, dict(usage.amounts), usage.fallbacks)}", flush=True)
    rec = {"weights": trainable_weights(trainer.model), "wrapped": type(trainer.model).__name__,
           "units": [n for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)], "error": None}
    del trainer
    gc.collect()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("stock-ddp", "fsdp"), required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--cases", default=",".join(DEFAULT))
    a = ap.parse_args()
    torch.set_num_threads(1)
    from hf_ddpfix import PlanError, patch_trainer

    rank = int(os.environ.get("RANK", 0))
    if a.mode == "fsdp":
        patch_trainer()
    with tempfile.TemporaryDirectory() as out:
        for case in a.cases.split(","):
            try:
                rec = train(case, out, patched=a.mode == "fsdp")
            except PlanError as e:  # refused with its reason: recorded, the next case runs
                rec = {"weights": {}, "wrapped": "", "units": [], "error": f"{type(e).__name__}: {e}"}
            if rank == 0:
                name = case if a.mode == "stock-ddp" else f"fsdp-{case}"
                torch.save(rec, os.path.join(a.dir, f"{name}.pt"))
            print(f"[rank {rank}] {a.mode} {case}: {rec['wrapped']} {len(rec['units'])} units {rec['error'] or ''}",
                  flush=True)
    print(f"[rank {rank}] FSDP_TRAINER_ZOO_OK", flush=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        from hf_ddpfix.ops.dist import destroy_default_group

        destroy_default_group()
