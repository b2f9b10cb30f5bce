"""The measurements of ``benchmarks/gpu_suite.py`` that need processes of their own.

Each part runs at a real size on a GPU, or at a toy size on the CPU (``--dry``: the same code path, every
branch, seconds; no figure from it means anything). Every worker prints one line ``RESULT <json>``.

- ``ddp-step``: seconds per optimizer step, stock ``Trainer`` vs ``patch_trainer()``, through the Trainer, on
  two DDP ranks. One GPU cannot hold two NCCL ranks, so both ranks share GPU 0 over gloo (every rank
  ``LOCAL_RANK=0``; REFERENCES §8): the ratio compares the two set-ups under the same sharing, the absolute
  seconds include the other rank's kernels and gloo's host copies (an NCCL all-reduce on 8 GPUs is faster).
  Cases: ``text`` (a Llama-3.2-1B-shaped LoRA, variable lengths, GA 1) and ``vlm`` (a Qwen2.5-VL-3B-shaped
  LoRA including the tower, rank 0 an image, rank 1 text only). Stock and patched alternate in pairs on the
  same weights and data; the figure is the median over pairs of patched / stock.
- ``fsdp-layout``: one FSDP2 training run of a Llama-3.2-11B-Vision-shaped LoRA model, rank 0 of 8 simulated in one
  process with torch's fake process group (collectives are no-ops, every buffer FSDP2 allocates for them is real,
  so the peak is rank 0's of an 8-GPU job; the values computed are not), with the plan's units for a forced
  ``fsdp_skippable`` (fold / shard) and the plan's dummy, alternating image and text-only batches
  (:func:`fsdp_layout`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

GIB = 1 << 30

# Llama-3.2-1B (its public config.json: hidden 2048, 16 layers, 32 heads, 8 KV heads, vocab 128256, tied)
TEXT = {"gpu": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, lengths=(1536, 2048),
                    batch=2, lora_r=16),
        "dry": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True, lengths=(12, 20), batch=2,
                    lora_r=4)}
# Qwen2.5-VL-3B-Instruct (public config.json: text hidden 2048, 36 layers, 16 heads, 2 KV heads; tower depth 32,
# hidden 1280, out 2048); an image of 32 x 32 patches (448 px) -> 256 merged tokens
VLM = {"gpu": dict(text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                             num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                             rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
                   vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                               fullatt_block_indexes=[7, 15, 23, 31]),
                   tokens=dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                               vision_end_token_id=151653), grid=32, seq=1024, lora_r=16),
       "dry": dict(text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, rope_scaling={"type": "mrope",
                                                                                  "mrope_section": [2, 2, 4]}),
                   vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                               fullatt_block_indexes=[1]),
                   tokens=dict(image_token_id=250, video_token_id=251, vision_start_token_id=252,
                               vision_end_token_id=253), grid=4, seq=24, lora_r=4)}
# Llama-3.2-11B-Vision (public config.json: text hidden 4096, 40 layers of which 8 cross-attention, vocab 128256;
# vision 32 + 8 global layers, hidden 1280, 560 px tiles of 14 px patches, 4 tiles)
MLLAMA = {"gpu": dict(text=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=40,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38]),
                      vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_global_layers=8,
                                  attention_heads=16, image_size=560, patch_size=14, max_num_tiles=4,
                                  vision_output_dim=7680, intermediate_layers_indices=[3, 7, 15, 23, 30]),
                      seq=2048, tiles=4, lora_r=16),
          "dry": dict(text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=256, cross_attention_layers=[1], pad_token_id=0),
                      vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                                  attention_heads=2, image_size=28, patch_size=14, max_num_tiles=2,
                                  vision_output_dim=64, intermediate_layers_indices=[0],
                                  supported_aspect_ratios=[[1, 1], [1, 2]]),
                      seq=24, tiles=2, lora_r=4)}


def _result(obj: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


# ------------------------------------------------------------------------------------------------ ddp-step


def _text_model(size: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    s = {k: v for k, v in TEXT[size].items() if k not in ("lengths", "batch", "lora_r")}
    model = LlamaForCausalLM(LlamaConfig(**s, attn_implementation="sdpa", use_cache=False))
    r = TEXT[size]["lora_r"]
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))


def _vlm_model(size: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    s = VLM[size]
    cfg = Qwen2_5_VLConfig(text_config=dict(s["text"], use_cache=False), vision_config=s["vision"], **s["tokens"])
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    r = s["lora_r"]
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))


def _text_rows(size: str, n: int, rank: int) -> list[dict[str, Any]]:
    import torch

    s = TEXT[size]
    g = torch.Generator().manual_seed(100 + rank)
    lo, hi = s["lengths"]
    return [{"input_ids": torch.randint(0, s["vocab_size"], (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                                        generator=g).tolist()} for _ in range(n)]


def _pad(rows: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _vlm_batch(size: str, has_image: bool, seed: int) -> dict[str, Any]:
    import torch

    s = VLM[size]
    g = torch.Generator().manual_seed(seed)
    vocab, tok = s["text"]["vocab_size"], s["tokens"]
    ids = torch.randint(0, min(vocab, 150000) - 8, (1, s["seq"]), generator=g)
    out: dict[str, Any] = {}
    if has_image:
        grid, v = s["grid"], s["vision"]
        n_tok = grid * grid // v["spatial_merge_size"] ** 2
        ids[0, 1] = tok["vision_start_token_id"]
        ids[0, 2: 2 + n_tok] = tok["image_token_id"]
        ids[0, 2 + n_tok] = tok["vision_end_token_id"]
        patch_dim = 3 * v["temporal_patch_size"] * v["patch_size"] ** 2
        out["pixel_values"] = torch.randn(grid * grid, patch_dim, generator=g)
        out["image_grid_thw"] = torch.tensor([[1, grid, grid]])
        out["mm_token_type_ids"] = (ids == tok["image_token_id"]).long()
    out["input_ids"] = ids
    out["labels"] = ids.clone()
    return out


def ddp_step(a: argparse.Namespace) -> None:
    """One rank of the ``ddp-step`` part (launched by gpu_suite.py with RANK/WORLD_SIZE, LOCAL_RANK=0)."""
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_ddpfix import patch_trainer, unpatch_trainer
    from hf_ddpfix._compat import checkpointing_training_args

    size = "dry" if a.dry else "gpu"
    cuda = torch.cuda.is_available() and not a.dry
    if cuda:
        torch.cuda.set_device(0)
    rank = int(os.environ.get("RANK", "0"))
    steps = a.steps
    if a.case == "vlm":
        data = Dataset.from_list([{"seed": i} for i in range(steps)])

        def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
            return _vlm_batch(size, rank == 0, seed=rows[0]["seed"] * 2 + rank)
        batch = 1
    else:
        batch = TEXT[size]["batch"]
        data = Dataset.from_list(_text_rows(size, steps * batch, rank))
        collate = _pad

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t0, self.times = 0.0, []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)

    class InOrder(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    def run(patched: bool) -> dict[str, Any]:
        if patched:
            patch_trainer()
        try:
            torch.manual_seed(0)
            dtype = torch.get_default_dtype()
            if cuda:
                torch.set_default_dtype(torch.bfloat16)
            with torch.device("cuda" if cuda else "cpu"):
                model = _vlm_model(size) if a.case == "vlm" else _text_model(size)
            torch.set_default_dtype(dtype)
            clock = Clock()
            args = TrainingArguments(
                output_dir=a.out_dir, per_device_train_batch_size=batch, max_steps=steps, report_to=[],
                use_cpu=not cuda, ddp_backend="gloo", bf16=cuda, save_strategy="no", learning_rate=1e-4,
                weight_decay=0.1, max_grad_norm=1.0, remove_unused_columns=False, disable_tqdm=True, seed=0,
                logging_steps=10_000, dataloader_num_workers=0, **checkpointing_training_args(True, {"use_reentrant": False}))
            trainer = InOrder(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[clock])
            out = trainer.train()
            wrapped = trainer.model_wrapped
            steady = clock.times[a.warmup:] or clock.times
            info = {"step_s": statistics.median(steady), "loss": float(out.training_loss),
                    "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
                    "static_graph": getattr(wrapped, "static_graph", None)}
            del trainer, wrapped, model
            if cuda:
                torch.cuda.empty_cache()
            return info
        finally:
            if patched:
                unpatch_trainer()

    pairs = [{"stock": run(False), "hf_ddpfix": run(True)} for _ in range(a.pairs)]
    if rank == 0:
        ratios = [p["hf_ddpfix"]["step_s"] / p["stock"]["step_s"] for p in pairs]
        _result({"part": "ddp-step", "case": a.case, "size": size, "ranks": int(os.environ.get("WORLD_SIZE", "1")),
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu", "pairs": pairs,
                 "stock_s": statistics.median(p["stock"]["step_s"] for p in pairs),
                 "hf_ddpfix_s": statistics.median(p["hf_ddpfix"]["step_s"] for p in pairs),
                 "ratio": statistics.median(ratios)})
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ fsdp-layout


def _mllama_batch(size: str, device: Any) -> dict[str, Any]:
    import torch

    s = MLLAMA[size]
    g = torch.Generator().manual_seed(0)
    vocab, seq, tiles, px = s["text"]["vocab_size"], s["seq"], s["tiles"], s["vision"]["image_size"]
    ids = torch.randint(0, vocab - 1, (1, seq), generator=g)
    ids[0, 1] = vocab  # MllamaConfig's default image_token_index is vocab_size (the extra embedding row)
    mask = torch.zeros(1, seq, 1, tiles, dtype=torch.long)
    mask[:, 1:, :, :] = 1
    batch = {"input_ids": ids, "labels": ids.clamp(max=vocab - 1),
             "pixel_values": torch.randn(1, 1, tiles, 3, px, px, generator=g),
             "aspect_ratio_ids": torch.tensor([[1]]), "aspect_ratio_mask": torch.ones(1, 1, tiles, dtype=torch.long),
             "cross_attention_mask": mask}
    return {k: v.to(device) for k, v in batch.items()}


def fsdp_layout(a: argparse.Namespace) -> None:
    """Rank 0 of a simulated 8-rank FSDP2 training run (fake process group) with the PLAN's units: ``hf-ddpfix
    plan``'s computation (``offline_plan.plan_offline`` with ``--set fsdp_skippable=<mode>``) gives the unit classes
    and the projected bytes (the one layout model, ``integrations/fsdp/scale.py``); accelerate's own
    ``fsdp2_prepare_model`` shards the model with those classes (``_compat.prepare_like_accelerate``, as the run's
    applier hands them to accelerate), the run's dummy is attached where the plan turns it on (``vlm_stabilizer``:
    ``integrations.fsdp.dummy.attach_fsdp_dummy``), and the steps alternate an image batch and a text-only batch,
    so the shard layout's text-only step runs the cross-attention dummy. One mode per process."""
    import contextlib
    import tempfile

    import torch
    from stand_in_device import device
    from transformers import MllamaConfig

    from hf_ddpfix import cli
    from hf_ddpfix._compat import (
        fake_process_group,
        fsdp_groups,
        prepare_like_accelerate,
        set_fsdp_wrap_classes,
    )
    from hf_ddpfix.facts import offline as offline_plan
    from hf_ddpfix.integrations.fsdp.dummy import attach_fsdp_dummy
    from hf_ddpfix.integrations.fsdp.scale import UNSHARDED
    from hf_ddpfix.plan.fsdp import fsdp_unit_classes, fsdp_units_ours

    size = "dry" if a.dry else "gpu"
    d = device()  # CUDA, or the GPU suite's stand-in device (dry run: tensors on the CPU)
    cuda = d is not None and not d.stand_in
    dev = d.torch_device if cuda else torch.device("cpu")
    s = MLLAMA[size]
    with tempfile.TemporaryDirectory() as tmp:
        MllamaConfig(vision_config=s["vision"], text_config=dict(s["text"], use_cache=False)).save_pretrained(tmp)
        args = cli._parser().parse_args([
            "plan", "--model", tmp, "--parallel", "fsdp", "--world-size", str(a.world), "--dtype",
            "bfloat16" if cuda else "float32", "--mixed-precision", "bf16" if cuda else "no", "--lora-targets",
            r".*language_model.*\.(q_proj|v_proj)", "--lora-r", str(s["lora_r"]), "--checkpointing", "non_reentrant",
            "--set", f"fsdp_skippable={a.skippable}"])
        done = offline_plan.plan_offline(args)
    plan, lay, model, plugin = done.plan, done.layout, done.model, done.plugin
    if fsdp_units_ours(plan.fsdp_units):  # what the run's applier hands accelerate
        set_fsdp_wrap_classes(plugin, fsdp_unit_classes(plan.fsdp_units))
    model.base_model.model.gradient_checkpointing_enable({"use_reentrant": False})
    before_clip: list[Any] = []
    with fake_process_group(a.world, 0), contextlib.ExitStack() as stack:
        prepare_like_accelerate(model, plugin, args.mixed_precision)
        units = len(fsdp_groups(model))
        model.to_empty(device=dev)
        with torch.no_grad():
            for p in model.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).normal_(0.0, 0.02)
        dummy = None
        if plan.vlm_stabilizer.value:  # the plan's dummy (shard): a text-only rank runs tower + cross-attention
            dummy = attach_fsdp_dummy(model, stack, lambda fn: (before_clip.append(fn), lambda: None)[1])
        image = _mllama_batch(size, dev)
        text = {k: image[k] for k in ("input_ids", "labels")}
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        if d is not None:
            d.synchronize()
            d.reset_peak()
        t0 = time.perf_counter()
        for step in range(a.steps):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(**(image if step % 2 == 0 else text)).loss
            loss.backward()
            for fn in before_clip:  # the dummy's step end (gradients no rank used reset), as before clipping
                fn()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if d is not None:
            d.synchronize()
        step_s = (time.perf_counter() - t0) / a.steps
    _result({"part": "fsdp-layout", "skippable": plan.fsdp_skippable.value, "size": size, "world": a.world,
             "units": len([u for u in lay.units if u.name != UNSHARDED]), "units_sharded": units,
             "root_gib": (lay.root.full_bytes if lay.root else 0) / GIB, "plan_peak_gib": lay.peak_bytes / GIB,
             "plan_rank_gib": lay.rank_bytes / GIB, "peak_gib": d.peak_bytes() / GIB if d is not None else None,
             "dummy_runs": getattr(dummy, "dummy_runs", 0), "step_s": step_s,
             "finite_loss": bool(torch.isfinite(loss).item()), "device": d.name() if d is not None else "cpu"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="part", required=True)
    d = sub.add_parser("ddp-step")
    d.add_argument("--case", choices=("text", "vlm"), required=True)
    d.add_argument("--steps", type=int, default=8)
    d.add_argument("--warmup", type=int, default=2)
    d.add_argument("--pairs", type=int, default=2)
    d.add_argument("--out-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hf_ddpfix_gpu_suite"))
    d.add_argument("--dry", action="store_true")
    f = sub.add_parser("fsdp-layout")
    f.add_argument("--skippable", choices=("fold", "shard"), required=True, help="the plan's fsdp_skippable, forced")
    f.add_argument("--world", type=int, default=8)
    f.add_argument("--steps", type=int, default=2)
    f.add_argument("--dry", action="store_true")
    a = ap.parse_args(argv)
    {"ddp-step": ddp_step, "fsdp-layout": fsdp_layout}[a.part](a)


if __name__ == "__main__":
    main()
