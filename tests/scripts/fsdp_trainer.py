"""Several VLM families through ``Trainer.train`` / ``evaluate`` / ``predict``, launched as users launch them.

Run (2 gloo processes on the CPU; the FSDP test device makes accelerate run FSDP2 there, docs/fsdp.md):

    PYTHONPATH=hf_ddpfix/rehearse/device:. accelerate launch --config_file accelerate_configs/fsdp.yaml \
        --mixed_precision no tests/scripts/fsdp_trainer.py --mode fixed --out OUT
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml tests/scripts/fsdp_trainer.py --mode stock --out OUT

``--mode fixed``: ``DDPFixTrainer`` (hf_ddpfix's plan: its FSDP2 units, parameter-usage ties per unit).
``--mode stock``: the stock ``Trainer`` with ``ddp_find_unused_parameters=True`` (the DDP reference; under
fsdp.yaml: stock FSDP, which crashes on mixed image/text ranks).

Per family, from the same initial weights (tests/zoo.py's LoRA with random A and B: on the language model, the
tower and the projector of a VLM; Mllama: the language model; Qwen3-MoE: attention and fused experts) and the
same data: rank ``r`` gets item ``k * world + r`` as its ``k``-th batch (sequential sampler, batch size 1),
with an image or not by :data:`PATTERN` (one rank, the other, none, both), sequence lengths varying by step,
micro-batch and rank; AdamW with weight decay 0.1, clipping at 1.0, non-reentrant
checkpointing (reentrant asked where ``CASES`` says: the plan runs it non-reentrant); gradient accumulation as
``CASES`` says. Then ``evaluate()`` and ``predict()`` on batches mixing image and text ranks.

LayerDrop families (:data:`RANK_SEEDED`: OPT, and BART when named) run with the Trainer seed ``1234 + rank`` in
both modes, so the ranks drop different layers and each rank drops the same ones in both runs.

Rank 0 writes ``OUT/<mode>-<family>.pt``: {"weights": every trainable tensor (FSDP2 shards gathered),
"eval_loss", "predict_loss", "wrapped": the model's class after prepare, "units": FSDP2 units, "layer_calls":
per rank, the training forwards of each LayerDrop layer (``None`` for other families)}. Prints
``FSDP_TRAINER_OK`` at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from transformers import TrainerCallback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fixtures import RankItems, single_collate, trainable_weights  # noqa: E402
from zoo import MORE_TEXT, MORE_VLMS, ZERO_DISCOVERED, ZERO_LOADED, ZOO, seq_len  # noqa: E402

ENTRIES = {**ZOO, **MORE_TEXT, **ZERO_DISCOVERED, **ZERO_LOADED, **MORE_VLMS}

PATTERN = [(True, False), (False, True), (False, False), (True, True)]  # k-th batch -> (rank 0, rank 1) image
EVAL_PATTERN = [(True, False), (False, True), (False, False)]
STEPS = 4
IGNORE = ["image_hidden_states", "past_key_values"]
#: family -> (gradient accumulation, checkpointing asked)
CASES = {"qwen2_5_vl": (2, "non_reentrant"), "gemma3": (1, "reentrant"), "llava": (1, "non_reentrant"),
         "aya_vision": (1, "non_reentrant"), "idefics2": (2, "non_reentrant"), "mllama": (1, "non_reentrant"),
         "qwen3_moe": (1, "non_reentrant"), "internvl": (1, "non_reentrant"), "mistral3": (2, "non_reentrant"),
         "llava_next": (1, "non_reentrant"), "got_ocr2": (1, "non_reentrant"), "janus": (1, "non_reentrant")}
#: the zoo's text families and the Qwen-VL towers no FSDP test trained (3 steps each: launch time); BART with
#: LayerDrop: ranks seeded apart (:data:`RANK_SEEDED`), so they drop different layers
CASES |= {"qwen3": (1, "non_reentrant"), "qwen2_vl": (1, "non_reentrant"), "qwen3_vl": (2, "non_reentrant"),
          "qwen3_vl_moe": (1, "non_reentrant"), "opt_layerdrop": (1, "non_reentrant"),
          "bart_layerdrop": (1, "non_reentrant")}
SHORT = {"qwen3": 3, "qwen2_vl": 3, "qwen3_vl": 2, "qwen3_vl_moe": 3, "opt_layerdrop": 4, "bart_layerdrop": 4}
#: families whose Trainer seed is ``1234 + rank`` in both modes (the Trainer seeds every rank alike, and a
#: LayerDrop draw is then the same on every rank; a user seeding per rank, or dropout on variable lengths, makes
#: the streams differ): each rank drops its own layers, the same ones in the fixed and the stock run
RANK_SEEDED = ("opt_layerdrop", "bart_layerdrop")
#: families run with the plugin's ``cpu_ram_efficient_loading`` off (fsdp.yaml's ``fsdp_cpu_ram_efficient_loading:
#: false``, as a user must set it): with it, stock accelerate 1.15 fails in ``prepare`` before any step (BART: its
#: persistent ``final_logits_bias`` buffer is no DTensor, ``'Tensor' object has no attribute 'device_mesh'``; its
#: LoRA on the tied lm_head: ``tie_weights`` ``attribute 'weight' already exists``), and hf_ddpfix's plan refuses it
#: before step 1 naming that setting (``check_fsdp_loading``)
EAGER_LOADING = ("bart_layerdrop",)
#: families run only when named (``--families``): the 4-process cell's text family; VLMs measured by hand with this
#: script (docs/fsdp.md) and left out of the tests' launches (launch time)
MORE_CASES = {"llama": (2, "non_reentrant"), "paligemma": (1, "non_reentrant"), "vipllava": (1, "non_reentrant"),
              "cohere2_vision": (1, "non_reentrant"), "smolvlm": (1, "non_reentrant"), "idefics3": (1, "non_reentrant"),
              "llava_onevision": (1, "non_reentrant")}


def training_args(output_dir: str, steps: int, ga: int, mode: str, reentrant: bool = False):  # noqa: ANN201
    """The FSDP/DDP comparison runs' arguments: batch 1 in order, AdamW lr 1e-3 with weight decay 0.1, clipping 1.0,
    a constant schedule, checkpointing (reentrant when asked); stock mode asks ``find_unused_parameters=True``."""
    from transformers import TrainingArguments

    from hf_ddpfix import checkpointing_training_args

    return TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=1,
        per_device_eval_batch_size=1, gradient_accumulation_steps=ga, learning_rate=1e-3, weight_decay=0.1,
        max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
        train_sampling_strategy="sequential", remove_unused_columns=False, use_cpu=True, seed=0,
        ddp_find_unused_parameters=True if mode == "stock" else None,
        **checkpointing_training_args(True, {"use_reentrant": reentrant}),
    )


def items(entry, pattern, n_batches: int, world: int, seed: int, ga: int = 1) -> RankItems:  # noqa: ANN001
    """Rank ``r``'s ``k``-th batch: ``entry``'s sample with or without an image as ``pattern`` says."""
    return RankItems(n_batches, world, lambda k, r: entry.batch(pattern[k % len(pattern)][r % 2], seed + 1000 * k + r,
                                                                 seq_len(k // ga, k % ga, r)))


def first_logits(logits, labels):
    """The logits alone: a VLM's output tuple carries image features on image ranks only (Gemma 3's
    ``image_hidden_states``), which stock evaluation would gather on some ranks only (a mismatch under DDP too)."""
    return logits[0] if isinstance(logits, (tuple, list)) else logits


def load_saved(entry, out: str, world: int):
    """The zoo's LoRA model as users load one: rank 0 saves the base model and the adapter once; every rank then
    calls ``from_pretrained`` + ``PeftModel.from_pretrained`` under the launch's environment (fsdp.yaml:
    ``FSDP_CPU_RAM_EFFICIENT_LOADING=true``, which transformers and accelerate's ``prepare`` read: accelerate
    broadcasts rank 0's state dict to the shards)."""
    import torch.distributed as dist
    from peft import PeftModel

    base, adapter = os.path.join(out, f"saved-{entry.name}", "base"), os.path.join(out, f"saved-{entry.name}", "lora")
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.isdir(adapter):
        entry.model(0, save_base_to=base).save_pretrained(adapter)
    if world > 1:
        dist.barrier()
    hf_cls = type(entry.build(0))
    hf = hf_cls.from_pretrained(base)
    return PeftModel.from_pretrained(hf, adapter, is_trainable=True).train()


