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

from collections.abc import Callable
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
        PlacementError: DDP with this rank's model spread over several devices (see `_decide_quantization`).
        QuantStorageError: FSDP / ZeRO-3 with 4-bit weights in a storage dtype the engine would break.
    """
    from .integrations import deepspeed_plan as ds_decisions  # DeepSpeed rules; lazy: it imports this module

    c = config or DDPFixConfig()
    strict = bool(c.strict)
    corrections: list[str] = []

    def correct(message: str) -> None:
        if strict:
            raise PlanError(f"{message} (strict mode: set HF_DDPFIX_STRICT=0 to let hf_ddpfix correct it)")
        corrections.append(message)

    distributed = facts.parallel in ("ddp", "fsdp")
    ddp = facts.parallel == "ddp"

    quantization = _decide_quantization(facts)  # raises PlacementError / QuantStorageError: cannot work
    ckpt = _decide_checkpointing(facts, c, distributed, correct)
    checkpointed = ckpt.value != "off" or bool(c.assume_checkpointing)
    usage = _decide_parameter_usage(facts, c, str(ckpt.value))
    stabilizer = _decide_stabilizer(facts, c, distributed, bool(usage.value))
    unused_reason = _unused_reason(facts, bool(stabilizer.value), usage)
    fu = _decide_find_unused(
        facts, c, ddp, str(ckpt.value), unused_reason, bool(stabilizer.value), correct, corrections
    )
    static = _decide_static_graph(facts, c, ddp, checkpointed, unused_reason, correct)
    offload = _decide_offload(facts, c, str(ckpt.value))
    guard = _decide_hang_guard(facts, c, ddp, bool(fu.value), bool(stabilizer.value), bool(usage.value))
    return Plan(
        parallel=facts.parallel,
        world_size=facts.world_size,
        checkpointing=ckpt,
        find_unused_parameters=fu,
        static_graph=static,
        offload_activations=offload,
        vlm_stabilizer=stabilizer,
        hang_guard=guard,
        tiled_mlp=_unverified_under_zero3(facts, _decide_tiled_mlp(facts, c)),
        tiled_loss=_unverified_under_zero3(facts, _decide_tiled_loss(c)),
        long_context=_unverified_under_zero3(facts, _decide_long_context(facts, c, str(ckpt.value))),
        quantization=quantization,
        parameter_usage=usage,
        deepspeed=ds_decisions.engine(facts),
        zero3_leaf_modules=ds_decisions.leaf_modules(facts),
        corrections=tuple(corrections),
        config_lines=tuple(c.describe()),
        offload_min_layer_bytes=offload_min_layer_bytes(c),
    )


def _decide_checkpointing(facts: RunFacts, c: DDPFixConfig, distributed: bool, correct) -> Decision:
    asked = facts.checkpointing
    if facts.parallel == "deepspeed" and facts.deepspeed is not None:
        from .integrations import deepspeed_plan

        return deepspeed_plan.checkpointing(facts, c, correct)
    if asked == "off":
        if c.assume_checkpointing:
            return Decision("off", "not detected; assumed on (custom checkpointing) for the DDP decisions")
        return Decision("off", "not requested")
    if c.checkpointing == "reentrant":
        return Decision("reentrant", f"forced ({c.source('checkpointing')})", changed=asked != "reentrant")
    if c.checkpointing == "non_reentrant":
        return Decision("non_reentrant", f"forced ({c.source('checkpointing')})", changed=asked != "non_reentrant")
    if asked == "reentrant" and distributed:
        if facts.user_reentrant and c.strict:
            # strict: keep the explicit choice; the find_unused decision raises if it cannot work
            return Decision("reentrant", "explicit use_reentrant=True kept (strict mode)")
        if facts.user_reentrant:
            correct(
                "use_reentrant=True -> False: reentrant checkpointing re-runs the forward inside backward, "
                "which DDP with find_unused_parameters=True sees as a second use ('ready only once')"
            )
        return Decision(
            "non_reentrant",
            "reentrant breaks DDP with find_unused/unused params; non-reentrant works in every DDP mode",
            changed=True,
        )
    return Decision(asked, "as requested")


_USAGE_HOW = (
    "every trainable parameter a forward leaves unused is tied into the loss with an exact-zero gradient "
    "(observed each forward by an autograd-graph walk, reentrant checkpointed layers by the tensors they "
    "read); grads no rank used in the step are reset to None before clipping (stock fu=True semantics)"
)
_USAGE_COST = "cost: one graph walk per forward, one all-reduce of 1 byte per trainable tensor per optimizer step"


def _decide_parameter_usage(facts: RunFacts, c: DDPFixConfig, ckpt: str) -> Decision:
    """The generic "every parameter used" mechanism (hf_ddpfix.integrations.usage) under DDP."""
    if facts.parallel != "ddp":
        return Decision(None, "")
    if c.parameter_usage is False:
        return Decision(False, f"disabled ({c.source('parameter_usage')}): stock find_unused_parameters kept")
    explicit = facts.user_find_unused if c.find_unused_parameters is None else c.find_unused_parameters
    if explicit is True and ckpt != "reentrant":  # reentrant: fu=True fails, the mechanism makes fu=False work
        return Decision(False, "not needed: explicit find_unused_parameters=True lets DDP find unused parameters")
    return Decision(True, f"{_USAGE_HOW}; {_USAGE_COST}", changed=True)


def _decide_stabilizer(facts: RunFacts, c: DDPFixConfig, distributed: bool, usage: bool = False) -> Decision:
    if not facts.is_vlm:
        return Decision(None, "")
    if facts.parallel == "deepspeed":
        from .integrations import deepspeed_plan

        return deepspeed_plan.stabilizer(facts, c)
    needs = distributed and (facts.trainable_vision_params or facts.parallel == "fsdp")
    if not needs:
        why = "no trainable vision parameters" if distributed else "single process"
        return Decision(False, f"not needed: {why}")
    if usage and facts.parallel == "ddp":
        return Decision(False, "not needed under DDP: parameter_usage ties the unused vision parameters in "
                        "(no dummy image forward)")
    if c.vlm_stabilizer is False:
        return Decision(False, f"disabled ({c.source('vlm_stabilizer')})")
    if facts.vlm_adapter is None:
        return Decision(False, "no adapter for this VLM family: safe fallback (non-reentrant + find_unused)")
    return Decision(
        True,
        f"{facts.vlm_adapter}: text-only steps run a dummy image (exactly-zero contribution) so every rank "
        "uses every vision parameter",
        changed=True,
    )


def _unused_reason(facts: RunFacts, stabilized: bool, usage: Decision | None = None) -> str | None:
    """Why some trainable parameters may go unused in a step (None: every one is used every step).

    With the parameter-usage mechanism on, none can (it ties them in). With it explicitly off, hf_ddpfix
    cannot prove that no layer is skipped (a text-only step in Mllama, LayerDrop, a branch), so stock's
    choice stays: that reason is returned whenever stock would pick find_unused_parameters=True.
    """
    if usage is not None and usage.value:
        return None
    if facts.trainable_vision_params and not stabilized:
        return "trainable vision parameters go unused on steps without images"
    if facts.conditional_params:
        return "conditionally used parameters (e.g. MoE experts)"
    if usage is not None and usage.value is False and facts.stock_find_unused():
        return "parameter_usage is off, so nothing proves every trainable parameter is used every step"
    return None


def _decide_find_unused(
    facts: RunFacts,
    c: DDPFixConfig,
    ddp: bool,
    ckpt: str,
    unused: str | None,
    stabilized: bool,
    correct: Callable[[str], None],
    corrections: list[str],
) -> Decision:
    if not ddp:
        return Decision(None, "")
    stock = facts.stock_find_unused()
    explicit = facts.user_find_unused if c.find_unused_parameters is None else c.find_unused_parameters
    source = "ddp_find_unused_parameters" if c.find_unused_parameters is None else c.source("find_unused_parameters")
    if ckpt == "reentrant":
        # reentrant checkpointing fires a parameter's hook in the recompute too: only fu=False works
        if unused is not None:
            raise PlanError(
                f"reentrant checkpointing cannot work under DDP here: {unused}. Use non-reentrant "
                "checkpointing (HF_DDPFIX_CHECKPOINTING=non_reentrant) or enable the VLM stabiliser"
            )
        if explicit:
            correct(f"find_unused_parameters=True ({source}) -> False: with reentrant checkpointing it fails "
                    "with 'Expected to mark a variable ready only once'")
        return Decision(False, "reentrant checkpointing: only find_unused=False works", changed=stock is not False)
    if (explicit is True and stabilized and not facts.conditional_params and unused is None
            and c.find_unused_parameters is None and not c.strict):
        corrections.append(
            "find_unused_parameters=True (ddp_find_unused_parameters) -> False: the VLM stabiliser uses every "
            "vision parameter every step, so the extra graph traversal buys nothing "
            "(HF_DDPFIX_FIND_UNUSED_PARAMETERS=1 forces it)"
        )
        return Decision(False, "stabiliser: every parameter is used every step", changed=stock is not False)
    if explicit is True:
        return Decision(True, f"explicit ({source})", changed=stock is not True)
    if c.find_unused_parameters is False and unused is not None:
        # a forced setting is a power-user choice (e.g. every batch has images): honoured, guarded
        return Decision(False, f"forced ({source}) although {unused}; the hang guard raises if ranks disagree",
                        changed=stock is not False)
    if explicit is False:
        if unused is not None:
            correct(f"find_unused_parameters=False ({source}) -> True: {unused}, which crashes or hangs DDP")
            return Decision(True, unused, changed=stock is not True)
        return Decision(False, f"explicit ({source})", changed=stock is not False)
    if unused is not None:
        return Decision(True, unused, changed=stock is not True)
    why = "every trainable parameter is used every step"
    if facts.is_peft and stock:
        why += " (stock picks True for every PeftModel: an extra graph traversal per step)"
    return Decision(False, why, changed=stock is not False)


def _decide_static_graph(
    facts: RunFacts, c: DDPFixConfig, ddp: bool, checkpointed: bool, unused: str | None, correct
) -> Decision:
    if not ddp:
        return Decision(None, "")
    stock = bool(facts.user_static_graph)
    # a failure known from the stock table forbids it; an env override disables it
    forbidden = None
    if facts.grad_accum_steps > 1:
        forbidden = (f"gradient_accumulation_steps={facts.grad_accum_steps} uses no_sync, which static graph "
                     "breaks (expect_autograd_hooks_ INTERNAL ASSERT)")
    elif unused is not None:
        forbidden = f"the graph changes between steps ({unused})"
    disabled = None
    if c.static_graph is False:
        disabled = f"disabled ({c.source('static_graph')})"
    elif checkpointed and c.static_graph_with_checkpointing is False:
        disabled = f"disabled with checkpointing ({c.source('static_graph_with_checkpointing')})"
    wanted = c.static_graph if c.static_graph is not None else facts.user_static_graph
    if forbidden:
        if wanted:
            src = "ddp_static_graph" if c.static_graph is None else c.source("static_graph")
            correct(f"static_graph=True ({src}) -> False: {forbidden}")
        return Decision(False, f"off: {forbidden}", changed=stock)
    if disabled:
        return Decision(False, disabled, changed=stock)
    if wanted is False:
        return Decision(False, "explicitly off", changed=stock)
    reason = "graph is fixed (every trainable parameter used every step, no accumulation)"
    return Decision(True, reason + ("" if wanted else ": DDP skips per-step graph search"), changed=not stock)


def _decide_offload(facts: RunFacts, c: DDPFixConfig, ckpt: str) -> Decision:
    requested = bool(facts.offload_requested) if c.offload_activations is None else bool(c.offload_activations)
    source = "activation_checkpointing_kwargs" if c.offload_activations is None else c.source("offload_activations")
    if not requested:
        return Decision(False, "not requested")
    if ckpt == "off":
        return Decision(False, f"requested ({source}) but checkpointing is off: nothing is saved to offload",
                        changed=bool(facts.offload_requested))
    if ckpt == "reentrant":
        return Decision(False, "requested but checkpointing is reentrant: the async offload hooks need non-reentrant",
                        changed=bool(facts.offload_requested))
    if not facts.accelerator_available:
        return Decision(False, "no-op: no accelerator, activations already live in host memory (nothing to "
                        "offload to; stock would crash in pin_memory)", changed=bool(facts.offload_requested))
    device_type = (facts.rank_device or "cuda").split(":")[0]
    if device_type not in ("cuda", "cpu", "meta"):  # ROCm reports "cuda" too; MPS, XPU, NPU, HPU do not
        if facts.offload_requested and c.offload_activations is None:
            return Decision("stock", f"on {device_type}: transformers' own offload kept (blocking save_on_cpu "
                            "copies); hf_ddpfix's asynchronous offload supports CUDA/ROCm only")
        return Decision(False, f"off on {device_type}: hf_ddpfix's asynchronous offload supports CUDA/ROCm only, "
                        "activations stay on the device", changed=bool(facts.offload_requested))
    mib = DEFAULT_OFFLOAD_MIN_LAYER_MIB if c.offload_min_layer_mib is None else int(c.offload_min_layer_mib)
    if mib == 0:
        policy = f"every step copies (offload_min_layer_mib=0, {c.source('offload_min_layer_mib')})"
    else:
        policy = (f"auto: a step copies checkpoint inputs >= {mib} MiB, or any when the device was >= 90% reserved; "
                  f"smaller ones stay (H100, 1.1B Llama: 1.57x step time at 8 MiB per layer, 1.08x at 32 MiB, "
                  f"0.99x at 64 MiB) ({c.source('offload_min_layer_mib')})")
    return Decision(True, f"async pinned-memory offload of checkpointed layer inputs ({source}); {policy}",
                    changed=True)


#: Offload policy default (MiB per checkpoint input): the smallest layer input at which offloading cost
#: nothing in the H100 measurement (2026-11-23, benchmarks/offload.py, BENCHMARKS.md): 1.57x step time at
#: 8 MiB (2K tokens x 2048 hidden x bf16), 1.08x at 32 MiB (8K), 0.99x at 64 MiB (16K), 1.01x at 128 MiB.
DEFAULT_OFFLOAD_MIN_LAYER_MIB = 64


def offload_min_layer_bytes(config: DDPFixConfig | None) -> int:
    """The offload policy's threshold in bytes for ``ActivationOffload(min_layer_bytes=...)``."""
    mib = None if config is None else config.offload_min_layer_mib
    return (DEFAULT_OFFLOAD_MIN_LAYER_MIB if mib is None else int(mib)) << 20


