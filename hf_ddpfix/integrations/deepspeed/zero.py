"""DeepSpeed ZeRO-2/3: read the run's ZeRO settings, decide what hf_ddpfix does there, apply it.

What differs from DDP (measured on CPU, 2 gloo ranks, torch 2.13 / transformers 5.23 / accelerate 1.15 /
deepspeed 0.19.8 and 0.19.2, 2026-11-23; REFERENCES.md §10):

- There is no DDP reducer: ``find_unused_parameters`` / ``static_graph`` do not exist, and reentrant
  checkpointing works (no "ready only once"); TRL forces it for PEFT + ZeRO-3.
- PEFT + ZeRO-3 + *non-reentrant* checkpointing fails on deepspeed <= 0.19.2 (``CheckpointError ...
  recomputed metadata shape [0]``: the recompute sees the partitioned, empty parameter), fixed in 0.19.3
  (DeepSpeed PR #8148). :func:`checkpointing_decision` switches to reentrant there, and only there.
- Mixed image/text batches fail in stock ZeRO-2 (all-reduce size mismatch) and ZeRO-3 (all-gather
  mismatch; NCCL hangs): :class:`~hf_ddpfix.integrations.vision.zero.ZeroVisionStabilizer` runs the
  dummy image where the real one runs. The DDP stabiliser and the generic "tie every unused parameter"
  mechanism (:mod:`hf_ddpfix.integrations.usage`) do not apply: ZeRO-3 needs the *module* to run (its
  parameters are all-gathered by module hooks; a tied partitioned parameter is an empty tensor) and
  ZeRO-2 needs gradients ready in the same order on every rank (its buckets are flat buffers).
- A mixture-of-experts block whose experts are separate submodules makes ZeRO-3 all-gather only the
  experts a rank routes to: ranks routing differently mismatch (hang on NCCL) or, with prefetching,
  run ~10x slower (DeepSpeed PR #4966). Marking the block a ZeRO-3 *leaf module*
  (``deepspeed.utils.set_z3_leaf_modules``) gathers the whole block at once and zero-fills the gradients
  of experts that got no token. deepspeed >= 0.18 marks Mixtral / Qwen2-MoE / Qwen3-MoE sparse blocks
  itself; transformers 5.x fuses the experts of its MoE models into 3-D tensors (one module that always
  runs), so only remote-code / custom models with per-expert modules need it (:func:`moe_leaf_blocks`).
- bf16 base + fp32 adapters (peft's ``autocast_adapter_dtype=True``) under ZeRO-3 with bf16 on:
  reported as a TypeError at the first optimizer step; on deepspeed 0.19.8 it trains (DeepSpeed casts
  the module, adapters included, to bf16 and keeps fp32 master weights) whether the model was built
  before the Trainer or under ``zero.Init``. The plan logs the dtype mix and what DeepSpeed does; it
  changes nothing.

Here: the facts (:class:`DeepSpeedFacts`, :func:`gather_deepspeed_facts`) and the appliers
(:func:`attach_deepspeed`). The decisions and the doctor's advice are pure functions in
:mod:`hf_ddpfix.plan.deepspeed`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..._compat import deepspeed_default_leaf_classes, z3_leaf_marked

__all__ = [
    "LEAF_MODULES_SINCE",
    "NON_REENTRANT_FIXED_IN",
    "DeepSpeedFacts",
    "apply_z3_leaf_modules",
    "attach_deepspeed",
    "deepspeed_version",
    "gather_deepspeed_facts",
    "moe_leaf_blocks",
    "parse_version",
    "read_deepspeed_config",
]

# PEFT + ZeRO-3 + non-reentrant checkpointing: CheckpointError on <= 0.19.2 (measured), fixed in 0.19.3
# (DeepSpeed PR #8148).
NON_REENTRANT_FIXED_IN = (0, 19, 3)
# Leaf modules are set with deepspeed.utils.set_z3_leaf_modules, which exists since 0.14.0.
LEAF_MODULES_SINCE = (0, 14, 0)


def parse_version(version: str | None) -> tuple[int, int, int] | None:
    """``"0.19.8"`` / ``"0.19.3+cu121"`` / ``"0.20.0rc1"`` -> ``(0, 19, 8)`` ...; ``None`` if unreadable."""
    if not version:
        return None
    parts: list[int] = []
    for piece in str(version).split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            return None
        parts.append(int(digits))
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def deepspeed_version() -> str | None:
    """The installed deepspeed's version (package metadata; does not import deepspeed), or ``None``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return None


