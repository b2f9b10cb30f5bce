"""2-process run-time guard: a module that runs but whose output never reaches the loss.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/usage_guard.py --case guard|tie

A tiny LoRA Llama gets an extra trainable ``probe`` Linear that a forward hook on decoder layer 0 runs
on the layer's output and throws away (a forward hook sees it "used"; its parameters never get a
gradient). DDP runs with ``find_unused_parameters=False`` (stock would fail the next step with
"Expected to have finished reduction"; with the probe only on rank 0 it would hang).
  guard: ParameterUsage(tie=False, guard=True) -> every rank raises UnusedParametersError naming
         ``probe`` before the first backward (the test asserts both ranks and the time).
  tie:   ParameterUsage() ties the probe in; 3 steps end with the weights of stock DDP(fu=True)
         (bit-equal; the probe's grad is None as in stock, so AdamW leaves it alone). Prints USAGE_TIE_OK.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fixtures import init_gloo, teardown, trainable_weights  # noqa: E402
from zoo import ZOO  # noqa: E402

from hf_ddpfix.integrations.usage import ParameterUsage, UnusedParametersError  # noqa: E402


def model_with_probe(only_rank0: bool) -> nn.Module:
    model = ZOO["llama"].model(0)
    layer = model.get_base_model().model.layers[0]
    torch.manual_seed(5)
    layer.probe = nn.Linear(64, 64)  # trainable, runs every forward, output discarded

    def run_probe(module: nn.Module, args: tuple, output):
        if not only_rank0 or dist.get_rank() == 0:
            hidden = output[0] if isinstance(output, tuple) else output
            module.probe(hidden)  # discarded: never reaches the loss

    layer.register_forward_hook(run_probe)
    return model


def train(fix: str, steps: int) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    model = model_with_probe(only_rank0=fix == "guard")
    usage = None
    if fix == "guard":
        usage = ParameterUsage(model, tie=False, guard=True).attach()
    elif fix == "tie":
        usage = ParameterUsage(model).attach()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=fix == "stock")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    for step in range(steps):
        batch = ZOO["llama"].batch(False, 100 * step + rank, 12 + 4 * ((step + rank) % 2))
        ddp(**batch).loss.backward()
        if usage is not None:
            usage.finalize()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return trainable_weights(model)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=["guard", "tie"], required=True)
    case = ap.parse_args().case
    rank, _ = init_gloo()
    if case == "guard":
        t0 = time.perf_counter()
        try:
            train("guard", 2)
        except UnusedParametersError as e:
            print(f"[rank {rank}] UnusedParametersError after {time.perf_counter() - t0:.1f}s: {e}", flush=True)
            raise
        raise SystemExit("guard did not fire")
    stock = train("stock", 3)
    fixed = train("tie", 3)
    bad = [n for n in stock if not torch.equal(stock[n], fixed[n])]
    assert not bad, f"tie vs stock fu=True: {bad[:3]}"
    probe = [n for n in stock if "probe" in n]
    init = dict(model_with_probe(False).named_parameters())
    assert probe and all(torch.equal(fixed[n], init[n]) for n in probe), "probe must stay untouched (grad None)"
    print(f"[rank {rank}] USAGE_TIE_OK", flush=True)
    teardown()


if __name__ == "__main__":
    main()
