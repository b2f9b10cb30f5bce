"""DeepSpeed internals (checked against 0.19.8; imported lazily, never required).

Part of the contract layer (:mod:`hf_ddpfix._compat`): torch-only at module level.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# --------------------------------------------------------------------------------------------------
# deepspeed (checked against 0.19.8; imported lazily, never required)
# --------------------------------------------------------------------------------------------------


def z3_leaf_marked(module: nn.Module) -> bool:
    """True when ``module`` is flagged as a ZeRO-3 leaf module: ``deepspeed.utils.set_z3_leaf_modules``
    sets the private attribute ``module._z3_leaf`` (deepspeed 0.14-0.19.8), read at engine init."""
    return bool(getattr(module, "_z3_leaf", False))


def zero3_partitioned(param: torch.Tensor) -> bool:
    """True when ``param`` is a ZeRO-3 partitioned parameter: ``deepspeed.zero.Init`` (and the ZeRO-3 engine)
    give every parameter it converts a ``ds_id`` (``partition_parameters._convert_to_deepspeed_param``,
    deepspeed 0.10-0.19.8); its ``data`` is then an empty placeholder outside a gather."""
    return hasattr(param, "ds_id")


class zero3_gathered:  # noqa: N801 - used as a function: `with zero3_gathered(params):`
    """Every ZeRO-3 partitioned parameter of ``params`` gathered in full on every rank for the block, read-only
    (``deepspeed.zero.GatheredParameters(..., modifier_rank=None)``, deepspeed 0.10-0.19.8): a collective, so
    every rank of the data-parallel group must enter it together, with the same parameters in the same order.
    ``__enter__`` returns whether anything was gathered (nothing, and no collective, when no parameter is
    partitioned)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.partitioned = [p for p in params if zero3_partitioned(p)]
        self._inner: Any = None

    def __enter__(self) -> bool:
        if not self.partitioned:
            return False
        import deepspeed

        self._inner = deepspeed.zero.GatheredParameters(self.partitioned, modifier_rank=None)
        self._inner.__enter__()
        return True

    def __exit__(self, *exc: Any) -> Any:
        inner, self._inner = self._inner, None
        return inner.__exit__(*exc) if inner is not None else None


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


def deepspeed_engine(accelerator: Any) -> Any:
    """The ``DeepSpeedEngine`` accelerate built in ``prepare`` (``accelerator.deepspeed_engine_wrapped.engine``,
    accelerate 1.0-1.15), or ``None`` before ``prepare`` / without DeepSpeed."""
    return getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)


def zero_flat_slices(engine: Any) -> tuple[torch.optim.Optimizer, list[tuple[nn.Parameter, torch.Tensor, int, int]]]:
    """The inner optimizer of a ZeRO-1/2/3 engine and, for every trainable parameter this rank holds a
    part of, ``(parameter, flat fp32 tensor the inner optimizer steps, start, numel)``.

    Private DeepSpeed state read (checked against 0.19.8):

    - ZeRO-1/2 (``stage_1_and_2.DeepSpeedZeroOptimizer``): ``bit16_groups[i]`` (the model parameters of
      group ``i``), ``single_partition_of_fp32_groups[i]`` (this rank's fp32 partition, the tensor in the
      inner optimizer's group ``i``), and each parameter's ``_hp_mapping`` (``utils.tensor_fragment.
      tensor_fragment``: ``hp_fragment_address.start/numel`` in that partition, ``lp_fragment_address`` in
      the parameter; ``None`` when the parameter lies outside this rank's partition).
    - ZeRO-3 (``stage3.DeepSpeedZeroOptimizer_Stage3``): ``fp16_groups[i]`` (the parameters of sub-group
      ``i``), ``fp32_partitioned_groups_flat[i]``, ``grad_position[get_param_id(p)] = [i, offset, numel]``
      and the parameter's own partition ``p.ds_tensor``.

    Every slice is checked against the weights it mirrors (the fp32 values cast to the model dtype equal
    the model's partition of the parameter): a layout read wrongly is refused, never used.

    Raises:
        ValueError: naming why (not a ZeRO-1/2/3 optimizer, optimizer state swapped to NVMe, partial
            offload with a second optimizer, a slice that does not mirror its parameter).
    """
    zero = getattr(engine, "optimizer", None)
    inner = getattr(zero, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        raise ValueError(f"the engine's optimizer ({type(zero).__name__}) is not a ZeRO optimizer wrapping a torch "
                         "optimizer")
    out: list[tuple[nn.Parameter, torch.Tensor, int, int]] = []
    if hasattr(zero, "single_partition_of_fp32_groups") and hasattr(zero, "bit16_groups"):
        for i, group in enumerate(zero.bit16_groups):
            flat = zero.single_partition_of_fp32_groups[i]
            for p in group:
                mapping = getattr(p, "_hp_mapping", None)
                if mapping is None or not p.requires_grad:
                    continue
                hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
                mirror = p.detach().flatten().narrow(0, lp.start, lp.numel)
                out.append((p, flat, int(hp.start), int(hp.numel)))
                _check_mirror(flat, int(hp.start), int(hp.numel), mirror, type(zero).__name__)
    elif hasattr(zero, "fp32_partitioned_groups_flat") and hasattr(zero, "grad_position"):
        if getattr(zero, "swap_optimizer", False):
            raise ValueError("ZeRO-3 optimizer state is swapped to NVMe (offload_optimizer.device=nvme)")
        if getattr(zero, "backup_optimizer", None) is not None:
            raise ValueError("ZeRO-3 partial optimizer offload (a second optimizer steps some sub-groups)")
        for i, group in enumerate(zero.fp16_groups):
            flat = zero.fp32_partitioned_groups_flat[i]
            for p in group:
                if not p.requires_grad:
                    continue
                sub, start, numel = zero.grad_position[zero.get_param_id(p)]
                if sub != i:
                    raise ValueError(f"ZeRO-3 grad_position names sub-group {sub} for a parameter of sub-group {i}")
                out.append((p, flat, int(start), int(numel)))
                _check_mirror(flat, int(start), int(numel), p.ds_tensor.detach().flatten()[:numel], type(zero).__name__)
    else:
        raise ValueError(f"{type(zero).__name__} is not a ZeRO-1/2/3 optimizer of deepspeed 0.19 (no flat fp32 "
                         "partitions found)")
    return inner, out


def _check_mirror(flat: torch.Tensor, start: int, numel: int, mirror: torch.Tensor, what: str) -> None:
    if start < 0 or start + numel > flat.numel() or mirror.numel() != numel:
        raise ValueError(f"{what}: a slice [{start}, {start + numel}) does not fit its flat partition of "
                         f"{flat.numel()} elements")
    if not torch.equal(flat.detach().narrow(0, start, numel).to(mirror.dtype), mirror.to(flat.device)):
        raise ValueError(f"{what}: the fp32 partition slice [{start}, {start + numel}) does not hold its "
                         "parameter's weights (DeepSpeed's layout changed?)")