@dataclass(frozen=True)
class DeepSpeedFacts:
    """What the plan needs to know about a DeepSpeed run.

    Attributes:
        stage: ZeRO stage 0-3 (``None``: not readable, e.g. ``"auto"``).
        version: installed deepspeed version string (``None``: not installed).
        offload_optimizer / offload_param: the ``zero_optimization.offload_*.device`` ("cpu", "nvme"),
            ``None`` when not offloaded.
        source: where the config was read ("accelerate DeepSpeedPlugin", "TrainingArguments.hf_deepspeed_config",
            "TrainingArguments.deepspeed").
        moe_blocks: classes (qualified names) of mixture-of-experts blocks whose experts are separate
            submodules and that are not ZeRO-3 leaf modules yet (see :func:`moe_leaf_blocks`).
        leaf_config: the ``zero_optimization.leaf_module`` entry of the config, if any.
        base_dtype / adapter_dtype: dtypes of frozen and trainable floating parameters when they differ
            (bf16 base + fp32 LoRA), else ``None``.
        cast_dtype: what DeepSpeed casts the module to ("bfloat16", "float16"), ``None`` for fp32.
    """

    stage: int | None
    version: str | None = None
    offload_optimizer: str | None = None
    offload_param: str | None = None
    source: str = ""
    moe_blocks: tuple[str, ...] = ()
    leaf_config: bool = False
    base_dtype: str | None = None
    adapter_dtype: str | None = None
    cast_dtype: str | None = None

    @property
    def version_tuple(self) -> tuple[int, int, int] | None:
        return parse_version(self.version)

    def describe(self) -> str:
        """One line for the plan log: ``ZeRO-3, deepspeed 0.19.8, optimizer offload cpu``."""
        bits = [f"ZeRO-{self.stage}" if self.stage is not None else "ZeRO stage unknown",
                f"deepspeed {self.version or 'not installed'}"]
        if self.offload_optimizer:
            bits.append(f"optimizer offload {self.offload_optimizer}")
        if self.offload_param:
            bits.append(f"parameter offload {self.offload_param}")
        return ", ".join(bits)


# -------------------------------------------------------------------------------------------------
# Reading the run
# -------------------------------------------------------------------------------------------------


