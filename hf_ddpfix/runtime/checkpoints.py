"""Checkpoint safety for resumable runs: find the last complete checkpoint, save the final model safely.

- `last_complete_checkpoint(output_dir)`: the newest `checkpoint-N` that was fully written (a crash
  while saving leaves a partial folder that `get_last_checkpoint` would still pick).
- `save_model_atomic(trainer, output_dir)`: every file of the final model lands in `output_dir` by an
  atomic rename, written once by the world's process zero; nothing else in `output_dir` is touched. Under
  FSDP with a sharded state dict (fsdp.yaml), where `Trainer.save_model` writes nothing, the model is gathered
  and saved all the same.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_RANK_RNG = re.compile(r"^rng_state_(\d+)\.pth$")


def last_complete_checkpoint(output_dir: str, world_size: int | None = None) -> str | None:
    """The newest `checkpoint-N` under `output_dir` that was completely written, or `None`.

    Complete means: the trainer state (written last, by rank 0) exists and, when the checkpoint holds
    per-rank RNG files (a multi-process run), every rank of the current world has one (each rank writes
    its own, with no barrier before rank 0's trainer state).

    Args:
        output_dir: `TrainingArguments.output_dir`.
        world_size: processes of the run (default: `WORLD_SIZE` from the environment, else 1).
    """
    if not os.path.isdir(output_dir):
        return None
    world = int(world_size or os.environ.get("WORLD_SIZE", 1))
    found = []
    for name in os.listdir(output_dir):
        m = _CHECKPOINT.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isdir(path):
            found.append((int(m.group(1)), path))
    for _, path in sorted(found, reverse=True):
        if not os.path.isfile(os.path.join(path, "trainer_state.json")):
            continue
        per_rank = {int(m.group(1)) for f in os.listdir(path) if (m := _RANK_RNG.match(f))}
        if world > 1 and per_rank and not set(range(world)) <= per_rank:
            continue
        return path
    return None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _fsdp_sharded(trainer: Any) -> bool:
    """FSDP with a state dict type other than FULL_STATE_DICT: transformers 5.23's `Trainer.save_model` saves
    a model under FSDP only for FULL_STATE_DICT and silently writes nothing otherwise (measured, 2026-11-27)."""
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "fsdp_plugin", None)
    return plugin is not None and "FULL_STATE_DICT" not in str(plugin.state_dict_type)


def _save_gathered(trainer: Any, output_dir: str, main: bool) -> None:
    """What `Trainer.save_model` saves under FULL_STATE_DICT, for a sharded run: the full state dict gathered
    on every rank (`accelerator.get_state_dict`, a collective), written by process zero through the model's
    `save_pretrained` (a PEFT model: the adapter only), with the processing class and the training args."""
    state = trainer.accelerator.get_state_dict(trainer.model)
    if not main:
        return
    os.makedirs(output_dir, exist_ok=True)
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(output_dir, state_dict=state)
    else:  # what `Trainer._save` does for a model that is not a PreTrainedModel / PeftModel
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(output_dir, "model.safetensors"),
                  metadata={"format": "pt"})
    if getattr(trainer, "processing_class", None) is not None:
        trainer.processing_class.save_pretrained(output_dir)
    torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))


def save_model_atomic(trainer: Any, output_dir: str) -> bool:
    """`trainer.save_model(output_dir)` where no file in `output_dir` is ever half-written. Call on every rank.

    Every rank saves into a sibling temp folder (`<output_dir>.tmp-hf_ddpfix`; FSDP full state dicts
    need all ranks; under FSDP's SHARDED_STATE_DICT, where `Trainer.save_model` writes nothing, the state dict
    is gathered and saved by process zero), then the main process moves each saved file into `output_dir` with `os.replace`
    (atomic per file) and removes the temp folder. Other content of `output_dir` (checkpoints, logs) is
    kept: nothing is lost. A crash leaves each file either old and complete or new and complete.

    Returns:
        True on the process that moved the files into place (the world's process zero).
    """
    output_dir = os.path.abspath(output_dir.rstrip("/"))
    tmp = output_dir + ".tmp-hf_ddpfix"
    main = trainer.is_world_process_zero()
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    if _distributed():
        dist.barrier()
    if _fsdp_sharded(trainer):
        _save_gathered(trainer, tmp, main)
    else:
        trainer.save_model(tmp)
    if _distributed():
        dist.barrier()
    if main:
        os.makedirs(output_dir, exist_ok=True)
        for root, _dirs, files in os.walk(tmp):
            dest_root = os.path.join(output_dir, os.path.relpath(root, tmp))
            os.makedirs(dest_root, exist_ok=True)
            for name in files:
                os.replace(os.path.join(root, name), os.path.join(dest_root, name))
        shutil.rmtree(tmp, ignore_errors=True)
    if _distributed():
        dist.barrier()
    return main
