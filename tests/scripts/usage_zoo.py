"""2-process DDP zoo: ParameterUsage + fu=False (+ static graph at accumulation 1) under REENTRANT
checkpointing ends with the trainable weights of stock DDP(find_unused_parameters=True) under
non-reentrant checkpointing (1e-6), replicas in sync, for every family in tests/zoo.py.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/usage_zoo.py --ga 1 [--families llama,mllama] [--report out.json]

Steps mix image and text ranks for VLMs: rank 0 only, no rank at all, both, rank 1 only (per
micro-batch with --ga 2, including an image only in a no_sync micro-batch). Sequence lengths vary;
AdamW(weight_decay=0.1) and clip_grad_norm_(1.0) make a zero gradient and a missing one differ.
Stock fu=True with reentrant checkpointing fails ("mark a variable ready only once"), so the stock
side uses non-reentrant; hf_ddpfix runs twice: non-reentrant (bit-equal to stock) and reentrant (1e-6). Prints ``USAGE_ZOO_OK`` on every rank; ``--report`` writes, per family, the
parameters observed unused on a text-only step and the max weight difference (rank 0).

``--old-plan mllama,bart_layerdrop`` (at ``--ga 1``) also runs, beside each of those families' fixed run, the
plan hf_ddpfix used to pick for them: the same DDP(fu=False, static graph) and data without the tie, on a
process group of its own whose collectives time out after ``OLD_PLAN_TIMEOUT`` s (a hang ends there, the
default group stays in step). Each rank prints ``<family> old plan (...): <outcome>``: LayerDrop fails
with "Your training graph has changed in this iteration" (a layer dropped at step 1 is used later), Mllama
hangs on one rank (a timed-out collective) while the other raises "Expected to have finished reduction".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from fixtures import accumulate, assert_same_across_ranks, init_gloo, teardown, trainable_weights  # noqa: E402
from zoo import ZOO, ZooEntry, seq_len  # noqa: E402

from hf_ddpfix.integrations.checkpointing import apply_checkpointing  # noqa: E402
from hf_ddpfix.integrations.usage import ParameterUsage  # noqa: E402

# step -> rank -> image per micro-batch
PATTERN_GA1 = {0: [[True], [False]], 1: [[False], [False]], 2: [[True], [True]], 3: [[False], [True]]}
PATTERN_GA2 = {
    0: [[True, False], [False, False]],  # image only in rank 0's no_sync micro-batch
    1: [[False, False], [False, False]],  # no image anywhere
    2: [[False, True], [True, False]],
}


# AdamW normalises each gradient element: a rounding-level difference becomes a lr-sized one where a
# gradient element is near zero. 1e-3 keeps reentrant-vs-non-reentrant rounding (stock's own, BART:
# 4e-9 in a gradient) under 1e-6 in the weights, while one AdamW step (~1e-3) and weight decay
# (~1e-4 * w) on a zero-but-not-missing gradient stay far above it.
LR = 1e-3


def enable_checkpointing(model: nn.Module, reentrant: bool) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    apply_checkpointing(model, use_reentrant=reentrant)


def train(entry: ZooEntry, *, fix: bool, ga: int, reentrant: bool = False, tie: bool = True,
          group: dist.ProcessGroup | None = None) -> tuple[dict[str, torch.Tensor], ParameterUsage | None, float]:
    """Stock (``fix=False``): DDP(fu=True). Fixed: ParameterUsage + DDP(fu=False, static graph at ga 1);
    ``tie=False`` drops ParameterUsage: hf_ddpfix's old plan (fu=False + static graph on its own)."""
    rank = dist.get_rank()
    pattern = PATTERN_GA1 if ga == 1 else PATTERN_GA2
    model = entry.model(0)
    enable_checkpointing(model, reentrant=reentrant)
    usage = ParameterUsage(model).attach() if fix and tie else None
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=not fix, static_graph=fix and ga == 1,
                                              process_group=group)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    torch.manual_seed(1234 + rank)  # LayerDrop draws: the same stream in both runs
    t0 = time.perf_counter()
    for step in range(len(pattern)):
        images = pattern[step][rank] if entry.vlm else [False] * ga
        accumulate(ddp, (entry.batch(images[micro], 1000 * step + 10 * micro + rank, seq_len(step, micro, rank))
                         for micro in range(ga)), ga)
        if usage is not None:
            usage.finalize()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0
    weights = trainable_weights(model)
    if usage is not None:
        usage.remove()
    del ddp
    return weights, usage, seconds


OLD_PLAN_TIMEOUT = 15  # seconds a collective of the old-plan run may wait before it counts as a hang


