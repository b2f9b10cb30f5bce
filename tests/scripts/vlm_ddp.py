"""2-process DDP parity for the VLM stabiliser: stabiliser + find_unused_parameters=False (and
static_graph=True) ends with weights bit-identical to stock DDP(find_unused_parameters=True).

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/vlm_ddp.py
Prints ``VLM_DDP_OK`` on every rank when every scenario passes. ``vlm_fsdp.py`` reuses
:func:`train_ddp` as its DDP reference; the tiny models come from ``tests/fixtures.py``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures

from fixtures import (  # noqa: E402
    BUILDERS,
    PATCH_DIM,
    accumulate,
    add_lora,
    assert_same_across_ranks,
    assert_weights_equal,
    build_qwen2_5_vl,
    make_batch,
    teardown,
)

from hf_ddpfix.integrations.vision.families import vision_param_names  # noqa: E402
from hf_ddpfix.integrations.vision.stabilizer import VisionStabilizer  # noqa: E402

Pattern = Callable[[int, int, int], bool]  # (step, micro, rank) -> has image


def train_ddp(
    pattern: Pattern,
    *,
    fix: bool,
    steps: int,
    ga: int = 1,
    static_graph: bool = False,
    find_unused: bool | None = None,
    dropout: float = 0.1,
    snapshot_after: int | None = None,
    family: str = "qwen2_5_vl",
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Train a LoRA VLM (``BUILDERS[family]``) under DDP; ``fix`` = stabiliser + fu=False, else stock
    fu=True. Returns (final trainable weights, vision weights after ``snapshot_after`` steps)."""
    rank = dist.get_rank()
    model = add_lora(BUILDERS[family](0), dropout)
    stab = VisionStabilizer(model).attach() if fix else None
    fu = (not fix) if find_unused is None else find_unused
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=fu, static_graph=static_graph)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    vis = set(vision_param_names(model))
    snap: dict[str, torch.Tensor] = {}
    torch.manual_seed(1234 + rank)  # LoRA dropout stream, identical in stock and fixed runs
    for step in range(steps):
        if snapshot_after == step:
            snap = {n: p.detach().clone() for n, p in model.named_parameters() if n in vis}
        accumulate(ddp, (make_batch(pattern(step, micro, rank), 1000 * step + 10 * micro + rank, PATCH_DIM[family])
                         for micro in range(ga)), ga)
        if stab is not None:
            stab.finalize_vision_grads()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if snapshot_after == steps:
        snap = {n: p.detach().clone() for n, p in model.named_parameters() if n in vis}
    if stab is not None:
        stab.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, snap


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[rank {rank} {time.time() - t0:5.1f}s] {msg}", flush=True)

    # (a) rank 0 always has images, rank 1 never.
    mixed: Pattern = lambda s, m, r: r == 0  # noqa: E731
    stock, _ = train_ddp(mixed, fix=False, steps=4)
    fixed, _ = train_ddp(mixed, fix=True, steps=4)
    assert_weights_equal(stock, fixed, "(a) mixed ranks: stabiliser+fu=False vs stock fu=True")
    assert_same_across_ranks(fixed, "(a)")
    log("(a) mixed ranks: bit-equal to stock fu=True, replicas in sync")

    # (b) no rank has images for 3 steps, then images (rank 0 at step 3, both at step 4).
    late: Pattern = lambda s, m, r: s >= 4 or (s == 3 and r == 0)  # noqa: E731
    stock_b, stock_snap = train_ddp(late, fix=False, steps=5, snapshot_after=3)
    fixed_b, fixed_snap = train_ddp(late, fix=True, steps=5, snapshot_after=3)
    init = {
        n: p.detach().clone() for n, p in add_lora(build_qwen2_5_vl(0)).named_parameters() if n in fixed_snap
    }
    assert_weights_equal(init, fixed_snap, "(b) vision params untouched while no rank saw an image")
    assert_weights_equal(stock_snap, fixed_snap, "(b) snapshot vs stock")
    assert_weights_equal(stock_b, fixed_b, "(b) images late: stabiliser vs stock fu=True")
    assert_same_across_ranks(fixed_b, "(b)")
    log("(b) images late: vision untouched while imageless, bit-equal to stock")

    # (c) static_graph=True + stabiliser, same two data patterns.
    static_a, _ = train_ddp(mixed, fix=True, steps=4, static_graph=True)
    assert_weights_equal(stock, static_a, "(c) static_graph mixed vs stock fu=True")
    static_b, _ = train_ddp(late, fix=True, steps=5, static_graph=True)
    assert_weights_equal(stock_b, static_b, "(c) static_graph images-late vs stock fu=True")
    assert_same_across_ranks(static_b, "(c)")
    log("(c) static_graph=True: bit-equal to stock fu=True")

    # (ga) gradient accumulation (no_sync): images in a no_sync micro-batch only, steps with none.
    table = {  # step -> {rank: [micro0, micro1]}
        0: {0: [True, False], 1: [False, False]},
        1: {0: [False, False], 1: [False, False]},
        2: {0: [False, True], 1: [True, False]},
        3: {0: [False, False], 1: [True, True]},
    }
    ga_pat: Pattern = lambda s, m, r: table[s][r][m]  # noqa: E731
    stock_ga, _ = train_ddp(ga_pat, fix=False, steps=4, ga=2)
    fixed_ga, _ = train_ddp(ga_pat, fix=True, steps=4, ga=2)
    assert_weights_equal(stock_ga, fixed_ga, "(ga) grad accumulation vs stock fu=True")
    assert_same_across_ranks(fixed_ga, "(ga)")
    log("(ga) gradient accumulation with no_sync: bit-equal to stock fu=True")

    # (qwen3) Qwen3-VL: deepstack features tied to decoder layers; mixed ranks and an imageless step.
    if BUILDERS["qwen3_vl"](0) is not None:
        q3: Pattern = lambda s, m, r: {0: r == 0, 1: False, 2: r == 1}[s]  # noqa: E731
        stock_q3, _ = train_ddp(q3, fix=False, steps=3, family="qwen3_vl")
        fixed_q3, _ = train_ddp(q3, fix=True, steps=3, family="qwen3_vl")
        assert_weights_equal(stock_q3, fixed_q3, "(qwen3) Qwen3-VL vs stock fu=True")
        assert_same_across_ranks(fixed_q3, "(qwen3)")
        log("(qwen3) Qwen3-VL mixed/imageless: bit-equal to stock fu=True")

    log("VLM_DDP_OK")
    teardown()


if __name__ == "__main__":
    main()
