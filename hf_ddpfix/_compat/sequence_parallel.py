"""accelerate's sequence-parallel switch (``ParallelismConfig(sp_size=N)``, accelerate >= 1.12) and what the
Trainer derives from it (checked against accelerate 1.12-1.15, transformers 5.23).

When hf_ddpfix runs its own Ulysses for a ``ParallelismConfig(sp_size=N)`` run, accelerate's and the Trainer's
DeepSpeed-SP code paths must stand down for the training loop, or the batch would be split twice. They all
read one object, ``accelerator.parallelism_config`` (a property over the shared ``AcceleratorState``):

- accelerate ``_prepare_deepspeed``: ``UlyssesSPAttentionHF.register_with_transformers`` (wraps the
  attention entry, builds DeepSpeed's SP groups, hands ``mpu`` to ``deepspeed.initialize``), the
  ``UlyssesSPDataLoaderAdapter``, ``train_batch_size`` divided by ``sp_size``;
- Trainer ``_inner_training_loop``: ``deepspeed_ulysses_dl_adapter``, ``len(dataloader) * sp_size``,
  ``get_sp_size()`` in the total batch size and in ``num_items_in_batch``; ``compute_loss``:
  ``deepspeed_sp_compute_loss``;
- Trainer ``__init__`` already set ``model_accepts_loss_kwargs = False`` ("SP computes its own good_tokens").

Part of the contract layer (:mod:`hf_ddpfix._compat`): torch-only at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["parallelism_config_available", "parallelism_sp_settings", "stand_down_accelerate_sequence_parallel"]


def parallelism_config_available() -> bool:
    """True when the installed accelerate has ``ParallelismConfig`` with ``sp_size`` (>= 1.12) and
    ``TrainingArguments`` takes ``parallelism_config``."""
    import dataclasses

    try:
        from accelerate.parallelism_config import ParallelismConfig
        from transformers import TrainingArguments
    except ImportError:
        return False
    names = {f.name for f in dataclasses.fields(ParallelismConfig)}
    return "sp_size" in names and "parallelism_config" in {f.name for f in dataclasses.fields(TrainingArguments)}


def parallelism_sp_settings(trainer: Any) -> tuple[int | None, str | None, str | None]:
    """``(sp_size, sp_backend, sp_attn_implementation)`` of ``trainer.args.parallelism_config``; ``None``s
    when there is none (``sp_handler.sp_attn_implementation``: accelerate's ``DeepSpeedSequenceParallelConfig``)."""
    pc = getattr(getattr(trainer, "args", None), "parallelism_config", None)
    if pc is None:
        return None, None, None
    size = getattr(pc, "sp_size", None)
    handler = getattr(pc, "sp_handler", None)
    return (int(size) if size else None, getattr(pc, "sp_backend", None),
            getattr(handler, "sp_attn_implementation", None) if handler is not None else None)


def _accepts_loss_kwargs(trainer: Any) -> bool:
    """What ``Trainer.__init__`` sets ``model_accepts_loss_kwargs`` to before its SP override (5.23: the
    unwrapped model's ``accepts_loss_kwargs``, else whether ``forward`` takes ``**kwargs``)."""
    import inspect

    from transformers.trainer import unwrap_peft_model

    model = unwrap_peft_model(trainer.accelerator.unwrap_model(trainer.model))
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def stand_down_accelerate_sequence_parallel(trainer: Any) -> Callable[[], None]:
    """For one training loop: ``trainer.accelerator.parallelism_config`` becomes a copy with ``sp_size=1``
    (accelerate and the Trainer then run their plain data-parallel paths: no DeepSpeed SP groups, no
    dataloader adapter, no ``deepspeed_sp_compute_loss``, batch sizes undivided), and
    ``trainer.model_accepts_loss_kwargs`` gets back the value ``Trainer.__init__`` computed before its SP
    override. Returns the undo (both restored). The user's ``TrainingArguments`` are never changed."""
    import dataclasses

    state = trainer.accelerator.state
    original = state.parallelism_config
    accepts = trainer.model_accepts_loss_kwargs
    if original is None or not getattr(original, "sp_size", 1) or original.sp_size <= 1:
        return lambda: None
    plain = dataclasses.replace(original, sp_size=1, sp_handler=None)
    state.parallelism_config = plain
    trainer.model_accepts_loss_kwargs = _accepts_loss_kwargs(trainer)

    def undo() -> None:
        if state.parallelism_config is plain:
            state.parallelism_config = original
        trainer.model_accepts_loss_kwargs = accepts

    return undo
