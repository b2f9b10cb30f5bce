"""DeepSpeed ZeRO-2/3 under the HF Trainer vs the stock DDP reference, 2 gloo processes, several cases per
process (one interpreter start, one DeepSpeed import: CI pays them once per suite).

Run:  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/deepspeed_train.py --suite text --out /tmp/ds_text.json

Suites (the DDP references run first: once a DeepSpeed TrainingArguments exists, accelerate stays in
DeepSpeed mode for the rest of the process):

- ``text``: tiny Llama LoRA, variable lengths. Reference: stock Trainer, DDP, non-reentrant checkpointing
  (stock picks find_unused_parameters=True for a PeftModel). hf_ddpfix ZeRO-2 and ZeRO-3 with *reentrant*
  checkpointing must end within 1e-5 of it. A tiny MoE whose experts are separate modules, routed so
  rank 0 uses experts 0-2 and rank 1 only expert 3: stock DDP reference vs hf_ddpfix ZeRO-3 (the plan
  marks the MoE block a ZeRO-3 leaf module).
- ``vlm``: Qwen2.5-VL, LoRA on every linear incl. the vision tower; rank 0 always has an image, rank 1
  never. Reference: stock DDP (fu=True). hf_ddpfix ZeRO-2 and ZeRO-3 within 1e-5 of it. The same for
  LLaVA (LoRA on tower, projector and language model; its dummy goes through ``get_image_features``).
  Gradient accumulation 2 under ZeRO-3 (Qwen2.5-VL): one image micro-batch per step, on rank 0, rank 1,
  rank 0 (micro-batch 0, 0, 1), so every rank mixes image and text micro-batches and no step is
  all-text; reference: stock DDP with accumulation 2 (no_sync). Then every rank text-only: stock ZeRO-3
  vs hf_ddpfix ZeRO-3 (what stock DeepSpeed does when no rank has an image: zero-filled vision
  gradients) within 1e-5.
- ``vlm`` also runs the ``zero_skip_unused`` cases (``skip_unused`` alone; tests/test_deepspeed.py runs it with
  ``DS_SKIP_CKPT=reentrant DS_TEST_GRAD_ACCUM=2``; ``non_reentrant`` by hand): Qwen2.5-VL, 4 steps, an image on
  rank 0 at step 0, on no rank at steps 1-2, on rank 1 at step 3; hf_ddpfix ZeRO-2 and ZeRO-3 with the option
  within 1e-5 here (the test holds them to its SKIP_UNUSED_TOL) of stock DDP, and
  ZeRO-2 without it (the gap, asserted by the test). ``skip_unused_paligemma`` (by hand): PaliGemma's pooling
  head, never in the loss, under ZeRO-3 with and without the option.
- ``stock_mixed``: stock ZeRO-3 with the mixed layout; expected to FAIL (collective mismatch): the
  failure hf_ddpfix fixes.
- ``eval``: Qwen2.5-VL LoRA (tower included) trained with the mixed layout, then ``trainer.evaluate()``,
  ``trainer.predict()`` (logits) and a ``predict()`` whose ``prediction_step`` calls ``generate(synced_gpus=
  True)``, evaluation batches mixed too (rank 0 image, rank 1 text, variable lengths): under hf_ddpfix DDP,
  ZeRO-2 and ZeRO-3, eval loss, logits and generated tokens equal a single-process reference computed
  from the same trained weights; the eval dummies are counted (``feature_counts["stabilizer"]``).
- ``discovered``: VLMs with no hand-written family (InternVL, Idefics3, PaliGemma, SmolVLM under ZeRO-3,
  Mistral 3 under ZeRO-2; LoRA on tower, projector and language model), rank 0 always with an image, rank 1
  never: the dummy built from each model's config, within 1e-5 of stock DDP (find_unused_parameters=True),
  except the tensors no rank ever gives a gradient (PaliGemma's SigLIP pooling head), reported apart.
- ``stock_discovered``: stock ZeRO-3 with Idefics3 and the same layout; expected to FAIL.
- ``stock_eval``: stock ZeRO-3 ``evaluate()`` on the mixed evaluation set; expected to FAIL with the
  collective mismatch the ``eval`` suite fixes.

AdamW with weight_decay=0.1 and max_grad_norm=1.0 everywhere (a zero and a missing gradient differ).
Rank 0 writes a JSON summary (max |diff| per case, plan lines, dummy-image runs) to ``--out`` and every
rank prints ``DEEPSPEED_OK`` when all comparisons hold.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from fixtures import (  # noqa: E402
    add_lora,
    build_qwen2_5_vl,
    finish_suite,
    in_order,
    lora,
    make_batch,
    tiny_llama,
    trainable_weights,
    variable_length_ids,
    zero_config,
)
from torch import nn  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from zoo import ZERO_DISCOVERED, ZOO  # noqa: E402

from hf_ddpfix import DDPFixTrainer  # noqa: E402
from hf_ddpfix._compat import checkpointing_training_args  # noqa: E402

TOL = 1e-5
STEPS = 3
SKIP_STEPS = 4  # the skip_unused cases: an image on rank 0 at step 0, none at steps 1-2, on rank 1 at step 3
SKIP_CKPT = os.environ.get("DS_SKIP_CKPT", "off")  # the skip_unused cases with (non_)reentrant checkpointing
ACCUM = int(os.environ.get("DS_TEST_GRAD_ACCUM", "1"))  # gradient accumulation of every case (the test: 2 for skip_unused)

Stock, Fixed = in_order(Trainer), in_order(DDPFixTrainer)  # rank r gets samples r, r+2, ...: exact layouts


GEN_TOKENS = 3


class Generating:
    """``prediction_step`` that returns ``generate(...)``'s new tokens (the Seq2SeqTrainer pattern) when
    ``self.generate_tokens`` is set; ``synced_gpus`` as transformers picks it under ZeRO-3 (True)."""

    generate_tokens = False

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if not self.generate_tokens:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        with torch.no_grad():
            out = self.accelerator.unwrap_model(model).generate(
                **inputs, max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS, do_sample=False,
                synced_gpus=dist.get_world_size() > 1)
        return None, out[:, inputs["input_ids"].shape[1]:], None


class StockGen(Generating, Stock):
    pass


class FixedGen(Generating, Fixed):
    pass


# ------------------------------------------------------------------------------------------------ MoE


class Expert(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.gelu(self.w1(h)))


class MoEBlock(nn.Module):
    """Experts as separate modules (as in remote-code MoE models); token t goes to expert ``id % n``."""

    def __init__(self, d: int, n: int):
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(Expert(d) for _ in range(n))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(h), dim=-1)
        out = h
        for e in route.unique().tolist():
            idx = (route == e).nonzero().squeeze(1)
            out = out.index_add(0, idx, self.experts[e](h[idx]) * probs[idx, e : e + 1])
        return out


class TinyMoE(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, n: int = 4, layers: int = 2):
        super().__init__()
        self.n = n
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MoEBlock(d, n) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels=None, attention_mask=None):
        ids = input_ids.reshape(-1)
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, ids % self.n)
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits[:-1], labels.reshape(-1)[1:])
        return {"loss": loss, "logits": logits}


def moe_rows(n: int) -> list[dict]:
    """Even samples (rank 0) use experts 0-2, odd samples (rank 1) only expert 3; lengths vary."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        length = 8 + (i % 3) * 3
        ids = torch.randint(0, 15, (length,), generator=g)
        ids = ids * 4 + (torch.randint(0, 3, (length,), generator=g) if i % 2 == 0 else 3)
        rows.append({"input_ids": ids.tolist()})
    return rows