def _decide_hang_guard(
    facts: RunFacts, c: DDPFixConfig, ddp: bool, fu: bool, stabilized: bool, usage: bool = False
) -> Decision:
    if ddp and not fu and not usage and not facts.is_vlm and c.parameter_usage is False:
        if c.hang_guard is False:
            return Decision(False, f"disabled ({c.source('hang_guard')})")
        return Decision(True, "find_unused=False without parameter_usage: before each backward ranks check that "
                        "every trainable parameter gets a gradient (one all-gather of 1 byte per tensor)", True)
    if not (ddp and facts.is_vlm):
        return Decision(None, "")
    if not facts.trainable_vision_params:
        return Decision(False, "not needed: no trainable vision parameters")
    if fu or stabilized or usage:
        why = "find_unused=True" if fu else "stabiliser uses every parameter" if stabilized else (
            "parameter_usage ties every parameter in")
        return Decision(False, "not needed: " + why)
    if c.hang_guard is False:
        return Decision(False, f"disabled ({c.source('hang_guard')})")
    return Decision(True, "VLM without stabiliser under find_unused=False: ranks must agree on image use", True)


def _decide_tiled_mlp(facts: RunFacts, c: DDPFixConfig) -> Decision:
    value = c.tiled_mlp
    if value is None or value == "off":
        return Decision("off", "not requested" if value is None else f"off ({c.source('tiled_mlp')})")
    rule = {
        "auto": "no tiling below 8K tokens, then ceil(tokens/2048) shards",
        "arctic": "ceil(tokens/hidden) shards",
        "target": "shards so one shard's MLP intermediate fits the memory target",
    }.get(value.split(":")[0], f"{value} shards per MLP call")
    sync = ("; shard count all-reduced (MAX) so FSDP ranks gather alike, in training forwards only (under "
            "no_grad, e.g. a rank-0-only evaluation, the MLP runs untiled with no collective)"
            if facts.parallel == "fsdp" else "")
    return Decision(value, f"{rule}, one gradient hook per parameter ({c.source('tiled_mlp')}){sync}", True)


