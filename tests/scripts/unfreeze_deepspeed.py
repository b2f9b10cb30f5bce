"""A head unfrozen by a callback after DeepSpeed ZeRO wrapped the model, through the Trainer, 2 processes.

Tiny Llama, attention projections trainable, ``lm_head`` frozen; AdamW (weight decay 0.1), clipping 1.0,
variable sequence lengths. Cases, in one launch (``DS_ACCELERATOR=cpu``):

- ``quiet``: ZeRO-2 and ZeRO-3, nothing changes: hf_ddpfix must train exactly as the stock Trainer under the
  same stage (weights bit-equal) and log no trainable-set warning. Prints
  ``QUIET rank=<r> case=<case> diff=<max |fixed - stock|>``.
- ``zero2`` / ``zero3``: a callback unfreezes ``lm_head`` at the start of optimizer step 2: hf_ddpfix must raise
  ``TrainableSetChangedError`` from ``train()`` on every rank, naming the parameter and step 2, before that
  step's optimizer step. Prints ``REFUSED rank=<r> case=<case> ok=<bool>``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as dist  # noqa: E402
from _unfreeze import Unfreeze, build, collate, rows  # noqa: E402
from datasets import Dataset  # noqa: E402
from fixtures import in_order, teardown, trainable_weights, zero_config  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_ddpfix import DDPFixTrainer  # noqa: E402
from hf_ddpfix.integrations.usage.trainable_set import TrainableSetChangedError  # noqa: E402

STEPS, UNFREEZE_AT = 3, 2
LENGTHS = (9, 14, 7)


def train(cls, stage: int, unfreeze: bool, tag: str):
    model = build()
    args = TrainingArguments(output_dir=f"/tmp/hf_ddpfix_unfreeze_ds_{tag}", per_device_train_batch_size=1,
                             max_steps=STEPS, report_to=[], use_cpu=True, save_strategy="no", max_grad_norm=1.0,
                             learning_rate=1e-2, weight_decay=0.1, remove_unused_columns=False, disable_tqdm=True,
                             seed=0, logging_steps=1, deepspeed=zero_config(stage))
    trainer = in_order(cls)(model=model, args=args, train_dataset=Dataset.from_list(rows(STEPS, LENGTHS)),
                            data_collator=collate, callbacks=[Unfreeze(model, UNFREEZE_AT)] if unfreeze else [])
    trainer.train()
    return trainable_weights(model)  # the attention projections (ZeRO-3 partitions gathered)


def main() -> None:
    rank = int(os.environ.get("RANK", 0))
    for stage in (2, 3):
        stock = train(Trainer, stage, False, f"stock{stage}")
        fixed = train(DDPFixTrainer, stage, False, f"fixed{stage}")
        diff = max((stock[n] - fixed[n]).abs().max().item() for n in stock)
        print(f"QUIET rank={rank} case=zero{stage} diff={diff}", flush=True)
    for stage in (2, 3):
        case = f"zero{stage}"
        try:
            train(DDPFixTrainer, stage, True, case)
            print(f"NOT_REFUSED rank={rank} case={case}", flush=True)
        except TrainableSetChangedError as err:
            text = str(err)
            ok = "optimizer step 2" in text and "lm_head.weight" in text and "deepspeed.initialize" in text
            print(f"REFUSED rank={rank} case={case} ok={ok} :: {text}", flush=True)
        dist.barrier()
    teardown()


if __name__ == "__main__":
    main()
