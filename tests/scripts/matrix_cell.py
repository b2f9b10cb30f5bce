"""Cells of the DDP compatibility matrix (the cell of ../shared/acceptance/cell.py, the acceptance harness): a tiny
LoRA fine-tune under the stock HF Trainer, or with hf_ddpfix.patch_trainer() when --fix 1, launched by torchrun.
Prints one line `CELL <json>` per cell from rank 0.

One cell per launch (the acceptance harness's form: ``--model ... --ckpt ...``), or several with ``--cells FILE``
(a JSON list of argument lists, run one after the other in this process group: each cell seeds, builds its model
and its Trainer afresh and drops them before the next; the suite's economy, tests/test_matrix.py). A cell that
raises is reported (``ok: false``) and the next one runs; ``--fix`` is the launch's, for every cell alike.
"""
import argparse
import gc
import hashlib
import json
import os
import threading

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--model", choices=["text", "vlm"], default="text")
p.add_argument("--ckpt", choices=["off", "nonreentrant", "reentrant"], default="nonreentrant")
p.add_argument("--find-unused", choices=["auto", "1", "0"], default="auto")
p.add_argument("--static", choices=["auto", "1", "0"], default="auto")
p.add_argument("--offload", type=int, default=0)
p.add_argument("--fix", type=int, default=0)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--ga", type=int, default=1)
p.add_argument("--seq", type=int, default=32)
p.add_argument("--cells", default="", help="a JSON file: a list of argument lists, one cell each")
launch = p.parse_args()

if launch.fix:
    from hf_ddpfix import patch_trainer
    patch_trainer()

from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402


def build(a):
    """The cell's LoRA model, its rows and its collate function (seeded: every cell starts from the same weights)."""
    torch.manual_seed(0)
    if a.model == "text":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        model = LlamaForCausalLM(cfg)
        targets = ["q_proj", "v_proj"]
        rows = [{"input_ids": [(i * 7 + j) % 240 for j in range(a.seq)]} for i in range(64)]
    else:
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        cfg = Qwen2_5_VLConfig(
            text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}, eos_token_id=0),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                               fullatt_block_indexes=[1], window_size=56),
            image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
        model = Qwen2_5_VLForConditionalGeneration(cfg)
        # LoRA on every linear layer, the vision tower's included (what "all-linear" users do)
        targets = ["q_proj", "v_proj", "qkv", "proj", "gate_proj", "up_proj", "down_proj"]
        rows = []
        for i in range(64):
            ids = [(i * 7 + j) % 240 for j in range(a.seq)]
            if i % 2 == 0:  # image sample: 4x4 patches -> 4 merged image tokens
                ids = ids[:4] + [252, 250, 250, 250, 250, 253] + ids[4:a.seq - 6]
                g = torch.Generator().manual_seed(i)
                rows.append({"input_ids": ids, "pixel_values": torch.randn(16, 1176, generator=g).tolist(),
                             "image_grid_thw": [[1, 4, 4]]})
            else:
                rows.append({"input_ids": ids, "pixel_values": None, "image_grid_thw": None})
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets)), rows


def collate(batch):
    out = {"input_ids": torch.tensor([b["input_ids"] for b in batch])}
    out["labels"] = out["input_ids"].clone()
    imgs = [b for b in batch if b.get("pixel_values") is not None]
    if imgs:
        out["pixel_values"] = torch.cat([torch.tensor(b["pixel_values"]) for b in imgs])
        out["image_grid_thw"] = torch.cat([torch.tensor(b["image_grid_thw"]) for b in imgs])
    return out


def run_cell(a) -> dict:
    """Train one cell; rank 0's result (loss, weights in sync across ranks, the DDP settings that ran)."""
    model, rows = build(a)
    ds = Dataset.from_list(rows)
    kw = {}
    if a.ckpt != "off":
        kw["gradient_checkpointing"] = True
        kw["gradient_checkpointing_kwargs"] = {"use_reentrant": a.ckpt == "reentrant"}
        if a.offload:
            kw["gradient_checkpointing_kwargs"]["offload"] = True
    if a.find_unused != "auto":
        kw["ddp_find_unused_parameters"] = a.find_unused == "1"
    if a.static != "auto":
        kw["ddp_static_graph"] = a.static == "1"
    args = TrainingArguments(output_dir=f"/tmp/cell_out_{os.getpid()}", per_device_train_batch_size=1,
                             max_steps=a.steps, report_to=[], logging_steps=1, use_cpu=True, save_strategy="no",
                             learning_rate=1e-2, remove_unused_columns=False, disable_tqdm=True, seed=0,
                             gradient_accumulation_steps=a.ga, **kw)
    res = {"model": a.model, "ckpt": a.ckpt, "fu": a.find_unused, "static": a.static, "offload": a.offload,
           "ga": a.ga, "fix": launch.fix}
    tr = w = None
    try:
        tr = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate)
        out = tr.train()
        w = tr.model_wrapped
        h = hashlib.sha256()
        for _, prm in sorted(model.named_parameters()):
            if prm.requires_grad:
                h.update(prm.detach().float().numpy().tobytes())
        digest = h.hexdigest()[:16]
        res.update(ok=True, loss=round(out.training_loss, 5), wrapped=type(w).__name__,
                   find_unused=getattr(w, "find_unused_parameters", None),
                   static_graph=getattr(w, "static_graph", None))
        if dist.is_initialized():
            all_d = [None] * dist.get_world_size()
            dist.all_gather_object(all_d, digest)
            res["in_sync"] = len(set(all_d)) == 1
    except Exception as e:
        msg = str(e).split("\n")[0][:160]
        res.update(ok=False, error=type(e).__name__ + ": " + msg)
    # drop the Trainer and the DDP wrapper (its reducer holds the group) before the next cell and before the group
    # goes: a reducer that outlives its gloo group aborts the process at exit now and then ("terminate called
    # without an active exception")
    del tr, w, model
    gc.collect()
    return res


def watchdog(cell: int) -> threading.Timer:
    """Past ``MATRIX_CELL_TIMEOUT_S`` seconds in one cell the process exits 124 saying which cell hung (a batched
    launch fails within one cell's time, not the whole batch's)."""
    limit = float(os.environ.get("MATRIX_CELL_TIMEOUT_S", "0") or 0)

    def fire() -> None:
        print(f"CELL-TIMEOUT cell {cell} ran past {limit:.0f}s (hang?)", flush=True)
        os._exit(124)

    timer = threading.Timer(limit, fire)
    timer.daemon = True
    if limit > 0:
        timer.start()
    return timer


cells = [launch] if not launch.cells else [p.parse_args(c) for c in json.load(open(launch.cells))]
for i, cell in enumerate(cells):
    timer = watchdog(i)
    res = run_cell(cell)
    timer.cancel()
    if launch.cells:
        res["cell"] = i
    if int(os.environ.get("RANK", 0)) == 0:
        print("CELL " + json.dumps(res), flush=True)
if dist.is_initialized():
    dist.destroy_process_group()
