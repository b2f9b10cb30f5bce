"""A checkpoint function a trainer or tool installs is read by what it really calls, and kept when it runs
the plan's variant (hf_ddpfix/integrations/checkpointing.py: read_checkpoint_function, keep_tool_checkpointing).

Our own small equivalents of two tools' wrappers: LLaMA-Factory's (a function around
``partial(checkpoint, use_reentrant=...)``, with or without ``functools.wraps``) and Unsloth's (a function
around an autograd Function that offloads the layer input to the host and recomputes in backward).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from fixtures import lora_llama
from torch.utils.checkpoint import checkpoint
from transformers import Trainer, TrainingArguments

from hf_ddpfix import patch_trainer, unpatch_trainer
from hf_ddpfix._compat import checkpointable_layers, layer_checkpoint_func, set_layer_checkpoint_func
from hf_ddpfix.integrations.checkpointing import (
    detect_checkpointing,
    keep_tool_checkpointing,
    read_checkpoint_function,
)
from hf_ddpfix.ops import feature_counts
from hf_ddpfix.plan.resolve import resolve_plan
from hf_ddpfix.plan.types import RunFacts

CALLS: list[str] = []


def factory_style(use_reentrant: bool, wraps: bool = True) -> Any:
    """LLaMA-Factory-like: only trainable layers' inputs get requires_grad, then the partial runs."""
    inner = functools.partial(checkpoint, use_reentrant=use_reentrant)

    def custom_checkpoint(func: Any, *args: Any, **kwargs: Any) -> Any:
        CALLS.append("factory")
        module = getattr(func, "__self__", None) or getattr(getattr(func, "func", None), "__self__", None)
        if module is not None and any(p.requires_grad for p in module.parameters()):
            for a in args:
                if torch.is_tensor(a) and torch.is_floating_point(a):
                    a.requires_grad_(True)
        return inner(func, *args, **kwargs)

    return functools.wraps(inner)(custom_checkpoint) if wraps else custom_checkpoint


class HostOffloadedCheckpoint(torch.autograd.Function):
    """Unsloth-like: keep the layer input on the host, recompute the layer in backward."""

    @staticmethod
    def forward(ctx: Any, function: Any, hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        ctx.function, ctx.args = function, args
        ctx.save_for_backward(hidden.to("cpu", copy=True))
        with torch.no_grad():
            return function(hidden, *args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (saved,) = ctx.saved_tensors
        hidden = saved.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.function(hidden, *ctx.args)
        torch.autograd.backward(out, grad)
        return (None, hidden.grad, *[None] * len(ctx.args))


def host_offloaded_checkpoint(function: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    CALLS.append("offloaded")
    return HostOffloadedCheckpoint.apply(function, *args)


@pytest.mark.parametrize("wraps", [True, False])
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_wrapper_around_a_partial_is_read_by_what_it_calls(reentrant: bool, wraps: bool) -> None:
    info = read_checkpoint_function(factory_style(reentrant, wraps))
    assert info.reentrant is reentrant and info.explicit and info.torch_checkpoint and not info.ours
    assert f"use_reentrant={reentrant}" in info.describe()


def test_a_custom_recompute_is_reentrant_like_and_an_unset_partial_is_torchs_default() -> None:
    info = read_checkpoint_function(host_offloaded_checkpoint)
    assert info.reentrant and not info.torch_checkpoint and "custom recompute" in info.describe()
    assert read_checkpoint_function(functools.partial(checkpoint)).reentrant
    assert not read_checkpoint_function(functools.partial(checkpoint, use_reentrant=False)).reentrant


def _install(model: torch.nn.Module, func: Any) -> None:
    for layer in checkpointable_layers(model):
        if layer_checkpoint_func(layer) is not None:
            set_layer_checkpoint_func(layer, func)


def test_keep_only_what_runs_the_plans_variant() -> None:
    model = lora_llama(checkpointing="non_reentrant")
    _install(model, factory_style(False))
    assert detect_checkpointing(model) == "non_reentrant"  # was read as reentrant whatever it wrapped
    assert "kept" in keep_tool_checkpointing(model, use_reentrant=False, offload=False)
    assert keep_tool_checkpointing(model, use_reentrant=False, offload=True) is None  # our offload: ours
    _install(model, host_offloaded_checkpoint)
    assert detect_checkpointing(model) == "reentrant"
    assert keep_tool_checkpointing(model, use_reentrant=False, offload=False) is None  # DDP plan: replaced


def test_plan_names_the_tool_function_it_keeps_or_replaces() -> None:
    desc = read_checkpoint_function(host_offloaded_checkpoint).describe()
    ddp = resolve_plan(RunFacts(parallel="ddp", world_size=2, is_peft=True, checkpointing="reentrant",
                                checkpoint_function=desc))
    assert ddp.checkpointing.value == "non_reentrant" and "replaces the model's own" in ddp.checkpointing.reason
    single = resolve_plan(RunFacts(checkpointing="reentrant", checkpoint_function=desc))
    assert single.checkpointing.value == "reentrant" and "kept" in single.checkpointing.reason


@pytest.mark.parametrize("tool", ["factory_non_reentrant", "offloaded"])
def test_trainer_keeps_a_tool_function_that_runs_the_plans_variant(tool: str, tmp_path) -> None:
    """One process: the plan keeps the requested variant, so the tool's function stays and runs."""
    from datasets import Dataset

    model = lora_llama(checkpointing="reentrant" if tool == "offloaded" else "non_reentrant")
    func = host_offloaded_checkpoint if tool == "offloaded" else factory_style(False)
    _install(model, func)
    data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5, 6]] * 4, "labels": [[1, 2, 3, 4, 5, 6]] * 4})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    feature_counts.reset()
    CALLS.clear()
    patch_trainer()
    try:
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    finally:
        unpatch_trainer()
    assert "kept" in trainer.hf_ddpfix_plan.checkpointing.reason
    assert all(layer_checkpoint_func(m) is func for m in checkpointable_layers(model) if layer_checkpoint_func(m))
    assert CALLS.count("offloaded" if tool == "offloaded" else "factory") == 2 * 2  # 2 layers x 2 steps
    assert feature_counts.snapshot()["checkpointing"].amounts == {"tool_functions_kept": 1}


