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
import gc
import hashlib
import json
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from hf_ddpfix.integrations.checkpointing import apply_checkpointing
from hf_ddpfix.ops.offload import ActivationOffload

STEPS, LAYERS, BATCH, SEQ, HIDDEN = 3, 3, 2, 24, 64
LAYER_INPUT_BYTES = BATCH * SEQ * HIDDEN * 4  # float32 hidden states entering one decoder layer
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=TARGETS)
    model = get_peft_model(LlamaForCausalLM(cfg), lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def full_trainable(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = t.detach().clone()
    return out


def digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].numpy().tobytes())
    return h.hexdigest()[:16]


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
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
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
    return full_trainable(model), stats


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
        # host slabs: step 1 takes one per layer input (no expectation yet) and folds them into one at its
        # end; later steps reuse that one (HostPool)
        "pool_allocated": (LAYERS - 1) + (LAYERS > 2) if copied else 0,
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
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stock, _ = train("stock", rank)
    init = full_trainable(build())
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
    # module=model (what hf_ddpfix.runtime passes) with FSDP2 DTensor parameters: errors go to the JSON.
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
    dist.all_gather_object(digests, digest(stock))
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
    dist.barrier()
    gc.collect()  # free FSDP state before the process group goes ("terminate called" at exit otherwise)
    dist.destroy_process_group()
    if not result["ok"]:
        raise SystemExit(f"offload FSDP mismatch: {result['errors']} ranks_equal={result['ranks_equal']}")


if __name__ == "__main__":
    main()
