"""Facts about quantized (bitsandbytes) weights and about where a rank's model is placed.

Read-only: nothing here changes the model. bitsandbytes is never imported: a model can only hold
bitsandbytes modules once the package is loaded, so `sys.modules` is checked and detection costs
nothing for a model without them.

What a QLoRA run needs the plan to know (checked against bitsandbytes 0.50.2, transformers 5.23,
accelerate 1.15, peft 0.21, torch 2.13; 2026-11-23):

- `Linear4bit` keeps its packed 4-bit weight in a `Params4bit` whose *dtype is the storage dtype*
  (`bnb_4bit_quant_storage`, default uint8): a float storage dtype is a byte container, its values are
  not numbers. Anything that value-casts it (a mixed-precision all-gather, `module.to(dtype)`) garbles
  the weight. The compute dtype (`bnb_4bit_compute_dtype`) is what the matmul runs in.
- `Linear8bitLt` keeps an int8 weight (`Int8Params`) with row statistics beside it.
- `model.hf_device_map` (set by `from_pretrained(device_map=...)`) names the device of every placed
  module; a map over several devices means one process runs the model as a pipeline over them.

Guarantees: `quantization_facts` returns `None` for a model without bitsandbytes layers; dtypes are
returned as torch's short names ("uint8", "bfloat16") so the plan stays free of torch objects.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

QuantMethod = Literal["bnb_4bit", "bnb_8bit"]

__all__ = ["QuantFacts", "device_name", "dtype_name", "placement_devices", "quantization_facts", "sharding_facts"]


@dataclass(frozen=True)
class QuantFacts:
    """The quantized part of a model, as the plan needs it.

    Attributes:
        method: "bnb_4bit" (`Linear4bit`, QLoRA) or "bnb_8bit" (`Linear8bitLt`); a model with both
            reports "bnb_4bit" (the stricter rules) and counts both.
        num_modules: quantized linear modules found.
        quant_bytes: bytes held by the quantized weights (storage bytes; statistics not counted).
        storage_dtype: dtype of the quantized weight tensors ("uint8" default for 4-bit; "int8" for
            8-bit). Several storage dtypes in one model are joined with "+" (e.g. "bfloat16+uint8").
        compute_dtype: dtype the 4-bit matmul runs in (`bnb_4bit_compute_dtype`), `None` if unknown.
        quant_type: "nf4" / "fp4" for 4-bit, `None` otherwise.
        other_dtype: dtype of the model's other floating parameters (norms, embeddings, adapters);
            several are joined with "+".
    """

    method: QuantMethod
    num_modules: int
    quant_bytes: int
    storage_dtype: str
    compute_dtype: str | None = None
    quant_type: str | None = None
    other_dtype: str | None = None

    @property
    def float_storage(self) -> bool:
        """The 4-bit weights live in a floating dtype (what FSDP / ZeRO-3 need to shard them)."""
        return all(name in _FLOAT_NAMES for name in self.storage_dtype.split("+"))

    def describe(self) -> str:
        """One line, e.g. `bnb 4-bit nf4 (14 modules, storage uint8, compute bfloat16)`."""
        kind = "bnb 4-bit" if self.method == "bnb_4bit" else "bnb 8-bit"
        qt = f" {self.quant_type}" if self.quant_type else ""
        compute = f", compute {self.compute_dtype}" if self.compute_dtype else ""
        count = f"{self.num_modules} modules, " if self.num_modules else ""
        return f"{kind}{qt} ({count}storage {self.storage_dtype}{compute})"


_FLOAT_NAMES = {"float32", "float16", "bfloat16", "float64"}


def dtype_name(dtype: Any) -> str | None:
    """torch's short name of a dtype ("bfloat16"), accepting a `torch.dtype` or a string such as
    "torch.bfloat16" / "bf16" / "bfloat16"; `None` for `None`."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    text = str(dtype).removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        text, text
    )


def _join(names: Iterable[str | None]) -> str | None:
    found = sorted({n for n in names if n})
    return "+".join(found) if found else None


def _bnb_classes() -> tuple[type, ...] | None:
    """(Linear4bit, Linear8bitLt) when bitsandbytes is loaded, else `None` (no import triggered)."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return None
    nn_mod = getattr(bnb, "nn", None)
    classes = tuple(c for c in (getattr(nn_mod, "Linear4bit", None), getattr(nn_mod, "Linear8bitLt", None)) if c)
    return classes or None


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor counts its shard
    return local.numel() * local.element_size()


def quantization_facts(model: nn.Module) -> QuantFacts | None:
    """Detect bitsandbytes 4-bit / 8-bit linear layers in `model` (a PeftModel is searched through).

    Args:
        model: the model the user built (unwrapped from DDP / FSDP-1 / compile).

    Returns:
        `QuantFacts`, or `None` when the model has no bitsandbytes layers.

    Example:
        >>> q = quantization_facts(model)   # NF4 Llama loaded with BitsAndBytesConfig(load_in_4bit=True)
        >>> q.method, q.storage_dtype
        ('bnb_4bit', 'uint8')
    """
    classes = _bnb_classes()
    if classes is None:
        return None
    linear4 = getattr(sys.modules["bitsandbytes"].nn, "Linear4bit", None)
    n4 = n8 = 0
    quant_bytes = 0
    storage: set[str] = set()
    compute: set[str] = set()
    qtypes: set[str] = set()
    quant_params: set[int] = set()
    for module in model.modules():
        if not isinstance(module, classes):
            continue
        weight = module.weight
        quant_params.add(id(weight))
        quant_bytes += _local_bytes(weight)
        storage.add(dtype_name(weight.dtype) or "")
        if linear4 is not None and isinstance(module, linear4):
            n4 += 1
            cd = getattr(module, "compute_dtype", None)  # public Linear4bit attribute (bnb 0.50.2)
            if cd is not None:
                compute.add(dtype_name(cd) or "")
            qt = getattr(weight, "quant_type", None)  # public Params4bit attribute ("nf4" / "fp4")
            if qt:
                qtypes.add(str(qt))
        else:
            n8 += 1
    if n4 + n8 == 0:
        return None
    if not compute and n4:
        compute_cfg = _config_compute_dtype(model)
        if compute_cfg:
            compute.add(compute_cfg)
    others = {dtype_name(p.dtype) for p in model.parameters() if id(p) not in quant_params and p.is_floating_point()}
    return QuantFacts(
        method="bnb_4bit" if n4 else "bnb_8bit",
        num_modules=n4 + n8,
        quant_bytes=quant_bytes,
        storage_dtype=_join(storage) or "unknown",
        compute_dtype=_join(compute),
        quant_type=_join(qtypes),
        other_dtype=_join(others),
    )


def _config_compute_dtype(model: nn.Module) -> str | None:
    """`bnb_4bit_compute_dtype` from the model's `quantization_config`, if any."""
    for m in model.modules():
        cfg = getattr(getattr(m, "config", None), "quantization_config", None)
        if cfg is None:
            continue
        value = cfg.get("bnb_4bit_compute_dtype") if isinstance(cfg, dict) else getattr(cfg, "bnb_4bit_compute_dtype", None)
        if value is not None:
            return dtype_name(value)
    return None


