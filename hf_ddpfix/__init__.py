"""hf_ddpfix: DDP/FSDP-safe LoRA and VLM fine-tuning with the HF Trainer.

Public API:
    patch_trainer / unpatch_trainer: run every `transformers.Trainer` under the hf_ddpfix plan.
    DDPFixTrainer: the same as a `Trainer` subclass.
    DDPFixConfig: every option once, with its environment variables.
    resolve_plan / RunFacts / Plan: the pure decision function and its types.
    ActivationOffload, apply_tiled_mlp, patch_model_loss, VisionStabilizer: the appliers, usable alone.
    Callbacks, errors and checkpoint helpers for operating runs.
"""

from .callbacks import MemoryThroughputCallback, PlanReportCallback, ReplicaSyncCallback, default_callbacks
from .checkpoints import last_complete_checkpoint, save_model_atomic
from .config import DDPFixConfig
from .errors import DDPFixError, ReplicaDivergenceError, explain, readable_ddp_errors
from .offload import ActivationOffload
from .plan import Decision, Plan, PlanError, RunFacts, resolve_plan
from .tiled import apply_tiled_mlp, remove_tiled_mlp
from .tiled_loss import patch_model_loss, tiled_causal_lm_loss, unpatch_model_loss
from .trainer import DDPFixTrainer, patch_trainer, plan_for_trainer, unpatch_trainer
from .vlm import HangGuard, UnusedParametersError, VisionStabilizer, find_vision_adapter

__all__ = [
    "ActivationOffload",
    "DDPFixConfig",
    "DDPFixError",
    "DDPFixTrainer",
    "Decision",
    "HangGuard",
    "MemoryThroughputCallback",
    "Plan",
    "PlanError",
    "PlanReportCallback",
    "ReplicaDivergenceError",
    "ReplicaSyncCallback",
    "RunFacts",
    "UnusedParametersError",
    "VisionStabilizer",
    "apply_tiled_mlp",
    "default_callbacks",
    "explain",
    "find_vision_adapter",
    "last_complete_checkpoint",
    "patch_model_loss",
    "patch_trainer",
    "plan_for_trainer",
    "readable_ddp_errors",
    "remove_tiled_mlp",
    "resolve_plan",
    "save_model_atomic",
    "tiled_causal_lm_loss",
    "unpatch_model_loss",
    "unpatch_trainer",
]
__version__ = "0.1.0"
