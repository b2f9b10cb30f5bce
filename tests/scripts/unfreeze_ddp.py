"""A head unfrozen by a callback after DDP wrapped the model (the "projector first, then the LLM" schedule).

Tiny Llama, attention projections trainable from the start, ``lm_head`` frozen until a callback sets
``requires_grad_(True)`` at the start of optimizer step 2; an optimizer built over every parameter (so the
head is stepped once it has a gradient), SGD and AdamW (weight decay 0.1), clipping 1.0; sequence lengths vary
from step to step (equal within a step, so a one-process batch of 2 needs no padding).

Run with torchrun: ``--nproc_per_node=1`` (the reference: one process, batch 2) or ``2`` (DDP, batch 1 per
rank: the same global batch). With 2 processes the stock Trainer runs too: its replicas drift apart (DDP never
reduces the head's gradient), reported as ``stock_rank_gap``. Rank 0 saves ``{optimizer: weights}`` and the
gaps to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import Trainer, TrainingArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from _unfreeze import Unfreeze, build, collate, rows  # noqa: E402
from fixtures import in_order, teardown  # noqa: E402

from hf_ddpfix import DDPFixTrainer  # noqa: E402

STEPS, UNFREEZE_AT = 4, 2
LENGTHS = (9, 14, 7, 12)


def train(kind: str, opt: str, world: int) -> dict[str, torch.Tensor]:
    model = build()
    if opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    args = TrainingArguments(output_dir=f"/tmp/hf_ddpfix_unfreeze_{kind}_{opt}", per_device_train_batch_size=2 // world,
                             max_steps=STEPS, report_to=[], use_cpu=True, save_strategy="no", max_grad_norm=1.0,
                             remove_unused_columns=False, disable_tqdm=True, seed=0, logging_steps=1)
    cls = in_order(DDPFixTrainer if kind == "fixed" else Trainer)
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(rows(STEPS, LENGTHS)), data_collator=collate,
                  optimizers=(optimizer, None), callbacks=[Unfreeze(model, UNFREEZE_AT)])
    trainer.train()
    out = {n: p.detach().clone() for n, p in model.named_parameters() if "self_attn" in n or "lm_head" in n}
    del trainer
    return out


def rank_gap(weights: dict[str, torch.Tensor]) -> float:
    """max |rank 0 - rank r| over every weight (0 when the replicas agree)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, weights)
    return max((everyone[0][n] - other[n]).abs().max().item() for other in everyone[1:] for n in weights)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    result: dict = {"weights": {}, "gaps": {}}
    for opt in ("sgd", "adamw"):
        if world > 1:
            stock = train("stock", opt, world)
            result["gaps"][f"stock_rank_gap_{opt}"] = rank_gap(stock)
        fixed = train("fixed", opt, world)
        result["gaps"][f"fixed_rank_gap_{opt}"] = rank_gap(fixed)
        result["weights"][opt] = fixed
        result["gaps"][f"head_moved_{opt}"] = (fixed["lm_head.weight"] - build().lm_head.weight).abs().max().item()
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(result, a.out)
        print("UNFREEZE_SAVED", result["gaps"], flush=True)
    teardown()


if __name__ == "__main__":
    main()