def _decide_long_context(facts: RunFacts, c: DDPFixConfig, ckpt: str) -> Decision:
    """Patched Llama-style layers (integrations/long_context.py): gradients equal stock (tests), every
    non-plain call (mask, cache, packing kwargs) runs stock at call time, other layer classes are left alone."""
    value = c.long_context
    if value is None or value == "off":
        return Decision("off", "not requested" if value is None else f"off ({c.source('long_context')})")
    notes = []
    if ckpt == "off":
        notes.append("checkpointing is off: each layer keeps q/k/v and the attention output (28 KiB/token on "
                     "Llama-8B) instead of only its input")
    if facts.parallel == "fsdp" and "tiled_layer" in value:
        notes.append("tile count all-reduced (MAX) so FSDP ranks gather alike")
    extra = ("; " + "; ".join(notes)) if notes else ""
    return Decision(value, f"Llama-style layers patched where source-identical to LlamaDecoderLayer, masked/cached "
                    f"calls run stock ({c.source('long_context')}){extra}", changed=True)


def _decide_tiled_loss(c: DDPFixConfig) -> Decision:
    value = c.tiled_loss
    if value is None or value == "off":
        return Decision("off", "not requested" if value is None else f"off ({c.source('tiled_loss')})")
    chunk = "auto chunk" if value == "on" else f"{value} tokens per chunk"
    return Decision(value, f"lm_head + cross-entropy in chunks, full logits never held, {chunk} "
                    f"({c.source('tiled_loss')})", changed=True)


