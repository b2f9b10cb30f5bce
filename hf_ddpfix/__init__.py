"""hf_ddpfix: DDP/FSDP-safe LoRA and VLM fine-tuning with the HF Trainer.

Public API:
    patch_trainer / unpatch_trainer: run every `transformers.Trainer` under the hf_ddpfix plan.
    DDPFixTrainer: the same as a `Trainer` subclass.
    DDPFixConfig: every option once, with its environment variables.
    resolve_plan / RunFacts / Plan: the pure decision function and its types.
"""

from .config import DDPFixConfig
from .plan import Decision, Plan, PlanError, RunFacts, resolve_plan
from .trainer import DDPFixTrainer, patch_trainer, plan_for_trainer, unpatch_trainer

__all__ = [
    "DDPFixConfig",
    "DDPFixTrainer",
    "Decision",
    "Plan",
    "PlanError",
    "RunFacts",
    "patch_trainer",
    "plan_for_trainer",
    "resolve_plan",
    "unpatch_trainer",
]
__version__ = "0.1.0"