# ------------------------------------------------------------------------------------------------ data


def text_collate(batch):
    ids = torch.tensor([b["input_ids"] for b in batch])
    return {"input_ids": ids, "labels": ids.clone()}


def vlm_rows(n: int, layout: str) -> list[dict]:
    """``mixed``: even samples (rank 0) with an image; ``text``: none; ``ga`` (2 processes, accumulation
    2: sample i is micro-batch (i // 2) % 2 of step i // 4 on rank i % 2): samples 0, 5, 10; ``skip``
    (2 processes, 4 steps): the first and the last sample (step 0 rank 0, step 3 rank 1; none in steps 1-2)."""
    rows = []
    for i in range(n):
        has_image = ((layout == "mixed" and i % 2 == 0) or (layout == "ga" and i % 5 == 0)
                     or (layout == "skip" and i in (0, n - 1)))
        b = make_batch(has_image, seed=i)
        ids = b["input_ids"][0].tolist()
        if not has_image:
            ids = ids[: 10 + i % 5]  # variable lengths
        rows.append({"input_ids": ids, "pixel_values": b["pixel_values"].tolist() if has_image else None,
                     "image_grid_thw": b["image_grid_thw"].tolist() if has_image else None})
    return rows


ZOO_ALL = {**ZOO, **ZERO_DISCOVERED}
SEQUENCE_KEYS = ("input_ids", "labels", "token_type_ids", "mm_token_type_ids")
IMAGE_KEYS = ("pixel_values", "image_sizes")


