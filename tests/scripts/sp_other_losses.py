"""Trainer subclasses with losses of their own that no issue names, for tests/scripts/sp_losses.py: the class of
"the trainer computes its own loss", checked beyond the examples. `Distill`: a frozen teacher (a second model the
trainer holds, as TRL's GKD / DPO `ref_model` do) called inside `compute_loss`; `Contrastive`: an in-batch InfoNCE
over mean-pooled last hidden states (each row's loss depends on every other row's whole sequence)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fixtures import lora_llama
from transformers import Trainer


class Distill(Trainer):
    """The model's loss plus the token KL from a frozen teacher (another LoRA Llama, seed 1) on the labelled
    positions, over the Trainer's `num_items_in_batch`."""

    def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        super().__init__(*args, **kwargs)
        dtype = next(self.model.parameters()).dtype
        self.teacher_model = lora_llama(attn_implementation="sdpa", dtype=dtype, seed=1).eval()
        self.teacher_model.requires_grad_(False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
        out = model(**inputs, num_items_in_batch=num_items_in_batch)
        with torch.no_grad():
            teacher = self.teacher_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        target = inputs["labels"][:, 1:] != -100
        student = F.log_softmax(out.logits[:, :-1].float(), -1)
        ref = F.log_softmax(teacher.logits[:, :-1].float(), -1)
        kl = (ref.exp() * (ref - student)).sum(-1)[target].sum()
        count = num_items_in_batch if num_items_in_batch is not None else target.sum()
        loss = (out.loss + kl / count) * self.accelerator.num_processes
        return (loss, out) if return_outputs else loss


class Contrastive(Trainer):
    """The model's loss plus an in-batch InfoNCE (temperature 0.5) between each row's mean-pooled last hidden state
    and the same row's pooled embedding of its input ids: a loss over whole sequences and every row."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
        out = model(**inputs, output_hidden_states=True, num_items_in_batch=num_items_in_batch)
        mask = inputs["attention_mask"].unsqueeze(-1).to(out.hidden_states[-1].dtype)
        pooled = F.normalize((out.hidden_states[-1] * mask).sum(1) / mask.sum(1), dim=-1)
        anchor = F.normalize((out.hidden_states[0] * mask).sum(1) / mask.sum(1), dim=-1)
        logits = pooled @ anchor.T / 0.5
        nce = F.cross_entropy(logits, torch.arange(len(logits), device=logits.device))
        loss = out.loss * self.accelerator.num_processes + 0.1 * nce
        return (loss, out) if return_outputs else loss
