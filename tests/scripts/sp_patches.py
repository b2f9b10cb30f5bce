"""Sequence parallelism through the zero-code route: `patches/` on PYTHONPATH and HF_DDPFIX_SEQUENCE_PARALLEL=2, no
hf_ddpfix call in this script. TRL's SFTTrainer (loss_type nll), DPOTrainer (sigmoid) and RewardTrainer (a
sequence-classification model: the head-whole route), built as in tests/scripts/sp_losses.py, trained on 2 gloo
processes; each rank records its weights, logged losses, plan and `sequence_parallel` counters, judged against the one-process reference sp_losses.py wrote (`--single-for 2`).

    python -m torch.distributed.run --standalone --nproc_per_node=1 tests/scripts/sp_losses.py ONE.pt --single-for 2 \
        --cases sft_nll,dpo,reward
    PYTHONPATH=patches:. HF_DDPFIX_SEQUENCE_PARALLEL=2 python -m torch.distributed.run --standalone \
        --nproc_per_node=2 tests/scripts/sp_patches.py OUT.json --single ONE.pt
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sp_losses  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from fixtures import Verdicts, init_gloo, trainable_weights  # noqa: E402
from sp_trainer import hist_diff  # noqa: E402

from hf_ddpfix.ops import feature_counts  # noqa: E402

#: case -> builder: the sp_losses.py cases of the same name (their one-process references)
CASES = {"sft_nll": lambda opt: sp_losses.sft_trainer({"loss_type": "nll"}, opt, 2),
         "dpo": lambda opt: sp_losses.dpo_trainer({}, opt, 2),
         "reward": lambda opt: sp_losses.sp_trl.reward({}, opt, 2, sp_losses.DTYPE)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--single", required=True)
    a = p.parse_args()
    rank, world = init_gloo()
    import hf_ddpfix.trainer as t

    one = torch.load(a.single, weights_only=False)
    v = Verdicts("SPP", a.out)
    for case, build in CASES.items():
        feature_counts.reset()
        trainer = build(dict(optim="sgd", max_grad_norm=0.0, weight_decay=0.0, learning_rate=5e-2))
        trainer.train()
        counts = {k: c.as_dict() for k, c in feature_counts.snapshot().items()}.get("sequence_parallel") or {}
        every: list = [None] * world
        dist.all_gather_object(every, {"amounts": counts.get("amounts", {}), "fallbacks": counts.get("fallbacks", {})})
        plan = getattr(trainer, "hf_ddpfix_plan", None)
        said = f"{plan.sequence_parallel.value}: {plan.sequence_parallel.reason}" if plan is not None else ""
        weights = trainable_weights(trainer.model)
        hist = [(h["loss"], h.get("grad_norm")) for h in trainer.state.log_history if "loss" in h]
        ref = one[case]
        route = sp_losses.route_of(case)
        rec = {"case": case, "patched": t.is_patched(), "plan": said, "route": route,
               "route_batches": [c["amounts"].get(route.replace("-", "_") + "_batches", 0) for c in every],
               "fallbacks": [c["fallbacks"] for c in every],
               "one_weight_diff": max((weights[k] - ref["weights"][k]).abs().max().item() for k in weights),
               "one_loss_diff": hist_diff(ref["hist"], hist, 0)}
        rec["ok"] = (rec["patched"] and "N=2" in said and f"loss {route}" in said
                     and rec["route_batches"] == [8] * world and not any(rec["fallbacks"])
                     and rec["one_weight_diff"] <= sp_losses.TOL and rec["one_loss_diff"] <= 1e-5)
        v.add(rec)
    dist.barrier()
    v.finish()


if __name__ == "__main__":
    main()