#: generate(): rank r asks for GEN_TOKENS[r % 2] new tokens (greedy; EOS never stops it: eos_token_id -1), from a
#: prompt with an image on even ranks and text only on odd ranks: ranks run different numbers of forwards
GEN_TOKENS = (3, 6)


def generate_mixed(trainer, entry, rank: int) -> torch.Tensor:
    """Greedy ``generate()`` of the trained model on this rank's prompt (image on even ranks, text on odd ones,
    :data:`GEN_TOKENS` new tokens), called as users call it: on the model the Trainer holds (under FSDP2 the
    ``FSDP<Class>`` root, whose forward hooks all-gather; under DDP the unwrapped model). ``synced_gpus`` is left
    to transformers. Returns the new token ids."""
    model = trainer.model if trainer.is_fsdp_enabled else trainer.accelerator.unwrap_model(trainer.model)
    prompt = {k: v for k, v in entry.batch(rank % 2 == 0, 70_000 + rank, 10).items() if k != "labels"}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        ids = model.generate(**prompt, max_new_tokens=GEN_TOKENS[rank % 2], min_new_tokens=GEN_TOKENS[rank % 2],
                             do_sample=False, use_cache=True, eos_token_id=-1, pad_token_id=0)
    model.train(was_training)
    return ids[:, prompt["input_ids"].shape[1]:]