def old_plan_failure(entry: ZooEntry) -> str:
    """Run hf_ddpfix's old plan for a family that can leave parameters unused: DDP(fu=False, static graph),
    non-reentrant checkpointing, no tie, the same data as :func:`train`, on a group of its own whose
    collectives time out after OLD_PLAN_TIMEOUT s (a hang then ends there and leaves the default group in
    step). Returns this rank's outcome: ``"trained"``, ``"hang: ..."`` (a collective timed out) or the
    error's type and first line."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=OLD_PLAN_TIMEOUT))
    t0 = time.perf_counter()
    try:
        train(entry, fix=True, ga=1, tie=False, group=group)
        outcome = "trained"
    except Exception as err:  # noqa: BLE001 - the outcome is the test's subject
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        kind = "hang" if re.search(r"timed out|timeout", first, re.I) else type(err).__name__
        outcome = f"{kind} after {time.perf_counter() - t0:.0f}s: {first}"
    gc.collect()
    dist.barrier()  # on the default group: both ranks are past the old-plan run
    return outcome


def text_step_unused(entry: ZooEntry) -> list[str]:
    """Trainable parameters a text-only training forward leaves without a gradient (observed)."""
    model = entry.model(0)
    usage = ParameterUsage(model, tie=False, guard=False).attach()
    model(**entry.batch(False, 7, 16))
    assert usage.last is not None
    used = set(usage.last.used)
    usage.remove()
    return [n for n, p in model.named_parameters() if p.requires_grad and n not in used]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ga", type=int, choices=[1, 2], default=1)
    ap.add_argument("--families", default=",".join(ZOO))
    ap.add_argument("--report", default="")
    ap.add_argument("--old-plan", default="", help="families to also run under the old plan (fu=False + static "
                    "graph, no tie) at --ga 1; each rank prints its outcome")
    a = ap.parse_args()
    rank, _ = init_gloo()
    t0 = time.time()
    report: dict[str, dict] = {}
    for name in a.families.split(","):
        entry = ZOO[name]
        stock, _, t_stock = train(entry, fix=False, ga=a.ga)
        exact, _, _ = train(entry, fix=True, ga=a.ga, reentrant=False)
        bad = [n for n in stock if not torch.equal(stock[n], exact[n])]
        assert not bad, f"{name} ga={a.ga}: non-reentrant: {len(bad)} tensors not bit-equal to stock: {bad[:3]}"
        fixed, usage, t_fix = train(entry, fix=True, ga=a.ga, reentrant=True)
        assert stock.keys() == fixed.keys()
        diff = max((stock[n] - fixed[n]).abs().max().item() for n in stock)
        # reentrant vs non-reentrant recompute sums a shared input's gradient in another order (rounding)
        bad = [n for n in stock if not torch.allclose(stock[n], fixed[n], atol=1e-6, rtol=0)]
        assert not bad, f"{name} ga={a.ga}: reentrant: {len(bad)} tensors differ from stock fu=True (max {diff:.2e}): {bad[:3]}"
        assert_same_across_ranks(fixed, name)
        moved = sum(not torch.equal(v, w) for v, w in zip(stock.values(), entry_init(entry).values(), strict=True))
        assert usage is not None
        print(f"[rank {rank} {time.time() - t0:5.1f}s] {name} ga={a.ga}: non-reentrant bit-equal; reentrant max |fix - stock| = {diff:.1e}, "
              f"{moved}/{len(stock)} tensors moved, {usage.ties} ties, {usage.seconds / usage.forwards * 1e3:.2f} "
              f"ms/forward observing, step time fix/stock {t_fix:.2f}/{t_stock:.2f}s", flush=True)
        if name in a.old_plan.split(",") and a.ga == 1:
            print(f"[rank {rank} {time.time() - t0:5.1f}s] {name} old plan (fu=False + static graph, no tie): "
                  f"{old_plan_failure(entry)}", flush=True)
        report[name] = {"max_diff": diff, "ties": usage.ties, "text_step_unused": text_step_unused(entry),
                        "ms_per_forward": usage.seconds / usage.forwards * 1e3, "moved": moved, "n": len(stock)}
        gc.collect()
    if a.report and rank == 0:
        with open(a.report, "w") as f:
            json.dump(report, f, indent=1)
    print(f"[rank {rank} {time.time() - t0:5.1f}s] USAGE_ZOO_OK", flush=True)
    teardown()


_INIT: dict[str, dict[str, torch.Tensor]] = {}


def entry_init(entry: ZooEntry) -> dict[str, torch.Tensor]:
    if entry.name not in _INIT:
        _INIT[entry.name] = trainable_weights(entry.model(0))
    return _INIT[entry.name]


if __name__ == "__main__":
    main()
