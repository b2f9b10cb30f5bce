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

Layout, bottom up (docs/design.md, "Layout"): ``_compat`` (every private upstream access), ``ops`` (pure torch),
``integrations`` (HF / accelerate plumbing, one folder or module per feature), ``config`` (the options), ``plan`` (the
pure decisions), ``facts`` (what a run is, live or offline), ``runtime`` (applies a plan and reports on it), then the
entry points at the top: ``callbacks``, ``trainer``, ``accelerate_loop``, ``rehearse`` and ``cli``. Only the names in
``__all__`` are public API; module paths below this package may change between releases.
"""

import importlib
from typing import Any

_LAZY = {  # public name -> the module that defines it, imported on first use (PEP 562)
    "checkpointing_training_args": "._compat",
    "AccelerateLoopRun": ".accelerate_loop",
    "prepare_accelerate_loop": ".accelerate_loop",
    "MemoryThroughputCallback": ".callbacks",
    "PlanReportCallback": ".callbacks",
    "ReplicaSyncCallback": ".callbacks",
    "default_callbacks": ".callbacks",
    "last_complete_checkpoint": ".runtime.checkpoints",
    "save_model_atomic": ".runtime.checkpoints",
    "DDPFixConfig": ".config.options",
    "DDPFixError": ".runtime.errors",
    "ReplicaDivergenceError": ".runtime.errors",
    "explain": ".runtime.errors",
    "readable_ddp_errors": ".runtime.errors",
    "FeatureFallbackError": ".runtime.feature_report",
    "apply_long_context": ".integrations.long_context.long_context",
    "remove_long_context": ".integrations.long_context.long_context",
    "patch_model_loss": ".integrations.long_context.loss_patch",
    "unpatch_model_loss": ".integrations.long_context.loss_patch",
    "apply_tiled_mlp": ".integrations.long_context.tiled_mlp",
    "remove_tiled_mlp": ".integrations.long_context.tiled_mlp",
    "HangGuard": ".integrations.usage",
    "ParameterUsage": ".integrations.usage",
    "UnusedParametersError": ".integrations.usage",
    "find_vision_adapter": ".integrations.vision.families",
    "VisionStabilizer": ".integrations.vision.stabilizer",
    "ActivationOffload": ".ops.offload",
    "OffloadBudgetError": ".ops.offload",
    "plan_offload_budget": ".ops.offload",
    "tiled_causal_lm_loss": ".ops.tiled_loss",
    "resolve_plan": ".plan.resolve",
    "Decision": ".plan.types",
    "Plan": ".plan.types",
    "PlanError": ".plan.types",
    "RunFacts": ".plan.types",
    "report_to_launcher": ".runtime.launcher_errors",
    "DDPFixTrainer": ".trainer",
    "patch_trainer": ".trainer",
    "plan_for_trainer": ".trainer",
    "unpatch_trainer": ".trainer",
}

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
    "report_to_launcher",
    "resolve_plan",
    "save_model_atomic",
    "tiled_causal_lm_loss",
    "unpatch_model_loss",
    "unpatch_trainer",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use, so `import hf_ddpfix` (and `hf-ddpfix --help`) loads
    neither torch nor transformers until something needs them. `_LAZY` is the one list of public names;
    `__all__` must equal its keys (tests/test_cli.py)."""
    module = _LAZY.get(name)
    if module is None:  # a submodule (`hf_ddpfix.trainer`), as an eager package would have bound it
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
