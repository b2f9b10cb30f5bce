"""hf_ddpfix: DDP/FSDP-safe LoRA and VLM fine-tuning with the HF Trainer.

Public API:
    patch_trainer / unpatch_trainer: run every `transformers.Trainer` under the hf_ddpfix plan.
    prepare_accelerate_loop: the same plan for a loop on accelerate alone (no Trainer).
    DDPFixTrainer: the same as a `Trainer` subclass.
    DDPFixConfig: every option once, with its environment variables.
    resolve_plan / RunFacts / Plan: the pure decision function and its types.
    ActivationOffload, apply_tiled_mlp, patch_model_loss, VisionStabilizer, apply_long_context: the
        appliers, usable alone; plan_offload_budget / OffloadBudgetError: the pre-flight memory check.
    Callbacks, errors and checkpoint helpers for operating runs.

Layout, bottom up: ``hf_ddpfix._compat`` (every private upstream access), ``hf_ddpfix.ops`` (pure torch),
``hf_ddpfix.integrations`` (HF / accelerate plumbing), then ``config``, ``facts``, ``plan`` (the pure
decisions), ``runtime`` (applies a plan), ``trainer`` (the entry points), ``cli``. Only the names in
``__all__`` are public API; module paths below this package may change between releases.
"""

from ._compat import checkpointing_training_args
from .accelerate_loop import AccelerateLoopRun, prepare_accelerate_loop
from .callbacks import MemoryThroughputCallback, PlanReportCallback, ReplicaSyncCallback, default_callbacks
from .checkpoints import last_complete_checkpoint, save_model_atomic
from .config import DDPFixConfig
from .errors import DDPFixError, ReplicaDivergenceError, explain, readable_ddp_errors
from .feature_report import FeatureFallbackError
from .integrations.long_context.long_context import apply_long_context, remove_long_context
from .integrations.long_context.loss_patch import patch_model_loss, unpatch_model_loss
from .integrations.long_context.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp
from .integrations.usage import HangGuard, ParameterUsage, UnusedParametersError
from .integrations.vision.families import find_vision_adapter
from .integrations.vision.stabilizer import VisionStabilizer
from .ops.offload import ActivationOffload, OffloadBudgetError, plan_offload_budget
from .ops.tiled_loss import tiled_causal_lm_loss
from .plan.resolve import resolve_plan
from .plan.types import Decision, Plan, PlanError, RunFacts
from .trainer import DDPFixTrainer, patch_trainer, plan_for_trainer, unpatch_trainer

__all__ = [
    "AccelerateLoopRun",
    "ActivationOffload",
    "DDPFixConfig",
    "DDPFixError",
    "DDPFixTrainer",
    "Decision",
    "FeatureFallbackError",
    "HangGuard",
    "MemoryThroughputCallback",
    "OffloadBudgetError",
    "ParameterUsage",
    "Plan",
    "PlanError",
    "PlanReportCallback",
    "ReplicaDivergenceError",
    "ReplicaSyncCallback",
    "RunFacts",
    "UnusedParametersError",
    "VisionStabilizer",
    "apply_long_context",
    "apply_tiled_mlp",
    "default_callbacks",
    "checkpointing_training_args",
    "explain",
    "find_vision_adapter",
    "last_complete_checkpoint",
    "patch_model_loss",
    "patch_trainer",
    "plan_for_trainer",
    "plan_offload_budget",
    "prepare_accelerate_loop",
    "readable_ddp_errors",
    "remove_long_context",
    "remove_tiled_mlp",
    "resolve_plan",
    "save_model_atomic",
    "tiled_causal_lm_loss",
    "unpatch_model_loss",
    "unpatch_trainer",
]
__version__ = "0.1.0"
