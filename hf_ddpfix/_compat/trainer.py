"""transformers.Trainer / TrainingArguments / accelerate: the hook points and switches hf_ddpfix uses.

The Trainer's private methods we hook (names are data, so the contract test checks them), the
version-keyed place where the plan is applied and where each step is finalised before clipping, the
DDP kwargs handler, and the checkpointing switches (public, renamed in transformers 5.23).

Part of the contract layer (:mod:`hf_ddpfix._compat`): torch-only at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

# --------------------------------------------------------------------------------------------------
# transformers.Trainer private methods we hook (names are data so the contract test can check them)
# --------------------------------------------------------------------------------------------------

#: Runs after ``train()`` loaded a checkpoint and before ``accelerator.prepare`` wraps the model; where the
#: plan is applied: its start (5.3-5.23) or after its ``_wrap_model`` (5.0-5.2; ``when_ready_to_prepare``).
TRAINER_INNER_LOOP = "_inner_training_loop"
#: Called once per optimizer step before ``optimizer.step()`` with the gradients final (5.3-5.23); the
#: usage finalisation (grad -> None for unused parameters) must run before it.
TRAINER_CLIP_GRAD_NORM = "_clip_grad_norm"
#: Used instead of ``_clip_grad_norm`` when ``max_grad_norm`` is 0/None to log ``grad_norm`` (5.3-5.23).
TRAINER_GET_GRAD_NORM = "_get_grad_norm"
TRAINER_STEP_HOOKS = (TRAINER_CLIP_GRAD_NORM, TRAINER_GET_GRAD_NORM)


#: 5.0-5.2 only: ``_inner_training_loop`` enables checkpointing, then calls this (it rebuilds
#: ``accelerator.ddp_handler`` from TrainingArguments), then ``accelerator.prepare``.
TRAINER_WRAP_MODEL = "_wrap_model"


def inner_loop_sets_up_training() -> bool:
    """True on transformers < 5.3: ``_inner_training_loop`` itself enables checkpointing, rebuilds the DDP
    kwargs (``_wrap_model``) and clips inline (no ``_clip_grad_norm`` / ``_get_grad_norm``)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release[:2] < (5, 3)


def _shadow(obj: Any, name: str, method: Callable[..., Any]) -> Callable[[], None]:
    """Shadow ``obj.name`` with ``method`` on the instance; the undo leaves a later shadow alone."""
    had_own, previous = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, method)

    def undo() -> None:
        if vars(obj).get(name) is not method:
            return
        if had_own:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)

    return undo


