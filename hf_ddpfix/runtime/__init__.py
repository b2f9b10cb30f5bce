"""What applies a plan to one run, and what reports on it.

- `attach`: `attach_runtime(trainer, model, plan, stack)`, the appliers for one `train()` call.
- `evaluation`: what a `Trainer` evaluation attaches outside `train()`.
- `feature_report`: the requested features' fallbacks and counts.
- `errors`, `launcher_errors`: readable DDP errors, and the one handed to the launcher.
- `checkpoints`: checkpoint safety (the last complete checkpoint, an atomic final save).
"""
