"""`resolve_plan(facts, config) -> Plan`: the DDP / checkpointing decisions as a pure function.

No torch.distributed, no model: facts in, decisions out, each with a one-line reason. The rules follow
the failure table in REFERENCES.md §1 (stock torch 2.13 / transformers 5.23 / accelerate 1.15):

| known failure                                              | how the plan avoids it                       |
|------------------------------------------------------------|----------------------------------------------|
| reentrant checkpointing + find_unused=True: "ready only once" | non-reentrant under DDP/FSDP (or fu=False) |
| fu=False + params that can go unused: reduction error/hang  | fu=True, or the VLM stabiliser uses them all |
| static_graph + a graph that changes step to step            | static graph only when the graph is fixed    |
| static_graph + gradient accumulation (no_sync): INTERNAL ASSERT | static graph only with accumulation 1    |
| transformers `offload=True` without an accelerator: crash   | offload off: nothing to offload to           |

Guarantees: the returned plan never holds a combination from the table above; an explicit user setting
that is known to fail is corrected (listed in `Plan.corrections`) or, with `strict`, raises
`PlanError` before training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .config import DDPFixConfig

if TYPE_CHECKING:  # the plan stays free of torch at run time; the facts type lives with its gatherer
    from .integrations.deepspeed import DeepSpeedFacts
    from .integrations.quantized import QuantFacts

ParallelMode = Literal["single", "ddp", "fsdp", "deepspeed"]
CheckpointMode = Literal["off", "reentrant", "non_reentrant"]


class PlanError(ValueError):
    """Raised (strict mode, or no working combination) before training starts."""


class PlacementError(PlanError):
    """DDP, but one rank's model is spread over several devices (or sits on another rank's device).

    Raised before training; the message names the devices and the fix (`device_map={"": local_rank}`).
    """


class QuantStorageError(PlanError):
    """FSDP / ZeRO-3 would value-cast (or cannot flatten) bitsandbytes 4-bit weights of this storage dtype.

    Raised before training; the message names the storage dtype, the engine's dtype and the fix
    (`bnb_4bit_quant_storage=...`).
    """


@dataclass(frozen=True)
class RunFacts:
    """What the plan needs to know about a run. Gathered by `hf_ddpfix.facts`, or built by hand in tests.

    Attributes:
        parallel: how gradients are synchronised: single process, DDP, FSDP or DeepSpeed.
        world_size: number of processes.
        checkpointing: the checkpointing the run asked for ("off", "reentrant", "non_reentrant").
        is_peft: the model is a peft `PeftModel` (stock Trainer then always picks fu=True).
        is_vlm: the model has a vision tower (`config.vision_config`).
        vlm_adapter: name of the hf_ddpfix VLM adapter for this family, `None` if unsupported.
        trainable_vision_params: trainable parameters live in the vision tower (LoRA on it, merger...).
        conditional_params: other trainable parameters that may go unused in a step (MoE experts).
        grad_accum_steps: gradient accumulation steps (>1 means DDP `no_sync` micro-steps).
        user_find_unused / user_static_graph: the explicit `TrainingArguments` values, `None` if unset.
        user_reentrant: explicit `use_reentrant` in the checkpointing kwargs, `None` if unset.
        offload_requested: transformers' `activation_checkpointing_kwargs={"offload": True}`.
        accelerator_available: a CUDA/XPU/... device is present (pinned memory, streams).
        quant: bitsandbytes weights in the model (`hf_ddpfix.integrations.quantized.QuantFacts`), or `None`.
        placement: the distinct devices `hf_device_map` places this rank's model on, e.g. ("cuda:0",);
            empty without a device map (accelerate then moves the model onto the rank's device).
        rank_device: the device this rank trains on (`TrainingArguments.device`), e.g. "cuda:1".
        fsdp_version: 1 or 2 under FSDP, else `None`.
        shard_cast_dtype: the dtype FSDP's mixed precision (`param_dtype`) or DeepSpeed's bf16/fp16 casts
            floating parameters to, `None` when nothing is cast.
        zero_stage: the DeepSpeed ZeRO stage, `None` without DeepSpeed.
        deepspeed: version, offload, MoE blocks, dtypes of a DeepSpeed run
            (`hf_ddpfix.integrations.deepspeed.DeepSpeedFacts`), `None` without DeepSpeed.
    """

    parallel: ParallelMode = "single"
    world_size: int = 1
    checkpointing: CheckpointMode = "off"
    is_peft: bool = False
    is_vlm: bool = False
    vlm_adapter: str | None = None
    trainable_vision_params: bool = False
    conditional_params: bool = False
    grad_accum_steps: int = 1
    user_find_unused: bool | None = None
    user_static_graph: bool | None = None
    user_reentrant: bool | None = None
    offload_requested: bool = False
    accelerator_available: bool = False
    quant: QuantFacts | None = None
    placement: tuple[str, ...] = ()
    rank_device: str | None = None
    fsdp_version: int | None = None
    shard_cast_dtype: str | None = None
    zero_stage: int | None = None
    deepspeed: DeepSpeedFacts | None = None

    def stock_find_unused(self) -> bool:
        """What stock `Trainer._build_accelerator_args` picks (REFERENCES.md §1)."""
        if self.user_find_unused is not None:
            return self.user_find_unused
        if self.is_peft:
            return True  # a PeftModel is not a PreTrainedModel
        return self.checkpointing == "off"


@dataclass(frozen=True)
class Decision:
    """One decision: its value, why, and whether it differs from what the stock stack does."""

    value: Any
    reason: str
    changed: bool = False


@dataclass(frozen=True)
class Plan:
    """What hf_ddpfix does for a run. Applied by `hf_ddpfix.trainer`; printed by `report()`."""

    parallel: ParallelMode
    world_size: int
    checkpointing: Decision
    find_unused_parameters: Decision
    static_graph: Decision
    offload_activations: Decision
    vlm_stabilizer: Decision
    hang_guard: Decision
    tiled_mlp: Decision
    tiled_loss: Decision
    quantization: Decision = Decision(None, "")
    parameter_usage: Decision = Decision(None, "")
    deepspeed: Decision = Decision(None, "")
    zero3_leaf_modules: Decision = Decision(None, "")
    long_context: Decision = Decision(None, "")
    corrections: tuple[str, ...] = ()
    config_lines: tuple[str, ...] = field(default=())
    offload_min_layer_bytes: int = 0  # the offload policy's threshold (ActivationOffload(min_layer_bytes=))

    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `DistributedDataParallel` (via accelerate's `DistributedDataParallelKwargs`)."""
        if self.parallel != "ddp":
            return {}
        return {
            "find_unused_parameters": bool(self.find_unused_parameters.value),
            "static_graph": bool(self.static_graph.value),
        }

    def decisions(self) -> dict[str, Decision]:
        return {
            "checkpointing": self.checkpointing,
            "parameter_usage": self.parameter_usage,
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "offload_activations": self.offload_activations,
            "vlm_stabilizer": self.vlm_stabilizer,
            "hang_guard": self.hang_guard,
            "tiled_mlp": self.tiled_mlp,
            "tiled_loss": self.tiled_loss,
            "long_context": self.long_context,
            "quantization": self.quantization,
            "deepspeed": self.deepspeed,
            "zero3_leaf_modules": self.zero3_leaf_modules,
        }

    def report(self) -> str:
        """Multi-line, human-readable plan: every decision, `*` marks what differs from stock."""
        lines = [f"hf_ddpfix plan ({self.parallel}, world size {self.world_size}):"]
        for name, d in self.decisions().items():
            if d.value is None:
                continue
            mark = "*" if d.changed else " "
            lines.append(f" {mark} {name:<23} = {_fmt(d.value):<14} {d.reason}")
        for c in self.corrections:
            lines.append(f"   corrected: {c}")
        if self.config_lines:
            lines.append("   settings: " + "; ".join(self.config_lines))
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def resolve_plan(facts: RunFacts, config: DDPFixConfig | None = None) -> Plan:
    """Map run facts and options to a `Plan`.

    Args:
        facts: what is known about the run (see `RunFacts`).
        config: hf_ddpfix options (already resolved against the environment); default: all unset.

    Returns:
        A frozen `Plan`; `Plan.ddp_kwargs()` is what DDP must be built with.

    Raises:
        PlanError: with `strict`, when an explicit setting is known to fail; or when options force
            a combination that cannot work (e.g. reentrant checkpointing with parameters that go unused).
        PlacementError: DDP with this rank's model spread over several devices (see `plan_quantized.decide_quantization`).
        QuantStorageError: FSDP / ZeRO-3 with 4-bit weights in a storage dtype the engine would break.
    """
    # the rule modules import this one for its types, so they are imported here, not at the top
    from . import plan_ddp as ddp_rules
    from . import plan_memory as memory
    from . import plan_quantized as quantized
    from .integrations import deepspeed_plan as ds_decisions

    c = config or DDPFixConfig()
    strict = bool(c.strict)
    corrections: list[str] = []

    def correct(message: str) -> None:
        if strict:
            raise PlanError(f"{message} (strict mode: set HF_DDPFIX_STRICT=0 to let hf_ddpfix correct it)")
        corrections.append(message)

    distributed = facts.parallel in ("ddp", "fsdp")
    ddp = facts.parallel == "ddp"

    quantization = quantized.decide_quantization(facts)  # raises PlacementError / QuantStorageError: cannot work
    ckpt = ddp_rules.decide_checkpointing(facts, c, distributed, correct)
    checkpointed = ckpt.value != "off" or bool(c.assume_checkpointing)
    usage = ddp_rules.decide_parameter_usage(facts, c, str(ckpt.value))
    stabilizer = ddp_rules.decide_stabilizer(facts, c, distributed, bool(usage.value))
    unused_reason = ddp_rules.unused_reason(facts, bool(stabilizer.value), usage)
    fu = ddp_rules.decide_find_unused(
        facts, c, ddp, str(ckpt.value), unused_reason, bool(stabilizer.value), correct, corrections
    )
    static = ddp_rules.decide_static_graph(facts, c, ddp, checkpointed, unused_reason, correct)
    offload = memory.decide_offload(facts, c, str(ckpt.value))
    guard = ddp_rules.decide_hang_guard(facts, c, ddp, bool(fu.value), bool(stabilizer.value), bool(usage.value))
    return Plan(
        parallel=facts.parallel,
        world_size=facts.world_size,
        checkpointing=ckpt,
        find_unused_parameters=fu,
        static_graph=static,
        offload_activations=offload,
        vlm_stabilizer=stabilizer,
        hang_guard=guard,
        tiled_mlp=_unverified_under_zero3(facts, memory.decide_tiled_mlp(facts, c)),
        tiled_loss=_unverified_under_zero3(facts, memory.decide_tiled_loss(c)),
        long_context=_unverified_under_zero3(facts, memory.decide_long_context(facts, c, str(ckpt.value))),
        quantization=quantization,
        parameter_usage=usage,
        deepspeed=ds_decisions.engine(facts),
        zero3_leaf_modules=ds_decisions.leaf_modules(facts),
        corrections=tuple(corrections),
        config_lines=tuple(c.describe()),
        offload_min_layer_bytes=memory.offload_min_layer_bytes(c),
    )


def _unverified_under_zero3(facts: RunFacts, decision: Decision) -> Decision:
    """Stock computation for opt-in features not verified under ZeRO-3 (see deepspeed_plan.zero3_unverified)."""
    from .integrations.deepspeed_plan import zero3_unverified

    return zero3_unverified(facts, decision)
