"""A VLM under DeepSpeed ZeRO-2 with hf_ddpfix's sequence parallelism, through the stock Trainer (run from
sp_deepspeed.py, case "hf_ddpfix_vlm/zero2/sgd_clip_wd"): tiny LLaVA (CLIP tower, Llama decoder), LoRA on every linear
layer incl. the tower and projector, `patch_trainer(sequence_parallel=2)` (world 4: DP 2 x SP 2), gradient accumulation,
SGD with weight decay and gradient clipping, micro-batches of 2 right-padded prompt-masked samples of variable length, an
image in every third sample (mixed image / text ranks and groups; each optimizer step has an image somewhere).

Reference: one process, the recorded batches of every rank; each step's loss is the token mean over all its
micro-batches (what one process computes on the whole batch); the same optimizer, schedule, clipping and weight decay.
The counters are judged on every rank (each rank's own, gathered).
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

IMG = 200  # tests/zoo.py's image token id
STEPS = 2
OPTIM = dict(optim="sgd", max_grad_norm=0.5, weight_decay=0.1, learning_rate=5e-2)


def _samples(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 9 + (i * 5) % 9
        ids = torch.randint(1, 190, (length,), generator=g)
        row: dict = {}
        if i % 3 == 0:
            start = 1 + i % 4
            ids[start:start + 4] = IMG
            row["pixel_values"] = torch.randn(3, 28, 28, generator=g)
        labels = ids.masked_fill(ids == IMG, -100)
        labels[: 2 + i % 3] = -100
        row.update(input_ids=ids, labels=labels)
        rows.append(row)
    return rows


class _Data(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.stack([F.pad(b["input_ids"], (0, n - len(b["input_ids"]))) for b in batch])
    mask = torch.stack([F.pad(torch.ones_like(b["input_ids"]), (0, n - len(b["input_ids"]))) for b in batch])
    labels = torch.stack([F.pad(b["labels"], (0, n - len(b["labels"])), value=-100) for b in batch])
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    pix = [b["pixel_values"] for b in batch if "pixel_values" in b]
    if pix:
        out["pixel_values"] = torch.stack(pix)
    return out


def _model():
    from zoo import ZOO

    return ZOO["llava"].model(seed=0)


def _token_sum(model, batch: dict) -> tuple[torch.Tensor, int]:
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits.float()
    labels = batch["labels"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    return loss, int((labels != -100).sum())


def _reference(steps: list[list[dict]]) -> dict:
    from transformers import get_linear_schedule_with_warmup

    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=OPTIM["learning_rate"], weight_decay=OPTIM["weight_decay"])
    sched = get_linear_schedule_with_warmup(opt, 0, STEPS)
    losses = []
    for step in steps:
        opt.zero_grad()
        parts = [_token_sum(model, b) for b in step]
        loss = sum(s for s, _ in parts) / sum(n for _, n in parts)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, OPTIM["max_grad_norm"])
        opt.step()
        sched.step()
        losses.append(float(loss))
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
            "losses": losses}


def vlm_zero2_cell(v, ga: int, sp: int, ds_config, recorder_cls, tol_weight: float, tol_loss: float,
                   zero: int | None = 2) -> None:
    """Train, gather every rank's batches and counters, compare with one process on rank 0 (module docstring).
    `zero=None`: the same run under DDP (no DeepSpeed config)."""
    from transformers import Trainer, TrainingArguments

    from hf_ddpfix import patch_trainer, unpatch_trainer
    from hf_ddpfix.ops import feature_counts

    world, r = dist.get_world_size(), dist.get_rank()
    unpatch_trainer()
    patch_trainer(sequence_parallel=sp)
    feature_counts.reset()
    model = _model()
    rec = recorder_cls(collate)
    args = TrainingArguments(output_dir=f"/tmp/hf_ddpfix_spds_vlm_{zero}", per_device_train_batch_size=2,
                             gradient_accumulation_steps=ga, max_steps=STEPS, report_to=[], use_cpu=True,
                             save_strategy="no", remove_unused_columns=False, disable_tqdm=True, seed=0,
                             logging_steps=1, deepspeed=ds_config(zero, None) if zero else None, **OPTIM)
    t0 = time.time()
    trainer = Trainer(model=model, args=args, train_dataset=_Data(_samples(2 * ga * STEPS * world, 3)),
                      data_collator=rec)
    trainer.train()
    seconds = time.time() - t0
    snap = feature_counts.snapshot()
    c = snap.get("sequence_parallel")
    plan = getattr(trainer, "hf_ddpfix_plan", None)
    mine = {"attention_calls": c.ran if c else 0, "fallbacks": dict(c.fallbacks) if c else {},
            "sharded_batches": c.amounts.get("sharded_batches", 0) if c else 0,
            "vision_sharded_forwards": c.amounts.get("vision_sharded_forwards", 0) if c else 0,
            "tower_attention_calls": c.amounts.get("full_sequence_attention_calls", 0) if c else 0,
            "plan": str(plan.sequence_parallel.value if plan is not None else None),
            "engine_sp": getattr(trainer.model_wrapped, "sequence_parallel_size", None)}
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, mine)
    batches: list = [None] * world
    dist.all_gather_object(batches, rec.batches)
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    unpatch_trainer()
    dist.barrier()
    del trainer
    gc.collect()
    micro = STEPS * ga * sp  # the group's micro-batches each rank forwards (its own and its SP peers')
    counters_ok = all(x["attention_calls"] > 0 and x["sharded_batches"] == micro and not x["fallbacks"]
                      and x["vision_sharded_forwards"] == STEPS * ga and x["tower_attention_calls"] > 0
                      and x["engine_sp"] in (None, 1) and x["plan"].startswith(f"N={sp} DP={world // sp}")
                      for x in per_rank)
    out = {"case": f"hf_ddpfix_vlm/{f'zero{zero}' if zero else 'ddp'}/sgd_clip_wd", "model": "llava", "world": world, "sp": sp, "ga": ga,
           "seconds": round(seconds, 1), "losses": losses, "per_rank": per_rank,
           "images_per_step": [sum("pixel_values" in b[k * ga + m] for b in batches for m in range(ga))
                               for k in range(STEPS)],
           # micro-batches where one SP group had images and another none (the tower runs on one group only)
           "mixed_group_micro_batches": sum(
               len({any("pixel_values" in batches[g * sp + j][m] for j in range(sp)) for g in range(world // sp)}) > 1
               for m in range(STEPS * ga)),
           "ok": counters_ok}
    if r == 0:
        steps = [[b[k * ga + m] for b in batches for m in range(ga)] for k in range(STEPS)]
        ref = _reference(steps)
        out.update(weight_diff=max((weights[k] - ref["weights"][k]).abs().max().item() for k in weights),
                   vision_lora=sum("vision_tower" in k for k in weights), ref_losses=ref["losses"],
                   loss_diff=max(abs(x - y) for x, y in zip(losses, ref["losses"], strict=True)))
        out["ok"] = counters_ok and out["weight_diff"] <= tol_weight and out["loss_diff"] <= tol_loss
    v.add(out)
