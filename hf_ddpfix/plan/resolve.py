"""`resolve_plan(facts, config) -> Plan`: every decision for a run, as a pure function.

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

from dataclasses import replace

from ..config import DDPFixConfig
from . import ddp as ddp_rules
from . import deepspeed as ds_rules
from . import memory, quantized, vision
from .asked import mark_not_applied
from .evaluation import decide_eval_outputs
from .fsdp import (
    check_fsdp_loading,
    decide_fsdp_shared,
    decide_fsdp_skippable,
    decide_fsdp_units,
    fsdp_vision_decisions,
)
from .sequence_parallel import decide_sequence_parallel, sp_size_of
from .types import CheckpointMode, Plan, PlanError, RunFacts

__all__ = ["resolve_plan"]


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
        PlacementError: DDP with this rank's model spread over several devices (see `quantized.decide_quantization`).
        QuantStorageError: FSDP / ZeRO-3 with 4-bit weights in a storage dtype the engine would break.
    """
    c = config or DDPFixConfig()
    strict = bool(c.strict)
    corrections: list[str] = []

    def correct(message: str) -> None:  # a `Correct`
        if strict:
            raise PlanError(f"{message} (strict mode: set HF_DDPFIX_STRICT=0 to let hf_ddpfix correct it)")
        corrections.append(message)

    distributed = facts.parallel in ("ddp", "fsdp")
    ddp = facts.parallel == "ddp"

    sequence_parallel = decide_sequence_parallel(facts, c)  # raises PlanError: cannot work (before training)
    quantization = quantized.decide_quantization(facts)  # raises PlacementError / QuantStorageError: cannot work
    ckpt = ddp_rules.decide_checkpointing(facts, c, distributed, correct)
    mode: CheckpointMode = ckpt.value or "off"  # the rules below read the variant as a mode string
    checkpointed = bool(ckpt.value) or bool(c.assume_checkpointing)
    usage = ddp_rules.decide_parameter_usage(facts, c, mode)
    loading = check_fsdp_loading(facts)  # raises PlanError: accelerate's cpu_ram_efficient_loading cannot prepare it
    skippable = decide_fsdp_skippable(facts, c)
    units = decide_fsdp_units(facts, c, skippable)
    if loading and units.value is not None:  # what the run does for persistent buffers under that loading
        units = replace(units, reason=f"{units.reason}; {loading}")
    stabilizer = ddp_rules.decide_stabilizer(facts, c, distributed, bool(usage.value))
    eval_sync = vision.decide_eval_sync(facts, c)
    fsdp_vision = fsdp_vision_decisions(facts, units, usage, skippable)
    if fsdp_vision is not None:
        stabilizer, eval_sync = fsdp_vision
    unused_reason = ddp_rules.unused_reason(facts, bool(stabilizer.value), usage)
    fu = ddp_rules.decide_find_unused(facts, c, ddp, mode, unused_reason, bool(stabilizer.value), correct, usage)
    static = ddp_rules.decide_static_graph(facts, c, ddp, checkpointed, unused_reason, correct)
    offload = memory.decide_offload(facts, c, mode)
    fit = memory.decide_memory_fit(  # the `auto` memory options (plan/memory_fit.py)
        facts, c, mode, offload, sp_size_of(sequence_parallel.value))
    if c.offload_activations == "auto":
        offload = memory.decide_offload(facts, c, mode, fit)
    guard = ddp_rules.decide_hang_guard(facts, c, ddp, bool(fu.value), bool(stabilizer.value), bool(usage.value))
    plan = Plan(
        parallel=facts.parallel,
        world_size=facts.world_size,
        checkpointing=ckpt,
        find_unused_parameters=fu,
        static_graph=static,
        offload_activations=offload,
        vlm_stabilizer=stabilizer,
        vlm_eval_sync=eval_sync,
        eval_outputs=decide_eval_outputs(facts, c),
        fsdp_units=units,
        fsdp_skippable=skippable,
        fsdp_shared=decide_fsdp_shared(facts),
        hang_guard=guard,
        # opt-in tiling reads partitioned (empty) weights under ZeRO-3: not verified there, stock kept
        tiled_mlp=ds_rules.zero3_unverified(facts, memory.decide_tiled_mlp(facts, c, fit)),
        tiled_loss=ds_rules.zero3_unverified(facts, memory.decide_tiled_loss(facts, c, fit)),
        sequence_parallel=sequence_parallel,
        long_context=ds_rules.zero3_unverified(facts, memory.decide_long_context(facts, c, mode, fit)),
        quantization=quantization,
        parameter_usage=usage,
        deepspeed=ds_rules.engine(facts),
        zero3_leaf_modules=ds_rules.leaf_modules(facts),
        zero_skip_unused=ds_rules.skip_unused(facts, c),
        corrections=tuple(corrections),
        config_lines=tuple(c.describe()),
        offload_min_layer_bytes=memory.offload_min_layer_bytes(c),
        offload_max_pool_bytes=memory.offload_max_pool_bytes(facts, c),
    )
    return mark_not_applied(plan, facts, c)  # options asked on that do not run: said, never dropped
