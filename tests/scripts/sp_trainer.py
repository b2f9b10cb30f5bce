"""Sequence parallelism through the stock Trainer (patch_trainer / HF_DDPFIX_SEQUENCE_PARALLEL / patches/) vs the
same run without it (stock DDP, hf_ddpfix unpatched) and one process: logged losses, grad norms, final LoRA
weights, evaluate() loss, predict() loss and logits (at every real token); evaluation and prediction sharded.

    python -m torch.distributed.run --standalone --nproc_per_node=4 tests/scripts/sp_trainer.py OUT.json --sp 2 --ga 3

Every run: tiny LoRA Llama (sdpa), variable lengths (not divisible by N), right padding, prompt-masked labels
(some shards without a valid label), 2 optimizer steps; SGD without clipping and AdamW with clipping and
weight decay. World 2 with --sp 2: N=2, DP=1; world 4 with --sp 2: DP2 x SP2. `--vlm`: also Qwen2.5-VL LoRA
(vision tower included) over 3 steps, AdamW + clipping, images on some ranks only and a step without any.
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

# Tolerances at the measured precision, about 2x the worst figure of world 2 (N=2, GA 2, + composition, patches/,
# VLM) and world 4 (DP2 x SP2, GA 3), vs stock DDP without SP and vs one process (torch 2.13 CPU fp32,
# 2026-11-27). Beside them the stock spread: one float32 ulp of a loss near 5.5 is 4.8e-7; the same stock model's
# gradients with eager instead of sdpa attention differ by 1.2e-7.
TOL_WEIGHT = 5e-7  # measured SGD <= 3e-8 (VLM 5e-8); AdamW + clipping 2.1e-7 (Adam's 1/sqrt(v) amplifies rounding)
TOL_LOSS = 2e-6  # logged losses, eval and predict losses: measured <= 9.5e-7 (2 ulps)
TOL_GRAD_NORM = 1.5e-6  # logged grad norms: measured <= 7.2e-7
TOL_LOGITS = 2.5e-6  # predict() logits: measured <= 1.2e-6

#: model outputs that are not predictions, for `predict(ignore_keys=...)` (it replaces the model's default; a name a
#: release lacks is harmless): the KV cache (`past_key_values`; 5.24: `cache`, which accelerate cannot pad), Qwen-VL's
#: `rope_deltas`, and 5.24's `image_outputs` (the vision tower's output, on image batches only: stock's evaluation
#: loop cannot concatenate those batches' tuples with the others' logits)
NOT_PREDICTIONS = ("past_key_values", "cache", "rope_deltas", "image_outputs")

#: Long-context layers under SP (docs/sequence-parallel.md): optimizer key -> family. fp64, because AdamW's first
#: steps move a weight by ~lr * sign(g): in fp32 the tiled layer's other summation order (per 3-token tile) flips
#: near-zero gradient entries and the weights differ by up to lr (a bound that tells nothing); in fp64 a wrong
#: gradient still moves them by >= 1e-4 while rounding stays near 1e-15. LoRA on every linear layer,
#: non-reentrant checkpointing (the recompute runs the patched layer again), AdamW wd 0.1, clipping 1.0.
#: "lc_llama_sgd": with tiled MLP + tiled loss, whose head runs fp32 chunks (as stock's loss upcasts to fp32) and
#: sums them in another order: fp32 rounding in the loss gradient, which AdamW's sign would amplify; SGD (wd 0.1,
#: clipping 1.0) keeps it at its size.
LC_FAMILIES = ("lc_llama", "lc_qwen3", "lc_llama_sgd")
#: fp64, vs stock DDP and one process alike (2026-11-27, world 2 N=2 GA 2 and world 4 DP2 x SP2 GA 3): weights,
#: logged grad norms, predict logits measured <= 1.6e-13 (Llama, Qwen3, AdamW); the logged / evaluation losses
#: are the Trainer's fp32 accumulators: TOL_LOSS
TOL_LC = 1e-12  # ~6x the worst measured (AdamW amplifies the last bits of near-zero gradients)
#: with tiled MLP + tiled loss (fp32 head chunks, SGD): weights measured 1.24e-9, grad norms 7.3e-8, predict
#: logits 1.2e-7 (the same vs one process without SP: the tiled head's fp32 rounding, not sequence parallelism)
TOL_LC_TILED_WEIGHT, TOL_LC_TILED = 3e-9, 2.5e-7


def lc_model(optim: str) -> torch.nn.Module:
    """The tiny fp64 LoRA decoder of a long-context case (Llama, or Qwen3 with its q/k norms), all-linear LoRA."""
    if optim in ("lc_llama", "lc_llama_sgd"):
        return lora_llama(targets="all-linear", dtype=torch.float64, checkpointing="non_reentrant",
                          attn_implementation="sdpa")
    from fixtures import SMALL_TEXT
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**SMALL_TEXT, head_dim=16, max_position_embeddings=128, attn_implementation="sdpa")
    model = get_peft_model(Qwen3ForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                             init_lora_weights=False)).to(torch.float64)
    for m in model.modules():  # q/k norms start at w=1: random, so a norm applied on the wrong slice shows
        if type(m).__name__ == "Qwen3RMSNorm":
            torch.nn.init.normal_(m.weight, mean=1.0, std=0.2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


class _SmallTiles:
    """The Trainer's long_context applier with 3-token tiles and 5-token norm chunks (the defaults, 2048 / 4096,
    would run one tile on these short sequences): the runtime's `apply_long_context` with those keywords."""

    def __enter__(self) -> None:
        import functools

        import hf_ddpfix.runtime.attach as runtime_mod

        self.saved = runtime_mod.apply_long_context
        runtime_mod.apply_long_context = functools.partial(self.saved, tokens_per_tile=3, norm_chunk_tokens=5)

    def __exit__(self, *exc: object) -> None:
        import hf_ddpfix.runtime.attach as runtime_mod

        runtime_mod.apply_long_context = self.saved


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

        import hf_ddpfix.runtime.attach as runtime_mod
        import hf_ddpfix.trainer as trainer_mod
        from hf_ddpfix.ops.offload import ActivationOffload

        self.saved = (trainer_mod.gather_facts, runtime_mod.ActivationOffload)
        real = trainer_mod.gather_facts
        trainer_mod.gather_facts = lambda tr: dataclasses.replace(real(tr), accelerator_available=True)
        runtime_mod.ActivationOffload = functools.partial(ActivationOffload, min_bytes=0, simulate=True)
        os.environ["HF_DDPFIX_OFFLOAD_MIN_LAYER_MIB"] = "0"  # copy always: these layers are tiny

    def __exit__(self, *exc: object) -> None:
        import hf_ddpfix.runtime.attach as runtime_mod
        import hf_ddpfix.trainer as trainer_mod

        trainer_mod.gather_facts, runtime_mod.ActivationOffload = self.saved
        os.environ.pop("HF_DDPFIX_OFFLOAD_MIN_LAYER_MIB", None)


