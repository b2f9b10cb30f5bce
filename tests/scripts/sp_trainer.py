"""Sequence parallelism through the stock Trainer (patch_trainer / HF_DDPFIX_SEQUENCE_PARALLEL / patches/) vs the
same run without it (stock DDP, hf_ddpfix unpatched) and one process: logged losses, grad norms, final LoRA
weights, evaluate() loss, predict() loss and logits (at every real token); evaluation and prediction sharded.

    python -m torch.distributed.run --standalone --nproc_per_node=4 tests/scripts/sp_trainer.py OUT.json --sp 2 --ga 3

Every run: tiny LoRA Llama (sdpa), variable lengths (not divisible by N), right padding, prompt-masked labels
(some shards without a valid label), 2 optimizer steps; SGD without clipping and AdamW with clipping and
weight decay. World 2 with --sp 2: N=2, DP=1; world 4 with --sp 2: DP2 x SP2.
"""

from __future__ import annotations

import argparse
import contextlib
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
from hf_ddpfix.trainer import is_patched  # noqa: E402

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


def hist_diff(a: list, b: list, i: int) -> float:
    """Largest difference of logged value `i` (0: loss, 1: grad_norm) between two runs' histories; a value
    one run logged and the other did not is a mismatch (inf). transformers < 5.3 logs no grad_norm when
    max_grad_norm is 0 (it measures the norm only to clip): absent in both runs, there is nothing to compare
    (the SGD weights, lr * gradient, still are)."""
    diffs = [0.0 if x[i] is None and y[i] is None else float("inf") if x[i] is None or y[i] is None
             else abs(x[i] - y[i]) for x, y in zip(a, b, strict=True)]
    return max(diffs, default=0.0)


def real_lengths(ds: Dataset) -> list[int]:
    return [len(r["input_ids"]) for r in ds]


def logits_diff(a: dict, b: dict) -> float:
    """Largest |difference| of `predict()` logits at the real tokens of every evaluation sample."""
    return max(float(abs(x[:n] - y[:n]).max()) for x, y, n in zip(a["pred"], b["pred"], a["lengths"], strict=True))


class _Offload:
    """The compose case's activation offload on CPU: the plan is told an accelerator exists and the runtime's
    `ActivationOffload` copies through host buffers (simulate mode: the CUDA state machine on CPU tensors,
    bit-exact by construction; tests/test_offload_plan.py does the same in one process)."""

    def __enter__(self) -> None:
        import dataclasses
        import functools

        import hf_ddpfix.runtime as runtime_mod
        import hf_ddpfix.trainer as trainer_mod
        from hf_ddpfix.ops.offload import ActivationOffload

        self.saved = (trainer_mod.gather_facts, runtime_mod.ActivationOffload)
        real = trainer_mod.gather_facts
        trainer_mod.gather_facts = lambda tr: dataclasses.replace(real(tr), accelerator_available=True)
        runtime_mod.ActivationOffload = functools.partial(ActivationOffload, min_bytes=0, simulate=True)
        os.environ["HF_DDPFIX_OFFLOAD_MIN_LAYER_MIB"] = "0"  # copy always: these layers are tiny

    def __exit__(self, *exc: object) -> None:
        import hf_ddpfix.runtime as runtime_mod
        import hf_ddpfix.trainer as trainer_mod

        trainer_mod.gather_facts, runtime_mod.ActivationOffload = self.saved
        os.environ.pop("HF_DDPFIX_OFFLOAD_MIN_LAYER_MIB", None)


