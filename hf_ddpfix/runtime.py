"""Appliers: turn a `Plan` into changes on the model and the trainer for one `train()` call.

Each applier registers its undo on the `ExitStack` it is given, so everything per-run is detached when
the training loop ends (normally or by an exception). Checkpointing stays switched (the user asked for
checkpointing; we only chose its implementation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .checkpointing import apply_checkpointing, checkpoint_kwargs_without_mode
from .config import DDPFixConfig
from .offload import ActivationOffload
from .plan import Plan

logger = logging.getLogger("hf_ddpfix")


@dataclass
class Runtime:
    """The live per-run pieces (exposed as `trainer.hf_ddpfix_runtime` for inspection and tests)."""

    plan: Plan
    offload: ActivationOffload | None = None
    step_contexts: list[Callable[[], AbstractContextManager[Any]]] = field(default_factory=list)


def attach_runtime(trainer: Any, model: nn.Module, plan: Plan, config: DDPFixConfig, stack: ExitStack) -> Runtime:
    """Apply every per-run piece of `plan` to `trainer` / `model`; undo callbacks go on `stack`."""
    rt = Runtime(plan)
    if plan.offload_activations.value:
        rt.offload = ActivationOffload(module=model)
        rt.step_contexts.append(rt.offload.step)
        stack.callback(rt.offload.clear_pool)
    _apply_checkpointing(trainer, model, plan, rt.offload)
    if rt.step_contexts:
        _wrap_training_step(trainer, rt.step_contexts, stack)
    return rt


def _apply_checkpointing(trainer: Any, model: nn.Module, plan: Plan, offload: ActivationOffload | None) -> None:
    mode = plan.checkpointing.value
    if mode == "off":
        return
    extra = checkpoint_kwargs_without_mode(getattr(trainer.args, "activation_checkpointing_kwargs", None))
    n = apply_checkpointing(model, use_reentrant=mode == "reentrant", offload=offload, **extra)
    if n == 0:
        logger.warning("checkpointing is %s in the plan but the model has no checkpointed layers", mode)


def _wrap_training_step(
    trainer: Any, contexts: list[Callable[[], AbstractContextManager[Any]]], stack: ExitStack
) -> None:
    """Run each `trainer.training_step` (one micro-batch's forward + backward) inside `contexts`."""
    had_own = "training_step" in vars(trainer)
    previous = vars(trainer).get("training_step")
    inner = trainer.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        with ExitStack() as step_stack:
            for make in contexts:
                step_stack.enter_context(make())
            return inner(*args, **kwargs)

    trainer.training_step = training_step

    def restore() -> None:
        if had_own:
            trainer.training_step = previous
        else:
            del trainer.training_step

    stack.callback(restore)
