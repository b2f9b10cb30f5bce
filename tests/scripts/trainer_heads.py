"""Cases of the trainer zoo (tests/scripts/trainer_zoo.py, which runs them): the plain ``Trainer`` with a
loss that is not the model's output, hf_ddpfix vs stock, same data.

Run:  PYTHONPATH=patches:. OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/trainer_zoo.py --route patches --cases head_in_forward,head_in_compute_loss,some_outputs

Cases (LoRA on every linear layer, variable lengths, weight decay, clipping, 4 steps):
- ``head_in_forward``: a trainable head on ``hidden_states[-1]`` applied inside the model's forward, LoRA also
  on ``lm_head``; ``compute_loss`` uses the head's output only, so ``lm_head``'s LoRA never reaches the loss.
  Stock (an ``nn.Module`` wrapper: find_unused_parameters=True) trains.
- ``head_in_compute_loss``: the head is a submodule of the model but called in ``compute_loss`` (outside the
  forward); no LoRA on ``lm_head``. Stock with find_unused_parameters=True fails ("ready only once": DDP marks
  the head unused after the forward, then its hook fires), so the stock reference is find_unused=False.
- ``some_outputs``: the plain Trainer with a ``compute_loss`` that reads ``logits`` of the last half of the
  tokens only and adds nothing else: every parameter is used, nothing must be tied or reset.

Each case is run stock (the stock setting that trains, non-reentrant checkpointing) and under hf_ddpfix
(reentrant requested: the plan corrects it); weights must agree within 1e-6 on every rank, and the
``parameter_usage`` feature counts must show the loss was observed (:func:`check_counts`).
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.utils.data import Dataset, SequentialSampler
from transformers import Trainer, TrainingArguments
from transformers.modeling_outputs import CausalLMOutputWithPast

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fixtures import lora_llama  # noqa: E402

STEPS = 4
LENGTHS = (7, 11, 5, 9)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Rows(Dataset):
    def __len__(self) -> int:
        return 2 * STEPS

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(1000 + i)
        n = LENGTHS[i % len(LENGTHS)] + (i // 2) % 2
        ids = torch.randint(1, 200, (n,), generator=g)
        return {"input_ids": ids, "target": torch.randn(1, generator=g)}


def collate(rows: list[dict]) -> dict:
    (row,) = rows
    ids = row["input_ids"][None]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "target": row["target"]}


class InOrder(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


class WithHead(nn.Module):
    """A causal LM whose forward also runs a scalar head on the last hidden state."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        torch.manual_seed(7)
        self.head = nn.Linear(lm.config.hidden_size, 1)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return CausalLMOutputWithPast(logits=out.logits, hidden_states=(self.head(out.hidden_states[-1]),))


class HeadLossInForward(InOrder):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        target = inputs.pop("target")
        out = model(**inputs)
        loss = ((out.hidden_states[0][:, -1, 0] - target) ** 2).mean()
        return (loss, out) if return_outputs else loss


class HeadLossInComputeLoss(InOrder):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        target = inputs.pop("target")
        out = model(**inputs, output_hidden_states=True)
        head = self.accelerator.unwrap_model(model).score_head
        loss = ((head(out.hidden_states[-1])[:, -1, 0] - target) ** 2).mean()
        return (loss, out) if return_outputs else loss


class SomeOutputs(InOrder):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs.pop("target")
        out = model(**inputs)
        half = out.logits.shape[1] // 2
        loss = out.logits[:, half:].float().logsumexp(-1).mean()
        return (loss, out) if return_outputs else loss


def build(case: str) -> tuple[nn.Module, type[Trainer], bool]:
    """(model, trainer class, stock find_unused_parameters that trains)."""
    if case == "head_in_forward":
        return WithHead(lora_llama(targets=(*ALL_LINEAR, "lm_head"))), HeadLossInForward, True
    if case == "head_in_compute_loss":
        model = lora_llama(targets=ALL_LINEAR)
        torch.manual_seed(7)
        model.add_module("score_head", nn.Linear(model.config.hidden_size, 1))
        return model, HeadLossInComputeLoss, False
    if case == "some_outputs":
        return lora_llama(targets=ALL_LINEAR), SomeOutputs, True
    raise ValueError(f"unknown case {case!r}")


STOCK_FU = {"head_in_forward": True, "head_in_compute_loss": False, "some_outputs": True}


def build_trainer(case: str, out: str, patched: bool, extra: dict | None = None) -> Trainer:
    """The trainer of ``case``: hf_ddpfix's (``patched``: reentrant checkpointing requested) or stock's (the
    stock setting that trains: non-reentrant, ``find_unused_parameters`` as in STOCK_FU)."""
    model, cls, stock_fu = build(case)
    ckpt = {}
    if hasattr(model, "gradient_checkpointing_enable"):
        ckpt = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": patched}}
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=1, max_steps=STEPS, report_to=[], use_cpu=True,
        save_strategy="no", learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, remove_unused_columns=False,
        disable_tqdm=True, seed=0, logging_steps=1, ddp_find_unused_parameters=None if patched else stock_fu, **ckpt,
        **(extra or {}),
    )
    return cls(model=model, args=args, train_dataset=Rows(), data_collator=collate)


def check_counts(case: str, amounts: dict[str, int]) -> None:
    """The ``parameter_usage`` amounts of the hf_ddpfix run: lm_head's LoRA (A and B) tied at the loss and its
    gradient reset to None every step in ``head_in_forward``; nothing tied or reset in the others."""
    if case == "head_in_forward":
        assert amounts.get("ties_at_loss") == 2 * STEPS and amounts.get("grads_reset") == 2 * STEPS, amounts
    else:
        assert "ties_at_loss" not in amounts and "grads_reset" not in amounts, amounts
