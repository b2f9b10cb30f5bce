"""DeepSpeed internals (checked against 0.19.8; imported lazily, never required).

Part of the contract layer (:mod:`hf_ddpfix._compat`): torch-only at module level.
"""

from __future__ import annotations

from torch import nn

# --------------------------------------------------------------------------------------------------
# deepspeed (checked against 0.19.8; imported lazily, never required)
# --------------------------------------------------------------------------------------------------


def z3_leaf_marked(module: nn.Module) -> bool:
    """True when ``module`` is flagged as a ZeRO-3 leaf module: ``deepspeed.utils.set_z3_leaf_modules``
    sets the private attribute ``module._z3_leaf`` (deepspeed 0.14-0.19.8), read at engine init."""
    return bool(getattr(module, "_z3_leaf", False))


def deepspeed_default_leaf_classes() -> frozenset[str]:
    """Qualified class names deepspeed marks as ZeRO-3 leaf modules by itself (the defaults of the
    ``zero_optimization.leaf_module`` config: ``deepspeed.runtime.zero.leaf_module_config.
    DEFAULT_LEAF_MODULE_CLASSES``, deepspeed >= 0.18; Mixtral / Qwen2-MoE / Qwen3-MoE sparse blocks in 0.19.8).
    Empty when deepspeed is missing or older."""
    try:
        from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
    except Exception:  # noqa: BLE001 - not installed, older, or its accelerator probe failed
        return frozenset()
    return frozenset(str(c) for c in DEFAULT_LEAF_MODULE_CLASSES)


def deepspeed_engine_sequence_parallel_size(engine: object) -> int | None:
    """The sequence-parallel degree a ``DeepSpeedEngine`` averages its gradients with: its
    ``sequence_parallel_size`` attribute (set from ``deepspeed.utils.groups`` in ``_configure_distributed_model``,
    deepspeed 0.14-0.19.8; > 1 when an ``mpu`` with SP groups was given, or left in ``groups.mpu`` by an
    earlier engine in the process). ``None`` when ``engine`` is not a DeepSpeed engine."""
    if type(engine).__name__ != "DeepSpeedEngine":
        return None
    size = getattr(engine, "sequence_parallel_size", None)
    return int(size) if size is not None else None
