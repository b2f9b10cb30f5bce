"""The 2-process cells of the VLM family sweep: each family through the Trainer under DDP and FSDP2, many families in
one launch, against stock DDP (issue 45).

Run (2 gloo processes on the CPU; the FSDP test device makes accelerate run FSDP2 there, docs/fsdp.md)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/scripts/vlm_family_cells.py --launch ddp --families llava,glm4v --out OUT
    PYTHONPATH=hf_ddpfix/rehearse/device:. accelerate launch --config_file accelerate_configs/fsdp.yaml \\
        --mixed_precision no tests/scripts/vlm_family_cells.py --launch fsdp --families llava,glm4v --out OUT
    PYTHONPATH=. accelerate launch --config_file accelerate_configs/zero3.yaml --mixed_precision no \\
        tests/scripts/vlm_family_cells.py --launch zero3 --families llava,glm4v --out OUT

Cells (one Trainer run each, in this order per family):

- ``--launch ddp``: ``stock`` (the stock ``Trainer``, ``ddp_find_unused_parameters=True``: the reference) and
  ``ddp`` (``DDPFixTrainer``: hf_ddpfix's plan);
- ``--launch fsdp``: ``fsdp_plan`` (``DDPFixTrainer``, the plan's FSDP2 units) and ``fsdp_list`` (``DDPFixTrainer``
  with ``fsdp_transformer_layer_cls_to_wrap`` = the family's ``<DecoderLayer>,<VisionBlock>`` list, the sweep's
  ``user_list``, set on the launch's plugin as the accelerate config would);
- ``--launch zero3`` (``accelerate launch --config_file accelerate_configs/zero3.yaml``, the file users launch, its
  ``ds_zero3.json`` as shipped): ``zero3`` (``DDPFixTrainer`` under DeepSpeed ZeRO-3 with :data:`ZERO3_ENV`; the
  family built whole, then partitioned when the engine starts).

Per family: the model is built tiny from its default config by the sweep's checked shrinker (the same seed on both
ranks), LoRA on every linear layer (tower included, peft's default init, seeded), batches from the structural
builder (:func:`hf_ddpfix.integrations.vision.sample.sample_batch`, variable lengths). :data:`STEPS` optimizer
steps, rank ``r``'s step ``k`` with an image as :data:`PATTERN` says (rank 0 only, no rank: an all-text step, both,
rank 1 only) where the sweep runs the family with an image; text only on every step where it does not; an image on
every rank and step where the model takes no text-only batch (BLIP, GIT, :data:`EVERY_STEP`). AdamW
(weight decay 0.1), clipping at 1.0, fp32, no checkpointing. Then ``evaluate()`` on one image rank and one text
rank (``prediction_loss_only``).

Each cell is isolated: an exception is recorded (a :class:`~hf_ddpfix.plan.types.PlanError` raised before step 1 as
``refused``, anything else as ``failed``) and the next cell runs. The process group is made with a short timeout
(:data:`PG_TIMEOUT`), so a collective mismatch or a hang ends the cell instead of the launch; after a failed cell
both ranks exchange their status, and when that exchange itself fails (the group is broken) the launch stops with
``CELLS_BROKEN <family>``: the driver (``scripts/vlm_families.py --cells``) launches the remaining families again.

Rank 0 writes ``OUT/<family>-<cell>.pt``: ``{"status": "trained" | "refused" | "failed", "error", "weights" (every
trainable tensor, FSDP2 shards gathered), "eval_loss", "units", "synced" (the ranks' trained weights hash equal),
"seconds", "images"}``. :func:`judge` compares them with ``stock``. Prints ``VLM_FAMILY_CELLS_OK`` at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

STEPS = 4
#: step -> image on (rank 0, rank 1)
PATTERN = ((True, False), (False, False), (True, True), (False, True))
EVAL_PATTERN = ((True, False),)
#: the ZeRO-3 cell's options: DeepSpeed steps every parameter each step (a zero gradient where no rank used it:
#: AdamW's moments and weight decay move it, stock DeepSpeed's semantics), where DDP leaves such a parameter alone
#: (the tower on the all-text step, an expert no rank routed to). ``zero_skip_unused`` gives the run DDP's
#: optimizer semantics (hf_ddpfix/integrations/deepspeed/zero_unused.py), so the cell compares with stock DDP; it
#: issues the same ZeRO-3 collectives either way (its one agreement all-reduce aside)
ZERO3_ENV = {"HF_DDPFIX_ZERO_SKIP_UNUSED": "1"}
#: the launches and their cells, in order
CELLS = {"ddp": ("stock", "ddp"), "fsdp": ("fsdp_plan", "fsdp_list"), "zero3": ("zero3",)}
#: the words of the mixed-image guard's error (hf_ddpfix/integrations/vision/mixed_guard.py): a ZeRO cell of a family
#: with no dummy image that stopped there is ``stopped``, not ``failed``
MIXED_STOP = "pass text only. Under ZeRO-"
#: the launch each cell runs in (a failed FSDP2 / ZeRO-3 cell is followed by ``stock_<launch>``: the stock Trainer
#: under the same engine, once per family)
LAUNCH_OF = {cell: launch for launch, cells in CELLS.items() for cell in cells}
#: the cells judged against stock DDP (``stock``)
COMPARED = ("ddp", "fsdp_plan", "fsdp_list", "zero3")
#: gloo's timeout for every collective (its default is 30 min): a cell whose ranks disagree ends here
PG_TIMEOUT = 240
#: hf_ddpfix's DDP vs stock DDP: the same math (parameter usage adds exact zeros; two ranks' sums are exact in any
#: order): bit-equal, measured 0.0 on every family of the full sweep. FSDP2 vs stock DDP: reduce-scatter vs
#: all-reduce order, and AdamW's division of a near-zero moment turns that rounding into a visible step
#: (tests/test_fsdp_trainer_zoo.py: 9.9e-7 on Qwen2-VL). Measured over every family of the full sweep (2026-12-02,
#: hf_ddpfix/rehearse/vlm_family_cells.json "max_spread"): 5.4e-6 (udop), 4.6e-6 (blip, both wrap modes: an image
#: every step), 3.0e-6 (lfm3_vl), 0 to 7e-7 for most; bound with a 2x margin. ZeRO-3 (its own reduction order and clipping, the
#: same AdamW amplification of near-zero moments): 5.8e-5 (gemma4_unified, text only: a few LoRA tensors; its eval
#: loss equal), 3.9e-6 (exaone4_5) and below for the other 48 equal families; bound with a 2x margin
TOL = {"ddp": 0.0, "fsdp_plan": 1e-5, "fsdp_list": 1e-5, "zero3": 1.2e-4}
#: the eval loss (a mean over two ranks' losses, ~10 for these random models), relative to max(1, stock's loss):
#: measured 1.9e-6 absolute (lighton_ocr, FSDP2 with the list), 0 under DDP
EVAL_TOL = {"ddp": 0.0, "fsdp_plan": 1e-6, "fsdp_list": 1e-6, "zero3": 1e-6}


#: ``images`` of a family whose tiny model takes no text-only batch (BLIP, GIT: the image is a required input)
EVERY_STEP = "every step"


def build(model_type: str):  # noqa: ANN201
    """The family's tiny model (the sweep's checked shrinker, seed 0) and its ``images``: True (mixed image / text
    ranks), False (text only: no image layout runs) or :data:`EVERY_STEP` (an image on every rank and step: the
    model runs no text-only batch, so no rank ever skips its tower; stock DDP is still the reference)."""
    import transformers
    from transformers import AutoConfig

    from hf_ddpfix.rehearse.family_sweep import families
    from hf_ddpfix.rehearse.shrink_check import shrink_checked

    cls = getattr(transformers, families()[model_type])
    checked = shrink_checked(AutoConfig.for_model(model_type), cls, seed=0, small_images=True)
    if checked.text != "ok" and checked.image != "ok":
        raise RuntimeError(f"the tiny model runs neither text only ({checked.text}) nor with an image "
                           f"({checked.image})")
    if checked.text != "ok":
        return checked.model, EVERY_STEP
    return checked.model, checked.image == "ok"


def lora(base: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``base`` with LoRA (r=2) on every linear layer but the output embedding (``family_sweep.with_lora``:
    ``"all-linear"``, or the same layers named in full where it breaks the model: Qwen3-Omni, Llama 4)."""
    from hf_ddpfix.rehearse.family_sweep import with_lora

    torch.manual_seed(1)
    model = with_lora(base)  # a copy: base is never touched
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model


