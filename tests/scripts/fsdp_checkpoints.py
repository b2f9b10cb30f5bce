"""Checkpoints under the Trainer's FSDP2 as users launch it: save, a rank killed mid-run, resume, the adapter.

Run (2 gloo processes on the CPU through the FSDP test device, docs/fsdp.md), twice: the run that loses a rank,
then the relaunch that resumes (as a job scheduler relaunches a failed job):

    PYTHONPATH=hf_ddpfix/rehearse/device:. accelerate launch --config_file accelerate_configs/fsdp.yaml \
        --mixed_precision no tests/scripts/fsdp_checkpoints.py --out OUT --phase kill
    ... the same ... --phase resume

One family (``--family``, default Qwen2.5-VL: image and text-only ranks mixed, so hf_ddpfix's per-unit ties run
on every step), loaded as users load it (saved, then ``from_pretrained``), trained by
``DDPFixTrainer`` on tests/scripts/fsdp_trainer.py's data (AdamW, weight decay 0.1, clipping 1.0, variable
lengths, non-reentrant checkpointing) for :data:`STEPS` optimizer steps, ``save_steps`` :data:`SAVE_EVERY`:

phase ``kill`` (the state dict type of the launch: fsdp.yaml's ``SHARDED_STATE_DICT``, or accelerate launch's
``--fsdp_state_dict_type FULL_STATE_DICT``):
- with ``--reference``, first the uninterrupted run, no checkpoint; rank 0 writes ``OUT/reference.pt`` (every
  trainable tensor, FSDP2 shards gathered);
- the checkpointed run: rank 1 is killed (``SIGKILL``) at the end of optimizer step :data:`KILL_AT`, after
  ``checkpoint-{KILL_AT - 1}`` was saved and before the next one; the launcher then ends rank 0 and the launch
  fails.
phase ``resume`` (the same launch line): the run resumes from hf_ddpfix's ``last_complete_checkpoint``
(``resume_from_checkpoint=``: accelerate's ``load_state``: model, optimizer, scheduler, RNG) and finishes; then
``hf_ddpfix.save_model_atomic`` saves the adapter to ``OUT/adapter-<type>`` and every rank runs one forward of a
fixed batch (with an image) through the FSDP2 model.

Rank 0 writes ``OUT/resumed-<type>.pt``: {"weights", "logits" (the fixed batch's), "resumed_from", "state_dict_type"
(the plugin's, as the save used it), "units", "wrapped"} and prints ``FSDP_CHECKPOINTS_OK <type>``. The test compares
the weights with the reference and loads each adapter in one process (``PeftModel.from_pretrained``) to compare the
logits.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from fixtures import single_collate, trainable_weights  # noqa: E402
from fsdp_trainer import PATTERN, items, load_saved  # noqa: E402
from zoo import MORE_VLMS, ZOO  # noqa: E402

STEPS = 4
SAVE_EVERY = 2
KILL_AT = 3  # optimizer step at whose end rank 1 dies: checkpoint-2 is the newest complete one
PROBE_SEED = 90_000


def probe_batch(entry) -> dict[str, torch.Tensor]:
    """The fixed batch whose logits the test compares (an image: the tower's adapter counts too)."""
    return entry.batch(True, PROBE_SEED, 12)


def state_dict_type() -> str:
    """The launch's ``fsdp_state_dict_type`` (accelerate exports it as ``FSDP_STATE_DICT_TYPE``)."""
    return os.environ.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT").upper().replace("FSDP_", "")


def run(entry, out: str, tag: str, checkpoints: bool, resume: bool, world: int):
    from transformers import TrainerCallback, TrainingArguments

    from hf_ddpfix import DDPFixTrainer, checkpointing_training_args, last_complete_checkpoint

    ga = 1
    run_dir = os.path.join(out, f"run-{tag}")
    args = TrainingArguments(
        output_dir=run_dir, max_steps=STEPS, per_device_train_batch_size=1, gradient_accumulation_steps=ga,
        learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="steps" if checkpoints else "no", save_steps=SAVE_EVERY, report_to="none",
        train_sampling_strategy="sequential", remove_unused_columns=False, use_cpu=True, seed=0,
        disable_tqdm=True, **checkpointing_training_args(True, {"use_reentrant": False}),
    )
    assert args.device.type == "cpu"
    rank = args.process_index

    class KillRankOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if checkpoints and not resume and rank == 1 and state.global_step == KILL_AT:
                print(f"KILLING rank 1 at step {state.global_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    model = load_saved(entry, out, world)
    model.config.use_cache = False
    trainer = DDPFixTrainer(model=model, args=args, data_collator=single_collate, callbacks=[KillRankOne()],
                            train_dataset=items(entry, PATTERN, STEPS * ga, world, seed=0, ga=ga))
    last = last_complete_checkpoint(run_dir) if resume else None
    if resume:
        assert last is not None, f"no complete checkpoint in {run_dir}"
        print(f"RESUMING from {os.path.basename(last)} ({tag})", flush=True)
    trainer.train(resume_from_checkpoint=last)
    return trainer, last


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", default="qwen2_5_vl")
    ap.add_argument("--phase", choices=("kill", "resume"), required=True)
    ap.add_argument("--reference", action="store_true", help="phase kill: the uninterrupted run first")
    a = ap.parse_args()
    from torch.distributed.fsdp import FSDPModule

    from hf_ddpfix import save_model_atomic

    entry = {**ZOO, **MORE_VLMS}[a.family]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kind = state_dict_type()
    if a.phase == "kill" and a.reference:
        trainer, _ = run(entry, a.out, "reference", checkpoints=False, resume=False, world=world)
        weights = trainable_weights(trainer.model)
        if trainer.is_world_process_zero():
            torch.save({"weights": weights}, os.path.join(a.out, "reference.pt"))
        del trainer
    trainer, resumed_from = run(entry, a.out, kind, checkpoints=True, resume=a.phase == "resume", world=world)
    assert a.phase == "resume", "phase kill: rank 1 should have been killed before the end"
    weights = trainable_weights(trainer.model)
    save_model_atomic(trainer, os.path.join(a.out, f"adapter-{kind}"))
    model = trainer.model.eval()
    with torch.no_grad():
        logits = model(**probe_batch(entry)).logits.float()
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if trainer.is_world_process_zero():
        torch.save({"weights": weights, "logits": logits, "units": units, "wrapped": type(model).__name__,
                    "state_dict_type": str(trainer.accelerator.state.fsdp_plugin.state_dict_type),
                    "resumed_from": os.path.basename(resumed_from) if resumed_from else None},
                   os.path.join(a.out, f"resumed-{kind}.pt"))
    print(f"FSDP_CHECKPOINTS_OK {kind}", flush=True)

if __name__ == "__main__":
    try:
        main()
    finally:
        from hf_ddpfix.ops.dist import destroy_default_group

        destroy_default_group()