def zoo_rows(family: str, n: int, images: set[int]) -> list[dict]:
    """Rows of a zoo VLM (e.g. LLaVA: ``pixel_values [1, 3, 28, 28]``; Mistral 3 also ``image_sizes``,
    PaliGemma ``token_type_ids``); text rows have variable lengths and ``None`` image inputs."""
    rows = []
    for i in range(n):
        b = ZOO_ALL[family].batch(i in images, i, 16 if i in images else 10 + i % 5)
        row = {k: b[k][0].tolist() for k in SEQUENCE_KEYS if k in b}
        row.update({k: b[k].tolist() if k in b else None for k in IMAGE_KEYS})
        rows.append(row)
    return rows


def zoo_collate(batch):
    out = {k: torch.tensor([b[k] for b in batch]) for k in SEQUENCE_KEYS if k in batch[0]}
    for key in IMAGE_KEYS:
        imgs = [torch.tensor(b[key]) for b in batch if b.get(key) is not None]
        if imgs:
            out[key] = torch.cat(imgs)
    return out


def vlm_collate(batch):
    out = text_collate(batch)
    imgs = [b for b in batch if b.get("pixel_values") is not None]
    if imgs:
        out["pixel_values"] = torch.cat([torch.tensor(b["pixel_values"]) for b in imgs])
        out["image_grid_thw"] = torch.cat([torch.tensor(b["image_grid_thw"]) for b in imgs])
    return out


# ------------------------------------------------------------------------------------------------ runs


def run(name: str, model: nn.Module, rows: list[dict], collate, *, stage: int | None, fixed: bool,
        ckpt: str = "off", accum: int = ACCUM, steps: int = STEPS, options: dict | None = None) -> dict:
    """Train ``steps`` optimizer steps (hf_ddpfix ``options`` as DDPFixConfig fields); returns weights, plan
    report, timing and the ``zero_skip_unused`` feature counts."""
    from hf_ddpfix.config.options import DDPFixConfig
    from hf_ddpfix.ops import feature_counts

    t0 = time.time()
    kw: dict = {}
    if stage is not None:
        kw["deepspeed"] = zero_config(stage)
    if ckpt != "off":
        kw.update(checkpointing_training_args(True, {"use_reentrant": ckpt == "reentrant"}))
    args = TrainingArguments(output_dir=f"/tmp/hf_ddpfix_ds_{name}", per_device_train_batch_size=1, max_steps=steps,
                             gradient_accumulation_steps=accum,
                             report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2, weight_decay=0.1,
                             max_grad_norm=1.0, remove_unused_columns=False, disable_tqdm=True, seed=0,
                             logging_steps=1, **kw)
    extra = {"ddpfix_config": DDPFixConfig(**options)} if options else {}
    cls = Fixed if fixed else Stock
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=collate, **extra)
    trainer.train()
    skip = feature_counts.snapshot().get("zero_skip_unused")
    plan = getattr(trainer, "hf_ddpfix_plan", None)
    rt = getattr(trainer, "hf_ddpfix_runtime", None)
    zv = getattr(rt, "zero_vision", None)
    out = {"weights": trainable_weights(model), "seconds": time.time() - t0,
           "plan": plan.report(width=None) if plan is not None else None,
           "checkpointing": plan.checkpointing.value if plan is not None else None,
           "stabilizer": plan.vlm_stabilizer.value if plan is not None else None,
           "leaf": plan.zero3_leaf_modules.value if plan is not None else None,
           "dummy_runs": zv.dummy_runs if zv is not None else 0,
           "skip_unused": plan.zero_skip_unused.value if plan is not None else None,
           "skip_counts": ({"ran": skip.ran, "fell_back": skip.fell_back, **skip.amounts} if skip else None)}
    dist.barrier()
    del trainer
    gc.collect()
    print(f"DS_CASE {name} trained in {out['seconds']:.1f}s", flush=True)
    return out


