"""The sequence-parallel decision: N ranks share one sequence (Ulysses all-to-all attention), the
data-parallel degree is world / N, every rank holds H/N query heads of the full sequence.

Pure: facts in, a `Decision` out, or a `PlanError` before training when the combination cannot work:

| setting                                         | why it cannot work                         | the fix                     |
|-------------------------------------------------|--------------------------------------------|-----------------------------|
| world size not a multiple of N                  | SP groups of N ranks tile the world        | N dividing the world size   |
| attention "eager" (or not through the interface)| eager is called directly, never wrapped    | attn_implementation="sdpa"  |
| H % N != 0 / KV heads neither divisible nor replicable | heads are what the all-to-all splits | N dividing the head count   |
| FSDP / single process                           | Trainer path tested under DDP only (below) | DDP, or DeepSpeed's engine  |

FSDP2: the Ulysses attention and the token-sum loss are exact under torch's `fully_shard` (tests/scripts/
sp_parity.py: loss and gathered gradients vs one process <= 1e-7, 2 and 4 gloo ranks), with parameters
sharded over the whole world (DP x SP, one flat mesh): SP ranks hold different tokens of the same samples, so
their gradients are summed exactly as DP ranks' are, and one reduce-scatter over all ranks does both (a
DP-only mesh would replicate every shard N times and need a second all-reduce over the SP group). The
Trainer path under FSDP is not built: accelerate runs FSDP only with an accelerator, so it cannot be tested
here, and the rule is not to switch on what is not checked. The PlanError says so and names the loop-level
route (`fully_shard` + `sharded_causal_lm_loss`).

DeepSpeed with `ParallelismConfig(sp_size=N)` is DeepSpeed's own engine: the plan records it ("deepspeed")
and changes nothing (hf_ddpfix's loss fixes there are not built yet). accelerate 1.15 knows only
`sp_backend="deepspeed"`: outside DeepSpeed the plan leaves it to accelerate (off, with the reason naming
`HF_DDPFIX_SEQUENCE_PARALLEL`); a backend other than DeepSpeed's (a later accelerate) is honoured here.
"""

from __future__ import annotations

from ..config import DDPFixConfig
from .types import Decision, PlanError, RunFacts

__all__ = ["decide_sequence_parallel", "sp_size_of"]


def sp_size_of(value: object) -> int:
    """N from the decision's value ("N=2 ..."); 1 when off."""
    if not value or not isinstance(value, str):
        return 1
    return int(value.split()[0].removeprefix("N="))


def decide_sequence_parallel(facts: RunFacts, config: DDPFixConfig) -> Decision:
    """Raises:
        PlanError: sequence parallelism asked for in a combination that cannot work (table above), naming
            the setting and the fix.
    """
    sp = facts.sequence_parallel
    n, source = config.sequence_parallel, config.source("sequence_parallel")
    if sp is not None and sp.parallelism_sp_size and sp.parallelism_sp_size > 1:
        if facts.parallel == "deepspeed":
            return Decision("deepspeed", f"ParallelismConfig(sp_size={sp.parallelism_sp_size}, sp_backend="
                            f"{sp.parallelism_sp_backend!r}): DeepSpeed's own Ulysses engine, left as stock")
        if sp.parallelism_sp_backend == "deepspeed" and n is not None:
            raise PlanError(f"sequence_parallel={n} ({source}) and ParallelismConfig(sp_size={sp.parallelism_sp_size}"
                            ", sp_backend='deepspeed') both ask for sequence parallelism outside DeepSpeed; drop "
                            "the parallelism_config (hf_ddpfix's Ulysses runs under DDP)")
        if sp.parallelism_sp_backend == "deepspeed":  # accelerate 1.15 knows no other backend
            return Decision(False, f"ParallelismConfig(sp_size={sp.parallelism_sp_size}) names DeepSpeed's engine "
                            f"but the run is {facts.parallel}: left to accelerate as stock; for hf_ddpfix's "
                            f"Ulysses under DDP set HF_DDPFIX_SEQUENCE_PARALLEL={sp.parallelism_sp_size} instead")
        if n is not None and n != sp.parallelism_sp_size:
            raise PlanError(f"sequence_parallel={n} ({source}) contradicts ParallelismConfig(sp_size="
                            f"{sp.parallelism_sp_size}); set one of them")
        n, source = sp.parallelism_sp_size, "ParallelismConfig.sp_size"
    if n is None:
        return Decision(None, "")
    if n == 1:
        return Decision(False, f"sequence_parallel=1 ({source}): every rank holds whole sequences")
    where = f"sequence_parallel={n} ({source})"
    if facts.parallel != "ddp":
        fsdp = (" (under FSDP2 the attention and loss are exact in your own loop: torch's fully_shard over all "
                "ranks + hf_ddpfix.integrations.sequence_parallel.sharded_causal_lm_loss; the Trainer path under "
                "FSDP is not tested, so not switched on)") if facts.parallel == "fsdp" else ""
        raise PlanError(f"{where}: hf_ddpfix's Ulysses sequence parallelism runs in the Trainer under DDP only (this "
                        f"run: {facts.parallel}, world size {facts.world_size}){fsdp}; launch with torchrun on N or "
                        "more processes without FSDP, or use DeepSpeed's engine (ParallelismConfig(sp_backend='deepspeed'))")
    if facts.world_size % n:
        raise PlanError(f"{where}: the world size {facts.world_size} is not a multiple of {n}; "
                        f"use a sequence_parallel that divides {facts.world_size}")
    impl = sp.attn_implementation if sp else None
    if impl != "sdpa":
        raise PlanError(f"{where}: attention implementation {impl!r} cannot be sharded (eager attention is called "
                        "directly by the model, never through the attention interface); load the model with "
                        "attn_implementation='sdpa'")
    heads, kv = (sp.num_heads, sp.num_kv_heads) if sp else (None, None)
    if not heads or not kv:
        raise PlanError(f"{where}: the model's config names no num_attention_heads; sequence parallelism needs it")
    from ..ops.sequence_parallel.ulysses import kv_replication  # pure arithmetic (the op's own rule)

    try:
        f = kv_replication(heads, kv, n)
    except ValueError as err:
        raise PlanError(f"{where}: {err}; choose a sequence_parallel that divides {heads}") from err
    dp = facts.world_size // n
    kv_text = f"{kv} KV heads replicated x{f}" if f > 1 else f"{kv * 1 // n} KV heads/rank"
    return Decision(f"N={n} DP={dp}", f"{source}: {heads // n} of {heads} heads/rank ({kv_text}) on the full "
                    f"sequence, L/{n} tokens/rank elsewhere; {dp} data-parallel group(s)", changed=True)
