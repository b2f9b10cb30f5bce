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
- ``stock_mixed``: stock ZeRO-3 with the mixed layout; expected to FAIL (collective mismatch): the
  failure hf_ddpfix fixes.

AdamW with weight_decay=0.1 and max_grad_norm=1.0 everywhere (a zero and a missing gradient differ).
Rank 0 writes a JSON summary (max |diff| per case, plan lines, dummy-image runs) to ``--out`` and every
rank prints ``DEEPSPEED_OK`` when all comparisons hold.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from fixtures import add_lora, build_qwen2_5_vl, lora, make_batch, tiny_llama, variable_length_ids  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from zoo import ZOO  # noqa: E402

from hf_ddpfix import DDPFixTrainer  # noqa: E402
from hf_ddpfix._compat import checkpointing_training_args  # noqa: E402

TOL = 1e-5
STEPS = 3
ACCUM = int(os.environ.get("DS_TEST_GRAD_ACCUM", "1"))  # manual checks with accumulation


def ds_config(stage: int) -> dict:
    """The smallest ZeRO config the Trainer fills in ("auto"); threshold 0 so ZeRO-3 shards tiny params."""
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0)
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": zero}


class Stock(Trainer):
    def _get_train_sampler(self, *args, **kwargs):  # rank r gets samples r, r+2, ...: exact layouts
        return SequentialSampler(self.train_dataset)


class Fixed(DDPFixTrainer):
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


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
    2: sample i is micro-batch (i // 2) % 2 of step i // 4 on rank i % 2): samples 0, 5, 10."""
    rows = []
    for i in range(n):
        has_image = (layout == "mixed" and i % 2 == 0) or (layout == "ga" and i % 5 == 0)
        b = make_batch(has_image, seed=i)
        ids = b["input_ids"][0].tolist()
        if not has_image:
            ids = ids[: 10 + i % 5]  # variable lengths
        rows.append({"input_ids": ids, "pixel_values": b["pixel_values"].tolist() if has_image else None,
                     "image_grid_thw": b["image_grid_thw"].tolist() if has_image else None})
    return rows


def zoo_rows(family: str, n: int, images: set[int]) -> list[dict]:
    """Rows of a zoo VLM (e.g. LLaVA: ``pixel_values [1, 3, 28, 28]``); text rows have variable lengths."""
    rows = []
    for i in range(n):
        b = ZOO[family].batch(i in images, i, 16 if i in images else 10 + i % 5)
        rows.append({"input_ids": b["input_ids"][0].tolist(), "labels": b["labels"][0].tolist(),
                     "pixel_values": b["pixel_values"].tolist() if "pixel_values" in b else None})
    return rows


def zoo_collate(batch):
    out = {"input_ids": torch.tensor([b["input_ids"] for b in batch]),
           "labels": torch.tensor([b["labels"] for b in batch])}
    imgs = [torch.tensor(b["pixel_values"]) for b in batch if b.get("pixel_values") is not None]
    if imgs:
        out["pixel_values"] = torch.cat(imgs)
    return out


def vlm_collate(batch):
    out = text_collate(batch)
    imgs = [b for b in batch if b.get("pixel_values") is not None]
    if imgs:
        out["pixel_values"] = torch.cat([torch.tensor(b["pixel_values"]) for b in imgs])
        out["image_grid_thw"] = torch.cat([torch.tensor(b["image_grid_thw"]) for b in imgs])
    return out


# ------------------------------------------------------------------------------------------------ runs


def trainable_weights(model: nn.Module, stage: int | None) -> dict[str, torch.Tensor]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}
    return {n: p.detach().clone() for n, p in params}


