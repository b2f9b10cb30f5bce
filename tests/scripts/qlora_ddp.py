"""QLoRA (bitsandbytes NF4 base + LoRA) under 2-process gloo DDP with the HF Trainer, four cases in one launch.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/qlora_ddp.py --model-dir DIR

DIR holds a tiny Llama saved with `save_pretrained` (tests/test_quantized.py writes it); every rank
reloads it with `BitsAndBytesConfig(load_in_4bit=True, nf4, double quant)` on the CPU, so the base really
is 4-bit (`Linear4bit`, uint8 storage).

1. stock: `prepare_model_for_kbit_training(..., use_reentrant=False)`, stock Trainer (fu=True).
2. hf_ddpfix: `prepare_model_for_kbit_training` defaults (reentrant checkpointing, which stock DDP fails
   with "Expected to mark a variable ready only once"), `patch_trainer()`: the plan switches to
   non-reentrant. Trainable weights must equal run 1's to 1e-6 (the math is the same) and every
   replica must hold the same weights.
3. placement guard: the same model claiming `hf_device_map` over two devices (what
   `device_map="auto"` does on a multi-GPU rank). Under `patch_trainer()` it must raise `PlacementError`
   before any step; the stock Trainer also fails on it (accelerate refuses it in `prepare`, without the fix).
4. stock on run 2's set-up (kbit defaults, stock Trainer): must fail on every rank with "Expected to mark
   a variable ready only once" (the failure the plan's switch to non-reentrant removes).

Variable sequence lengths (padding, -100 labels), AdamW weight_decay=0.1, max_grad_norm=0.2 (clips),
LoRA dropout 0.1 (checkpoint recompute must replay it). Prints ``QLORA_DDP_OK``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig, LlamaForCausalLM, Trainer, TrainingArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import init_gloo, padded_collate, rank_log, teardown, trainable_weights  # noqa: E402

from hf_ddpfix import patch_trainer, unpatch_trainer  # noqa: E402
from hf_ddpfix.plan import PlacementError  # noqa: E402

STEPS = 4
LENGTHS = (7, 12, 16, 9, 20, 5, 14, 11)


def load_qlora(model_dir: str, *, reentrant: bool | None, device_map_override: dict | None = None):
    """The NF4 base + LoRA; `reentrant=None` leaves `prepare_model_for_kbit_training` at its defaults."""
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)
    model = LlamaForCausalLM.from_pretrained(model_dir, quantization_config=q, device_map="cpu")
    if reentrant is None:
        model = prepare_model_for_kbit_training(model)  # defaults: checkpointing on, reentrant
    else:
        model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if device_map_override is not None:
        model.hf_device_map = device_map_override
    torch.manual_seed(0)  # identical LoRA init in every run and on every rank
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"])
    return get_peft_model(model, lora)


def dataset() -> Dataset:
    rows = [{"input_ids": [(i * 7 + j * 3) % 240 + 1 for j in range(LENGTHS[i % len(LENGTHS)])]} for i in range(32)]
    return Dataset.from_list(rows)


def make_trainer(model, out: str) -> Trainer:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=STEPS, report_to=[],
                             use_cpu=True, save_strategy="no", learning_rate=1e-2, weight_decay=0.1,
                             max_grad_norm=0.2, remove_unused_columns=False, disable_tqdm=True, seed=0,
                             logging_steps=1, data_seed=0)
    return Trainer(model=model, args=args, train_dataset=dataset(), data_collator=padded_collate)


def assert_replicas_equal(weights: dict[str, torch.Tensor], what: str) -> None:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, weights)
    for r, other in enumerate(gathered[1:], start=1):
        bad = [n for n in weights if not torch.equal(weights[n], other[n])]
        assert not bad, f"{what}: rank {r} diverged from rank 0 in {bad[:3]}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", default="/tmp/qlora_ddp_run")
    a = p.parse_args()
    init_gloo()
    log = rank_log()

    # 1. stock Trainer, non-reentrant checkpointing, find_unused_parameters=True (stock pick for a PeftModel)
    model = load_qlora(a.model_dir, reentrant=False)
    init = trainable_weights(model)
    trainer = make_trainer(model, a.out)
    trainer.train()
    stock = trainable_weights(model)
    stock_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert_replicas_equal(stock, "stock")
    moved = sum(not torch.equal(init[n], stock[n]) for n in init)
    assert moved == len(init), f"stock: only {moved}/{len(init)} LoRA tensors moved"
    log(f"stock non-reentrant fu=True: losses {[round(x, 4) for x in stock_losses]}")
    del trainer, model
    gc.collect()

    patch_trainer()
    try:
        # 2. prepare_model_for_kbit_training defaults (reentrant) under hf_ddpfix
        model = load_qlora(a.model_dir, reentrant=None)
        trainer = make_trainer(model, a.out)
        trainer.train()
        plan = trainer.hf_ddpfix_plan
        assert plan.checkpointing.value == "non_reentrant" and plan.checkpointing.changed, plan.report()
        assert str(plan.quantization.value).startswith("bnb 4-bit nf4"), plan.report()
        fixed = trainable_weights(model)
        assert_replicas_equal(fixed, "hf_ddpfix")
        diff = max((stock[n] - fixed[n]).abs().max().item() for n in stock)
        assert diff <= 1e-6, f"hf_ddpfix vs stock non-reentrant fu=True: max |diff| {diff:.3e}"
        log(f"hf_ddpfix (kbit defaults, reentrant -> {plan.checkpointing.value}, "
            f"ddp {plan.ddp_kwargs()}): max |w - stock| = {diff:.2e}")
        del trainer, model
        gc.collect()

        # 3. one rank's model claimed over two devices: refused before the first step
        spread = {"model.embed_tokens": 0, "model.layers": 1, "model.norm": 1, "lm_head": 1}
        model = load_qlora(a.model_dir, reentrant=False, device_map_override=spread)
        trainer = make_trainer(model, a.out)
        try:
            trainer.train()
        except PlacementError as err:
            text = str(err)
            assert "device_map={'': local_rank}" in text or 'device_map={"": local_rank}' in text, text
            assert trainer.state.global_step == 0
            log(f"placement guard: PlacementError before step 1: {text.splitlines()[0][:100]}")
        else:
            raise AssertionError("a model spread over two devices trained under DDP")
        del trainer
    finally:
        unpatch_trainer()

    # the stock Trainer fails on the same placement too (so the guard turns no working run into a failure)
    trainer = make_trainer(model, a.out)
    try:
        trainer.train()
    except ValueError as err:
        # accelerate 1.15 refuses any multi-entry hf_device_map under a distributed launch
        assert "device_map='auto'" in str(err) or "multiple devices" in str(err), err
        log(f"stock on the spread placement: ValueError from accelerate.prepare: {str(err)[:80]}")
    else:
        raise AssertionError("stock trained a 4-bit model spread over two devices under DDP?")
    del trainer, model
    gc.collect()

    # 4. stock Trainer on run 2's set-up (prepare_model_for_kbit_training defaults: reentrant checkpointing,
    # fu=True for a PeftModel): the failure hf_ddpfix's plan removes, from every rank (the same set-up on both,
    # so both fail in the same backward and the group stays in step)
    model = load_qlora(a.model_dir, reentrant=None)
    trainer = make_trainer(model, a.out)
    try:
        trainer.train()
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        assert first.startswith("Expected to mark a variable ready only once."), first
        log(f"stock kbit defaults (reentrant, fu=True): RuntimeError at step {trainer.state.global_step}: "
            f"{first[:120]}")
    else:
        raise AssertionError("stock DDP trained prepare_model_for_kbit_training's reentrant checkpointing")
    del trainer, model
    gc.collect()
    log("QLORA_DDP_OK")
    teardown()


if __name__ == "__main__":
    main()