# ----------------------------------------------------------------------------------------------------
# Quantized (bitsandbytes) weights and placement. Measured on CPU, 2 gloo processes, bitsandbytes 0.50.2,
# torch 2.13, transformers 5.23, accelerate 1.15, deepspeed 0.19.8 (2026-11-23; tests/test_quantized.py):
#   FSDP2 fully_shard, storage float32 + MixedPrecisionPolicy(param_dtype=bfloat16): the all-gather
#     value-casts the packed bytes -> "shape '[64, 64]' is invalid for input of size 2048" in the first
#     forward; storage bfloat16 + param_dtype bfloat16 and storage uint8 (never cast) train.
#   FSDP1 wrap of a uint8 weight: "Cannot flatten integer dtype tensors"; mixed float dtypes in one unit:
#     "Must flatten tensors with uniform dtype" (torch/distributed/fsdp/_flat_param.py).
#   ZeRO-3 + bf16 engine, storage float32: "shape '[64, 32]' is invalid for input of size 1024" at step 1;
#     storage bfloat16 or uint8: trains, each rank keeps 1/world of the 4-bit bytes.
#   DDP with an hf_device_map of several entries: accelerate's prepare raises "You can't train a model that
#     has been loaded with `device_map='auto'` in any distributed mode" (4-bit/8-bit: "... on multiple
#     devices"; on another rank's GPU: "... on a different device than the one you're training on"),
#     without the per-rank fix; a model without a device map is moved onto the rank's device.
# ----------------------------------------------------------------------------------------------------