def run(optim: str, ga: int, out: str, sp: int | None, via: str, batch: int = 2, compose: bool = False) -> dict:
    """One Trainer run: train 2 steps, evaluate, predict. `via`: "patch_trainer", "env" (HF_DDPFIX_SEQUENCE_PARALLEL
    + patch_trainer()), "patches" (the sitecustomize's own patch, no hf_ddpfix call), or "" (stock, unpatched)."""
    # the patches case runs first: the sitecustomize's patch and the launch's HF_DDPFIX_SEQUENCE_PARALLEL
    env_from_launch = os.environ.get("HF_DDPFIX_SEQUENCE_PARALLEL") == str(sp) if via == "patches" else None
    os.environ.pop("HF_DDPFIX_SEQUENCE_PARALLEL", None)
    patched_at_start = is_patched()
    if via != "patches":
        unpatch_trainer()
    extra = dict(tiled_mlp="2", tiled_loss="on", offload_activations=True) if compose else {}
    if sp and via in ("env", "patches"):  # (patches: the launch's value, put back for a launch without it)
        os.environ["HF_DDPFIX_SEQUENCE_PARALLEL"] = str(sp)
    if sp and via == "env":
        patch_trainer(**extra)
    elif sp and via == "patch_trainer":
        patch_trainer(sequence_parallel=sp, **extra)
    feature_counts.reset()
    model = lora_llama(attn_implementation="sdpa")
    # AdamW's first steps are ~lr * sign(g): float noise in a near-zero gradient moves a weight by up to lr,
    # so its lr is small enough that 1e-5 is a real bound (SGD: lr * g, no amplification)
    kw = dict(optim="sgd", max_grad_norm=0.0, weight_decay=0.0, learning_rate=5e-2) if optim == "sgd" else \
        dict(optim="adamw_torch", max_grad_norm=0.05, weight_decay=0.1, learning_rate=2e-4)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
                             gradient_accumulation_steps=ga, max_steps=2, report_to=[],
                             use_cpu=True, save_strategy="no", remove_unused_columns=False, disable_tqdm=True,
                             seed=0, logging_steps=1, ddp_find_unused_parameters=False, **kw,
                             **(checkpointing_training_args(True, {"use_reentrant": False}) if compose else {}))
    eval_ds = dataset(8, 2)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(48, 1), eval_dataset=eval_ds,
                      data_collator=collate)
    with _Offload() if compose else contextlib.nullcontext():
        trainer.train()
    ev = trainer.evaluate()
    pred = trainer.predict(eval_ds)
    snap = {k: c.as_dict() for k, c in feature_counts.snapshot().items()}
    hist = [(h["loss"], h.get("grad_norm")) for h in trainer.state.log_history if "loss" in h]
    plan = getattr(trainer, "hf_ddpfix_plan", None)
    res = {"weights": trainable_weights(model), "hist": hist, "eval": ev["eval_loss"], "predict_loss":
           pred.metrics["test_loss"], "pred": list(pred.predictions), "lengths": real_lengths(eval_ds),
           "counts": snap, "patched_at_start": patched_at_start, "env_from_launch": env_from_launch, "layers": model.config.num_hidden_layers,
           "plan": plan.sequence_parallel.text if plan is not None else None,
           "plan_offload": plan.offload_activations.value if plan is not None else None}
    unpatch_trainer()
    os.environ.pop("HF_DDPFIX_SEQUENCE_PARALLEL", None)
    del trainer
    return res


