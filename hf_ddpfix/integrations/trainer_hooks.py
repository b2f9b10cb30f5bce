"""A reversible layer over `transformers.Trainer`'s hook points that chains with other libraries' patches.

`TrainerPatchLayer(run_inner_loop, resolve_resume, run_eval_loop)` wraps `Trainer._inner_training_loop` (which
runs after `train()` has enabled checkpointing and loaded any checkpoint, and before `accelerator.prepare()`
wraps the model), `Trainer.train` and `Trainer.evaluation_loop` (shared by `evaluate()` and `predict()`), as
they are installed when the layer is created. It knows nothing of what
runs inside: the caller gives it the two callables (`hf_ddpfix.trainer` passes the plan's).

Guarantees: the layer calls the methods that were installed when it was created (stock, or a patch another
library applied before, which keeps working inside ours); `remove()` puts them back when the layer is
still on top, and otherwise (someone patched over it) turns the layer into a pass-through, so the other
patch stays and keeps working (tests/test_trainer_entry_points.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import Trainer

from .._compat import TRAINER_INNER_LOOP

__all__ = ["EvalLoopRunner", "InnerLoopRunner", "ResumeResolver", "TrainerPatchLayer"]

#: `run_inner_loop(trainer, previous, *args, **kwargs)`: runs `previous(*args, **kwargs)` (the inner loop
#: installed below this layer, already bound to `trainer`) in whatever context it sets up.
InnerLoopRunner = Callable[..., Any]
#: `resolve_resume(trainer, resume_from_checkpoint) -> resume_from_checkpoint` as `Trainer.train` gets it.
ResumeResolver = Callable[[Trainer, Any], Any]
#: `run_eval_loop(trainer, previous, *args, **kwargs)`: runs `previous` (the installed `evaluation_loop`).
EvalLoopRunner = Callable[..., Any]


class TrainerPatchLayer:
    """One layer over `Trainer._inner_training_loop` and `Trainer.train`.

    Args:
        run_inner_loop: called instead of the installed inner loop while the layer is enabled.
        resolve_resume: maps `train()`'s `resume_from_checkpoint` while the layer is enabled.
        run_eval_loop: called instead of the installed `evaluation_loop` while the layer is enabled
            (`None`: `evaluation_loop` is not wrapped).

    Attributes:
        inner_training_loop, train: the wrappers this layer installs (compare with `Trainer`'s to see
            whether the layer is on top).
        prev_inner, prev_train: the methods installed when the layer was created.
        enabled: False after `remove()`; a disabled layer only passes calls through.
    """

    def __init__(self, run_inner_loop: InnerLoopRunner, resolve_resume: ResumeResolver,
                 run_eval_loop: EvalLoopRunner | None = None) -> None:
        self.enabled = True
        self.prev_inner = getattr(Trainer, TRAINER_INNER_LOOP)
        self.prev_train = Trainer.train
        self.prev_eval = Trainer.evaluation_loop
        self.run_eval_loop = run_eval_loop
        layer = self

        def _inner_training_loop(trainer: Trainer, *args: Any, **kwargs: Any) -> Any:
            def previous(*a: Any, **k: Any) -> Any:
                return layer.prev_inner(trainer, *a, **k)

            if not layer.enabled:
                return previous(*args, **kwargs)
            return run_inner_loop(trainer, previous, *args, **kwargs)

        def train(trainer: Trainer, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
            if layer.enabled:
                resume_from_checkpoint = resolve_resume(trainer, resume_from_checkpoint)
            return layer.prev_train(trainer, resume_from_checkpoint, *args, **kwargs)

        def evaluation_loop(trainer: Trainer, *args: Any, **kwargs: Any) -> Any:
            def previous(*a: Any, **k: Any) -> Any:
                return layer.prev_eval(trainer, *a, **k)

            if not layer.enabled or layer.run_eval_loop is None:
                return previous(*args, **kwargs)
            return layer.run_eval_loop(trainer, previous, *args, **kwargs)

        self.inner_training_loop = _inner_training_loop
        self.train = train
        self.evaluation_loop = evaluation_loop

    def installed(self) -> bool:
        """True while every wrapper is the method `Trainer` has now (this layer is on top)."""
        return (getattr(Trainer, TRAINER_INNER_LOOP) is self.inner_training_loop and Trainer.train is self.train
                and Trainer.evaluation_loop is self.evaluation_loop)

    def install(self) -> None:
        """Put this layer's wrappers on `Trainer` (on top of whatever is installed)."""
        setattr(Trainer, TRAINER_INNER_LOOP, self.inner_training_loop)
        Trainer.train = self.train  # type: ignore[method-assign]
        Trainer.evaluation_loop = self.evaluation_loop  # type: ignore[method-assign]

    def remove(self) -> None:
        """Take the layer off: restore the previous methods when on top, else become a pass-through."""
        if self.installed():
            setattr(Trainer, TRAINER_INNER_LOOP, self.prev_inner)
            Trainer.train = self.prev_train  # type: ignore[method-assign]
            Trainer.evaluation_loop = self.prev_eval  # type: ignore[method-assign]
        self.enabled = False