def datasets(base: torch.nn.Module, images: bool | str, world: int):  # noqa: ANN201
    from fixtures import RankItems

    from hf_ddpfix.integrations.vision.sample import sample_batch

    def make(pattern, seed):  # noqa: ANN001, ANN202
        def item(k, r):  # noqa: ANN001, ANN202
            image = images == EVERY_STEP or (images is True and pattern[k % len(pattern)][r % 2])
            return sample_batch(base, image=image, seq=6 + (3 * k + r) % 5, seed=seed + 100 * k + r)

        return item

    return (RankItems(STEPS, world, make(PATTERN, 0)), RankItems(len(EVAL_PATTERN), world, make(EVAL_PATTERN, 5000)))


def training_args(out: str, stock: bool):  # noqa: ANN201
    """``label_names`` given: a model whose ``forward`` takes ``labels`` through ``**kwargs`` (Granite Docling)
    would otherwise evaluate without a loss in both modes."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=1, per_device_eval_batch_size=1,
        learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to="none", train_sampling_strategy="sequential", remove_unused_columns=False,
        use_cpu=True, seed=0, prediction_loss_only=True, disable_tqdm=True, label_names=["labels"],
        ddp_find_unused_parameters=True if stock else None)


def _digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha1()
    for n in sorted(weights):
        h.update(n.encode())
        h.update(weights[n].float().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_cell(model_type: str, cell: str, base: torch.nn.Module, images: bool | str, user_list: list[str],
             out: str) -> dict:
    """Train and evaluate one cell; the record rank 0 saves (without raising: the error is a field)."""
    import torch.distributed as dist
    from fixtures import single_collate, trainable_weights
    from transformers import Trainer

    from hf_ddpfix import DDPFixTrainer
    from hf_ddpfix.plan.types import PlanError

    world = dist.get_world_size()
    t0 = time.perf_counter()
    rec: dict = {"status": "trained", "images": images, "error": ""}
    trainer = plugin = saved = None
    try:
        train, evaluate = datasets(base, images, world)
        model = lora(base)
        args = training_args(os.path.join(out, f"run-{model_type}-{cell}"), stock=cell == "stock")
        cls = Trainer if cell.startswith("stock") else DDPFixTrainer
        trainer = cls(model=model, args=args, data_collator=single_collate, train_dataset=train,
                      eval_dataset=evaluate)
        plugin = trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None
        if cell.startswith("fsdp") or cell == "stock_fsdp":  # stock_fsdp: the launch's own plugin, as stock
            assert plugin is not None, "an FSDP cell under a launch without FSDP"
            saved = (plugin.transformer_cls_names_to_wrap, plugin.cpu_ram_efficient_loading)
            plugin.cpu_ram_efficient_loading = False  # the tiny model is built on every rank, not loaded
            if cell == "fsdp_list":
                plugin.transformer_cls_names_to_wrap = list(user_list)
                rec["user_list"] = list(user_list)
        if cell == "zero3":
            assert trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3, \
                "the zero3 cell under a launch without DeepSpeed ZeRO-3"
        trainer.train()
        rec["eval_loss"] = float(trainer.evaluate()["eval_loss"])
        from torch.distributed.fsdp import FSDPModule

        rec["units"] = [n for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)]
        weights = trainable_weights(trainer.model)
        rec["weights"] = weights
        rec["digest"] = _digest(weights)
    except PlanError as e:
        rec.update(status="refused", error=f"PlanError: {' '.join(str(e).split())}",
                   at_step=int(trainer.state.global_step) if trainer is not None else 0)
    except Exception as e:  # noqa: BLE001 - a cell's failure is its record
        rec.update(status="failed", error=f"{type(e).__name__}: {' '.join(str(e).split())[:600]}",
                   at_step=int(trainer.state.global_step) if trainer is not None else 0)
        if os.environ.get("CELLS_TRACEBACK"):
            traceback.print_exc()
    finally:
        if saved is not None:
            plugin.transformer_cls_names_to_wrap, plugin.cpu_ram_efficient_loading = saved
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def main() -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    p.add_argument("--launch", choices=sorted(CELLS), required=True)
    p.add_argument("--families", required=True, help="model_type values, comma-separated")
    p.add_argument("--out", required=True)
    p.add_argument("--cells", default="", help="only these cells of the launch, comma-separated")
    p.add_argument("--results", default=None, help="the sweep's results file (default: the shipped one)")
    a = p.parse_args()
    if a.launch == "zero3":
        os.environ.update(ZERO3_ENV)
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT))
    rank = dist.get_rank()
    from hf_ddpfix.rehearse.family_sweep import load_results

    recorded = load_results(a.results)["families"]
    cells = [c for c in CELLS[a.launch] if not a.cells or c in a.cells.split(",")]
    os.makedirs(a.out, exist_ok=True)
    for model_type in a.families.split(","):
        if a.launch == "zero3":  # the last cell's TrainingArguments switched zero.Init on: build this family whole,
            # as the sweep built it (DeepSpeed partitions it when the Trainer initialises the engine)
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        try:
            base, images = build(model_type)
        except Exception as e:  # noqa: BLE001 - the family is not run; same on both ranks (same build)
            for cell in cells:
                if rank == 0:
                    torch.save({"status": "not_run", "error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"},
                               os.path.join(a.out, f"{model_type}-{cell}.pt"))
            continue
        user_list = recorded.get(model_type, {}).get("user_list") or []
        for cell in cells:
            rec = run_cell(model_type, cell, base, images, user_list, a.out)
            try:  # both ranks' outcome: a cell failed on one rank only, or the group is broken
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, (rec["status"], rec.get("digest"), rec["error"][:300]))
            except Exception as e:  # noqa: BLE001 - the group is gone: the driver relaunches the rest
                if rank == 0:
                    rec.setdefault("error", "")
                    rec.update(status="failed", error=rec["error"] or f"process group broken: {e}")
                    torch.save(rec, os.path.join(a.out, f"{model_type}-{cell}.pt"))
                print(f"CELLS_BROKEN {model_type} {cell}", flush=True)
                os._exit(3)
            statuses = {s for s, _, _ in every}
            if statuses != {rec["status"]}:  # one rank trained, the other did not: the cell failed
                errors = [e for _, _, e in every if e]
                rec.update(status="failed" if "failed" in statuses or "trained" in statuses else rec["status"],
                           error=rec["error"] or f"another rank: {errors[0] if errors else statuses}")
            rec["synced"] = len({d for _, d, _ in every}) == 1
            if rank == 0:
                torch.save(rec, os.path.join(a.out, f"{model_type}-{cell}.pt"))
                print(f"[cell] {model_type} {cell}: {rec['status']} {rec['error'][:200]} "
                      f"eval_loss={rec.get('eval_loss')} {rec['seconds']}s", flush=True)
            reference = f"stock_{a.launch}"
            if (a.launch != "ddp" and statuses == {"failed"} and MIXED_STOP not in rec["error"]
                    and not os.path.exists(os.path.join(a.out, f"{model_type}-{reference}.pt"))):
                # hf_ddpfix's run failed on every rank under this engine (not at the guard): does the stock Trainer
                # fail too, in the same launch (the engine the user's config asks for)?
                stock = run_cell(model_type, reference, base, images, user_list, a.out)
                if rank == 0:
                    torch.save(stock, os.path.join(a.out, f"{model_type}-{reference}.pt"))
    print(f"[rank {rank}] VLM_FAMILY_CELLS_OK", flush=True)
    from hf_ddpfix.ops.dist import destroy_default_group

    destroy_default_group()


def judge(out: str, model_type: str, tol: dict | None = None, eval_tol: dict | None = None) -> dict:
    """The family's verdict from ``OUT/<family>-<cell>.pt``: per compared cell ``{"status": "equal" | "differs" |
    "refused" | "failed" | "stock_fails" (failed, and so did stock DDP: ``stock`` holds its error; or the stock
    Trainer run after it under the same engine, FSDP2 or ZeRO-3: ``stock_error``) | "stopped" (ZeRO,
    no dummy image: the mixed-image guard stopped the first mixed forward with its named error) | "not_run" |
    "no_reference" (trained, stock DDP did not) | "missing", "max_diff", "eval_diff", "error", "at_step",
    "units"}``, and
    ``images`` (True: mixed image/text ranks; False: text only, the sweep's image run fails; :data:`EVERY_STEP`:
    an image on every rank and step, the model runs no text-only batch)."""
    tol, eval_tol = tol or TOL, eval_tol or EVAL_TOL

    def load(cell):  # noqa: ANN001, ANN202
        path = os.path.join(out, f"{model_type}-{cell}.pt")
        return torch.load(path, weights_only=False) if os.path.exists(path) else None

    stock = load("stock")
    verdict: dict = {"images": None if stock is None else stock.get("images"), "cells": {}}
    if stock is not None and stock["status"] != "trained":
        verdict["stock"] = {"status": stock["status"], "error": stock.get("error", "")[:300]}
    for cell in COMPARED:
        rec = load(cell)
        if rec is None:
            verdict["cells"][cell] = {"status": "missing"}
            continue
        v: dict = {"status": rec["status"], "seconds": rec.get("seconds")}
        if rec.get("user_list"):
            v["user_list"] = rec["user_list"]
        if rec["status"] != "trained":
            v.update(error=rec.get("error", "")[:400], at_step=rec.get("at_step", 0))
            same_engine = load(f"stock_{LAUNCH_OF[cell]}") if cell != "ddp" else None
            if rec["status"] == "failed" and stock is not None and stock["status"] == "failed":
                v["status"] = "stock_fails"  # the stock Trainer fails this family too (its error is "stock")
            elif rec["status"] == "failed" and same_engine is not None and same_engine["status"] == "failed":
                # the stock Trainer fails it under the same engine too (stock FSDP2 / stock ZeRO-3)
                v.update(status="stock_fails", stock_error=same_engine.get("error", "")[:300])
            elif rec["status"] == "failed" and MIXED_STOP in rec.get("error", ""):
                v["status"] = "stopped"  # ZeRO, no dummy image: the mixed-image guard's named stop, on every rank
            verdict["cells"][cell] = v
            continue
        v["units"] = len(rec.get("units") or [])
        if stock is None or stock["status"] != "trained":
            v.update(status="no_reference", error="stock DDP did not train")
            verdict["cells"][cell] = v
            continue
        a, b = stock["weights"], rec["weights"]
        same_keys = sorted(a) == sorted(b)
        diff = max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=0.0) if same_keys else None
        ediff = abs(rec["eval_loss"] - stock["eval_loss"])
        equal = (same_keys and rec.get("synced", True) and diff <= tol[cell]
                 and ediff <= eval_tol[cell] * max(1.0, abs(stock["eval_loss"])))
        v.update(status="equal" if equal else "differs", max_diff=diff, eval_diff=ediff, synced=rec.get("synced"))
        if not same_keys:
            v["error"] = "trainable tensors differ from stock's"
        verdict["cells"][cell] = v
    return verdict


if __name__ == "__main__":
    main()