def reference_eval(model: nn.Module, weights: dict[str, torch.Tensor], rows: list[dict]) -> dict:
    """One process: ``weights`` loaded into ``model``; per-sample loss, logits and greedy new tokens."""
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, w in weights.items():
            params[name].copy_(w)
    model.eval()
    losses, logits, tokens = [], [], []
    with torch.no_grad():
        for row in rows:
            batch = vlm_collate([row])
            out = model(**batch)
            losses.append(out.loss.item())
            logits.append(out.logits[0].clone())
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            gen = model.generate(**inputs, max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS, do_sample=False)
            tokens.append(gen[0, batch["input_ids"].shape[1]:].clone())
    return {"eval_loss": sum(losses) / len(losses), "logits": logits, "tokens": tokens}


def train_and_evaluate(name: str, model: nn.Module, rows: list[dict], eval_rows: list[dict], *,
                       stage: int | None, fixed: bool = True) -> dict:
    """Train ``STEPS`` steps (mixed layout), then evaluate, predict (logits) and predict by generation."""
    from hf_ddpfix.ops import feature_counts

    kw: dict = {"deepspeed": zero_config(stage)} if stage is not None else {}
    args = TrainingArguments(output_dir=f"/tmp/hf_ddpfix_ds_{name}", per_device_train_batch_size=1,
                             per_device_eval_batch_size=1, max_steps=STEPS, report_to=[], use_cpu=True,
                             save_strategy="no", learning_rate=1e-2, weight_decay=0.1, max_grad_norm=1.0,
                             remove_unused_columns=False, disable_tqdm=True, seed=0, **kw)
    cls = FixedGen if fixed else StockGen
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(rows),
                  eval_dataset=Dataset.from_list(eval_rows), data_collator=vlm_collate)
    feature_counts.reset()
    t0 = time.time()
    if rows:
        trainer.train()
    train_counts = feature_counts.snapshot().get("stabilizer")
    feature_counts.reset()
    dist.barrier()
    print(f"EVALUATING on rank {dist.get_rank()}", flush=True)  # what fails after this fails in evaluation
    metrics = trainer.evaluate()
    pred = trainer.predict(Dataset.from_list(eval_rows))
    trainer.generate_tokens = True
    gen = trainer.predict(Dataset.from_list(eval_rows))
    eval_counts = feature_counts.snapshot().get("stabilizer")
    out = {"weights": trainable_weights(model), "eval_loss": metrics["eval_loss"],
           "predict_loss": pred.metrics["test_loss"], "logits": pred.predictions, "tokens": gen.predictions,
           "seconds": time.time() - t0,
           "train_dummies": train_counts.amounts.get("train_dummies", 0) if train_counts else 0,
           "eval_dummies": eval_counts.amounts.get("eval_dummies", 0) if eval_counts else 0,
           "plan": trainer.hf_ddpfix_plan.report(width=None) if getattr(trainer, "hf_ddpfix_plan", None) else None}
    dist.barrier()
    del trainer
    gc.collect()
    print(f"DS_CASE {name} trained and evaluated in {out['seconds']:.1f}s", flush=True)
    return out