def run(name: str, model: nn.Module, rows: list[dict], collate, *, stage: int | None, fixed: bool,
        ckpt: str = "off", accum: int = ACCUM) -> dict:
    """Train ``STEPS`` optimizer steps; returns weights, plan report and timing."""
    t0 = time.time()
    kw: dict = {}
    if stage is not None:
        kw["deepspeed"] = ds_config(stage)
    if ckpt != "off":
        kw.update(checkpointing_training_args(True, {"use_reentrant": ckpt == "reentrant"}))
    args = TrainingArguments(output_dir=f"/tmp/hf_ddpfix_ds_{name}", per_device_train_batch_size=1, max_steps=STEPS,
                             gradient_accumulation_steps=accum,
                             report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2, weight_decay=0.1,
                             max_grad_norm=1.0, remove_unused_columns=False, disable_tqdm=True, seed=0,
                             logging_steps=1, **kw)
    cls = Fixed if fixed else Stock
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=collate)
    trainer.train()
    plan = getattr(trainer, "hf_ddpfix_plan", None)
    rt = getattr(trainer, "hf_ddpfix_runtime", None)
    zv = getattr(rt, "zero_vision", None)
    out = {"weights": trainable_weights(model, stage), "seconds": time.time() - t0,
           "plan": plan.report() if plan is not None else None,
           "checkpointing": plan.checkpointing.value if plan is not None else None,
           "stabilizer": plan.vlm_stabilizer.value if plan is not None else None,
           "leaf": plan.zero3_leaf_modules.value if plan is not None else None,
           "dummy_runs": zv.dummy_runs if zv is not None else 0}
    dist.barrier()
    del trainer
    gc.collect()
    print(f"DS_CASE {name} trained in {out['seconds']:.1f}s", flush=True)
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def moved(a: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    return max_diff(a, before)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--suite", choices=["text", "vlm", "stock_mixed"], required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # models below are built before any Trainer
    rank, world = dist.get_rank(), dist.get_world_size()
    n = STEPS * world * ACCUM
    summary: dict = {"suite": a.suite, "cases": {}}
    failures: list[str] = []

    def compare(name: str, got: dict, ref: dict, start: dict) -> None:
        d = max_diff(got["weights"], ref["weights"])
        summary["cases"][name] = {k: v for k, v in got.items() if k != "weights"}
        summary["cases"][name].update(max_diff=d, moved=moved(ref["weights"], start))
        print(f"DS_CASE {name} max|w - ref| = {d:.3g} (weights moved {summary['cases'][name]['moved']:.3g})",
              flush=True)
        if not d <= TOL:
            failures.append(f"{name}: max diff {d:.3g} > {TOL}")

    if a.suite == "text":
        rows = [{"input_ids": ids} for ids in variable_length_ids(n, lengths=(6, 11, 8, 14, 9, 12))]
        start = trainable_weights(lora(tiny_llama(0)), None)
        ref = run("ddp_ref_text", lora(tiny_llama(0)), rows, text_collate, stage=None, fixed=False,
                  ckpt="non_reentrant")
        torch.manual_seed(0)
        moe_start = trainable_weights(TinyMoE(), None)
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
        llava = [ZOO["llava"].model(0) for _ in range(3)]
        start, llava_start = trainable_weights(models[0], None), trainable_weights(llava[0], None)
        ga_rows = vlm_rows(STEPS * world * 2, "ga")
        ref = run("ddp_ref_vlm", models[0], rows, vlm_collate, stage=None, fixed=False, ckpt="non_reentrant")
        llava_rows = zoo_rows("llava", n, set(range(0, n, 2)))  # rank 0 always with an image, rank 1 never
        llava_ref = run("ddp_ref_llava", llava[0], llava_rows, zoo_collate, stage=None, fixed=False,
                        ckpt="non_reentrant")
        ga_ref = run("ddp_ref_vlm_ga2", models[5], ga_rows, vlm_collate, stage=None, fixed=False,
                     ckpt="non_reentrant", accum=2)

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
        text_rows = vlm_rows(n, "text")
        stock = run("zero3_vlm_text_stock", models[3], text_rows, vlm_collate, stage=3, fixed=False)
        got = run("zero3_vlm_text_fixed", models[4], text_rows, vlm_collate, stage=3, fixed=True)
        compare("zero3_vlm_text_fixed", got, stock, start)
        if got["dummy_runs"] != STEPS * ACCUM:
            failures.append(f"zero3_vlm_text_fixed: {got['dummy_runs']} dummy runs on rank {rank}")
    else:  # stock_mixed: expected to fail with a collective mismatch
        run("zero3_vlm_mixed_stock", add_lora(build_qwen2_5_vl(0)), vlm_rows(n, "mixed"), vlm_collate, stage=3,
            fixed=False)
        print("STOCK_TRAINED", flush=True)

    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({**summary, "failures": failures}, f, indent=1, default=str)
    if failures:
        raise SystemExit("DEEPSPEED_FAIL " + "; ".join(failures))
    print("DEEPSPEED_OK", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
