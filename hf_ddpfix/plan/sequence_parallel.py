"""The sequence-parallel decision: N ranks share one sequence (Ulysses all-to-all attention), the
data-parallel degree is world / N, every rank holds H/N query heads of the full sequence.

Pure: facts in, a `Decision` out, or a `PlanError` before training when the combination cannot work:

| setting                                         | why it cannot work                         | the fix                     |
|-------------------------------------------------|--------------------------------------------|-----------------------------|
| world size not a multiple of N                  | SP groups of N ranks tile the world        | N dividing the world size   |
| attention "eager" (or not through the interface)| eager is called directly, never wrapped    | attn_implementation="sdpa"  |
| H % N != 0 / KV heads neither divisible nor replicable | heads are what the all-to-all splits | N dividing the head count   |
| single process                                  | no other rank to share the sequence with   | DDP, FSDP2 or DeepSpeed ZeRO |
| a VLM whose images do not enter the decoder's `inputs_embeds` (cross-attention: Mllama), or M-RoPE outside `SEQUENCE_PARALLEL_VISION_FAMILIES` | its image inputs / positions would be cut blindly | train it without SP |
| a VLM under DeepSpeed ZeRO-1 / ZeRO-3 or FSDP   | the VLM path is tested under DDP and ZeRO-2 | DDP or ZeRO-2              |
| a MoE router loss (`output_router_logits`)      | a per-slice load-balancing loss is not the sequence's | output_router_logits=False |
| a model without an LM head whose decoder is not found / not causal, or a VLM | the head-whole route cannot run it | train it without SP |
| a non-stock loss on a VLM                       | the VLM outputs are not made whole yet     | the stock loss, or no SP    |
| decoder layers whose token mixer is no attention (Qwen3.5 / Qwen3-Next gated delta nets, Mamba) | a recurrent scan over the whole sequence: each rank would scan its slice alone | train it without SP |

The loss route (`integrations.sequence_parallel.facts.sequence_parallel_loss_route`, docs/sequence-parallel-
losses.md) is said in the reason: "loss sharded" (stock loss, token sums per slice), "loss gathered" (the
trainer's own compute_loss on outputs made whole across the group) or "loss head-whole" (a model without an LM
head: the decoder sharded, its last hidden state gathered under the model's own head and pooling).

FSDP2: the Ulysses attention and the token-sum loss are exact under torch's `fully_shard` (tests/scripts/
sp_parity.py: loss and gathered gradients vs one process, 2 and 4 gloo ranks), with parameters sharded over
the whole world (DP x SP, one flat mesh): SP ranks hold different tokens of the same samples, so their
gradients are summed exactly as DP ranks' are, and one reduce-scatter over all ranks does both (a DP-only
mesh would replicate every shard N times and need a second all-reduce over the SP group). The Trainer path
under accelerate's FSDP2 is the DDP one (the group's batches exchanged in `compute_loss`, the stock loss scale;
FSDP2's reduce-scatter averages over the world as DDP's all-reduce does): tests/test_fsdp_features.py trains a
LoRA Llama with N=2 through `accelerate launch --config_file fsdp.yaml` bit-equal to the same run under DDP,
which tests/test_sequence_parallel.py checks against one process, and at 4 processes DP2 x SP2 and N=4 against
one process on the whole global batch (weights, each step's loss and gradient norm). The token count is the
Trainer's `num_items_in_batch` gathered over the world: each rank's loader gives its own batch, so it counts every
token once although each SP group trains its ranks' batches together. A VLM under FSDP is refused (tested under DDP
only), as under ZeRO.

The switch is `sequence_parallel=N` (`patch_trainer`, `HF_DDPFIX_SEQUENCE_PARALLEL`) or the ecosystem's own,
`TrainingArguments(parallelism_config=ParallelismConfig(sp_size=N))` (accelerate >= 1.12); both mean hf_ddpfix's
Ulysses, and two different N are a `PlanError` naming both. Under DeepSpeed ZeRO hf_ddpfix's Ulysses replaces
DeepSpeed's own engine (`sp_backend="deepspeed"`): DeepSpeed then sees plain data parallelism over the whole
world, which every ZeRO stage and `reduce_scatter` setting averages the same way, so the token-sum loss is
exact by the same argument as under DDP. DeepSpeed's engine divides its gradients by world/N on ZeRO-0/1/2
and on ZeRO-3 without reduce-scatter but by the world on ZeRO-3 with it (every update N x too large on the
former), and its loss is a mean of per-micro-batch means (tests/scripts/sp_deepspeed.py measures both).
Only where hf_ddpfix's attention cannot reach the model's (not sdpa) is DeepSpeed's engine left to run as
stock, with those gaps named in the reason. An accelerate without `ParallelismConfig` is said in the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config.options import DDPFixConfig
from .types import Decision, PlanError, RunFacts

if TYPE_CHECKING:
    from ..integrations.sequence_parallel.facts import SequenceParallelFacts

__all__ = ["decide_sequence_parallel", "sp_size_of"]


def sp_size_of(value: object) -> int:
    """N hf_ddpfix shards by, from the decision's value ("N=2 ..."); 1 when off or "deepspeed" (DeepSpeed's own
    Ulysses engine runs, hf_ddpfix shards nothing)."""
    if not value or not isinstance(value, str) or value == "deepspeed":
        return 1
    return int(value.split()[0].removeprefix("N="))


_DS_GAPS = ("its updates are sp_size x too large on ZeRO-0/1/2 and on ZeRO-3 without reduce_scatter, and its "
            "loss over gradient accumulation and data parallel is a mean of per-micro-batch means")


def _reaches_attention(sp: SequenceParallelFacts) -> bool:
    """hf_ddpfix's Ulysses wraps the model's attention: sdpa, and DeepSpeed's handler (if set) names it too."""
    return sp.attn_implementation == "sdpa" and sp.parallelism_sp_attn in (None, "sdpa")