def _load_config(value: Any) -> dict[str, Any] | None:
    """A DeepSpeed config given as a dict, a JSON string or a path to a JSON file."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str):
        if os.path.isfile(value):
            with open(value, encoding="utf-8") as f:
                return json.load(f)
        try:
            loaded = json.loads(value)
        except ValueError:
            return None
        return loaded if isinstance(loaded, dict) else None
    return None


def read_deepspeed_config(trainer: Any = None, args: Any = None) -> tuple[dict[str, Any] | None, str]:
    """The DeepSpeed config of a run and where it came from, first found wins:

    1. accelerate's ``DeepSpeedPlugin`` on the trainer's accelerator (``accelerate launch`` with a
       ``deepspeed_config_file``, or TrainingArguments(deepspeed=...) after the Trainer was built);
    2. ``TrainingArguments.hf_deepspeed_config.config`` (transformers' processed copy);
    3. ``TrainingArguments.deepspeed`` itself (dict, JSON string or path).

    Returns:
        ``(config dict or None, source name)``. Values may still be ``"auto"`` before the Trainer
        fills them in.
    """
    args = args if args is not None else getattr(trainer, "args", None)
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(state, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None)
    if isinstance(config, Mapping) and config:
        return dict(config), "accelerate DeepSpeedPlugin"
    hf = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if isinstance(hf, Mapping) and hf:
        return dict(hf), "TrainingArguments.hf_deepspeed_config"
    raw = _load_config(getattr(args, "deepspeed", None))
    if raw:
        return raw, "TrainingArguments.deepspeed"
    return None, ""


def _offload_device(zero: Mapping[str, Any], key: str) -> str | None:
    entry = zero.get(key)
    if not isinstance(entry, Mapping):
        return None
    device = str(entry.get("device", "none")).lower()
    return None if device in ("none", "") else device


def _stage(zero: Mapping[str, Any]) -> int | None:
    stage = zero.get("stage", 0)
    if isinstance(stage, int) or str(stage).isdigit():
        return int(stage)
    return None


def _float_dtypes(model: nn.Module) -> tuple[str | None, str | None]:
    """(frozen floating dtype, trainable floating dtype) when each is uniform and they differ."""
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
    trainable = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    if len(frozen) == 1 and len(trainable) == 1 and frozen != trainable:
        return str(next(iter(frozen))).replace("torch.", ""), str(next(iter(trainable))).replace("torch.", "")
    return None, None


def _cast_dtype(config: Mapping[str, Any], args: Any) -> str | None:
    def enabled(section: str, flag: str) -> bool:
        value = (config.get(section) or {}).get("enabled", False)
        if value == "auto":
            return bool(getattr(args, flag, False))
        return bool(value)

    if enabled("bf16", "bf16") or enabled("bfloat16", "bf16"):
        return "bfloat16"
    if enabled("fp16", "fp16"):
        return "float16"
    return None


def gather_deepspeed_facts(trainer: Any, model: nn.Module) -> DeepSpeedFacts | None:
    """Read-only facts about a DeepSpeed run, or ``None`` when the trainer has no DeepSpeed config."""
    config, source = read_deepspeed_config(trainer)
    if config is None:
        return None
    zero = config.get("zero_optimization") or {}
    base, adapter = _float_dtypes(model)
    return DeepSpeedFacts(
        stage=_stage(zero),
        version=deepspeed_version(),
        offload_optimizer=_offload_device(zero, "offload_optimizer"),
        offload_param=_offload_device(zero, "offload_param"),
        source=source,
        moe_blocks=tuple(moe_leaf_blocks(model)),
        leaf_config="leaf_module" in zero,
        base_dtype=base,
        adapter_dtype=adapter,
        cast_dtype=_cast_dtype(config, getattr(trainer, "args", None)),
    )


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def moe_leaf_blocks(model: nn.Module) -> list[str]:
    """Qualified class names of MoE blocks ZeRO-3 should treat as leaf modules, not yet marked.

    A block qualifies when one of its children is an ``nn.ModuleList`` whose name contains "expert"
    and that holds at least two modules with parameters: an expert that gets no token on a rank does
    not run there, so ZeRO-3 would skip its all-gather on that rank only. Fused experts (one module
    holding 3-D weights, transformers 5.x) always run and do not qualify. Blocks already marked
    (``_z3_leaf``) or covered by deepspeed's own default leaf classes are left out.

    Pure: no collectives, no deepspeed engine needed.
    """
    defaults = deepspeed_default_leaf_classes()
    found: dict[str, None] = {}
    for module in model.modules():
        if z3_leaf_marked(module):
            continue
        for name, child in module.named_children():
            if "expert" not in name.lower() or not isinstance(child, nn.ModuleList):
                continue
            with_params = [m for m in child if any(True for _ in m.parameters())]
            if len(with_params) >= 2:
                qual = _qualname(type(module))
                if qual not in defaults:
                    found[qual] = None
                break
    return list(found)


def apply_z3_leaf_modules(model: nn.Module, class_names: tuple[str, ...] | list[str]) -> list[nn.Module]:
    """Mark every module of ``model`` whose class is in ``class_names`` (qualified or plain class names)
    as a ZeRO-3 leaf module.

    Must run before ``deepspeed.initialize`` (the engine reads the flags when it installs its hooks;
    the Trainer initialises it inside ``train()``, after hf_ddpfix's plan is applied).

    Returns:
        The modules marked.

    Raises:
        ImportError: deepspeed is missing or older than 0.14 (no ``set_z3_leaf_modules``).
    """
    from deepspeed.utils import set_z3_leaf_modules

    wanted = set(class_names)
    classes = list({type(m) for m in model.modules() if wanted & {_qualname(type(m)), type(m).__name__}})
    if not classes:
        return []
    return list(set_z3_leaf_modules(model, classes))


def attach_deepspeed(model: nn.Module, *, stabilize: bool, leaf_classes: tuple[str, ...] | None,
                     stack: ExitStack, log: Callable[[str], None] = lambda _: None, sync_eval: bool = False,
                     guard_stage: int | None = None, error: type[Exception] = RuntimeError) -> Any:
    """Apply the DeepSpeed part of a plan before the Trainer initialises the DeepSpeed engine.

    Args:
        model: the unwrapped model (PeftModel or HF model), not yet wrapped by ``deepspeed.initialize``.
        stabilize: attach :class:`~hf_ddpfix.integrations.vision.zero.ZeroVisionStabilizer`.
        sync_eval: its evaluation forwards (eval / predict / generate inside ``train()``) agree across
            ranks too (ZeRO-3).
        leaf_classes: MoE block classes to mark as ZeRO-3 leaf modules (``None`` / empty: none).
        stack: undo callbacks go here (the stabiliser's hooks are removed; leaf flags are reset).
        guard_stage: the ZeRO stage when a VLM with no dummy image (the plan's ``vlm_stabilizer`` off for that
            reason, or the stabiliser's trial failed here) gets
            :class:`~hf_ddpfix.integrations.vision.mixed_guard.MixedImageGuard`, which raises ``error``.
        log: receives one line per applied piece.

    Returns:
        The attached ``ZeroVisionStabilizer``, or ``None``.
    """
    stab, why = None, ""
    if stabilize:
        from ..vision.zero import ZeroVisionStabilizer

        try:
            stab = ZeroVisionStabilizer(model, sync_eval=sync_eval).attach()
        except ValueError as err:  # no language-model module / a failed trial run: stock behaviour, with the reason
            from ...ops.feature_counts import record_fallback

            record_fallback("stabilizer", str(err))
            log(f"deepspeed: no ZeRO dummy image (stock behaviour): {err}")
            why = str(err)
        else:
            stack.callback(stab.remove)
            log(f"deepspeed: dummy image before {type(stab.language_model).__name__} on text-only micro-batches")
    if stab is None and guard_stage is not None and (why or not stabilize):
        from ..vision.families import describe_unsupported
        from ..vision.mixed_guard import MixedImageGuard

        guard = MixedImageGuard(model, why=why or describe_unsupported(model, zero=True), stage=guard_stage,
                                error=error).attach()
        stack.callback(guard.remove)
        log(f"deepspeed: no dummy image for this VLM: a forward where ranks mix images and text stops with a named "
            f"error (ZeRO-{guard_stage} would mismatch or hang there)")
    if leaf_classes:
        marked = apply_z3_leaf_modules(model, leaf_classes)
        if marked:
            from deepspeed.utils import unset_z3_leaf_modules

            stack.callback(unset_z3_leaf_modules, model, list({type(m) for m in marked}))
        log(f"deepspeed: {len(marked)} MoE blocks marked as ZeRO-3 leaf modules ({', '.join(leaf_classes)})")
    return stab
