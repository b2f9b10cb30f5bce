"""2-process HF Trainer runs of zoo models that stock's plan used to break: hf_ddpfix (patch_trainer,
reentrant checkpointing requested) vs the stock Trainer (fu=True for a PeftModel), same data.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/usage_trainer.py [--families mllama,bart_layerdrop,llava]

Sample i goes to rank i % 2 (sequential sampler, batch 1 per rank); it has an image when i % 4 == 0,
so steps alternate "rank 0 only" and "no rank". Checks, per family: the patched run wraps DDP with
find_unused_parameters=False, its plan log shows parameter_usage, and its trainable weights equal the
stock run's (1e-6) on every rank.

``--no-walk`` (issue 38): the "no walk once established" check and its retry, through the Trainer's real
``accelerator.backward``: TRL ``SFTTrainer`` on a tiny OPT (LoRA) and the plain ``Trainer`` on a tiny LLaVA whose
language model is OPT (LoRA on tower and language model, an image on every rank every step: one batch
signature, every parameter used), gradient accumulation 1 and 2, ``NO_WALK_STEPS`` steps. From step
``DROP_FROM`` (after the check took over) a progressive-layer-dropping schedule (a callback) makes rank 1's OPT
decoder drop its layers: the same batch signature now leaves the layers' LoRA without a gradient. Checks, per
case: the check decided micro-batches before the change (``no_walk.checks > 0``), it failed at the change and
``accelerator.backward`` ran the retry (``no_walk_check_failed > 0`` in the feature counts), and the weights
are bit-equal to the stock Trainer's (fu=True) on every rank. Prints ``USAGE_NO_WALK_OK``.

Prints ``USAGE_TRAINER_OK``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
from torch.utils.data import Dataset, SequentialSampler
from transformers import Trainer, TrainerCallback, TrainingArguments

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))

from fixtures import teardown, trainable_weights  # noqa: E402
from zoo import IMG, SEQ, ZOO, _pixel_batch  # noqa: E402

from hf_ddpfix import patch_trainer, unpatch_trainer  # noqa: E402
from hf_ddpfix._compat import checkpointing_training_args  # noqa: E402

STEPS = 4


class Indices(Dataset):
    def __init__(self, n: int = 2 * STEPS) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"i": i}


class InOrder(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def run(name: str, patched: bool, out: str) -> tuple[dict[str, torch.Tensor], bool]:
    entry = ZOO[name]
    if patched:
        patch_trainer()
    else:
        unpatch_trainer()

    def collate(rows: list[dict]) -> dict:
        (i,) = [r["i"] for r in rows]
        return entry.batch(entry.vlm and i % 4 == 0, 100 + i, SEQ[(i // 2) % 2])

    model = entry.model(0)
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=1, max_steps=STEPS, report_to=[], use_cpu=True,
        save_strategy="no", learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, remove_unused_columns=False,
        disable_tqdm=True, seed=0, logging_steps=1,
        **checkpointing_training_args(True, {"use_reentrant": patched}),
    )
    trainer = InOrder(model=model, args=args, train_dataset=Indices(), data_collator=collate)
    trainer.train()
    fu = bool(trainer.model_wrapped.find_unused_parameters)
    if patched:
        assert trainer.hf_ddpfix_plan.parameter_usage.value is True, trainer.hf_ddpfix_plan.report()
    weights = trainable_weights(model)
    del trainer
    unpatch_trainer()
    return weights, fu


NO_WALK_STEPS, DROP_FROM = 7, 5  # the check takes over after ESTABLISH (2) walks once the route is set (step 1)
_OPT = dict(model_type="opt", vocab_size=256, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=512, word_embed_proj_dim=32, pad_token_id=0, bos_token_id=0, eos_token_id=0,
            dropout=0.0, attention_dropout=0.0, layerdrop=0.0, tie_word_embeddings=False)
_OPT_LORA = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
# the text-only case: word embeddings narrower than the decoder, so OPT's project_in / project_out (LoRA there too)
# keep the loss trainable on a step whose every layer is dropped
_OPT_NARROW = dict(word_embed_proj_dim=16)


class LayerDropFrom(TrainerCallback):
    """Progressive layer dropping on one rank: from step ``DROP_FROM`` rank 1's OPT decoder drops every layer
    (``layerdrop=1.0``; ``torch.rand([]) < 1.0`` always), the batch signature unchanged."""

    def __init__(self, decoder: torch.nn.Module, rank: int) -> None:
        self.decoder, self.rank = decoder, rank

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        self.decoder.layerdrop = 1.0 if state.global_step >= DROP_FROM and self.rank == 1 else 0.0


def _opt_decoder(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if type(m).__name__ == "OPTDecoder")


def no_walk_case(case: str, ga: int, patched: bool, out: str, rank: int) -> tuple[dict[str, torch.Tensor], bool, int, int]:
    """One run of ``case`` (``sft_opt`` / ``llava_opt``): weights, DDP's fu, no-walk checks, failed checks."""
    from peft import LoraConfig, get_peft_model

    from hf_ddpfix.ops import feature_counts

    if patched:
        patch_trainer()
    else:
        unpatch_trainer()
    feature_counts.reset()
    common = dict(output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=ga,
                  max_steps=NO_WALK_STEPS, report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2,
                  weight_decay=0.1, max_grad_norm=0.5, disable_tqdm=True, seed=0, data_seed=0, logging_steps=1,
                  **checkpointing_training_args(True, {"use_reentrant": patched}))
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False)
    rows = 2 * NO_WALK_STEPS * ga
    torch.manual_seed(0)
    if case == "sft_opt":
        from datasets import Dataset as HFDataset
        from transformers import OPTConfig, OPTForCausalLM
        from trl import SFTConfig, SFTTrainer
        from trl_sft import WORDS, build_tokenizer

        tok = build_tokenizer()
        cfg = OPTConfig(**{**{k: v for k, v in _OPT.items() if k != "model_type"}, **_OPT_NARROW})
        cfg.vocab_size = len(tok)
        model = OPTForCausalLM(cfg)
        texts = [" ".join(WORDS[(i * k + 5) % len(WORDS)] for k in range(1, 4 + (i * 7) % 9)) for i in range(rows)]
        args = SFTConfig(max_length=32, **common)
        trainer = SFTTrainer(model=model, args=args, processing_class=tok,
                             peft_config=LoraConfig(task_type="CAUSAL_LM", target_modules=[*_OPT_LORA, "project_in",
                                                                                   "project_out"], **lora),
                             train_dataset=HFDataset.from_dict({"text": texts}))
    else:
        from transformers import LlavaConfig, LlavaForConditionalGeneration

        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
        # vision_feature_layer -1: every tower layer reaches the loss (so every parameter is used on image steps)
        cfg = LlavaConfig(text_config=_OPT, vision_config=vision, image_token_id=IMG, vision_feature_layer=-1,
                          tie_word_embeddings=False)
        model = get_peft_model(LlavaForConditionalGeneration(cfg),
                               LoraConfig(target_modules=[*_OPT_LORA, "linear_1", "linear_2"], **lora)).train()
        image_batch = _pixel_batch(4, 28)

        def collate(rows_: list[dict]) -> dict:
            (i,) = [r["i"] for r in rows_]
            return image_batch(True, 100 + i, SEQ[(i // 2) % 2])  # an image on every rank, every step

        args = TrainingArguments(remove_unused_columns=False, **common)
        trainer = InOrder(model=model, args=args, train_dataset=Indices(rows), data_collator=collate)
    trainer.add_callback(LayerDropFrom(_opt_decoder(trainer.model), rank))
    trainer.train()
    fu = bool(trainer.model_wrapped.find_unused_parameters)
    checks = trainer.hf_ddpfix_runtime.usage.no_walk.checks if patched else 0
    amounts = feature_counts.snapshot().get("parameter_usage")
    failed = amounts.amounts.get("no_walk_check_failed", 0) if amounts is not None else 0
    weights = trainable_weights(trainer.model)
    del trainer
    unpatch_trainer()
    gc.collect()
    return weights, fu, checks, failed


def no_walk(out: str, rank: int) -> None:
    for case in ("sft_opt", "llava_opt"):
        for ga in (1, 2):
            stock, stock_fu, _, _ = no_walk_case(case, ga, False, out, rank)
            fixed, fixed_fu, checks, failed = no_walk_case(case, ga, True, out, rank)
            same = all(torch.equal(stock[k], fixed[k]) for k in stock)
            print(f"[rank {rank}] no-walk {case} ga={ga}: fu stock={stock_fu} fixed={fixed_fu} checks={checks} "
                  f"failed={failed} bit-equal={same}", flush=True)
            assert stock_fu and not fixed_fu, (case, ga, stock_fu, fixed_fu)
            assert same, f"{case} ga={ga}: hf_ddpfix vs stock Trainer weights differ"
            assert checks > 0, f"{case} ga={ga}: the no-walk check never took over"
            if rank == 1:  # rank 1's layers dropped at step DROP_FROM: its check failed and the retry ran
                assert failed > 0, f"{case} ga={ga}: the retry branch never ran"
    print(f"[rank {rank}] USAGE_NO_WALK_OK", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="mllama,bart_layerdrop,llava")
    ap.add_argument("--out", default="/tmp/usage_trainer")
    ap.add_argument("--no-walk", action="store_true", help="also the no-walk retry cases (issue 38)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    if a.no_walk:
        no_walk(a.out, rank)
    for name in [f for f in a.families.split(",") if f]:
        stock, stock_fu = run(name, False, a.out)
        fixed, fixed_fu = run(name, True, a.out)
        assert stock_fu and not fixed_fu, (stock_fu, fixed_fu)
        diff = max((stock[k] - fixed[k]).abs().max().item() for k in stock)
        assert diff <= 1e-6, f"{name}: hf_ddpfix vs stock Trainer differ by {diff:.2e}"
        print(f"[rank {rank}] {name}: Trainer fu=False (stock True), max |fix - stock| = {diff:.1e}", flush=True)
        gc.collect()
    print(f"[rank {rank}] USAGE_TRAINER_OK", flush=True)
    teardown()


if __name__ == "__main__":
    main()