def count_layer_calls(model) -> list[int]:  # noqa: ANN001
    """A list the training forwards fill: how often each LayerDrop layer ran (``nn.ModuleList`` ``layers``),
    counted by forward pre-hooks in training mode only."""
    from torch import nn

    layers = [m for n, mods in model.named_modules() if n.endswith("layers") and isinstance(mods, nn.ModuleList)
              for m in mods]
    counts = [0] * len(layers)

    def hook(i: int):
        def pre(mod, args, kwargs=None):  # noqa: ANN001, ANN202
            counts[i] += int(mod.training)
        return pre

    for i, m in enumerate(layers):
        m.register_forward_pre_hook(hook(i))
    return counts


def tower_wrap_list(model) -> list[str]:  # noqa: ANN001
    """An explicit ``fsdp_transformer_layer_cls_to_wrap`` as VLM guides write one: every block class the model
    stacks (the decoder layer and the vision tower's blocks), as its ``_no_split_modules`` names them where it has
    them (else its repeated blocks)."""
    from hf_ddpfix._compat import no_split_modules, unwrap_model
    from hf_ddpfix.integrations.fsdp import repeated_block_classes

    hf = unwrap_model(model)
    have = {type(m).__name__ for m in hf.modules()}
    named = [n for n in sorted(no_split_modules(hf)) if n in have]
    return list(dict.fromkeys(named + repeated_block_classes(hf)))


class PlanAtStart(TrainerCallback):
    """A callback keeping the plan block rank 0 logs at the start of training
    (``trainer.hf_ddpfix_plan.report()``, what ``PlanReportCallback`` prints): the run's own plan, read from the
    trainer, not parsed from stdout, where several processes' lines may interleave."""

    def __init__(self, trainer) -> None:  # noqa: ANN001
        self.trainer, self.block = trainer, None

    def on_train_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        plan = getattr(self.trainer, "hf_ddpfix_plan", None)
        if state.is_world_process_zero and plan is not None and self.block is None:
            self.block = plan.report()