def test_transformers_own_functions_are_not_tool_functions() -> None:
    from hf_ddpfix._compat import enable_model_checkpointing
    from hf_ddpfix.integrations.checkpointing import tool_checkpoint_functions

    model = lora_llama()
    for kwargs in ({"use_reentrant": False}, {"use_reentrant": False, "offload": True}):
        enable_model_checkpointing(model, kwargs)
        assert detect_checkpointing(model) == "non_reentrant"
        assert tool_checkpoint_functions(model) == {}, kwargs


def _reinstall_setup(tmp_path: Any, usage_mode: str) -> tuple[Any, Any, Any]:
    """A LoRA Llama with the plan's non-reentrant function installed, the re-install check of a DDP run
    (`runtime._keep_plan_checkpointing`) and the usage observer that wraps each checkpointing layer's function
    (as under DDP). Returns (model, exit stack, batch)."""
    from contextlib import ExitStack
    from types import SimpleNamespace

    from hf_ddpfix.integrations.checkpointing import apply_checkpointing
    from hf_ddpfix.integrations.usage import ParameterUsage
    from hf_ddpfix.plan.types import Decision
    from hf_ddpfix.runtime import attach as runtime

    model = lora_llama(checkpointing=usage_mode)
    apply_checkpointing(model, use_reentrant=False)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    stack = ExitStack()
    plan = SimpleNamespace(checkpointing=Decision("non_reentrant", "test"))
    runtime._keep_plan_checkpointing(SimpleNamespace(args=args), model, plan, None, stack)
    usage = ParameterUsage(model).attach()
    stack.callback(usage.remove)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    return model, stack, {"input_ids": ids, "labels": ids}


def test_our_own_usage_wrapper_is_not_taken_for_a_replacement(tmp_path: Any, caplog: Any) -> None:
    """Issue #28: the usage observer around the plan's function was read as someone else's, so every training
    forward re-installed the function and every run warned about itself. Now: nothing re-installed, no warning."""
    import logging

    model, stack, batch = _reinstall_setup(tmp_path, "non_reentrant")
    feature_counts.reset()
    with stack, caplog.at_level(logging.WARNING, logger="hf_ddpfix"):
        for _ in range(3):
            model(**batch).loss.backward()
        wrapped = [layer_checkpoint_func(m) for m in checkpointable_layers(model)]
    assert all(getattr(f, "_hf_ddpfix_usage", None) is not None for f in wrapped)  # the observer is on
    assert feature_counts.snapshot().get("checkpointing") is None or \
        "reinstalled" not in feature_counts.snapshot()["checkpointing"].amounts
    # hf_ddpfix's own records (transformers >= 5.24 warns about use_cache under checkpointing itself)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("hf_ddpfix")] == []


def test_a_real_replacement_is_still_reinstalled_once_and_logged_once(tmp_path: Any, caplog: Any) -> None:
    """Someone else's function put back mid-run (TRL re-enabling checkpointing with the user's arguments) is
    caught at the next training forward: the plan's function re-installed, counted, logged once."""
    import logging

    from hf_ddpfix.integrations.checkpointing import CheckpointFunction, unwrap_own

    model, stack, batch = _reinstall_setup(tmp_path, "non_reentrant")
    feature_counts.reset()
    with stack, caplog.at_level(logging.WARNING, logger="hf_ddpfix"):
        model(**batch).loss.backward()
        _install(model, functools.partial(checkpoint, use_reentrant=True))  # a trainer re-enables it
        for _ in range(3):
            model(**batch).loss.backward()
        funcs = [unwrap_own(layer_checkpoint_func(m)) for m in checkpointable_layers(model)]
    assert all(isinstance(f, CheckpointFunction) and not f.use_reentrant for f in funcs)
    assert feature_counts.snapshot()["checkpointing"].amounts == {"reinstalled": 1}
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "re-installed" in warned[0].getMessage()