def decide_sequence_parallel(facts: RunFacts, config: DDPFixConfig) -> Decision:
    """Raises:
        PlanError: sequence parallelism asked for in a combination that cannot work (table above), naming
            the setting and the fix.
    """
    sp = facts.sequence_parallel
    n, source = config.sequence_parallel, config.source("sequence_parallel")
    pc_n = sp.parallelism_sp_size if sp is not None and (sp.parallelism_sp_size or 1) > 1 else None
    from_pc = False
    if sp is not None and pc_n is not None:
        if n is not None and n != pc_n:
            raise PlanError(f"sequence_parallel={n} ({source}) contradicts ParallelismConfig(sp_size={pc_n}) "
                            "(TrainingArguments.parallelism_config); both switch on hf_ddpfix's Ulysses: set one "
                            "of them, or the same N in both")
        if n is None and facts.parallel == "deepspeed" and not _reaches_attention(sp):
            return Decision("deepspeed", f"ParallelismConfig(sp_size={pc_n}): DeepSpeed's own Ulysses engine left "
                            f"as stock: hf_ddpfix's Ulysses wraps sdpa only (model attention "
                            f"{sp.attn_implementation!r}, sp_attn_implementation {sp.parallelism_sp_attn!r}); "
                            f"{_DS_GAPS}")
        if n is None and facts.parallel not in ("ddp", "deepspeed"):
            return Decision(False, f"ParallelismConfig(sp_size={pc_n}) on a {facts.parallel} run: left to "
                            "accelerate as stock (ParallelismConfig switches hf_ddpfix's Ulysses on under DDP and "
                            "DeepSpeed; under FSDP2 set sequence_parallel=N)")
        source = "ParallelismConfig.sp_size" if n is None else f"{source} and ParallelismConfig.sp_size"
        n, from_pc = pc_n, True
    if n is None:
        return Decision(None, "")
    if n == 1:
        return Decision(False, f"sequence_parallel=1 ({source}): every rank holds whole sequences")
    where = f"sequence_parallel={n} ({source})"
    if facts.parallel not in ("ddp", "deepspeed", "fsdp"):
        raise PlanError(f"{where}: hf_ddpfix's Ulysses sequence parallelism shares each sequence between N "
                        f"processes (this run: {facts.parallel}, world size {facts.world_size}); launch N or more "
                        "processes (torchrun / accelerate launch: DDP, FSDP2 or a DeepSpeed ZeRO config)")
    if facts.parallel == "fsdp" and (facts.fsdp_version or 2) != 2:
        raise PlanError(f"{where}: FSDP{facts.fsdp_version} is not tested with sequence parallelism (FSDP2 is: the "
                        "same loss scale as DDP); use fsdp_version: 2")
    if facts.world_size % n:
        raise PlanError(f"{where}: the world size {facts.world_size} is not a multiple of {n}; "
                        f"use a sequence_parallel that divides {facts.world_size}")
    if sp is not None and sp.vision_refusal:
        raise PlanError(f"{where}: {sp.vision_refusal}; train it without sequence parallelism")
    stage = facts.deepspeed.stage if facts.deepspeed is not None else facts.zero_stage
    if sp is not None and sp.vision_family and (facts.parallel == "fsdp" or (facts.parallel == "deepspeed" and stage != 2)):
        engine = "FSDP" if facts.parallel == "fsdp" else f"DeepSpeed ZeRO stage {stage}"
        raise PlanError(f"{where}: {sp.vision_family} under {engine}: hf_ddpfix's "
                        "sequence parallelism for vision-language models (tower and image merge on the full sequence, "
                        "the dummy image) is tested under DDP and ZeRO-2 only; launch it under DDP or ZeRO-2, or "
                        "train without sequence parallelism")
    if sp is not None and sp.sequence_scan:
        raise PlanError(f"{where}: the model mixes tokens outside attention in {sp.sequence_scan}: a recurrent scan over "
                        "the whole sequence, which Ulysses (an all-to-all around the attention kernel) does not reach, "
                        "so each rank would scan its slice alone; train it without sequence parallelism")
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
    reason = (f"{source}: {heads // n} of {heads} heads/rank ({kv_text}) on the full sequence, L/{n} tokens/rank "
              f"elsewhere; {dp} data-parallel group(s)")
    if facts.parallel == "fsdp":
        reason += (f"; under FSDP2 the parameters are sharded over all {facts.world_size} ranks (one reduce-scatter "
                   "sums SP and DP gradients alike, averaged over the world as DDP's: the token-sum loss is exact)")
    if facts.parallel == "deepspeed":
        reason += ("; under DeepSpeed ZeRO hf_ddpfix's Ulysses runs and DeepSpeed sees plain data parallelism over "
                   f"all {facts.world_size} ranks (every stage averages over the world: the token-sum loss is exact)")
        if from_pc:
            reason += f"; it replaces DeepSpeed's Ulysses engine ({_DS_GAPS})"
    if from_pc:
        reason += "; accelerate's and the Trainer's DeepSpeed-SP paths stand down for the training loop"
    if sp is not None and not sp.parallelism_config_available:
        reason += ("; this accelerate has no ParallelismConfig (needs >= 1.12): only sequence_parallel / "
                   "HF_DDPFIX_SEQUENCE_PARALLEL switch it on")
    if sp is not None:
        from ..integrations.sequence_parallel.facts import sequence_parallel_loss_route

        _, why, refusal = sequence_parallel_loss_route(sp)
        if refusal:
            raise PlanError(f"{where}: {refusal}")
        reason += f"; {why}"
    if sp is not None and sp.vision_family:
        reason += (f"; {sp.vision_family}: vision tower, image merge and position ids (3-D for M-RoPE) on the full "
                   "sequence, the text decoder sharded")
    return Decision(f"N={n} DP={dp}" + (" via parallelism_config" if from_pc else ""), reason, changed=True)