def eval_diffs(got: dict, ref: dict, rows: list[dict]) -> dict:
    """|eval loss - ref|, |predict loss - ref|, max |logit - ref| over real positions, generated tokens equal."""
    logits = torch.as_tensor(got["logits"])
    tokens = torch.as_tensor(got["tokens"])
    logit_diff = 0.0
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        logit_diff = max(logit_diff, (logits[i, :n].float() - ref["logits"][i].float()).abs().max().item())
    same_tokens = all(torch.equal(tokens[i, :GEN_TOKENS].long(), ref["tokens"][i].long()) for i in range(len(rows)))
    return {"eval_loss_diff": abs(got["eval_loss"] - ref["eval_loss"]),
            "predict_loss_diff": abs(got["predict_loss"] - ref["eval_loss"]), "logit_diff": logit_diff,
            "tokens_equal": same_tokens}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def moved(a: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    return max_diff(a, before)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--suite", choices=["text", "vlm", "skip_unused", "skip_unused_paligemma", "stock_mixed", "eval", "stock_eval", "discovered",
                                       "stock_discovered"], required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # models below are built before any Trainer
    rank, world = dist.get_rank(), dist.get_world_size()
    n = STEPS * world * ACCUM
    summary: dict = {"suite": a.suite, "cases": {}}
    failures: list[str] = []

    def compare(name: str, got: dict, ref: dict, start: dict, split_unused: bool = False, check: bool = True) -> None:
        """Weights within TOL of the reference; with ``split_unused``, the trainable tensors the DDP reference
        never moved (no rank ever gave them a gradient: AdamW skipped them) are reported apart (DeepSpeed
        steps them with zero gradients: weight decay; docs/deepspeed.md) and left out of TOL."""
        unused = [k for k in ref["weights"] if split_unused and torch.equal(ref["weights"][k], start[k])]
        keep = [k for k in ref["weights"] if k not in unused]
        d = max_diff({k: got["weights"][k] for k in keep}, {k: ref["weights"][k] for k in keep})
        summary["cases"][name] = {k: v for k, v in got.items() if k != "weights"}
        summary["cases"][name].update(max_diff=d, moved=moved(ref["weights"], start), unused=unused,
                                      unused_max_diff=max((got["weights"][k] - ref["weights"][k]).abs().max().item()
                                                          for k in unused) if unused else 0.0)
        print(f"DS_CASE {name} max|w - ref| = {d:.3g} (weights moved {summary['cases'][name]['moved']:.3g})",
              flush=True)
        if check and not d <= TOL:
            worst = sorted(((got["weights"][k].float() - ref["weights"][k].float()).abs().max().item(), k)
                           for k in keep)[-3:]
            failures.append(f"{name}: max diff {d:.3g} > {TOL} (worst: {worst})")

    skip_rows = vlm_rows(SKIP_STEPS * world * ACCUM, "skip")

    def skip_unused_ref(model: nn.Module) -> dict:
        """Stock DDP on the ``skip`` layout (before any DeepSpeed TrainingArguments exists)."""
        return run("ddp_ref_vlm_skip", model, skip_rows, vlm_collate, stage=None, fixed=False, steps=SKIP_STEPS,
                   ckpt="non_reentrant" if SKIP_CKPT != "off" else "off")

    def skip_unused_cases(skip_models: list[nn.Module], start: dict, skip_ref: dict) -> None:
        """Steps where no rank has an image between steps where one has (layout ``skip``): stock DDP vs hf_ddpfix
        ZeRO-2 and ZeRO-3 with ``zero_skip_unused`` (within TOL, counts checked) and ZeRO-2 without (the gap)."""
        for i, (stage, on) in enumerate(((2, True), (3, True), (2, False)), start=1):
            name = f"zero{stage}_vlm_skip_{'on' if on else 'off'}"
            got = run(name, skip_models[i], skip_rows, vlm_collate, stage=stage, fixed=True, steps=SKIP_STEPS,
                      options={"zero_skip_unused": True} if on else None, ckpt=SKIP_CKPT)
            compare(name, got, skip_ref, start, check=on)  # off: the gap is asserted by the test
            summary["cases"][name]["vision_diff"] = max_diff(
                {k: v for k, v in got["weights"].items() if ".visual." in k},
                {k: v for k, v in skip_ref["weights"].items() if ".visual." in k})
            counts = got["skip_counts"] or {}
            if on and not (got["skip_unused"] is True and counts.get("ran") == SKIP_STEPS and not counts.get(
                    "fell_back") and counts.get("restored_elements", 0) > 0 and counts.get("recomputed_elements", 0) > 0):
                failures.append(f"{name}: plan {got['skip_unused']}, counts {counts} on rank {rank}")
            if not on and (got["skip_unused"] is not False or counts):
                failures.append(f"{name}: plan {got['skip_unused']}, counts {counts} (expected off, nothing run)")
    if a.suite == "text":
        rows = [{"input_ids": ids} for ids in variable_length_ids(n, lengths=(6, 11, 8, 14, 9, 12))]
        start = trainable_weights(lora(tiny_llama(0)))
        ref = run("ddp_ref_text", lora(tiny_llama(0)), rows, text_collate, stage=None, fixed=False,
                  ckpt="non_reentrant")
        torch.manual_seed(0)
        moe_start = trainable_weights(TinyMoE())
        torch.manual_seed(0)
        ref_moe = run("ddp_ref_moe", TinyMoE(), moe_rows(n), text_collate, stage=None, fixed=False)
        for stage in (2, 3):
            got = run(f"zero{stage}_text", lora(tiny_llama(0)), rows, text_collate, stage=stage, fixed=True,
                      ckpt="reentrant")
            compare(f"zero{stage}_text", got, ref, start)
            if got["checkpointing"] != "reentrant":
                failures.append(f"zero{stage}_text: plan checkpointing {got['checkpointing']}")
        torch.manual_seed(0)
        got = run("zero3_moe", TinyMoE(), moe_rows(n), text_collate, stage=3, fixed=True)
        compare("zero3_moe", got, ref_moe, moe_start)
        if got["leaf"] != "MoEBlock":
            failures.append(f"zero3_moe: plan leaf modules {got['leaf']!r}")
    elif a.suite == "vlm":
        rows = vlm_rows(n, "mixed")
        # Every model is built before the first ZeRO-3 TrainingArguments exists: after it, transformers
        # builds models under zero.Init (partitioned), and peft then refuses LoRA on the tower's Conv3d
        # ("Conv3d layer kernel must have 5 dimensions, not 1") - stock behaviour, not ours.
        models = [add_lora(build_qwen2_5_vl(0)) for _ in range(7)]
        skip_models = [add_lora(build_qwen2_5_vl(0)) for _ in range(4)]  # DDP ref, ZeRO-2 on, ZeRO-3 on, ZeRO-2 off
        llava = [ZOO["llava"].model(0) for _ in range(3)]
        start, llava_start = trainable_weights(models[0]), trainable_weights(llava[0])
        ga_rows = vlm_rows(STEPS * world * 2, "ga")
        ref = run("ddp_ref_vlm", models[0], rows, vlm_collate, stage=None, fixed=False, ckpt="non_reentrant")
        llava_rows = zoo_rows("llava", n, set(range(0, n, 2)))  # rank 0 always with an image, rank 1 never
        llava_ref = run("ddp_ref_llava", llava[0], llava_rows, zoo_collate, stage=None, fixed=False,
                        ckpt="non_reentrant")
        ga_ref = run("ddp_ref_vlm_ga2", models[5], ga_rows, vlm_collate, stage=None, fixed=False,
                     ckpt="non_reentrant", accum=2)
        skip_ref = skip_unused_ref(skip_models[0])

        def check_dummy(name: str, got: dict, runs: int) -> None:
            if got["stabilizer"] is not True or got["dummy_runs"] != runs:
                failures.append(f"{name}: stabiliser {got['stabilizer']}, {got['dummy_runs']} dummy runs on "
                                f"rank {rank} (expected {runs})")

        for stage in (2, 3):
            name = f"zero{stage}_vlm_mixed"
            got = run(name, models[stage - 1], rows, vlm_collate, stage=stage, fixed=True, ckpt="non_reentrant")
            compare(name, got, ref, start)
            check_dummy(name, got, STEPS * ACCUM if rank == 1 else 0)
            name = f"zero{stage}_llava_mixed"
            got = run(name, llava[stage - 1], llava_rows, zoo_collate, stage=stage, fixed=True,
                      ckpt="non_reentrant")
            compare(name, got, llava_ref, llava_start)
            check_dummy(name, got, STEPS * ACCUM if rank == 1 else 0)
        got = run("zero3_vlm_mixed_ga2", models[6], ga_rows, vlm_collate, stage=3, fixed=True, ckpt="non_reentrant",
                  accum=2)
        compare("zero3_vlm_mixed_ga2", got, ga_ref, start)
        check_dummy("zero3_vlm_mixed_ga2", got, 2 * STEPS - (2 if rank == 0 else 1))
        skip_unused_cases(skip_models, start, skip_ref)
        text_rows = vlm_rows(n, "text")
        stock = run("zero3_vlm_text_stock", models[3], text_rows, vlm_collate, stage=3, fixed=False)
        got = run("zero3_vlm_text_fixed", models[4], text_rows, vlm_collate, stage=3, fixed=True)
        compare("zero3_vlm_text_fixed", got, stock, start)
        if got["dummy_runs"] != STEPS * ACCUM:
            failures.append(f"zero3_vlm_text_fixed: {got['dummy_runs']} dummy runs on rank {rank}")
    elif a.suite == "skip_unused":  # the vlm suite's skip_unused cases alone (the test: GA 2, reentrant)
        skip_models = [add_lora(build_qwen2_5_vl(0)) for _ in range(4)]
        skip_start = trainable_weights(skip_models[0])
        skip_unused_cases(skip_models, skip_start, skip_unused_ref(skip_models[0]))
    elif a.suite == "skip_unused_paligemma":  # by hand: a head outside the loss (SigLIP pooling), ZeRO-3
        models = [ZOO_ALL["paligemma"].model(0) for _ in range(3)]
        rows = zoo_rows("paligemma", n, set(range(0, n, 2)))
        start = trainable_weights(models[0])
        ref = run("ddp_ref_paligemma", models[0], rows, zoo_collate, stage=None, fixed=False)
        for model, on in ((models[1], True), (models[2], False)):
            name = f"zero3_paligemma_skip_{'on' if on else 'off'}"
            got = run(name, model, rows, zoo_collate, stage=3, fixed=True,
                      options={"zero_skip_unused": True} if on else None)
            compare(name, got, ref, start, split_unused=True)
            print(f"DS_CASE {name} never-used tensors {len(summary['cases'][name]['unused'])}: max diff "
                  f"{summary['cases'][name]['unused_max_diff']:.3g}; counts {got['skip_counts']}", flush=True)
    elif a.suite == "eval":
        rows = vlm_rows(n, "mixed")
        eval_rows = [dict(r) for r in vlm_rows(2 * world, "mixed")]  # eval sample i -> rank i % 2: 0 image, 1 text
        for i, r in enumerate(eval_rows):  # other samples than training's, variable lengths
            b = make_batch(i % 2 == 0, seed=100 + i)
            r["input_ids"] = b["input_ids"][0].tolist()[: None if i % 2 == 0 else 9 + i]
            r["pixel_values"] = b["pixel_values"].tolist() if i % 2 == 0 else None
        models = {k: add_lora(build_qwen2_5_vl(0)) for k in ("ddp", "zero2", "zero3")}  # before any ZeRO-3 args
        refs = {k: add_lora(build_qwen2_5_vl(0)) for k in models}
        only = os.environ.get("DS_EVAL_ONLY")  # run one case by hand: ddp, zero2 or zero3
        for key, stage in (("ddp", None), ("zero2", 2), ("zero3", 3)):
            if only and key != only:
                continue
            name = f"{key}_eval_mixed"
            got = train_and_evaluate(name, models[key], rows, eval_rows, stage=stage)
            ref = reference_eval(refs[key], got["weights"], eval_rows)
            diffs = eval_diffs(got, ref, eval_rows)
            summary["cases"][name] = {**diffs, "seconds": got["seconds"], "train_dummies": got["train_dummies"],
                                      "eval_dummies": got["eval_dummies"], "plan": got["plan"]}
            print(f"DS_CASE {name} rank {rank} {diffs} train_dummies={got['train_dummies']} "
                  f"eval_dummies={got['eval_dummies']}", flush=True)
            if not (diffs["eval_loss_diff"] <= TOL and diffs["predict_loss_diff"] <= TOL
                    and diffs["logit_diff"] <= TOL and diffs["tokens_equal"]):
                failures.append(f"{name}: {diffs}")
            # rank 1 (text-only) runs one dummy per training step on ZeRO and, on ZeRO-3 only, one per evaluation
            # forward where rank 0 passes an image: evaluate, predict and generate's prefill, 2 batches each
            want_train = STEPS if (stage is not None and rank == 1) else 0
            want_eval = 3 * world if (stage == 3 and rank == 1) else 0
            if (got["train_dummies"], got["eval_dummies"]) != (want_train, want_eval):
                failures.append(f"{name}: rank {rank} dummies train {got['train_dummies']} eval "
                                f"{got['eval_dummies']} (expected {want_train}, {want_eval})")
    elif a.suite in ("discovered", "stock_discovered"):
        cases = [("internvl", 3), ("mistral3", 2), ("idefics3", 3), ("paligemma", 3), ("smolvlm", 3)]
        if a.suite == "stock_discovered":
            rows = zoo_rows("idefics3", n, set(range(0, n, 2)))
            run("zero3_idefics3_stock", ZOO_ALL["idefics3"].model(0), rows, zoo_collate, stage=3, fixed=False)
            print("STOCK_TRAINED", flush=True)
            cases = []
        models = {f: (ZOO_ALL[f].model(0), ZOO_ALL[f].model(0)) for f, _ in cases}  # before any ZeRO-3 args
        rows = {f: zoo_rows(f, n, set(range(0, n, 2))) for f, _ in cases}  # rank 0 always with an image, 1 never
        starts = {f: trainable_weights(models[f][0]) for f, _ in cases}
        refs = {f: run(f"ddp_ref_{f}", models[f][0], rows[f], zoo_collate, stage=None, fixed=False)
                for f, _ in cases}  # every DDP reference before the first DeepSpeed TrainingArguments
        for family, stage in cases:
            name = f"zero{stage}_{family}_mixed"
            got = run(name, models[family][1], rows[family], zoo_collate, stage=stage, fixed=True)
            compare(name, got, refs[family], starts[family], split_unused=True)
            want = STEPS * ACCUM if rank == 1 else 0
            if got["stabilizer"] is not True or got["dummy_runs"] != want:
                failures.append(f"{name}: stabiliser {got['stabilizer']}, {got['dummy_runs']} dummy runs on rank "
                                f"{rank} (expected {want})")
    elif a.suite == "stock_eval":  # expected to fail: rank 1 skips the tower rank 0 gathers
        rows = [dict(r) for r in vlm_rows(2 * world, "mixed")]
        train_and_evaluate("zero3_eval_stock", add_lora(build_qwen2_5_vl(0)), [], rows, stage=3, fixed=False)
        print("STOCK_EVALUATED", flush=True)
    else:  # stock_mixed: expected to fail with a collective mismatch
        run("zero3_vlm_mixed_stock", add_lora(build_qwen2_5_vl(0)), vlm_rows(n, "mixed"), vlm_collate, stage=3,
            fixed=False)
        print("STOCK_TRAINED", flush=True)

    finish_suite(a.out, summary, failures, "DEEPSPEED")


if __name__ == "__main__":
    main()
