"""The plan's rules for quantized (bitsandbytes) weights and model placement.

Pure rules called by :func:`hf_ddpfix.plan.resolve.resolve_plan`; they raise `PlacementError` /
`QuantStorageError` before training for set-ups that cannot work, with the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .types import Decision, PlacementError, QuantStorageError, RunFacts

if TYPE_CHECKING:
    from ..integrations.quantized import QuantFacts

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
    "local_rank = int(os.environ['LOCAL_RANK']) (or accelerate.PartialState().local_process_index: the rank on "
    "this node; process_index is the global rank, another node's device number); for model parallelism over several GPUs launch ONE process (python train.py), not torchrun"
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


def decide_quantization(facts: RunFacts) -> Decision:
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
                        f"{_storage_fix(cast or 'bfloat16')}{_NO_REPACK}")
    return Decision(what, f"FSDP2: 4-bit weights sharded in {storage} storage (each rank holds 1/world of "
                    f"{_nbytes(q)}), all-gathered without a cast{_NO_REPACK}")


# hf_ddpfix._compat.bitsandbytes: the repack garbles evaluation under FSDP2 (measured eval loss 5.496 vs 5.524)
_NO_REPACK = ("; bitsandbytes' in-place CPU repack for evaluation switched off (FSDP2 rebuilds the weight from "
              "its shards every forward; CUDA never repacks)")


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