def run(optim: str, ga: int, out: str, sp: int | None, via: str, batch: int = 2, compose: bool | str = False) -> dict:
    """One Trainer run: train 2 steps, evaluate, predict. `via`: "patch_trainer", "env" (HF_DDPFIX_SEQUENCE_PARALLEL
    + patch_trainer()), "patches" (the sitecustomize's own patch, no hf_ddpfix call), or "" (stock, unpatched).
    `compose`: True (tiled MLP + tiled loss + offload + checkpointing), "lc" (long_context="all"), "lc_tiled"
    (long_context="all" + tiled MLP + tiled loss)."""
    # the patches case runs first: the sitecustomize's patch and the launch's HF_DDPFIX_SEQUENCE_PARALLEL
    env_from_launch = os.environ.get("HF_DDPFIX_SEQUENCE_PARALLEL") == str(sp) if via == "patches" else None
    os.environ.pop("HF_DDPFIX_SEQUENCE_PARALLEL", None)
    patched_at_start = is_patched()
    if via != "patches":
        unpatch_trainer()
    lc = isinstance(compose, str)
    extra = {"lc": dict(long_context="all"), "lc_tiled": dict(long_context="all", tiled_mlp="2", tiled_loss="on")}[
        compose] if lc else dict(tiled_mlp="2", tiled_loss="on", offload_activations=True) if compose else {}
    if sp and via in ("env", "patches"):  # (patches: the launch's value, put back for a launch without it)
        os.environ["HF_DDPFIX_SEQUENCE_PARALLEL"] = str(sp)
    if sp and via == "env":
        patch_trainer(**extra)
    elif sp and via == "patch_trainer":
        patch_trainer(sequence_parallel=sp, **extra)
    feature_counts.reset()
    vlm = optim.startswith("vlm_")
    optim = optim.removeprefix("vlm_")
    if vlm:
        from fixtures import add_lora, build_qwen2_5_vl

        model = add_lora(build_qwen2_5_vl(0))  # LoRA on every linear layer, vision tower included
    elif optim in LC_FAMILIES:
        model = lc_model(optim)
    else:
        model = lora_llama(attn_implementation="sdpa")
    # AdamW's first steps are ~lr * sign(g): float noise in a near-zero gradient moves a weight by up to lr,
    # so its lr is small enough that TOL_WEIGHT is a real bound (SGD: lr * g, no amplification)
    kw = dict(optim="sgd", max_grad_norm=0.0, weight_decay=0.0, learning_rate=5e-2) if optim == "sgd" else \
        dict(optim="sgd", max_grad_norm=1.0, weight_decay=0.1, learning_rate=5e-2) if optim == "lc_llama_sgd" else \
        dict(optim="adamw_torch", max_grad_norm=1.0, weight_decay=0.1, learning_rate=1e-2) if optim in LC_FAMILIES \
        else dict(optim="adamw_torch", max_grad_norm=0.05, weight_decay=0.1, learning_rate=2e-4)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
                             gradient_accumulation_steps=ga, max_steps=3 if vlm else 2, report_to=[],
                             use_cpu=True, save_strategy="no", remove_unused_columns=False, disable_tqdm=True,
                             seed=0, logging_steps=1, **kw,
                             # VLM: stock's default (a text-only rank leaves the tower unused); the SP run: the plan's
                             ddp_find_unused_parameters=None if vlm else False,
                             **(checkpointing_training_args(True, {"use_reentrant": False}) if compose is True else {}))
    if vlm:
        eval_ds = vlm_samples(4, 2)
        trainer = InOrder(model=model, args=args, train_dataset=vlm_samples(12, 1), eval_dataset=eval_ds,
                          data_collator=vlm_collate)
    else:
        eval_ds = dataset(8, 2)
        trainer = Trainer(model=model, args=args, train_dataset=dataset(48, 1), eval_dataset=eval_ds,
                          data_collator=collate)
    start = trainable_weights(model) if vlm else {}
    with _Offload() if compose is True else _SmallTiles() if lc else contextlib.nullcontext():
        trainer.train()
    trained = {k: c.as_dict() for k, c in feature_counts.snapshot().items()}  # training alone
    ev = trainer.evaluate()
    # what a user of these releases passes: outputs that are not predictions (stock gathers every other output)
    pred = trainer.predict(eval_ds, ignore_keys=list(NOT_PREDICTIONS))
    # the logits; transformers 5.0's Qwen-VL adds rope_deltas after them (a tuple of arrays)
    logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
    snap = {k: c.as_dict() for k, c in feature_counts.snapshot().items()}
    hist = [(h["loss"], h.get("grad_norm")) for h in trainer.state.log_history if "loss" in h]
    plan = getattr(trainer, "hf_ddpfix_plan", None)
    weights = trainable_weights(model)
    text_config = getattr(model.config, "text_config", model.config)
    res = {"weights": weights, "hist": hist, "eval": ev["eval_loss"], "predict_loss":
           pred.metrics["test_loss"], "pred": list(logits), "lengths": real_lengths(eval_ds),
           "counts": snap, "trained": trained, "patched_at_start": patched_at_start, "env_from_launch": env_from_launch, "layers": text_config.num_hidden_layers,
           "vision_moved": sum(int(not torch.equal(weights[k], start[k])) for k in start if "visual" in k),
           "find_unused": plan.find_unused_parameters.value if plan is not None else None,
           "plan": plan.sequence_parallel.text if plan is not None else None,
           "plan_offload": plan.offload_activations.value if plan is not None else None}
    unpatch_trainer()
    os.environ.pop("HF_DDPFIX_SEQUENCE_PARALLEL", None)
    del trainer
    return res


