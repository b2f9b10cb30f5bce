"""Today's families through the Trainer on 2 gloo processes, one engine per launch: stock vs hf_ddpfix with
``long_context="all"`` and with ``sequence_parallel=2`` (issue 47, "Done when").

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/today_families.py --engine ddp --out OUT
      DS_ACCELERATOR=cpu ... tests/scripts/today_families.py --engine zero3 --out OUT
      PYTHONPATH=hf_ddpfix/rehearse/device:. accelerate launch --config_file accelerate_configs/fsdp.yaml \
          --mixed_precision no tests/scripts/today_families.py --engine fsdp2 --out OUT

Families (tiny, from their own config classes, tests/fixtures.py ``layer_family_config``): Qwen3.5 (3 gated-delta-net
linear-attention layers + 1 gated full-attention layer), Qwen3.5-MoE (its text config: the same hybrid with routed
experts), Gemma 4 (3 sliding + 1 full-attention layer, keys and values shared across layers) and Qwen3-Next (a
hybrid no issue names). Every run: LoRA r=4 on every linear layer (random A and B), non-reentrant checkpointing,
batch 1 per rank with lengths differing per rank and step (a third of the labels masked), 2 optimizer steps; SGD (lr 5e-2, weight decay 0.1, clipping 1.0: AdamW's first steps, ~lr * sign(g),
would turn rounding in near-zero gradients into lr-sized differences); :func:`dtype`.

Per family (``--engine ddp``):

- ``stock``: the stock ``Trainer`` (hf_ddpfix not involved);
- ``lc``: ``DDPFixTrainer(long_context="all")`` with 5-token tiles: its plan's ``long_context`` lines and the
  layer handle's counters per layer type (``patched calls [<type>]``, ``stock calls [<type>]``);
- ``sp``: ``DDPFixTrainer(sequence_parallel=2)`` (N=2, DP=1: both ranks train both ranks' batches in slices, the
  same global batch as stock): trained, or refused before step 1 (``PlanError``, no optimizer step taken).

``--engine zero3`` (ZeRO-3 through the Trainer's ``deepspeed`` argument, every parameter sharded): one run per family,
``lc_sp`` (both asked), compared by the test with the DDP launch's ``stock`` run.

``--engine fsdp2`` (accelerate's FSDP2 through the Trainer as users launch it: the shipped fsdp.yaml, the FSDP test
device on ``PYTHONPATH``, ``--mixed_precision no`` so weights compare with float32/float64 stock): ``stock``,
``lc`` and ``sp`` as under DDP (:func:`dtype`: float64 Qwen hybrids), plus two stock runs with what a user changes
in fsdp.yaml after stock's failures (:data:`STOCK_FAILS`, :func:`user_fixes`): ``stock_units`` (the decoder layer
class as ``fsdp_transformer_layer_cls_to_wrap``) and ``stock_units_noload`` (that and
``fsdp_cpu_ram_efficient_loading: false``), each run only while every stock run of the family before it failed
(a user changes the yaml after a failure). A stock run that fails as :data:`STOCK_FAILS` says is recorded
(``"failed"``), no step taken. Every run under that loading starts from rank 0's values only
(:func:`loaded_on_rank0_only`: the other rank's off by +1), as a checkpoint loads under it.

Rank 0 writes ``OUT/<engine>-<family>-<run>.pt``: {"weights", "plan": the plan's lines (whole), "kinds": per layer
type (label, count, patched), "refused": the refusal or None, "failed": stock's failure or None, "steps": optimizer
steps taken, "wrapped": the model's class after the run, "units": its FSDP2 units}; every rank writes
``...-rank<r>.pt``: {"stats": the long-context layer counters, "counts": hf_ddpfix's feature counters}.
Prints ``TODAY_FAMILIES_OK`` at the end.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from fixtures import (  # noqa: E402,I001
    RankItems,
    init_gloo,
    layer_family_config,
    layer_family_model,
    masked_labels,
    single_collate,
    trainable_weights,
    zero_config,
)

FAMILIES = ("qwen3_5", "qwen3_5_moe", "gemma4", "qwen3_next")
STEPS = 2
TOKENS_PER_TILE = 5
#: runs per engine (--runs): DDP trains each feature alone; ZeRO-3 one run with both asked (the plan keeps long
#: context off there, "not verified under ZeRO-3", and runs Ulysses), compared with the DDP launch's stock run
RUNS = {"ddp": "stock,lc,sp", "zero3": "lc_sp", "fsdp2": "stock,stock_units,stock_units_noload,lc,sp"}
OPTIONS = {"lc": {"long_context": "all"}, "sp": {"sequence_parallel": 2},
           "lc_sp": {"long_context": "all", "sequence_parallel": 2}}


def dtype(family: str, engine: str) -> torch.dtype:
    """float64 for the Qwen hybrids under DDP and FSDP2 (the tiled layer's other summation order stays at 1e-16); float32
    for Gemma 4 (its RMSNorm computes in float32 whatever the input: in float64 the norm patch's check against stock
    refuses every norm and the model keeps float32 islands) and under ZeRO-3 (compared with DDP's float32 stock)."""
    return torch.float64 if engine in ("ddp", "fsdp2") and family != "gemma4" else torch.float32


def config(family: str):  # noqa: ANN201
    if family == "qwen3_5_moe":
        import transformers

        base = layer_family_config("qwen3_5").to_dict()
        keep = {k: base[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                     "head_dim", "pad_token_id", "bos_token_id", "eos_token_id", "num_hidden_layers",
                                     "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
                                     "linear_value_head_dim", "layer_types")}
        return transformers.Qwen3_5MoeTextConfig(**keep, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=32)
    return layer_family_config(family)


def build(family: str, dtype: torch.dtype, attention: str = "sdpa"):  # noqa: ANN201
    from peft import LoraConfig, get_peft_model

    cfg = config(family)
    cfg.use_cache = False
    if getattr(cfg, "num_experts", 0):  # torch's grouped_mm takes no float64: the experts' eager loop (the same math)
        cfg._experts_implementation = "eager"
    model = layer_family_model(cfg, attention)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    return model.to(dtype).train()


def items(world: int) -> RankItems:
    def make(k: int, r: int) -> dict:
        g = torch.Generator().manual_seed(1000 * k + r)
        ids = torch.randint(3, 96, (1, 7 + (5 * k + 7 * r) % 11), generator=g)
        return {"input_ids": ids, "labels": masked_labels(ids, g)}
    return RankItems(STEPS, world, make)


def args(out: str, engine: str, run: str):  # noqa: ANN201
    from transformers import TrainingArguments

    from hf_ddpfix import checkpointing_training_args

    return TrainingArguments(
        output_dir=os.path.join(out, f"{engine}-{run}"), max_steps=STEPS, per_device_train_batch_size=1,
        optim="sgd", learning_rate=5e-2, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to="none", train_sampling_strategy="sequential", remove_unused_columns=False,
        use_cpu=True, seed=0, disable_tqdm=True, ddp_find_unused_parameters=True if run.startswith("stock") else None,
        deepspeed=zero_config(3) if engine == "zero3" else None,
        **checkpointing_training_args(True, {"use_reentrant": False}))


#: stock FSDP2's failures in accelerate 1.15's ``prepare`` (the stock runs record them; both ranks raise at the same
#: point: the wrap policy before any collective, the state-dict broadcast at the same entry): the shipped fsdp.yaml
#: wraps ``_no_split_modules``, which names vision classes the text models lack; ``cpu_ram_efficient_loading``'s
#: ``fsdp2_load_full_state_dict`` reads ``.device_mesh`` of every state-dict entry, a persistent buffer included
STOCK_FAILS = ("Could not find the transformer layer class", "'Tensor' object has no attribute 'device_mesh'")
#: the user's fixes (:func:`user_fixes`), run in this order, each only while no stock run of the family trained
USER_FIXES = ("stock_units", "stock_units_noload")


def user_fixes(trainer, model, run: str) -> None:  # noqa: ANN001
    """A stock FSDP2 run with what a user changes in fsdp.yaml after stock's failures (:data:`STOCK_FAILS`):
    ``stock_units``: ``fsdp_transformer_layer_cls_to_wrap: <the decoder layer class>``; ``stock_units_noload``:
    that and ``fsdp_cpu_ram_efficient_loading: false``. Set on the plugin this trainer's accelerator prepares with."""
    if run not in USER_FIXES:
        return
    plugin = trainer.accelerator.state.fsdp_plugin
    assert plugin.transformer_cls_names_to_wrap is None and plugin.cpu_ram_efficient_loading, "fsdp.yaml as shipped"
    plugin.transformer_cls_names_to_wrap = [type(model.base_model.model.model.layers[0]).__name__]
    if run == "stock_units_noload":
        plugin.cpu_ram_efficient_loading = False


def loaded_on_rank0_only(model, rank: int) -> None:  # noqa: ANN001
    """As transformers loads a checkpoint under ``fsdp_cpu_ram_efficient_loading`` (the real values on rank 0 only,
    the others' placeholders filled by accelerate's broadcast): on every other rank, each ``state_dict`` entry
    (parameters and persistent buffers: Gemma 4's ``layer_scalar``) is moved off rank 0's value by +1, so a run that
    trains with a value it did not receive from rank 0 ends far from stock. Non-persistent buffers (rotary
    frequencies) are computed on every rank at build and not broadcast by accelerate: kept."""
    if rank == 0:
        return
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            if t.is_floating_point():
                t.add_(1.0)


def fsdp_units(model) -> list[str]:  # noqa: ANN001
    """The names of ``model``'s FSDP2 units (``fully_shard`` modules; none outside FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]


@functools.cache
def small_tiles() -> None:
    import hf_ddpfix.runtime.attach as runtime_mod
    from hf_ddpfix.integrations.long_context.long_context import apply_long_context

    runtime_mod.apply_long_context = functools.partial(apply_long_context, tokens_per_tile=TOKENS_PER_TILE)


def one(family: str, run: str, engine: str, model, out: str, rank: int, world: int) -> bool:  # noqa: ANN001
    """Train one run and write its files (module docstring); returns whether it trained (no refusal, no failure)."""
    import torch.distributed as dist
    from transformers import Trainer

    from hf_ddpfix import DDPFixConfig, DDPFixTrainer
    from hf_ddpfix.ops import feature_counts
    from hf_ddpfix.plan.types import PlanError

    feature_counts.reset()
    if engine == "fsdp2" and run != "stock_units_noload":  # the shipped fsdp.yaml's loading
        loaded_on_rank0_only(model, rank)
    kw = dict(model=model, args=args(out, engine, run), data_collator=single_collate, train_dataset=items(world))
    if run.startswith("stock"):  # stock_eager (by hand): the stock spread, eager attention instead of sdpa
        trainer = Trainer(**kw)
        user_fixes(trainer, model, run)
    else:
        trainer = DDPFixTrainer(**kw, ddpfix_config=DDPFixConfig(**OPTIONS[run]))
    refused, failed, t0 = None, None, time.time()
    try:
        trainer.train()
    except PlanError as err:
        refused = str(err)
    except (ValueError, AttributeError) as err:  # stock FSDP2's known failures in accelerate's prepare (STOCK_FAILS)
        if not (run.startswith("stock") and any(s in str(err) for s in STOCK_FAILS)):
            raise
        failed = f"{type(err).__name__}: {err}"
    plan = getattr(trainer, "hf_ddpfix_plan", None)
    runtime = getattr(trainer, "hf_ddpfix_runtime", None)
    handle = getattr(runtime, "long_context", None)
    tag = f"{engine}-{family}-{run}"
    torch.save({"stats": dict(handle.stats) if handle is not None else {},
                "counts": {k: v.as_dict() for k, v in feature_counts.snapshot().items()}},
               os.path.join(out, f"{tag}-rank{rank}.pt"))
    weights = {k.removeprefix("module."): v for k, v in
               trainable_weights(trainer.model_wrapped if engine == "zero3" else model).items()}
    units = fsdp_units(model)
    if rank == 0:
        kinds = [(k.label, k.count, k.patched) for k in handle.kinds] if handle is not None else []
        torch.save({"weights": weights, "plan": plan.report(width=None).splitlines() if plan is not None else [],
                    "lc_lines": list(plan.long_context.details) if plan is not None else [], "kinds": kinds,
                    "refused": refused, "failed": failed, "steps": trainer.state.global_step, "wrapped": type(model).__name__,
                    "units": units}, os.path.join(out, f"{tag}.pt"))
        print(f"[{engine}] {family} {run}: {'refused' if refused else 'failed' if failed else 'trained'} in {time.time() - t0:.1f}s",
              flush=True)
    if world > 1:
        dist.barrier()
    return refused is None and failed is None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=tuple(RUNS), required=True)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--runs", default=None, help="default: RUNS[engine]")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rank, world = init_gloo()
    small_tiles()
    cases = [(f, r) for f in a.families.split(",") for r in (a.runs or RUNS[a.engine]).split(",")]
    # every model built before the first TrainingArguments: after a ZeRO-3 one, transformers builds under zero.Init
    # (partitioned at birth: the perturbation and LoRA's random init would differ from DDP's build)
    models = [build(f, dtype(f, a.engine), "eager" if r == "stock_eager" else "sdpa") for f, r in cases]
    stock_trained = set()
    for (family, run), model in zip(cases, models, strict=True):
        if run in USER_FIXES and family in stock_trained:  # a user changes fsdp.yaml only after stock failed
            continue
        if one(family, run, a.engine, model, a.out, rank, world) and run.startswith("stock"):
            stock_trained.add(family)
    print("TODAY_FAMILIES_OK", flush=True)


if __name__ == "__main__":
    main()
