"""Appliers: turn a `Plan` into changes on the model and the trainer for one `train()` call.

Each applier registers its undo on the `ExitStack` it is given, so everything per-run is detached when
the training loop ends (normally or by an exception). Checkpointing stays switched (the user asked for
checkpointing; we only chose its implementation).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any

from torch import nn

from .checkpointing import apply_checkpointing, checkpoint_kwargs_without_mode
from .config import DDPFixConfig
from .plan import Plan

logger = logging.getLogger("hf_ddpfix")


def attach_runtime(trainer: Any, model: nn.Module, plan: Plan, config: DDPFixConfig, stack: ExitStack) -> None:
    """Apply every per-run piece of `plan` to `trainer` / `model`; undo callbacks go on `stack`."""
    _apply_checkpointing(trainer, model, plan)


def _apply_checkpointing(trainer: Any, model: nn.Module, plan: Plan) -> None:
    mode = plan.checkpointing.value
    if mode == "off":
        return
    extra = checkpoint_kwargs_without_mode(getattr(trainer.args, "activation_checkpointing_kwargs", None))
    n = apply_checkpointing(model, use_reentrant=mode == "reentrant", offload=None, **extra)
    if n == 0:
        logger.warning("checkpointing is %s in the plan but the model has no checkpointed layers", mode)
