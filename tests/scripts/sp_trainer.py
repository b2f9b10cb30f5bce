"""Sequence parallelism through the stock Trainer (patch_trainer / HF_DDPFIX_SEQUENCE_PARALLEL) vs the same
run without it (stock DDP, hf_ddpfix unpatched): logged losses, grad norms, final LoRA weights, eval loss.

    python -m torch.distributed.run --standalone --nproc_per_node=4 tests/scripts/sp_trainer.py OUT.json --sp 2 --ga 3

Every run: tiny LoRA Llama (sdpa), variable lengths (not divisible by N), right padding, prompt-masked labels
(some shards without a valid label), 2 optimizer steps; SGD without clipping and AdamW with clipping and
weight decay. World 2 with --sp 2: N=2, DP=1; world 4 with --sp 2: DP2 x SP2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from fixtures import Verdicts, init_gloo, lora_llama, rank_log, trainable_weights  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_ddpfix import patch_trainer, unpatch_trainer  # noqa: E402
from hf_ddpfix._compat import checkpointing_training_args  # noqa: E402
from hf_ddpfix.ops import feature_counts  # noqa: E402

TOL = 1e-5


def dataset(n: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 5 + (i * 7) % 13
        ids = torch.randint(1, 250, (length,), generator=g).tolist()
        prompt = (length * 2) // 5 + (i % 3) * 2
        rows.append({"input_ids": ids, "labels": [-100] * min(prompt, length - 1) + ids[min(prompt, length - 1):]})
    return Dataset.from_list(rows)


def collate(batch):
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.tensor([b["input_ids"] + [0] * (n - len(b["input_ids"])) for b in batch])
    mask = torch.tensor([[1] * len(b["input_ids"]) + [0] * (n - len(b["input_ids"])) for b in batch])
    labels = torch.tensor([b["labels"] + [-100] * (n - len(b["labels"])) for b in batch])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def vlm_samples(n: int, seed: int) -> list[dict]:
    """Qwen2.5-VL samples in a fixed order (sequential sampler): lengths 13..20, prompt-masked labels, a
    4-token image (4x4 patches) in samples 0, 5 and 6 only. World 2, batch 1, GA 2: step 1 mixes an image
    rank with a text rank, step 2 has two images in its second micro-batch, step 3 has no image on any
    rank (vision LoRA grads must be None then: AdamW's weight decay would move them)."""
    from fixtures import IMAGE, PATCH_DIM, VEND, VSTART

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 13 + (i * 5) % 8
        ids = torch.randint(1, 240, (length,), generator=g)
        row: dict = {}
        if i in (0, 5, 6):
            start = 2 + i % 5
            ids[start - 1], ids[start:start + 4], ids[start + 4] = VSTART, IMAGE, VEND
            row["pixel_values"] = torch.randn(16, PATCH_DIM["qwen2_5_vl"], generator=g)
            row["image_grid_thw"] = torch.tensor([[1, 4, 4]])
        labels = ids.clone()
        labels[: 3 + i % 4] = -100
        rows.append({"input_ids": ids, "labels": labels, **row})
    return rows


def vlm_collate(batch: list[dict]) -> dict:
    """Right padding (mask 0, labels -100), `mm_token_type_ids` for the 3-D positions, images concatenated."""
    from fixtures import IMAGE

    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, b in enumerate(batch):
        k = len(b["input_ids"])
        ids[i, :k], mask[i, :k], labels[i, :k] = b["input_ids"], 1, b["labels"]
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels, "mm_token_type_ids": (ids == IMAGE).long()}
    imgs = [b for b in batch if "pixel_values" in b]
    if imgs:
        out["pixel_values"] = torch.cat([b["pixel_values"] for b in imgs])
        out["image_grid_thw"] = torch.cat([b["image_grid_thw"] for b in imgs])
    return out


