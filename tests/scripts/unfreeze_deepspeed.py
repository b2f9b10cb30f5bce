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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from fixtures import teardown, tiny_llama, trainable_weights  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from hf_ddpfix import DDPFixTrainer  # noqa: E402
from hf_ddpfix.integrations.trainable_set import TrainableSetChangedError  # noqa: E402

STEPS, UNFREEZE_AT = 3, 2
LENGTHS = (9, 14, 7)


class Unfreeze(TrainerCallback):
    def __init__(self, model):
        self.model = model

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == UNFREEZE_AT:
            self.model.lm_head.weight.requires_grad_(True)


def build() -> torch.nn.Module:
    model = tiny_llama(0)
    for name, p in model.named_parameters():
        p.requires_grad_("self_attn" in name)
    return model.train()


def rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, 64, (LENGTHS[i // 2 % len(LENGTHS)],), generator=g).tolist()}
            for i in range(2 * STEPS)]


def collate(batch):
    ids = torch.tensor([b["input_ids"] for b in batch])
    return {"input_ids": ids, "labels": ids.clone()}


def ds_config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0)
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": zero}


def train(cls, stage: int, unfreeze: bool, tag: str):
    model = build()
    args = TrainingArguments(output_dir=f"/tmp/hf_ddpfix_unfreeze_ds_{tag}", per_device_train_batch_size=1,
                             max_steps=STEPS, report_to=[], use_cpu=True, save_strategy="no", max_grad_norm=1.0,
                             learning_rate=1e-2, weight_decay=0.1, remove_unused_columns=False, disable_tqdm=True,
                             seed=0, logging_steps=1, deepspeed=ds_config(stage))

    class Sequential(cls):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    trainer = Sequential(model=model, args=args, train_dataset=Dataset.from_list(rows()), data_collator=collate,
                         callbacks=[Unfreeze(model)] if unfreeze else [])
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
