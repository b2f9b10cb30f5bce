"""What tests/scripts/unfreeze_ddp.py and tests/scripts/unfreeze_deepspeed.py share: the tiny Llama with only its
attention projections trainable, the callback that unfreezes ``lm_head`` at the start of an optimizer step, and
the variable-length data (equal lengths within a step, so a batch needs no padding)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from fixtures import tiny_llama
from transformers import TrainerCallback


class Unfreeze(TrainerCallback):
    """``model.lm_head.weight.requires_grad_(True)`` at the start of optimizer step ``at`` (1-based)."""

    def __init__(self, model: torch.nn.Module, at: int) -> None:
        self.model, self.at = model, at

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if state.global_step + 1 == self.at:
            self.model.lm_head.weight.requires_grad_(True)


def build() -> torch.nn.Module:
    """``tiny_llama(0)`` in training mode, only the attention projections trainable (``lm_head`` frozen)."""
    model = tiny_llama(0)
    for name, p in model.named_parameters():
        p.requires_grad_("self_attn" in name)
    return model.train()


def rows(steps: int, lengths: Sequence[int]) -> list[dict]:
    """2 samples a step (a global batch of 2), step ``s`` of length ``lengths[s % len(lengths)]``."""
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, 64, (lengths[i // 2 % len(lengths)],), generator=g).tolist()}
            for i in range(2 * steps)]


def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([b["input_ids"] for b in batch])
    return {"input_ids": ids, "labels": ids.clone()}