_PLACEMENT_FIX = (
    'load each rank\'s model onto its own device: from_pretrained(..., device_map={"": local_rank}) with '
    "local_rank = int(os.environ['LOCAL_RANK']) (or accelerate.PartialState().process_index); for model "
    "parallelism over several GPUs launch ONE process (python train.py), not torchrun"
)


def _is_accelerator(device: str) -> bool:
    return device.split(":")[0] not in ("cpu", "disk", "meta")


def _check_placement(facts: RunFacts) -> None:
    """DDP needs each rank's whole model on that rank's device (`device_ids=[local_rank]`)."""
    if facts.parallel != "ddp" or not facts.placement:
        return
    devices = facts.placement
    where = ", ".join(devices)
    if len(devices) > 1:
        raise PlacementError(
            f"DDP needs each rank's whole model on one device, but this rank's model is placed on {where} "
            f"(device_map='auto' or a multi-device device_map on every rank turns DDP into per-rank model "
            f"parallelism, which DDP and accelerate refuse). Fix: {_PLACEMENT_FIX}."
        )
    rank = facts.rank_device
    if facts.quant is not None and rank and _is_accelerator(rank) and _is_accelerator(devices[0]) and devices[0] != rank:
        raise PlacementError(
            f"this rank trains on {rank} but its {facts.quant.describe()} model was loaded on {devices[0]} "
            f"(every rank loaded onto the same device; bitsandbytes weights cannot be moved afterwards). "
            f"Fix: {_PLACEMENT_FIX}."
        )


def _decide_quantization(facts: RunFacts) -> Decision:
    """Placement under DDP, and whether FSDP / ZeRO-3 can shard this run's bitsandbytes weights.

    Fires only for a model with bitsandbytes layers (`facts.quant`) or, under DDP, a model placed on
    several devices. Never changes a setting: it reports, or refuses a run that cannot work.

    Raises:
        PlacementError: DDP and this rank's model spans several devices, or a quantized model sits on
            another accelerator than this rank's.
        QuantStorageError: 4-bit weights under FSDP / ZeRO-3 whose storage dtype the engine casts or
            cannot flatten (see the measurements above).
    """
    _check_placement(facts)
    q = facts.quant
    if q is None:
        return Decision(None, "")
    what = q.describe()
    if facts.parallel == "single":
        return Decision(what, "single process: the quantized base stays as loaded")
    if facts.parallel == "ddp":
        device = facts.placement[0] if facts.placement else facts.rank_device
        on = f" on {device}" if device else ""
        return Decision(what, f"DDP: every rank holds the whole quantized base{on}; only adapter gradients are "
                        "all-reduced")
    if q.method != "bnb_4bit":
        return Decision(what, f"8-bit weights under {facts.parallel}: not checked by hf_ddpfix (stock behaviour)")
    if facts.parallel == "fsdp":
        return _quantized_fsdp(facts, q, what)
    return _quantized_zero(facts, q, what)


