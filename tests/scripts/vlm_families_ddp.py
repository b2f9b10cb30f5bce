"""2-process DDP cells of the VLM family sweep: hf_ddpfix's plan vs stock DDP, several families in one launch.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/vlm_families_ddp.py --families qwen2_5_vl,glm4v,llava [--report out.json]

Per family (``model_type``): the model is built tiny from its default config by the sweep's checked shrinker
(:func:`hf_ddpfix.rehearse.shrink_check.shrink_checked`, the same seed on both ranks), LoRA on every linear layer
(tower included), batches from the structural builder (:func:`hf_ddpfix.integrations.vision.sample.sample_batch`,
variable lengths). 4 optimizer steps with mixed image and text ranks: rank 0 only, no rank (an all-text step),
both, rank 1 only. AdamW(weight_decay=0.1) and clipping make a zero gradient and a missing one differ. Stock:
``DDP(find_unused_parameters=True)`` through accelerate; hf_ddpfix: the same loop with
:func:`hf_ddpfix.prepare_accelerate_loop` (the plan's DDP kwargs and parameter usage). Checks per family, on
every rank: the trainable weights equal stock's (``TOL``: bit-equal), replicas in sync. Prints ``VLM_FAMILIES_DDP_OK``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from fixtures import assert_same_across_ranks, teardown, trainable_weights  # noqa: E402

from hf_ddpfix import prepare_accelerate_loop  # noqa: E402

#: step -> image on (rank 0, rank 1)
PATTERN = {0: (True, False), 1: (False, False), 2: (True, True), 3: (False, True)}
#: the same math on both sides (parameter usage adds exact zeros; two ranks' sums are exact in any order): measured
#: 0.0 for glm4v, qwen2_5_vl, llava, idefics2 and mllama on 2026-12-02 (AdamW 1e-2, weight decay, clipping, fp32)
TOL = 0.0


def _model(model_type: str, seed: int) -> torch.nn.Module:
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    from hf_ddpfix.rehearse.family_sweep import families
    from hf_ddpfix.rehearse.shrink_check import shrink_checked

    cls = getattr(transformers, families()[model_type])
    checked = shrink_checked(AutoConfig.for_model(model_type), cls, seed=seed, small_images=True)
    assert checked.runs and checked.image == "ok", (model_type, checked.text, checked.image)
    torch.manual_seed(seed + 1)
    return get_peft_model(checked.model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))


def _train(model_type: str, fixed: bool, rank: int) -> dict[str, torch.Tensor]:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from hf_ddpfix.integrations.vision.sample import sample_batch

    handlers = [] if fixed else [DistributedDataParallelKwargs(find_unused_parameters=True)]
    accelerator = Accelerator(cpu=True, kwargs_handlers=handlers)
    model = _model(model_type, 0)
    run = prepare_accelerate_loop(accelerator, model) if fixed else None
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ddp, optimizer = accelerator.prepare(model, optimizer)
    for step, images in PATTERN.items():
        batch = sample_batch(model, image=images[rank], seq=6 + (3 * step + rank) % 5, seed=100 * rank + step)
        loss = ddp(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(ddp.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    if run is not None:
        run.close()
    weights = trainable_weights(model)
    accelerator.free_memory()
    return weights


def main() -> None:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    p.add_argument("--families", required=True)
    p.add_argument("--report", default="")
    args = p.parse_args()
    rank = int(os.environ.get("RANK", 0))
    report = {}
    for model_type in args.families.split(","):
        t0 = time.perf_counter()
        stock = _train(model_type, False, rank)
        fixed = _train(model_type, True, rank)
        assert_same_across_ranks(fixed, f"{model_type} hf_ddpfix")
        assert_same_across_ranks(stock, f"{model_type} stock")
        diff = max((stock[k] - fixed[k]).abs().max().item() for k in stock)
        report[model_type] = {"max_diff": diff, "tensors": len(stock), "seconds": round(time.perf_counter() - t0, 1)}
        print(f"[rank {rank}] {model_type}: max |hf_ddpfix - stock| = {diff:.1e} over {len(stock)} tensors", flush=True)
        assert diff <= TOL, (model_type, diff)
    if args.report and rank == 0:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    print(f"[rank {rank}] VLM_FAMILIES_DDP_OK", flush=True)
    teardown()


if __name__ == "__main__":
    main()
