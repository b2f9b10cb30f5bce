"""HF Trainer with DDPFixConfig(long_context=...) trains like the stock Trainer (one process, CPU).

Tiny Llama + LoRA on every linear layer, non-reentrant checkpointing, AdamW with weight decay,
max_grad_norm, variable sequence lengths (batch size 1: no padding mask, so the patched path runs);
final LoRA weights compared with the stock Trainer's, and the patched forward checked to have run.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("peft")

from fixtures import lora, tiny_llama, variable_length_ids  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from hf_ddpfix.config.options import DDPFixConfig  # noqa: E402
from hf_ddpfix.trainer import DDPFixTrainer  # noqa: E402


class _SeenPatched(TrainerCallback):
    def __init__(self) -> None:
        self.kinds: set[str] = set()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        for m in model.modules():
            fwd = m.__dict__.get("forward")
            if fwd is not None and ".integrations.long_context." in type(fwd).__module__:
                self.kinds.add(type(fwd).__name__)


def _train(tmp_path, config: DDPFixConfig | None):
    model = lora(tiny_llama(seed=0, num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"),
                 targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                 init_lora_weights=False)
    data = [{"input_ids": ids, "labels": ids} for ids in variable_length_ids(6, lengths=(7, 13, 10))]
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=3, per_device_train_batch_size=1,
                             learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, seed=0, logging_steps=1,
                             save_strategy="no", gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": False})
    seen = _SeenPatched()
    kw = {"ddpfix_config": config} if config is not None else {}
    cls = DDPFixTrainer if config is not None else Trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = cls(model=model, args=args, train_dataset=data, callbacks=[seen], **kw)
        result = trainer.train()
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return weights, losses, seen.kinds, result.metrics, model


def _layers(model) -> int:
    return model.get_base_model().config.num_hidden_layers


def test_trainer_with_long_context_matches_stock(tmp_path):
    w0, loss0, kinds0, _, _ = _train(tmp_path / "stock", None)
    w1, loss1, kinds1, metrics, model = _train(tmp_path / "ours", DDPFixConfig(long_context="all"))
    assert not kinds0 and kinds1 == {"NormForward", "_LayerForward"}
    # the patched layer really ran: layers x steps x (forward + checkpoint recompute), never stock
    assert metrics["hf_ddpfix/long_context/ran"] == _layers(model) * 3 * 2, metrics
    assert metrics["hf_ddpfix/long_context/fell_back"] == 0, metrics
    assert len(loss0) == len(loss1) == 3
    moved = max((w0[n] - w1[n]).abs().max().item() for n in w0)
    # fp32 residual stream: the layer input's gradient is the same three terms summed in another order
    # (stock: autograd's input buffer; ours: per tile), so equal to float rounding, not bitwise.
    assert moved < 1e-6, moved
    torch.testing.assert_close(torch.tensor(loss1), torch.tensor(loss0), rtol=1e-6, atol=1e-6)
    assert any((w0[n] - lora_init).abs().max() > 1e-4 for n, lora_init in _initial().items())


def _initial():
    model = lora(tiny_llama(seed=0, num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"),
                 targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                 init_lora_weights=False)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