def _nbytes(q: QuantFacts) -> str:
    return f"{q.quant_bytes} bytes" if q.quant_bytes else "the 4-bit bytes"


def _storage_fix(dtype: str) -> str:
    return (f"load with BitsAndBytesConfig(..., bnb_4bit_quant_storage=torch.{dtype}) and "
            f"torch_dtype=torch.{dtype}")


def _quantized_fsdp(facts: RunFacts, q: QuantFacts, what: str) -> Decision:
    version = facts.fsdp_version or 2
    storage, cast = q.storage_dtype, facts.shard_cast_dtype
    if q.float_storage and cast is not None and cast != storage:
        raise QuantStorageError(
            f"FSDP{version} mixed precision casts parameters to {cast}, which would convert the packed 4-bit "
            f"bytes held in {storage} storage as numbers and garble every quantized weight (FSDP2 measured: "
            f"'shape ... is invalid for input of size ...' in the first forward). Fix: {_storage_fix(cast)}, "
            f"or turn mixed precision off (bf16=False, fp16=False)."
        )
    if version == 1:
        want = cast or (q.other_dtype if q.other_dtype and "+" not in q.other_dtype else None) or "bfloat16"
        if not q.float_storage:
            raise QuantStorageError(
                f"FSDP1 flattens each wrapped unit into one tensor and cannot flatten the {storage} 4-bit "
                f"weights ('Cannot flatten integer dtype tensors'). Fix: {_storage_fix(want)}, or use FSDP2 "
                f"(fsdp_config={{'version': 2}}, the transformers default)."
            )
        if q.other_dtype not in (None, storage):
            # not refused: which parameters share a unit is decided at wrap time (a unit without 4-bit
            # weights may hold another dtype); FSDP1 itself raises at wrap if one mixes them
            return Decision(what, f"FSDP1: 4-bit weights in {storage} storage but other parameters in "
                            f"{q.other_dtype}; FSDP1 raises 'Must flatten tensors with uniform dtype' at wrap if "
                            f"one unit mixes them (prepare_model_for_kbit_training upcasts norms to float32): keep "
                            f"every parameter in {storage}, or use FSDP2")
        return Decision(what, f"FSDP1: 4-bit weights sharded in {storage} storage, flattened with the "
                        "other parameters without a cast")
    if not q.float_storage:
        return Decision(what, f"FSDP2: {storage} 4-bit weights are not a floating dtype, so accelerate keeps "
                        f"them out of sharding (every rank holds all {_nbytes(q)}); to shard them "
                        f"{_storage_fix(cast or 'bfloat16')}")
    return Decision(what, f"FSDP2: 4-bit weights sharded in {storage} storage (each rank holds 1/world of "
                    f"{_nbytes(q)}), all-gathered without a cast")


def _quantized_zero(facts: RunFacts, q: QuantFacts, what: str) -> Decision:
    stage = facts.zero_stage
    if stage != 3:
        return Decision(what, f"DeepSpeed ZeRO-{stage}: the quantized base is not partitioned (every rank "
                        "holds all of it)")
    storage, cast = q.storage_dtype, facts.shard_cast_dtype
    if q.float_storage and cast is not None and cast != storage:
        raise QuantStorageError(
            f"DeepSpeed casts the model to {cast} (its bf16/fp16 setting), which would convert the packed 4-bit "
            f"bytes held in {storage} storage as numbers (measured: 'shape ... is invalid for input of size "
            f"...' at step 1). Fix: {_storage_fix(cast)}."
        )
    return Decision(what, f"ZeRO-3 partitions the 4-bit weights ({storage} storage, not cast; each rank holds "
                    f"1/world of {_nbytes(q)})")


def _unverified_under_zero3(facts: RunFacts, decision: Decision) -> Decision:
    """Stock computation for opt-in features not verified under ZeRO-3 (see deepspeed_plan.zero3_unverified)."""
    from .integrations.deepspeed_plan import zero3_unverified

    return zero3_unverified(facts, decision)