#: (case, optimizer, how hf_ddpfix is switched on, compose). "patches" runs first: the sitecustomize's patch
#: is the one installed at start-up (every other run unpatches / patches again).
CASES = (("trainer/patches", "sgd", "patches", False), ("trainer/sgd", "sgd", "patch_trainer", False),
         ("trainer/adamw_clip", "adamw", "env", False), ("trainer/compose", "sgd", "patch_trainer", True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--ga", type=int, default=1)
    p.add_argument("--single-for", type=int, default=0,
                   help="world size W: run one process with batch 2*W (the reference) and save it to OUT")
    p.add_argument("--single", default=None, help="the one-process reference saved by --single-for")
    p.add_argument("--compose", action="store_true",
                   help="also SGD with non-reentrant checkpointing + tiled MLP (2 shards) + tiled loss + activation "
                   "offload under SP, and SGD through patches/ (launch with patches/ on PYTHONPATH)")
    a = p.parse_args()
    r, world = init_gloo()
    log = rank_log()
    cases = [c for c in CASES if a.compose or c[0] in ("trainer/sgd", "trainer/adamw_clip")]
    optims = sorted({c[1] for c in cases})
    if a.single_for:  # the same global batch in one process: sampler order and GA normalisation are the Trainer's
        torch.save({o: run(o, a.ga, a.out + ".one", None, "", batch=2 * a.single_for) for o in optims}, a.out)
        v = Verdicts("SPT", None)
        v.finish()
        return
    single = torch.load(a.single, weights_only=False) if a.single else None
    v = Verdicts("SPT", a.out)
    refs: dict[str, dict] = {}
    for case, optim, via, compose in cases:
        got = run(optim, a.ga, a.out + ".sp", a.sp, via, compose=compose)
        if optim not in refs:  # stock DDP, same world, no SP (after the patches case: its patch is gone by then)
            refs[optim] = run(optim, a.ga, a.out + ".ref", None, "")
        ref = refs[optim]
        one = single[optim] if single else None
        one_w = max((one["weights"][k] - got["weights"][k]).abs().max().item() for k in one["weights"]) if one else None
        one_l = hist_diff(one["hist"], got["hist"], 0) if one else None
        one_g = hist_diff(one["hist"], got["hist"], 1) if one else None
        one_e = max(abs(one["eval"] - got["eval"]), abs(one["predict_loss"] - got["predict_loss"])) if one else None
        one_p = logits_diff(one, got) if one else None
        wdiff = max((ref["weights"][k] - got["weights"][k]).abs().max().item() for k in ref["weights"])
        ldiff = hist_diff(ref["hist"], got["hist"], 0)
        gdiff = hist_diff(ref["hist"], got["hist"], 1)
        ediff = max(abs(ref["eval"] - got["eval"]), abs(ref["predict_loss"] - got["predict_loss"]))
        pdiff = logits_diff(ref, got)
        counts = got["counts"]
        c = counts.get("sequence_parallel") or {"ran": 0, "fallbacks": {}, "amounts": {}}
        ok = (max(wdiff, ldiff, gdiff, ediff, pdiff) <= TOL and c["ran"] > 0
              and c["amounts"].get("sharded_batches", 0) > 0 and c["amounts"].get("eval_sharded_batches", 0) > 0
              and len(ref["hist"]) == 2 and (one is None or max(one_w, one_l, one_g, one_e, one_p) <= TOL)
              and (got["plan"] or "").startswith(f"N={a.sp} DP={world // a.sp}"))
        v.add({"case": case, "world": world, "sp": a.sp, "ga": a.ga, "via": via, "plan": got["plan"], "layers": got["layers"],
               "plan_offload": got["plan_offload"], "patched_at_start": got["patched_at_start"],
               "env_from_launch": got["env_from_launch"],
               "weight_diff": wdiff, "loss_diff": ldiff, "grad_norm_diff": gdiff, "eval_diff": ediff,
               "logits_diff": pdiff, "losses_ref": [h[0] for h in ref["hist"]], "losses_sp": [h[0] for h in got["hist"]],
               "grad_norms_sp": [h[1] for h in got["hist"]], "eval_ref": ref["eval"], "eval_sp": got["eval"],
               "attention_calls": c["ran"], "sharded_batches": c["amounts"].get("sharded_batches"),
               "eval_sharded_batches": c["amounts"].get("eval_sharded_batches"),
               "ddp_find_unused_false": c["amounts"].get("ddp_find_unused_false"), "sp_fallbacks": c["fallbacks"],
               "counts": {k: counts[k] for k in ("tiled_mlp", "tiled_loss", "offload") if k in counts},
               "one_process": None if one is None else {
                   "weight_diff": one_w, "loss_diff": one_l, "grad_norm_diff": one_g, "eval_diff": one_e,
                   "logits_diff": one_p, "losses": [h[0] for h in one["hist"]]}, "ok": ok})
        log(f"{case} done")
    dist.barrier()
    v.finish()


if __name__ == "__main__":
    main()