def run(name: str, mode: str, out: str, saved: bool = False, generate: bool = False, wrap: str = "plan") -> None:
    from transformers import Trainer

    from hf_ddpfix import DDPFixConfig, DDPFixTrainer

    entry = ENTRIES[name]
    ga, ckpt = {**CASES, **MORE_CASES}[name]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps = SHORT.get(name, STEPS)
    args = training_args(os.path.join(out, f"run-{mode}-{name}"), steps, ga, mode,
                         reentrant=ckpt == "reentrant" and mode == "fixed")
    if name in RANK_SEEDED:
        args.seed = 1234 + int(os.environ.get("RANK", "0"))
    assert args.device.type == "cpu"  # sets up accelerate's state and the process group (from_pretrained reads it)
    model = load_saved(entry, out, world) if saved else entry.model(0)
    model.config.use_cache = False
    cls = DDPFixTrainer if mode == "fixed" else Trainer
    own = {"ddpfix_config": DDPFixConfig(fsdp_skippable="shard")} if wrap == "shard" and mode == "fixed" else {}
    trainer = cls(model=model, **own, args=args, data_collator=single_collate,
                  train_dataset=items(entry, PATTERN, steps * ga, world, seed=0, ga=ga),
                  eval_dataset=items(entry, EVAL_PATTERN, len(EVAL_PATTERN), world, seed=50_000),
                  preprocess_logits_for_metrics=first_logits)
    plugin = trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None
    eager = plugin is not None and name in EAGER_LOADING and plugin.cpu_ram_efficient_loading
    if eager:  # this run only (the plugin is the launch's): restored below
        plugin.cpu_ram_efficient_loading = False
    explicit = plugin is not None and wrap == "explicit"
    if explicit:  # as fsdp_transformer_layer_cls_to_wrap in the accelerate config: restored below
        saved_names = plugin.transformer_cls_names_to_wrap
        plugin.transformer_cls_names_to_wrap = tower_wrap_list(model)
        print(f"[{mode}] {name}: explicit wrap list {plugin.transformer_cls_names_to_wrap}", flush=True)
    calls = count_layer_calls(model) if name in RANK_SEEDED else None
    at_start = PlanAtStart(trainer)
    trainer.add_callback(at_start)
    t0 = time.time()
    try:
        trainer.train()
    finally:
        if eager:
            plugin.cpu_ram_efficient_loading = True
        if explicit:
            plugin.transformer_cls_names_to_wrap = saved_names
    # image features in the output exist on image ranks only: stock gathers them there only (DDP too), so skip them
    metrics = trainer.evaluate(ignore_keys=IGNORE)
    predicted = trainer.predict(trainer.eval_dataset, ignore_keys=IGNORE)
    from torch.distributed.fsdp import FSDPModule

    units = [n for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)]
    weights = trainable_weights(trainer.model)
    from hf_ddpfix._compat import shared_parameter_holders

    ties = shared_parameter_holders(trainer.model)  # the modules still holding one tensor per tie (FSDP2: one group)
    if calls is not None:  # training forwards per layer, per rank (LayerDrop: ranks differ)
        import torch.distributed as dist

        every = [None] * world
        dist.all_gather_object(every, calls)
        calls = every
    generated = None
    if generate:
        import torch.distributed as dist

        mine = generate_mixed(trainer, entry, trainer.args.process_index)
        generated = [None] * world
        dist.all_gather_object(generated, mine)
    if trainer.is_world_process_zero():
        torch.save({"weights": weights, "eval_loss": metrics["eval_loss"],
                    "predict_loss": predicted.metrics["test_loss"], "predictions": torch.as_tensor(predicted.predictions),
                    "wrapped": type(trainer.model).__name__,
                    "units": units, "generated": generated, "layer_calls": calls,
                    "ties": ties}, os.path.join(out, f"{mode}{'' if wrap == 'plan' else '-' + wrap}-{name}.pt"))
        print(f"[{mode}] {name}: {type(trainer.model).__name__}, {len(units)} FSDP2 units, eval_loss "
              f"{metrics['eval_loss']:.6f}, {time.time() - t0:.1f}s", flush=True)
        if at_start.block is not None:  # the plan block this family's run logged (tests/plan_parity.py reads it)
            tag = f"{mode}{'' if wrap == 'plan' else '-' + wrap}-{name}"
            with open(os.path.join(out, f"plan-{tag}.txt"), "w") as f:
                f.write(at_start.block)
        plan = getattr(trainer, "hf_ddpfix_plan", None)
        if plan is not None:  # the whole reasons (the logged plan's lines are cut at 160 characters)
            print("\n".join("full plan: " + ln for ln in plan.report(width=None).splitlines()[1:]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("fixed", "stock"), required=True)
    ap.add_argument("--families", default=",".join(CASES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--generate", default="", help="families that also generate() with mixed ranks, comma-separated")
    ap.add_argument("--wraps", default="plan", help="plan (the plan's units), explicit (a wrap list naming the tower's "
                    "block classes), shard (fsdp_skippable=shard); comma-separated: each family runs once per wrap")
    ap.add_argument("--from-saved", default="", help="families loaded with from_pretrained (load_saved), comma-separated")
    a = ap.parse_args()
    for wrap in a.wraps.split(","):
        for name in a.families.split(","):
            run(name, a.mode, a.out, saved=name in a.from_saved.split(","), generate=name in a.generate.split(","),
                wrap=wrap)
    print("FSDP_TRAINER_OK", flush=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        from hf_ddpfix.ops.dist import destroy_default_group

        destroy_default_group()