def device_name(value: Any) -> str:
    """Normalise a device-map value: 0 -> "cuda:0", torch.device("cuda", 1) -> "cuda:1", "cpu" -> "cpu".

    A bare integer is an accelerator index (transformers/accelerate write CUDA / XPU indices that way);
    it is written "cuda:N" whatever the accelerator, which is enough to tell devices apart.
    """
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"cuda:{value}"
    if isinstance(value, torch.device):
        return str(value) if value.index is not None or value.type in ("cpu", "meta") else f"{value.type}:0"
    text = str(value)
    if text.isdigit():
        return f"cuda:{text}"
    if text in ("cuda", "xpu", "npu", "mlu", "hpu"):
        return f"{text}:0"
    return text


def placement_devices(model: nn.Module) -> tuple[str, ...]:
    """The distinct devices `from_pretrained(device_map=...)` placed one process's `model` on, sorted.

    Reads every `hf_device_map` in the model (a PeftModel keeps it on the base model), as accelerate
    does in `prepare`: a model *with* a device map is never moved there (a multi-entry map under a
    distributed launch is refused; a quantized model must already sit on the rank's device), while a
    model without one is moved onto the rank's device whatever its parameters' devices were. So where
    the parameters happen to be is deliberately not read.

    Returns:
        e.g. () (no device map), ("cuda:0",), ("cpu", "cuda:0", "cuda:1"); more than one entry means
        the model is spread over several devices (pipeline / offload placement).
    """
    devices: set[str] = set()
    for m in model.modules():
        device_map = getattr(m, "hf_device_map", None)
        if isinstance(device_map, dict):
            devices.update(device_name(v) for v in device_map.values())
    return tuple(sorted(devices))


_MIXED = {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16", "fp32": "float32"}


def _enabled(value: Any, fallback: bool) -> bool:
    if isinstance(value, str):
        return fallback if value.lower() == "auto" else value.lower() == "true"
    return bool(value)


def sharding_facts(trainer: Any, parallel: str) -> dict[str, Any]:
    """What a sharding engine will do to floating parameters, read from the Trainer's accelerator.

    Returns:
        {"fsdp_version": 1 | 2 | None, "shard_cast_dtype": "bfloat16" | ... | None, "zero_stage": int | None}:
        under FSDP the plugin's version and its mixed-precision `param_dtype` (or the accelerator's
        mixed precision when no policy is set yet); under DeepSpeed the ZeRO stage and the dtype its
        bf16 / fp16 setting casts the model to ("auto" follows `TrainingArguments.bf16/fp16`).
    """
    out: dict[str, Any] = {"fsdp_version": None, "shard_cast_dtype": None, "zero_stage": None}
    accelerator = getattr(trainer, "accelerator", None)
    state = getattr(accelerator, "state", None)
    args = trainer.args
    if parallel == "fsdp":
        plugin = getattr(state, "fsdp_plugin", None)
        out["fsdp_version"] = int(getattr(plugin, "fsdp_version", None) or 1) if plugin is not None else 2
        policy = getattr(plugin, "mixed_precision_policy", None)
        dtype = policy.get("param_dtype") if isinstance(policy, dict) else getattr(policy, "param_dtype", None)
        if policy is None:
            dtype = _MIXED.get(str(getattr(accelerator, "mixed_precision", "no")))
        out["shard_cast_dtype"] = dtype_name(dtype)
    elif parallel == "deepspeed":
        plugin = getattr(state, "deepspeed_plugin", None)
        config = getattr(plugin, "deepspeed_config", None)
        if not isinstance(config, dict):
            config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or {}
        stage = (config.get("zero_optimization") or {}).get("stage")
        out["zero_stage"] = int(stage) if isinstance(stage, int) or str(stage).isdigit() else None
        if _enabled((config.get("bf16") or {}).get("enabled", False), bool(getattr(args, "bf16", False))):
            out["shard_cast_dtype"] = "bfloat16"
        elif _enabled((config.get("fp16") or {}).get("enabled", False), bool(getattr(args, "fp16", False))):
            out["shard_cast_dtype"] = "float16"
    return out
