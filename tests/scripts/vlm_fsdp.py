"""2-process FSDP2 (fully_shard, gloo, CPU) + VLM stabiliser with mixed image/text ranks.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/vlm_fsdp.py

Shards a LoRA Qwen2.5-VL with ``fsdp_wrap_plan`` (the plan's ``shard`` units: vision blocks, decoder layers, root),
trains with ranks that differ in image/text (and one step where no rank has an image), and checks the
final weights equal the DDP + stabiliser run (itself bit-equal to stock DDP fu=True; scripts/vlm_ddp.py)
within 1e-5. Without the stabiliser the first mixed step would hang (mismatched all-gathers). Then
evaluation forwards (``model.eval()``, no grad; rank 0 with an image, rank 1 text-only, variable lengths)
with an eval-sync stabiliser (``train=False, sync_eval=True``): each rank's loss and logits equal a
single-process reference model holding the same trained weights, bit for bit; the eval dummies are
counted (``feature_counts["stabilizer"]``). Prints ``VLM_FSDP_OK``.

``--case stock_eval``: the same evaluation forwards without the eval sync, on a freshly sharded model;
expected to FAIL (rank 1 skips the vision-block units rank 0 all-gathers).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import BUILDERS, PATCH_DIM, add_lora, assert_weights_equal, make_batch, teardown  # noqa: E402
from vlm_ddp import train_ddp  # noqa: E402

from hf_ddpfix.integrations.fsdp.units import fsdp_wrap_plan  # noqa: E402
from hf_ddpfix.integrations.vision.families import vision_param_names  # noqa: E402
from hf_ddpfix.integrations.vision.stabilizer import VisionStabilizer  # noqa: E402

STEPS = 5


def pattern(step: int, micro: int, rank: int) -> bool:
    """Step 0: rank 0 only; step 1: rank 1 only; step 2: no rank; step 3: both; step 4: rank 0 only."""
    return {0: rank == 0, 1: rank == 1, 2: False, 3: True, 4: rank == 0}[step]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


EVAL_BATCHES = 2


def eval_batches(rank: int, family: str) -> list[dict[str, torch.Tensor]]:
    """Rank 0: images; rank 1: text only, shorter and of varying length."""
    out = []
    for i in range(EVAL_BATCHES):
        b = make_batch(rank == 0, 500 + 10 * i + rank, PATCH_DIM[family])
        if rank != 0:
            b = {k: v[:, : 9 + i] for k, v in b.items()}
        out.append(b)
    return out


def evaluate(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
    model.eval()
    with torch.no_grad():
        outs = [model(**b) for b in batches]
    model.train()
    return [(o.loss.detach().clone(), o.logits.detach().clone()) for o in outs]


def check_eval(family: str, model: torch.nn.Module) -> int:
    """Mixed-rank evaluation with the eval sync vs a one-process reference; returns this rank's eval dummies."""
    from hf_ddpfix.ops import feature_counts

    rank = dist.get_rank()
    feature_counts.reset()
    sync = VisionStabilizer(model, run_when_frozen=True, train=False, sync_eval=True).attach()
    got = evaluate(model, eval_batches(rank, family))
    sync.remove()
    counts = feature_counts.snapshot().get("stabilizer")
    dummies = counts.amounts.get("eval_dummies", 0) if counts else 0
    trained = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    ref = add_lora(BUILDERS[family](0))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(trained[n])
    want = evaluate(ref, eval_batches(rank, family))
    for i, ((gl, gx), (wl, wx)) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(gl, wl) and torch.equal(gx, wx), (
            f"{family} eval batch {i}: loss {gl.item()} vs {wl.item()}, max logit diff {(gx - wx).abs().max()}")
    expected = EVAL_BATCHES if rank == 1 else 0
    assert dummies == expected == sync.eval_dummy_runs, (dummies, expected, sync.eval_dummy_runs)
    return dummies


def stock_eval(family: str) -> None:
    """Freshly sharded model, the stabiliser's training part only: evaluation forwards are stock."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = add_lora(BUILDERS[family](0))
    VisionStabilizer(model).attach()
    for _, mod in fsdp_wrap_plan(model):
        fully_shard(mod, mesh=mesh)
    dist.barrier()
    print(f"EVALUATING on rank {dist.get_rank()}", flush=True)  # what fails after this fails in evaluation
    evaluate(model, eval_batches(dist.get_rank(), family))
    print("STOCK_EVALUATED", flush=True)


def train_fsdp(family: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = add_lora(BUILDERS[family](0), dropout=0.1)
    stab = VisionStabilizer(model).attach()
    plan = fsdp_wrap_plan(model)
    for _, mod in plan:
        fully_shard(mod, mesh=mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    vis = set(vision_param_names(model))
    torch.manual_seed(1234 + rank)
    for step in range(STEPS):
        batch = make_batch(pattern(step, 0, rank), 1000 * step + rank, PATCH_DIM[family])
        model(**batch).loss.backward()
        any_images = stab.finalize_vision_grads()
        vis_grads = [p.grad for n, p in model.named_parameters() if n in vis]
        if step == 2:
            assert any_images is False and all(g is None for g in vis_grads), "no-image step must leave None"
        else:
            assert any_images is True and all(g is not None for g in vis_grads), step
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = {n: full(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}
    dummies = check_eval(family, model)
    print(f"[rank {rank}] {family}: FSDP2 evaluation with mixed ranks equals one process bitwise "
          f"({dummies} eval dummies)", flush=True)
    return weights, [n for n, _ in plan]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=["train_eval", "stock_eval"], default="train_eval")
    case = p.parse_args().case
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t0 = time.time()
    if case == "stock_eval":
        stock_eval("qwen2_5_vl")
        teardown()
        return
    for family in ("qwen2_5_vl", "qwen3_vl"):
        if BUILDERS[family](0) is None:
            continue
        fsdp_w, plan = train_fsdp(family)
        print(
            f"[rank {rank} {time.time() - t0:5.1f}s] {family}: FSDP2 {STEPS} steps; units {plan}", flush=True
        )
        assert any(".visual.blocks." in n for n in plan) and plan[-1] == "", plan  # units inside the tower (shard)
        ddp_w, _ = train_ddp(pattern, fix=True, steps=STEPS, family=family)
        assert_weights_equal(ddp_w, fsdp_w, f"{family}: FSDP2 + stabiliser vs DDP + stabiliser", atol=1e-5)
        diff = max((ddp_w[n] - fsdp_w[n]).abs().max().item() for n in ddp_w)
        print(f"[rank {rank} {time.time() - t0:5.1f}s] {family}: max |FSDP2 - DDP| = {diff:.2e}", flush=True)
        lora = add_lora(BUILDERS[family](0))
        init = {n: p.detach() for n, p in lora.named_parameters() if p.requires_grad}
        moved = sum(not torch.equal(init[n], fsdp_w[n]) for n in init)
        assert moved == len(init), f"{family}: only {moved}/{len(init)} trainable tensors moved"
    print(f"[rank {rank} {time.time() - t0:5.1f}s] VLM_FSDP_OK", flush=True)
    teardown()


if __name__ == "__main__":
    main()