def when_ready_to_prepare(trainer: Any, setup: Callable[[], None]) -> Callable[[], None]:
    """Called first thing in ``_inner_training_loop``: run ``setup`` where the requested checkpointing is
    on and the DDP kwargs are final, before ``accelerator.prepare`` wraps the model; returns the undo.

    5.3-5.23: now (``train()`` enabled checkpointing; ``Trainer.__init__`` built the DDP kwargs). 5.0-5.2:
    right after the loop's first ``_wrap_model(model, training=True)`` (the optimizer may exist then:
    ``setup`` must not replace parameters). TrainingArguments are never changed (checkpoints save them).
    """
    if not inner_loop_sets_up_training():
        setup()
        return lambda: None
    stock, done = getattr(trainer, TRAINER_WRAP_MODEL), []

    def wrap_model(model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        out = stock(model, training=training, dataloader=dataloader)
        if training and not done:
            done.append(True)
            setup()
        return out

    return _shadow(trainer, TRAINER_WRAP_MODEL, wrap_model)


def before_gradient_clipping(trainer: Any, finalize: Callable[[], Any]) -> Callable[[], None]:
    """Run ``finalize`` after the last backward of each optimizer step, before the gradients are clipped,
    measured or stepped (a second call in one step must be a no-op); returns the undo.

    5.3-5.23: first in ``trainer._clip_grad_norm`` / ``_get_grad_norm`` (instance shadows). 5.0-5.2 clip
    inline: first in ``trainer.accelerator.clip_grad_norm_`` while ``accelerator.sync_gradients`` (the
    loop sets it just before), and at the public ``on_pre_optimizer_step`` for runs that do not clip.
    """
    def first(inner: Callable[..., Any], when: Callable[[], bool] = lambda: True) -> Callable[..., Any]:
        def method(*args: Any, **kwargs: Any) -> Any:
            if when():
                finalize()
            return inner(*args, **kwargs)

        return method

    if not inner_loop_sets_up_training():
        undos = [_shadow(trainer, name, first(getattr(trainer, name))) for name in TRAINER_STEP_HOOKS]
    else:
        from transformers import TrainerCallback

        class BeforeOptimizerStep(TrainerCallback):
            def on_pre_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
                finalize()

        acc, callback = trainer.accelerator, BeforeOptimizerStep()
        trainer.add_callback(callback)
        undos = [_shadow(acc, "clip_grad_norm_", first(acc.clip_grad_norm_, lambda: bool(acc.sync_gradients))),
                 lambda: trainer.remove_callback(callback)]

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


def around_backward(accelerator: Any, transform: Callable[[Any], Any],
                    retry: type[BaseException] | None = None) -> Callable[[], None]:
    """Make ``accelerator.backward(loss, **kw)`` back-propagate ``transform(loss)``; returns the undo.

    ``Accelerator.backward`` (accelerate 1.0-1.15) is where the Trainer's ``training_step`` (transformers
    5.0-5.23, and every TRL 1.x trainer, which call it through ``super().training_step``) and a plain
    accelerate loop hand over the loss that is back-propagated: it divides by the accumulation steps
    (DeepSpeed: the engine's own ``backward``) and calls ``loss.backward()``. ``transform`` sees the loss
    before either, on every micro-batch (``no_sync`` ones included). An instance shadow: another library's
    shadow installed later stays on top and the undo leaves it alone.

    ``retry``: an exception ``transform``'s output may raise from the first node of its backward, before any
    other node ran (nothing accumulated, no gradient hook fired): the backward is then run once more on
    ``transform(loss)`` (``ParameterUsage``'s no-walk check: the second call walks and ties).
    """
    stock = accelerator.backward

    def backward(loss: Any, **kwargs: Any) -> Any:
        if retry is None:
            return stock(transform(loss), **kwargs)
        try:
            return stock(transform(loss), **kwargs)
        except retry:
            return stock(transform(loss), **kwargs)

    backward._hf_ddpfix_around = transform  # type: ignore[attr-defined]
    return _shadow(accelerator, "backward", backward)


def trainer_callbacks(trainer: Any) -> list[Any]:
    """The live callback list of a ``Trainer`` (``trainer.callback_handler.callbacks``)."""
    return trainer.callback_handler.callbacks


def set_ddp_kwargs(accelerator: Any, **kwargs: Any) -> None:
    """Make ``accelerator.prepare`` build DDP with ``kwargs`` (``find_unused_parameters``, ``static_graph``).

    accelerate keeps the ``DistributedDataParallelKwargs`` it was given in ``Accelerator.ddp_handler``
    and reads it only when ``prepare`` wraps the model (accelerate 1.0-1.15).
    """
    import dataclasses

    from accelerate.utils import DistributedDataParallelKwargs

    handler = accelerator.ddp_handler or DistributedDataParallelKwargs()
    accelerator.ddp_handler = dataclasses.replace(handler, **kwargs)


def ddp_kwargs_handler(accelerator: Any) -> Any:
    """The ``DistributedDataParallelKwargs`` ``accelerator.prepare`` will wrap with (``Accelerator.ddp_handler``,
    accelerate 1.0-1.15), or None when the loop gave none (accelerate's defaults: find_unused False)."""
    return accelerator.ddp_handler


def ddp_syncs_grads(ddp_module: Any) -> bool:
    """False inside ``DistributedDataParallel.no_sync()`` (``require_backward_grad_sync``); True for
    anything that is not DDP."""
    return bool(getattr(ddp_module, "require_backward_grad_sync", True))


# --------------------------------------------------------------------------------------------------
# The checkpointing switches (public, but renamed in transformers 5.23)
# --------------------------------------------------------------------------------------------------

#: TrainingArguments' checkpointing flag and kwargs, and the model method that enables it: transformers
#: 5.23 renamed them to ``activation_checkpointing(_kwargs)`` / ``activation_checkpointing_enable`` (the
#: ``gradient_checkpointing*`` names stay as deprecated aliases until v6, warning when set); 5.0-5.22
#: have only the ``gradient_checkpointing*`` names. Both spell ``{}`` / ``None`` kwargs as
#: ``{"use_reentrant": False}`` (the 5.x default).
_NEW_CHECKPOINTING_ARGS = ("activation_checkpointing", "activation_checkpointing_kwargs")
_OLD_CHECKPOINTING_ARGS = ("gradient_checkpointing", "gradient_checkpointing_kwargs")


def checkpointing_arg_names() -> tuple[str, str]:
    """The installed TrainingArguments' names for (checkpointing flag, its kwargs)."""
    from transformers import TrainingArguments

    if _NEW_CHECKPOINTING_ARGS[0] in TrainingArguments.__dataclass_fields__:
        return _NEW_CHECKPOINTING_ARGS
    return _OLD_CHECKPOINTING_ARGS


def checkpointing_args(args: Any) -> tuple[bool, dict[str, Any] | None]:
    """(checkpointing requested, its kwargs) as ``args`` (a TrainingArguments) states them, under
    whichever names the installed transformers has (the 5.23 names win when both exist: 5.23 resolves
    the deprecated aliases into them)."""
    flag, kwargs = _NEW_CHECKPOINTING_ARGS if hasattr(args, _NEW_CHECKPOINTING_ARGS[0]) else _OLD_CHECKPOINTING_ARGS
    return bool(getattr(args, flag, False)), getattr(args, kwargs, None)


def checkpointing_training_args(enabled: bool = True, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``TrainingArguments(...)`` (and subclasses such as TRL's configs) that request
    checkpointing with ``kwargs``, spelled for the installed transformers: ``activation_checkpointing*``
    where it has them (5.23+, no deprecation warning), ``gradient_checkpointing*`` on 5.0-5.22 (where the
    new names are an unknown argument). Public as ``hf_ddpfix.checkpointing_training_args``:
    ``TrainingArguments(..., **checkpointing_training_args(True, {"use_reentrant": False}))``."""
    flag, kw_name = checkpointing_arg_names()
    out: dict[str, Any] = {flag: enabled}
    if kwargs is not None:
        out[kw_name] = kwargs
    return out


def enable_model_checkpointing(model: nn.Module, kwargs: dict[str, Any] | None = None) -> None:
    """``model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)`` (5.23), or
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)`` where that is the only name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_model_checkpointing(model: nn.Module) -> None:
    """``model.activation_checkpointing_disable()`` (5.23) or ``gradient_checkpointing_disable()``."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


# --------------------------------------------------------------------------------------------------
# What Trainer.evaluation_loop gathers as predictions (evaluation output agreement)
# --------------------------------------------------------------------------------------------------

#: ``Trainer.prediction_step``'s default ``ignore_keys`` when the model's config names none
#: (``keys_to_ignore_at_inference``): the KV-cache field, ``cache`` from transformers 5.24, ``past_key_values``
#: in 5.0-5.23 (tests/test_upstream_contracts.py reads it from the installed source).
def default_prediction_ignore_keys() -> list[str]:
    import transformers
    from packaging.version import Version

    return ["cache"] if Version(transformers.__version__).release[:2] >= (5, 24) else ["past_key_values"]


def prediction_ignore_keys(trainer: Any, ignore_keys: list[str] | None) -> list[str]:
    """The output keys ``Trainer.prediction_step`` leaves out of the predictions (5.0-5.24): ``ignore_keys`` when
    given, else ``trainer.model.config.keys_to_ignore_at_inference``, else the cache field
    (:func:`default_prediction_ignore_keys`); ``[]`` for a model without a config."""
    if ignore_keys is not None:
        return list(ignore_keys)
    config = getattr(trainer.model, "config", None)
    if config is None:
        return []
    return list(getattr(config, "keys_to_ignore_at_inference", default_prediction_ignore_keys()))


def evaluation_loop_options(trainer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, list[str] | None]:
    """``(prediction_loss_only, ignore_keys)`` of a ``Trainer.evaluation_loop(dataloader, description,
    prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval")`` call (5.0-5.24), resolved as the loop
    resolves them (``prediction_loss_only`` None: ``args.prediction_loss_only``)."""
    named = {**dict(zip(EVALUATION_LOOP_PARAMETERS, args, strict=False)), **kwargs}  # fewer args than names
    loss_only = named.get("prediction_loss_only")
    if loss_only is None:
        loss_only = bool(getattr(trainer.args, "prediction_loss_only", False))
    return bool(loss_only), named.get("ignore_keys")


#: ``Trainer.evaluation_loop``'s parameters after ``self`` (5.0-5.24; a patched class attribute hides the signature,
#: so it is spelled here and checked against the stock function by the contract test).
EVALUATION_LOOP_PARAMETERS = ("dataloader", "description", "prediction_loss_only", "ignore_keys", "metric_key_prefix")


def shadow_method(obj: Any, name: str, method: Callable[..., Any]) -> Callable[[], None]:
    """Shadow ``obj.name`` with ``method`` on the instance (e.g. ``trainer.prediction_step``, ``model.generate``);
    returns the undo, which leaves a later shadow alone."""
    return _shadow(obj, name, method)
