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

from ..config.options import DDPFixConfig
from .asked import mark_not_applied
from .checkpointing import decide_checkpointing
from .ddp import decide_ddp
from .deepspeed import decide_deepspeed
from .evaluation import decide_eval_outputs
from .fsdp import decide_fsdp
from .memory import decide_memory
from .quantized import decide_quantization
from .sequence_parallel import decide_sequence_parallel, sp_size_of
from .types import CheckpointMode, Plan, PlanError, RunFacts
from .usage import decide_parameter_usage
from .vision import decide_vision

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
    # each rule module is visited once, in this order (a later decision reads the earlier ones)
    sequence_parallel = decide_sequence_parallel(facts, c)  # raises PlanError: cannot work (before training)
    sp_size = sp_size_of(sequence_parallel.value)  # ranks sharing one sequence (1: none)
    quantization = decide_quantization(facts)  # raises PlacementError / QuantStorageError: cannot work
    ckpt = decide_checkpointing(facts, c, distributed, correct)
    mode: CheckpointMode = ckpt.value or "off"  # the rules below read the variant as a mode string
    checkpointed = bool(ckpt.value) or bool(c.assume_checkpointing)
    usage = decide_parameter_usage(facts, c, mode)
    units, skippable, shared = decide_fsdp(facts, c)  # raises PlanError: accelerate's cpu_ram_efficient_loading
    stabilizer, eval_sync = decide_vision(facts, c, distributed, units, usage, skippable)
    fu, static, guard = decide_ddp(facts, c, mode, checkpointed, stabilizer, usage, correct)
    memory = decide_memory(facts, c, mode, sp_size)
    deepspeed, leaf_modules, skip_unused = decide_deepspeed(facts, c)
    plan = Plan(
        parallel=facts.parallel,
        world_size=facts.world_size,
        checkpointing=ckpt,
        find_unused_parameters=fu,
        static_graph=static,
        offload_activations=memory.offload_activations,
        vlm_stabilizer=stabilizer,
        vlm_eval_sync=eval_sync,
        eval_outputs=decide_eval_outputs(facts, c),
        fsdp_units=units,
        fsdp_skippable=skippable,
        fsdp_shared=shared,
        hang_guard=guard,
        tiled_mlp=memory.tiled_mlp,
        tiled_loss=memory.tiled_loss,
        sequence_parallel=sequence_parallel,
        long_context=memory.long_context,
        quantization=quantization,
        parameter_usage=usage,
        deepspeed=deepspeed,
        zero3_leaf_modules=leaf_modules,
        zero_skip_unused=skip_unused,
        corrections=tuple(corrections),
        config_lines=tuple(c.describe()),
        offload_min_layer_bytes=memory.offload_min_layer_bytes,
        offload_max_pool_bytes=memory.offload_max_pool_bytes,
    )
    return mark_not_applied(plan, facts, c)  # options asked on that do not run: said, never dropped