class InOrder(Trainer):
    """Samples in dataset order, so which rank gets an image is fixed."""

    def _get_train_sampler(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return torch.utils.data.SequentialSampler(self.train_dataset)


def hist_diff(a: list, b: list, i: int) -> float:
    """Largest difference of logged value `i` (0: loss, 1: grad_norm) between two runs' histories; a value
    one run logged and the other did not is a mismatch (inf). transformers < 5.3 logs no grad_norm when
    max_grad_norm is 0 (it measures the norm only to clip): absent in both runs, there is nothing to compare
    (the SGD weights, lr * gradient, still are)."""
    diffs = [0.0 if x[i] is None and y[i] is None else float("inf") if x[i] is None or y[i] is None
             else abs(x[i] - y[i]) for x, y in zip(a, b, strict=True)]
    return max(diffs, default=0.0)


def run(optim: str, ga: int, out: str, sp: int | None, via_env: bool, batch: int = 2, compose: bool = False) -> dict:
    unpatch_trainer()
    os.environ.pop("HF_DDPFIX_SEQUENCE_PARALLEL", None)
    extra = {"tiled_mlp": "2"} if compose else {}
    if sp and via_env:
        os.environ["HF_DDPFIX_SEQUENCE_PARALLEL"] = str(sp)
        patch_trainer(**extra)
    elif sp:
        patch_trainer(sequence_parallel=sp, **extra)
    feature_counts.reset()
    vlm = optim.startswith("vlm_")
    optim = optim.removeprefix("vlm_")
    if vlm:
        from fixtures import add_lora, build_qwen2_5_vl

        model = add_lora(build_qwen2_5_vl(0))  # LoRA on every linear layer, vision tower included
    else:
        model = lora_llama(attn_implementation="sdpa")
    # AdamW's first steps are ~lr * sign(g): float noise in a near-zero gradient moves a weight by up to lr,
    # so its lr is small enough that 1e-5 is a real bound (SGD: lr * g, no amplification)
    kw = dict(optim="sgd", max_grad_norm=0.0, weight_decay=0.0, learning_rate=5e-2) if optim == "sgd" else \
        dict(optim="adamw_torch", max_grad_norm=0.05, weight_decay=0.1, learning_rate=2e-4)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
                             gradient_accumulation_steps=ga, max_steps=3 if vlm else 2, report_to=[],
                             use_cpu=True, save_strategy="no", remove_unused_columns=False, disable_tqdm=True,
                             seed=0, logging_steps=1, **kw,
                             # VLM: stock's default (a text-only rank leaves the tower unused); the SP run: the plan's
                             ddp_find_unused_parameters=None if vlm else False,
                             **(checkpointing_training_args(True, {"use_reentrant": False}) if compose else {}))
    if vlm:
        trainer = InOrder(model=model, args=args, train_dataset=vlm_samples(12, 1),
                          eval_dataset=vlm_samples(4, 2), data_collator=vlm_collate)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=dataset(48, 1), eval_dataset=dataset(8, 2),
                          data_collator=collate)
    res0 = trainable_weights(model) if vlm else {}
    trainer.train()
    ev = trainer.evaluate()
    snap = feature_counts.snapshot()
    counts = snap.get("sequence_parallel")
    tiled = snap.get("tiled_mlp")
    hist = [(h["loss"], h.get("grad_norm")) for h in trainer.state.log_history if "loss" in h]
    plan = getattr(trainer, "hf_ddpfix_plan", None)
    stab = snap.get("parameter_usage")
    start = res0 if vlm else {}
    weights = trainable_weights(model)
    res = {"weights": weights, "hist": hist, "eval": ev["eval_loss"], "usage": stab.as_dict() if stab else None,
           "vision_moved": sum(int(not torch.equal(weights[k], start[k])) for k in start if "visual" in k),
           "counts": counts.as_dict() if counts else None, "tiled_mlp_calls": tiled.ran if tiled else 0,
           "plan": plan.sequence_parallel.text if plan is not None else None,
           "find_unused": plan.find_unused_parameters.value if plan is not None else None}
    unpatch_trainer()
    os.environ.pop("HF_DDPFIX_SEQUENCE_PARALLEL", None)
    del trainer
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--ga", type=int, default=1)
    p.add_argument("--single-for", type=int, default=0,
                   help="world size W: run one process with batch 2*W (the reference) and save it to OUT")
    p.add_argument("--single", default=None, help="the one-process reference saved by --single-for")
    p.add_argument("--compose", action="store_true",
                   help="also SGD with non-reentrant checkpointing + tiled MLP (2 shards) under SP")
    p.add_argument("--vlm", action="store_true",
                   help="also Qwen2.5-VL LoRA (vision included), AdamW + clipping, 3 steps, images on some ranks only")
    a = p.parse_args()
    r, world = init_gloo()
    log = rank_log()
    optims: tuple[tuple[str, bool], ...] = (("sgd", False), ("adamw_clip", True))
    if a.compose:
        optims += (("sgd_ckpt_tiled", False),)
    if a.vlm:
        optims += (("vlm_adamw_clip", False),)
    per_device = {o: 1 if o.startswith("vlm_") else 2 for o, _ in optims}
    if a.single_for:  # the same global batch in one process: sampler order and GA normalisation are the Trainer's
        # Qwen-VL declares accepts_loss_kwargs=False: stock averages per-micro-batch means, so its one-process
        # twin takes the world's micro-batches one after the other (batch 1, GA x W), each a full sequence
        torch.save({o: run(o.removesuffix("_ckpt_tiled"), a.ga * a.single_for, a.out + ".one", None, False, batch=1)
                    if o.startswith("vlm_") else
                    run(o.removesuffix("_ckpt_tiled"), a.ga, a.out + ".one", None, False, batch=2 * a.single_for)
                    for o, _ in optims}, a.out)
        v = Verdicts("SPT", None)
        v.finish()
        return
    single = torch.load(a.single, weights_only=False) if a.single else None
    v = Verdicts("SPT", a.out)
    for optim, via_env in optims:
        ref = run(optim.removesuffix("_ckpt_tiled"), a.ga, a.out + ".ref", None, False, batch=per_device[optim])
        got = run(optim.removesuffix("_ckpt_tiled"), a.ga, a.out + ".sp", a.sp, via_env, batch=per_device[optim],
                  compose=optim.endswith("_ckpt_tiled"))
        one = single[optim] if single else None
        one_w = max((one["weights"][k] - got["weights"][k]).abs().max().item() for k in one["weights"]) if one else None
        one_l = hist_diff(one["hist"], got["hist"], 0) if one else None
        one_g = hist_diff(one["hist"], got["hist"], 1) if one else None
        one_e = abs(one["eval"] - got["eval"]) if one else None
        wdiff = max((ref["weights"][k] - got["weights"][k]).abs().max().item() for k in ref["weights"])
        ldiff = hist_diff(ref["hist"], got["hist"], 0)
        gdiff = hist_diff(ref["hist"], got["hist"], 1)
        c = got["counts"] or {"ran": 0, "fallbacks": {}, "amounts": {}}
        ok = (wdiff <= TOL and ldiff <= TOL and gdiff <= TOL and abs(ref["eval"] - got["eval"]) <= TOL
              and c["ran"] > 0 and c["amounts"].get("sharded_batches", 0) > 0
              and len(ref["hist"]) == (3 if optim.startswith("vlm_") else 2) and (not optim.endswith("_ckpt_tiled") or got["tiled_mlp_calls"] > 0) and (one is None or max(one_w, one_l, one_g, one_e) <= TOL) and (got["plan"] or "").startswith(f"N={a.sp} DP={world // a.sp}"))
        vision = {}
        if optim.startswith("vlm_"):  # the decoder was sharded after the image merge, every micro-batch
            usage = got["usage"] or {"amounts": {}}
            vision = {"vision_sharded_forwards": c["amounts"].get("vision_sharded_forwards", 0),
                      "full_sequence_attention_calls": c["amounts"].get("full_sequence_attention_calls", 0),
                      "find_unused_parameters": got["find_unused"], "usage": usage["amounts"],
                      "vision_weights_moved": got["vision_moved"], "ref_vision_weights_moved": ref["vision_moved"]}
            # every micro-batch sharded after the image merge; the tower's attention on the full sequence; DDP
            # without find_unused: the text-only micro-batches' vision LoRA tied into the loss by parameter_usage, and the
            # step without any image gave them no gradient (else AdamW's weight decay moves them: weights differ)
            ok = (ok and vision["vision_sharded_forwards"] == 3 * a.ga and vision["full_sequence_attention_calls"] > 0
                  and got["find_unused"] is False and usage["amounts"].get("output_ties_in_loss", 0) > 0
                  and usage["amounts"].get("grads_reset", 0) > 0 and got["vision_moved"] > 0)
        v.add({**vision, "case": f"trainer/{optim}", "world": world, "sp": a.sp, "ga": a.ga, "via": "env" if via_env else
               "patch_trainer", "plan": got["plan"], "weight_diff": wdiff, "loss_diff": ldiff, "grad_norm_diff": gdiff,
               "losses_ref": [h[0] for h in ref["hist"]], "losses_sp": [h[0] for h in got["hist"]],
               "grad_norms_sp": [h[1] for h in got["hist"]],
               "eval_ref": ref["eval"], "eval_sp": got["eval"], "attention_calls": c["ran"], "tiled_mlp_calls": got["tiled_mlp_calls"],
               "sharded_batches": c["amounts"].get("sharded_batches"), "fallbacks": c["fallbacks"], "one_process": None if one is None else {
                   "weight_diff": one_w, "loss_diff": one_l, "grad_norm_diff": one_g, "eval_diff": one_e,
                   "losses": [h[0] for h in one["hist"]]}, "ok": ok})
        log(f"{optim} done")
    dist.barrier()
    v.finish()


if __name__ == "__main__":
    main()
