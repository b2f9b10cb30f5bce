"""The plan's types: what a run is (`RunFacts`), what hf_ddpfix decides for it (`Decision`, `Plan`), and
the errors raised before training (`PlanError` and its kinds).

This module imports no rule module: the rules (`ddp`, `memory`, `quantized`, `deepspeed` in this package)
import these types, and `hf_ddpfix.plan.resolve.resolve_plan` imports the rules. Nothing here imports
torch or touches a process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # the plan stays free of torch at run time; the facts type lives with its gatherer
    from ..integrations.deepspeed.zero import DeepSpeedFacts
    from ..integrations.fsdp.units import FsdpFacts
    from ..integrations.long_context.layer_kinds import LayerKind
    from ..integrations.quantized import QuantFacts
    from ..integrations.sequence_parallel.facts import SequenceParallelFacts

ParallelMode = Literal["single", "ddp", "fsdp", "deepspeed"]
CheckpointMode = Literal["off", "reentrant", "non_reentrant"]

#: How a rule reports that it overrides an explicit user setting known to fail: the message is listed in
#: `Plan.corrections`, or, in strict mode, raised as `PlanError` before training.
Correct = Callable[[str], None]


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
class MemoryFacts:
    """What the `auto` memory plan (`hf_ddpfix.plan.memory_fit`) reads about one device's step.

    Attributes:
        device_total_bytes: the training device's memory, `None` when unknown (no accelerator).
        tokens: the longest tokens per micro-batch on this device (max sequence length x micro-batch size),
            `None` when the run names no length; `tokens_source` says where it was read.
        layers / hidden / vocab: the decoder's layer count, hidden size and vocabulary (text config).
        dtype_bytes: bytes per activation element (2: bf16/fp16 autocast).
        fixed_bytes: device bytes that do not grow with tokens (weights, trainable gradients and AdamW state:
            an estimate), `None` when unknown (e.g. weights sharded by FSDP / ZeRO).
        host_budget_bytes: pinned host memory the offload may hold (the pool's cap), `None`: unknown.
        unknown: why the gatherer could not read a fact ("" when it read them all).
    """

    device_total_bytes: int | None = None
    tokens: int | None = None
    tokens_source: str = ""
    layers: int | None = None
    hidden: int | None = None
    vocab: int | None = None
    dtype_bytes: int = 2
    fixed_bytes: int | None = None
    host_budget_bytes: int | None = None
    unknown: str = ""


@dataclass(frozen=True)
class RunFacts:
    """What the plan needs to know about a run. Gathered by `hf_ddpfix.facts.gather`, or built by hand in tests.

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
        host_memory_bytes / local_processes: this node's physical memory and its training processes.
        quant: bitsandbytes weights in the model (`hf_ddpfix.integrations.quantized.QuantFacts`), or `None`.
        placement: the distinct devices `hf_device_map` places this rank's model on, e.g. ("cuda:0",);
            empty without a device map (accelerate then moves the model onto the rank's device).
        rank_device: the device this rank trains on (`TrainingArguments.device`), e.g. "cuda:1".
        fsdp_version: 1 or 2 under FSDP, else `None`.
        shard_cast_dtype: the dtype FSDP's mixed precision (`param_dtype`) or DeepSpeed's bf16/fp16 casts
            floating parameters to, `None` when nothing is cast.
        zero_stage: the DeepSpeed ZeRO stage, `None` without DeepSpeed.
        checkpoint_function: the checkpoint function(s) a trainer or tool installed on the model, as read
            (e.g. "custom -> partial(checkpoint, use_reentrant=False) -> checkpoint (torch checkpoint,
            non-reentrant)"), `None` when the layers run transformers' own.
        loss_unseen: why hf_ddpfix cannot see the loss the trainer back-propagates (a ``training_step``
            override that does not call the stock one, a ``compute_loss`` / ``training_step`` that calls
            ``backward`` itself), `None` when every loss passes through ``accelerator.backward``.
        fsdp: the wrap facts of an FSDP run (`hf_ddpfix.integrations.fsdp.FsdpFacts`), `None` otherwise.
        deepspeed: version, offload, MoE blocks, dtypes of a DeepSpeed run
            (`hf_ddpfix.integrations.deepspeed.zero.DeepSpeedFacts`), `None` without DeepSpeed.
        memory: device memory, tokens per step and model sizes for the `auto` memory options
            (`MemoryFacts`), `None` when not gathered (no accelerator: today's `auto` rules apply).
        long_context_layers: the decoder layers by type with the long-context layer patch's verdict for each
            (`integrations.long_context.layer_kinds.layer_kinds`, by structure: the run and `hf-ddpfix plan` read
            the same), `None` when not read.
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
    host_memory_bytes: int | None = None  # physical memory of this node (None: unknown)
    local_processes: int = 1  # training processes on this node (LOCAL_WORLD_SIZE)
    quant: QuantFacts | None = None
    placement: tuple[str, ...] = ()
    rank_device: str | None = None
    fsdp_version: int | None = None
    shard_cast_dtype: str | None = None
    zero_stage: int | None = None
    deepspeed: DeepSpeedFacts | None = None
    fsdp: FsdpFacts | None = None
    sequence_parallel: SequenceParallelFacts | None = None  # attention and heads (plan/sequence_parallel.py)
    loss_unseen: str | None = None
    checkpoint_function: str | None = None
    memory: MemoryFacts | None = None
    long_context_layers: tuple[LayerKind, ...] | None = None

    def stock_find_unused(self) -> bool:
        """What stock `Trainer._build_accelerator_args` picks (REFERENCES.md §1)."""
        if self.user_find_unused is not None:
            return self.user_find_unused
        if self.is_peft:
            return True  # a PeftModel is not a PreTrainedModel
        return self.checkpointing == "off"


#: The longest line `Plan.report()` prints: a terminal's width. A longer line is cut at a clause boundary and ends
#: with a link to its section of docs/plan.md (one anchor per decision, tests/test_plan_report_width.py); the full
#: reason stays in `Decision.reason` (and `hf-ddpfix plan --json`).
REPORT_WIDTH = 160
PLAN_DOC = "docs/plan.md"


def fit_line(line: str, anchor: str, width: int = REPORT_WIDTH) -> str:
    """``line`` if it fits ``width`` characters, else its longest head that ends at a clause boundary (``; ``,
    ``: ``, ``, ``, else a space, within its last quarter; else where the width ends), its open parentheses
    closed, then `` … (docs/plan.md#<anchor>)``.

    Guarantees: the result has at most ``width`` characters (a link longer than the room aside) and starts with
    the same text as ``line``; a line that fits is returned unchanged."""
    if len(line) <= width:
        return line
    link = f" … ({PLAN_DOC}#{anchor})"
    head = line[: max(width - len(link), 0)]
    unclosed = 0
    for _ in range(8):  # room for the closing parentheses: at most a few rounds
        room = max(width - len(link) - unclosed, 0)
        head = line[:room]
        clause, space = max(head.rfind(sep) for sep in ("; ", ": ", ", ")), head.rfind(" ")
        # a clause boundary, else a space, unless either drops more than a quarter: then the characters that fit
        cut = clause if clause > room * 3 // 4 else space if space > room * 3 // 4 else room
        head = head[:cut].rstrip(" ,;:")
        if max(head.count("(") - head.count(")"), 0) <= unclosed:
            break
        unclosed = head.count("(") - head.count(")")
    return head + ")" * max(head.count("(") - head.count(")"), 0) + link


@dataclass(frozen=True)
class Decision:
    """One decision: its value, why, and whether it differs from what the stock stack does.

    Attributes:
        value: `None` (the decision does not arise for this run), `False` (off), or `True` / a string
            naming how it is on; see `Plan` for the convention.
        reason: one line saying why; "" exactly when `value` is `None`.
        changed: the value differs from what the stock stack does.
        details: lines the report prints under the decision's line (``long_context``: one per decoder layer type,
            with its count and verdict); empty for most decisions.
    """

    value: Any
    reason: str
    changed: bool = False
    details: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The value as the plan log prints it: "off" for `False`, "on" for `True`, else the value."""
        if isinstance(self.value, bool):
            return "on" if self.value else "off"
        return str(self.value)


@dataclass(frozen=True)
class Plan:
    """What hf_ddpfix does for a run. Applied by `hf_ddpfix.runtime.attach`; printed by `report()`.

    One spelling of "off". Every decision field holds a `Decision` whose `value` is
      - `None`: the decision does not arise for this run (DDP flags outside DDP, the VLM stabiliser for a
        text model, the quantization line without quantized weights); its reason is "" and `report()`
        leaves it out;
      - `False`: off (the feature is not applied, the DDP flag is False), always with its reason;
      - `True`, or a non-empty string naming how it is on ("non_reentrant", "auto", "ZeRO-3", "stock", ...).
    So `if plan.<field>.value:` reads "on" for every field; no field spells off as "off", "none" or "".
    `report()` prints `False` as "off" and `True` as "on" (`Decision.text`).
    """

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
    sequence_parallel: Decision = Decision(None, "")
    vlm_eval_sync: Decision = Decision(None, "")
    eval_outputs: Decision = Decision(None, "")
    fsdp_units: Decision = Decision(None, "")
    fsdp_skippable: Decision = Decision(None, "")
    fsdp_shared: Decision = Decision(None, "")
    zero_skip_unused: Decision = Decision(None, "")
    corrections: tuple[str, ...] = ()
    config_lines: tuple[str, ...] = field(default=())
    #: option -> "asked ... (<where>): <why>" for every option asked on explicitly that this plan does not run
    #: (plan/asked.py); the report marks each with `!`, the run logs one warning listing them.
    not_applied: dict[str, str] = field(default_factory=dict)
    offload_min_layer_bytes: int = 0  # the offload policy's threshold (ActivationOffload(min_layer_bytes=))
    offload_max_pool_bytes: int | str | None = "default"  # the host pool's cap (ActivationOffload(max_pool_bytes=))

    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `DistributedDataParallel` (via accelerate's `DistributedDataParallelKwargs`)."""
        if self.parallel != "ddp":
            return {}
        return {
            "find_unused_parameters": bool(self.find_unused_parameters.value),
            "static_graph": bool(self.static_graph.value),
        }

    def decisions(self) -> dict[str, Decision]:
        """Every decision field by name, in the order the report lists them."""
        return {
            "checkpointing": self.checkpointing,
            "fsdp_units": self.fsdp_units,
            "fsdp_skippable": self.fsdp_skippable,
            "fsdp_shared": self.fsdp_shared,
            "parameter_usage": self.parameter_usage,
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "offload_activations": self.offload_activations,
            "vlm_stabilizer": self.vlm_stabilizer,
            "vlm_eval_sync": self.vlm_eval_sync,
            "eval_outputs": self.eval_outputs,
            "hang_guard": self.hang_guard,
            "tiled_mlp": self.tiled_mlp,
            "tiled_loss": self.tiled_loss,
            "long_context": self.long_context,
            "sequence_parallel": self.sequence_parallel,
            "quantization": self.quantization,
            "deepspeed": self.deepspeed,
            "zero3_leaf_modules": self.zero3_leaf_modules,
            "zero_skip_unused": self.zero_skip_unused,
        }

    def with_attach_fallbacks(self, fallbacks: dict[str, str]) -> Plan:
        """This plan with the decisions in ``fallbacks`` (field name -> reason) turned off because the
        runtime found, when it attached them (before step 1), that they cannot run for this model: what the
        report then prints is what executes. A field that is not on, or not a decision, is left as it is;
        the correction is listed under ``corrected:`` as well.

        Guarantees: pure; the plan is unchanged when ``fallbacks`` is empty (tests/test_feature_report.py).
        """
        decisions = self.decisions()
        changes = {name: Decision(False, f"requested ({decisions[name].text}) but stock behaviour: at attach time, "
                                         f"before step 1: {reason}")
                   for name, reason in fallbacks.items() if name in decisions and decisions[name].value}
        if not changes:
            return self
        notes = tuple(f"{name}: {decisions[name].text} -> off at attach time ({fallbacks[name]})" for name in changes)
        return replace(self, **changes, corrections=self.corrections + notes)

    def report(self, width: int | None = REPORT_WIDTH) -> str:
        """Multi-line, human-readable plan: every decision, `*` marks what differs from stock, `!` an option
        asked on that does not run (with its reason; options that are no decision get a line of their own).

        Guarantees: every line fits `width` (default `REPORT_WIDTH`; `None`: the whole reasons, uncut); a cut one
        links its section of docs/plan.md (`fit_line`)."""

        def fit(line: str, anchor: str) -> str:
            return line if width is None else fit_line(line, anchor, width)

        lines = [f"hf_ddpfix plan ({self.parallel}, world size {self.world_size}):"]
        decisions = self.decisions()
        for name, d in decisions.items():
            if d.value is None:
                continue
            mark = "!" if name in self.not_applied else "*" if d.changed else " "
            lines.append(fit(f" {mark} {name:<23} = {d.text:<14} {d.reason}", name))
            lines.extend(fit(f"{'':28}{detail}", name) for detail in d.details)
        for name, text in self.not_applied.items():
            if name not in decisions:
                lines.append(fit(f" ! {name:<23} = {'off':<14} {text}", "asked-for-not-applied"))
        for c in self.corrections:
            lines.append(fit(f"   corrected: {c}", "corrected"))
        if self.config_lines:
            lines.append(fit("   settings: " + "; ".join(self.config_lines), "settings"))
        return "\n".join(lines)