#: (case, optimizer, how hf_ddpfix is switched on, compose). "patches" runs first: the sitecustomize's patch
#: is the one installed at start-up (every other run unpatches / patches again).
CASES = (("trainer/patches", "sgd", "patches", False), ("trainer/sgd", "sgd", "patch_trainer", False),
         ("trainer/adamw_clip", "adamw", "env", False), ("trainer/compose", "sgd", "patch_trainer", True),
         ("trainer/vlm", "vlm_adamw", "patch_trainer", False),
         ("trainer/long_context_llama", "lc_llama", "patch_trainer", "lc"),
         ("trainer/long_context_qwen3", "lc_qwen3", "patch_trainer", "lc"),
         ("trainer/long_context_tiled", "lc_llama_sgd", "patch_trainer", "lc_tiled"))


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
    p.add_argument("--vlm", action="store_true",
                   help="also Qwen2.5-VL LoRA (vision included), AdamW + clipping, 3 steps, images on some ranks only")
    p.add_argument("--long-context", action="store_true",
                   help="also long_context='all' (3-token tiles) on a fp64 LoRA Llama and Qwen3, and with tiled MLP + "
                   "tiled loss, AdamW + clipping, vs stock DDP and one process; counters from every rank")
    a = p.parse_args()
    r, world = init_gloo()
    log = rank_log()
    cases = [c for c in CASES if c[0] in ("trainer/sgd", "trainer/adamw_clip") or (a.compose and c[3] is True)
             or (a.compose and c[0] == "trainer/patches") or (a.vlm and c[0] == "trainer/vlm")
             or (a.long_context and c[1] in LC_FAMILIES)]
    optims = sorted({c[1] for c in cases})
    if a.single_for:  # the same global batch in one process: sampler order and GA normalisation are the Trainer's
        # Qwen-VL declares accepts_loss_kwargs=False: stock averages per-micro-batch means, so its one-process
        # twin takes the world's micro-batches one after the other (batch 1, GA x W), each a full sequence
        torch.save({o: run(o, a.ga * a.single_for, a.out + ".one", None, "", batch=1) if o.startswith("vlm_") else
                    run(o, a.ga, a.out + ".one", None, "", batch=2 * a.single_for) for o in optims}, a.out)
        v = Verdicts("SPT", None)
        v.finish()
        return
    single = torch.load(a.single, weights_only=False) if a.single else None
    v = Verdicts("SPT", a.out)
    refs: dict[str, dict] = {}
    for case, optim, via, compose in cases:
        batch = 1 if optim.startswith("vlm_") else 2
        got = run(optim, a.ga, a.out + ".sp", a.sp, via, batch=batch, compose=compose)
        if optim not in refs:  # stock DDP, same world, no SP (after the patches case: its patch is gone by then)
            refs[optim] = run(optim, a.ga, a.out + ".ref", None, "", batch=batch)
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
        def within(w, lo, g, e, lg, optim=optim):
            if optim == "lc_llama_sgd":
                return w <= TOL_LC_TILED_WEIGHT and max(g, lg) <= TOL_LC_TILED and max(lo, e) <= TOL_LOSS
            if optim in LC_FAMILIES:  # the logged / evaluation losses are fp32 (the Trainer's accumulators)
                return max(w, g, lg) <= TOL_LC and max(lo, e) <= TOL_LOSS
            return w <= TOL_WEIGHT and max(lo, e) <= TOL_LOSS and g <= TOL_GRAD_NORM and lg <= TOL_LOGITS

        ok = (within(wdiff, ldiff, gdiff, ediff, pdiff) and c["ran"] > 0
              and c["amounts"].get("sharded_batches", 0) > 0 and c["amounts"].get("eval_sharded_batches", 0) > 0
              and len(ref["hist"]) == (3 if optim.startswith("vlm_") else 2) and (one is None or within(one_w, one_l, one_g, one_e, one_p))
              and (got["plan"] or "").startswith(f"N={a.sp} DP={world // a.sp}"))
        vision = {}
        if optim.startswith("vlm_"):
            usage = (counts.get("parameter_usage") or {"amounts": {}})["amounts"]
            vision = {"vision_sharded_forwards": c["amounts"].get("vision_sharded_forwards", 0),
                      "full_sequence_attention_calls": c["amounts"].get("full_sequence_attention_calls", 0),
                      "find_unused_parameters": got["find_unused"], "usage": usage,
                      "vision_weights_moved": got["vision_moved"], "ref_vision_weights_moved": ref["vision_moved"]}
            # every training micro-batch sharded after the image merge (and each evaluation / prediction batch);
            # the tower's attention on the full sequence; DDP without find_unused: the text-only micro-batches'
            # vision LoRA tied into the loss by parameter_usage, and the step without any image left them without
            # a gradient (else AdamW's weight decay moves them and the weights differ from stock's)
            ok = (ok and vision["vision_sharded_forwards"] >= 3 * a.ga and vision["full_sequence_attention_calls"] > 0
                  and got["find_unused"] is False and usage.get("output_ties_in_loss", 0) > 0
                  and usage.get("grads_reset", 0) > 0 and got["vision_moved"] > 0)
        if optim in LC_FAMILIES:  # every rank's training counters, judged here on every rank and in the test
            mine = {k: {"ran": got["trained"].get(k, {}).get("ran", 0), "fallbacks": got["trained"].get(k, {}).get(
                "fallbacks", {})} for k in ("long_context", "sequence_parallel", "tiled_mlp", "tiled_loss")}
            per_rank = [None] * world
            dist.all_gather_object(per_rank, mine)
            vision["per_rank_trained"] = per_rank
            # every training attention call ran sharded inside a patched layer (none stock, nothing fell back);
            # with tiled MLP + tiled loss, those ran too, without a fallback
            tiled = compose == "lc_tiled"
            ok = ok and all(m["long_context"]["ran"] == m["sequence_parallel"]["ran"] > 0
                            and (m["tiled_mlp"]["ran"] > 0 and m["tiled_loss"]["ran"] > 0) == tiled
                            and not any(m[k]["fallbacks"] for k in m) for m in per_rank)
        v.add({**vision, "case": case, "world": world, "sp": a.sp, "ga": a.ga, "via": via, "plan": got["plan"], "layers": got["layers"],
               "plan_offload": got["plan_offload"], "patched_at_start": got["patched_at_start"],
               "env_from_launch": got["env_from_launch"],
               "weight_diff": wdiff, "loss_diff": ldiff, "grad_norm_diff": gdiff, "eval_diff": ediff,
               "logits_diff": pdiff, "losses_ref": [h[0] for h in ref["hist"]], "losses_sp": [h[0] for h in got["hist"]],
               "grad_norms_sp": [h[1] for h in got["hist"]], "eval_ref": ref["eval"], "eval_sp": got["eval"],
               "attention_calls": c["ran"], "sharded_batches": c["amounts"].get("sharded_batches"),
               "eval_sharded_batches": c["amounts"].get("eval_sharded_batches"),
               "ddp_find_unused_false": c["amounts"].get("ddp_find_unused_false"), "sp_fallbacks": c["fallbacks"],
               "counts": {k: counts[k] for k in ("tiled_mlp", "tiled_loss", "offload", "long_context") if k in counts},
               "one_process": None if one is None else {
                   "weight_diff": one_w, "loss_diff": one_l, "grad_norm_diff": one_g, "eval_diff": one_e,
                   "logits_diff": one_p, "losses": [h[0] for h in one["hist"]]}, "ok": ok})
        log(f"{case} done")
    dist.barrier()
    v.finish()


if __name__ == "__main__":
    main()
