"""Two gloo processes: FSDP2 (``fully_shard``) + non-reentrant checkpointing + ActivationOffload gives stock weights.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/offload_fsdp.py --out /tmp/offload_fsdp.json

Every rank builds the same tiny LoRA Llama (LoRA on every linear layer of the decoder, random A and B so
every adapter trains from step 1), turns on non-reentrant checkpointing of the decoder layers, applies
``fully_shard`` to each decoder layer and to the root, and trains 3 AdamW steps on its own data. Three
runs: stock checkpointing, ``ActivationOffload(min_bytes=0, simulate=True)`` (real host copies of the
CPU tensors) and ``ActivationOffload(min_bytes=0)`` (CPU accounting mode). Checks, on every rank: the
full (gathered) trainable weights of both offload runs are bit-identical to the stock run and identical
across ranks; each step packed exactly one input per decoder layer, moved all but the last one to the
host and restored every one of them. Rank 0 writes the verdict as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import init_gloo, lora_llama, shard_decoder, teardown, trainable_weights, weights_digest  # noqa: E402

from hf_ddpfix.integrations.checkpointing import apply_checkpointing  # noqa: E402
from hf_ddpfix.ops.offload import ActivationOffload  # noqa: E402

STEPS, LAYERS, BATCH, SEQ, HIDDEN = 3, 3, 2, 24, 64
LAYER_INPUT_BYTES = BATCH * SEQ * HIDDEN * 4  # float32 hidden states entering one decoder layer
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build():
    return lora_llama(targets=TARGETS, checkpointing="non_reentrant", num_hidden_layers=LAYERS, hidden_size=HIDDEN)


def train(mode: str, rank: int, with_module: bool = False) -> tuple[dict[str, torch.Tensor], list[dict[str, int]]]:
    """``mode``: "stock", "simulate" or "accounting"; ``with_module`` passes ``module=model`` (the
    parameters become FSDP2 DTensors after ``fully_shard``, before the first ``step()``)."""
    model = build()
    offload = None
    if mode != "stock":
        offload = ActivationOffload(min_bytes=0, module=model if with_module else None,
                                    simulate=(mode == "simulate"))
    replaced = apply_checkpointing(model, use_reentrant=False, offload=offload)
    assert replaced >= LAYERS, replaced
    layers = model.get_base_model().model.layers
    assert sum(bool(layer.gradient_checkpointing) for layer in layers) == LAYERS
    shard_decoder(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
    stats = []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
        with offload.step() if offload is not None else contextlib.nullcontext():
            model(input_ids=ids, labels=ids).loss.backward()
        if offload is not None:
            stats.append(offload.stats.as_dict())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return trainable_weights(model), stats


def check_stats(mode: str, stats: list[dict[str, int]]) -> list[str]:
    moved = (LAYERS - 1) * LAYER_INPUT_BYTES
    copied = mode == "simulate"
    want = {
        "packed_tensors": LAYERS,  # one hidden-states input per checkpointed decoder layer
        "packed_bytes": LAYERS * LAYER_INPUT_BYTES,
        "would_offload_bytes": moved,
        "offloaded_tensors": LAYERS - 1 if copied else 0,
        "offloaded_bytes": moved if copied else 0,
        "restored_tensors": LAYERS - 1 if copied else 0,
        "kept_tensors": 1,  # the last layer's input stays: the backward needs it first
        "kept_bytes": LAYER_INPUT_BYTES,
        "skipped_params": 0,
        "skipped_small": 0,
        "skipped_views": 0,
        "skipped_other": 0,
        "in_flight": 0,
        # host slabs: step 1 grows by exactly each missing layer input (its power-of-two digits); later
        # steps reuse them (HostPool), and the pool holds exactly the inputs in use at once
        "pool_allocated": (LAYERS - 1) * LAYER_INPUT_BYTES.bit_count() if copied else 0,
        "pool_bytes": moved if copied else 0,
    }
    errors = []
    for i, s in enumerate(stats):
        errors += [f"{mode} step {i}: {k}={s[k]} != {v}" for k, v in want.items() if s[k] != v]
    if len(stats) != STEPS:
        errors.append(f"{mode}: {len(stats)} steps recorded")
    return errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rank, world = init_gloo()
    stock, _ = train("stock", rank)
    init = trainable_weights(build())
    result: dict = {"world_size": world, "trainable_tensors": len(stock),
                    "trained": sum(not torch.equal(stock[k], init[k]) for k in stock)}
    errors = []
    for mode in ("simulate", "accounting"):
        weights, stats = train(mode, rank)
        differ = [k for k in stock if not torch.equal(stock[k], weights[k])]
        if differ or weights.keys() != stock.keys():
            errors.append(f"{mode}: {len(differ)} tensors differ from stock, e.g. {differ[:3]}")
        errors += check_stats(mode, stats)
        result[f"{mode}_stats_last_step"] = stats[-1]
    # module=model (what hf_ddpfix.runtime.attach passes) with FSDP2 DTensor parameters: errors go to the JSON.
    try:
        weights, stats = train("simulate", rank, with_module=True)
        differ = [k for k in stock if not torch.equal(stock[k], weights[k])]
        module_error = (f"{len(differ)} tensors differ from stock" if differ else None) or (
            "; ".join(check_stats("simulate", stats)) or None)
    except Exception as exc:  # reported in the JSON verdict
        module_error = f"{type(exc).__name__}: {exc}"
    module_errors: list[str | None] = [None] * world
    dist.all_gather_object(module_errors, module_error)
    result["module_arg_errors"] = [e for e in module_errors if e]
    digests: list[str | None] = [None] * world
    dist.all_gather_object(digests, weights_digest(stock))
    all_errors: list[list[str] | None] = [None] * world
    dist.all_gather_object(all_errors, errors)
    result["digests"] = digests
    result["ranks_equal"] = len(set(digests)) == 1
    result["errors"] = [e for errs in all_errors for e in (errs or [])]
    result["ok"] = bool(result["ranks_equal"] and not result["errors"] and result["trained"] == len(stock))
    if rank == 0:
        print("OFFLOAD_FSDP", json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    teardown()
    if not result["ok"]:
        raise SystemExit(f"offload FSDP mismatch: {result['errors']} ranks_equal={result['ranks_equal']}")


if __name__ == "__main__":
    main()
