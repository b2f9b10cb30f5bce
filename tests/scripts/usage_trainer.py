"""2-process HF Trainer runs of zoo models that stock's plan used to break: hf_ddpfix (patch_trainer,
reentrant checkpointing requested) vs the stock Trainer (fu=True for a PeftModel), same data.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/usage_trainer.py [--families mllama,bart_layerdrop,llava]

Sample i goes to rank i % 2 (sequential sampler, batch 1 per rank); it has an image when i % 4 == 0,
so steps alternate "rank 0 only" and "no rank". Checks, per family: the patched run wraps DDP with
find_unused_parameters=False, its plan log shows parameter_usage, and its trainable weights equal the
stock run's (1e-6) on every rank. Prints ``USAGE_TRAINER_OK``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
from torch.utils.data import Dataset, SequentialSampler
from transformers import Trainer, TrainingArguments

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fixtures import teardown, trainable_weights  # noqa: E402
from zoo import SEQ, ZOO  # noqa: E402

from hf_ddpfix import patch_trainer, unpatch_trainer  # noqa: E402
from hf_ddpfix._compat import checkpointing_training_args  # noqa: E402

STEPS = 4


class Indices(Dataset):
    def __len__(self) -> int:
        return 2 * STEPS

    def __getitem__(self, i: int) -> dict:
        return {"i": i}


class InOrder(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def run(name: str, patched: bool, out: str) -> tuple[dict[str, torch.Tensor], bool]:
    entry = ZOO[name]
    if patched:
        patch_trainer()
    else:
        unpatch_trainer()

    def collate(rows: list[dict]) -> dict:
        (i,) = [r["i"] for r in rows]
        return entry.batch(entry.vlm and i % 4 == 0, 100 + i, SEQ[(i // 2) % 2])

    model = entry.model(0)
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=1, max_steps=STEPS, report_to=[], use_cpu=True,
        save_strategy="no", learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, remove_unused_columns=False,
        disable_tqdm=True, seed=0, logging_steps=1,
        **checkpointing_training_args(True, {"use_reentrant": patched}),
    )
    trainer = InOrder(model=model, args=args, train_dataset=Indices(), data_collator=collate)
    trainer.train()
    fu = bool(trainer.model_wrapped.find_unused_parameters)
    if patched:
        assert trainer.hf_ddpfix_plan.parameter_usage.value is True, trainer.hf_ddpfix_plan.report()
    weights = trainable_weights(model)
    del trainer
    unpatch_trainer()
    return weights, fu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="mllama,bart_layerdrop,llava")
    ap.add_argument("--out", default="/tmp/usage_trainer")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    for name in a.families.split(","):
        stock, stock_fu = run(name, False, a.out)
        fixed, fixed_fu = run(name, True, a.out)
        assert stock_fu and not fixed_fu, (stock_fu, fixed_fu)
        diff = max((stock[k] - fixed[k]).abs().max().item() for k in stock)
        assert diff <= 1e-6, f"{name}: hf_ddpfix vs stock Trainer differ by {diff:.2e}"
        print(f"[rank {rank}] {name}: Trainer fu=False (stock True), max |fix - stock| = {diff:.1e}", flush=True)
        gc.collect()
    print(f"[rank {rank}] USAGE_TRAINER_OK", flush=True)
    teardown()


if __name__ == "__main__":
    main()
