"""Two gloo processes: plain DDP + tiled MLP (shards=4) + tiled loss equals a single-process reference.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/tiled_ddp.py --out /tmp/tiled_ddp.json

For each DDP setting (find_unused_parameters False / True, static_graph=True; with and without
non-reentrant checkpointing, and reentrant with fu=False) every rank trains a tiny LoRA Llama (LoRA on
q/v/gate/up/down) for 3 SGD steps on its half of a global batch, with the MLPs tiled (4 shards, forced)
and the loss head tiled. The loss uses ``num_items_in_batch`` = global label-token count times the
world size, so DDP's gradient average equals the gradient of the global-batch loss. Each rank also
trains the untiled, uncheckpointed model on the whole global batch in one process (the reference).
Checks: final trainable weights equal across ranks (bitwise) and equal to the reference (1e-6; the
model runs in float64 so float summation order, which DDP itself changes, stays far below that).
Rank 0 writes one JSON record per setting.
"""

from __future__ import annotations

import argparse
import gc
import json
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_ddpfix.integrations.loss_patch import patch_model_loss
from hf_ddpfix.integrations.tiled_mlp import apply_tiled_mlp

STEPS, ROWS_PER_RANK, SEQ, LR = 3, 2, 24, 0.5
SETTINGS = [
    ("fu_false", {"find_unused_parameters": False}, None),
    ("fu_false_ckpt", {"find_unused_parameters": False}, "non_reentrant"),
    ("fu_true_ckpt", {"find_unused_parameters": True}, "non_reentrant"),
    ("static_graph_ckpt", {"static_graph": True}, "non_reentrant"),
    ("fu_false_reentrant", {"find_unused_parameters": False}, "reentrant"),
]


def build(ckpt: str | None):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(LlamaForCausalLM(cfg), lora).double()  # fp64: summation order noise << 1e-6
    if ckpt:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
        if ckpt == "reentrant":
            model.enable_input_require_grads()
    model.train()
    return model


def batches(world: int):
    gen = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (ROWS_PER_RANK * world, SEQ), generator=gen)
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=gen) < 0.3] = -100
        count = (labels[:, 1:] != -100).sum()
        yield ids, labels, count


def trainable(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for _, p in sorted(model.named_parameters()) if p.requires_grad])


def reference(world: int) -> torch.Tensor:
    model = build(None)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for ids, labels, count in batches(world):
        model(input_ids=ids, labels=labels, num_items_in_batch=count).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return trainable(model)


def run(ddp_kwargs: dict, ckpt: str | None, rank: int, world: int) -> tuple[torch.Tensor, dict]:
    model = build(ckpt)
    handle = apply_tiled_mlp(model, shards=4)
    loss_handle = patch_model_loss(model, chunk_tokens=7)
    stats: dict[str, int] = {}
    for m in model.modules():
        fwd = m.__dict__.get("forward")
        if fwd is not None and hasattr(fwd, "stats"):
            fwd.stats = stats
    ddp = DDP(model, **ddp_kwargs)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=LR)
    lo, hi = rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK
    for ids, labels, count in batches(world):
        out = ddp(input_ids=ids[lo:hi], labels=labels[lo:hi], num_items_in_batch=count)
        assert out.logits is None, "tiled loss head not used"
        (out.loss * world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    info = {"tiled_modules": len(handle.patched), "loss_calls": loss_handle.calls, **stats}
    return trainable(model), info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = reference(world)
    records = []
    for name, kwargs, ckpt in SETTINGS:
        w, info = run(kwargs, ckpt, rank, world)
        gathered = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(gathered, w)
        rec = {
            "setting": name, "ddp_kwargs": kwargs, "checkpointing": ckpt,
            "max_diff_vs_reference": float((w - ref).abs().max()),
            "max_diff_across_ranks": float(max((g - gathered[0]).abs().max() for g in gathered)),
            "weights_moved": float((w - trainable(build(None))).abs().max()),
            **info,
        }
        ok = (rec["max_diff_vs_reference"] < 1e-6 and rec["max_diff_across_ranks"] == 0.0
              and rec["tiled_modules"] == 2 and rec["loss_calls"] == STEPS and rec["weights_moved"] > 1e-3
              and rec.get("backward_tokens", 0) > 0)
        rec["ok"] = bool(ok)
        records.append(rec)
        if rank == 0:
            print("TILED_DDP", json.dumps(rec), flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    dist.barrier()
    gc.collect()  # free FSDP/DDP state before the process group goes ("terminate called" at exit otherwise)
    dist.destroy_process_group()
    if not all(r["ok"] for r in records):
        raise SystemExit(f"tiled DDP mismatch: {[r for r in records if not r['ok']]}")


if __name__ == "__main__":
    main()
