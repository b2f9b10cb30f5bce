"""The contract layer: every private upstream access hf_ddpfix makes, in one place.

hf_ddpfix needs a few things that torch, transformers and accelerate do not expose publicly (a hook
point between ``Trainer.train`` and ``accelerator.prepare``, the per-layer checkpoint function, a
storage identity, …). Each one is a small function here, with the private name it touches, so that:

- a new upstream release that moves one of them breaks **one** function, and
  ``tests/test_upstream_contracts.py`` says which, with the version it was checked against;
- ``hf_ddpfix/ops`` (pure torch) and ``hf_ddpfix/integrations`` (HF plumbing) never spell a private
  name themselves.

This module imports only torch at module level; transformers / accelerate are imported inside the
functions that need them, so ``hf_ddpfix.ops`` can use the torch contracts without pulling in HF.

Checked against: :data:`CHECKED_AGAINST` (newest) and :data:`OLDEST_SUPPORTED` (the oldest stack CI runs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

# The newest versions every contract below was read against (the pinned CI stack, constraints.txt).
CHECKED_AGAINST = {"torch": "2.13.0", "transformers": "5.23.0", "accelerate": "1.15.0", "peft": "0.21.2"}
# The oldest versions CI also runs the unit tests and 2-process cells on (constraints-oldest.txt).
# transformers 5.0-5.2 set training up inside `_inner_training_loop` (see `when_ready_to_prepare` and
# `before_gradient_clipping`); 4.x is out of reach (README "Supported versions").
OLDEST_SUPPORTED = {"transformers": "5.0.0", "accelerate": "1.12.0", "peft": "0.18.0"}

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
    """Keyword arguments for ``TrainingArguments(...)`` that request checkpointing with ``kwargs``, spelled
    for the installed transformers (no deprecation warning on 5.23, no unknown argument on 5.0-5.22)."""
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
# Model wrappers
# --------------------------------------------------------------------------------------------------


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / DataParallel / FSDP1 / ``torch.compile`` (``_orig_mod``) / PEFT wrappers.

    The one unwrap helper of the package.

    Guarantees: ``unwrap_model(DataParallel(get_peft_model(m, cfg))) is m`` (tests/test_families.py).
    """
    seen: set[int] = set()
    cur = model
    while id(cur) not in seen:
        seen.add(id(cur))
        inner = getattr(cur, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, nn.Module):
            cur = inner
            continue
        inner = getattr(cur, "module", None)  # DDP, DataParallel, FSDP1, accelerate wrappers
        if isinstance(inner, nn.Module):
            cur = inner
            continue
        get_base = getattr(cur, "get_base_model", None)  # peft.PeftModel
        if callable(get_base):
            inner = get_base()
            if isinstance(inner, nn.Module) and inner is not cur:
                cur = inner
                continue
        break
    return cur


def unwrap_parallel(model: nn.Module) -> nn.Module:
    """Strip only DDP / DataParallel / ``torch.compile`` wrappers (a ``PeftModel`` stays)."""
    seen: set[int] = set()
    cur = model
    while id(cur) not in seen:
        seen.add(id(cur))
        inner = getattr(cur, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(cur, "module", None)
        if not isinstance(inner, nn.Module):
            break
        cur = inner
    return cur


# --------------------------------------------------------------------------------------------------
# transformers' per-layer checkpointing
# --------------------------------------------------------------------------------------------------

#: transformers' checkpointed layers (``GradientCheckpointingLayer``, 5.x) call
#: ``self._gradient_checkpointing_func(forward, *args, **kwargs)`` when ``self.gradient_checkpointing``.
CHECKPOINT_FUNC_ATTR = "_gradient_checkpointing_func"


def checkpointable_layers(model: nn.Module) -> Iterator[nn.Module]:
    """Every submodule transformers can checkpoint: it has a ``gradient_checkpointing`` flag and a
    checkpoint function (whether the flag is on is :func:`is_checkpointing`)."""
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing") and hasattr(module, CHECKPOINT_FUNC_ATTR):
            yield module


def is_checkpointing(layer: nn.Module) -> bool:
    """True when ``layer`` checkpoints its forward in training (its ``gradient_checkpointing`` flag)."""
    return bool(getattr(layer, "gradient_checkpointing", False))


def layer_checkpoint_func(layer: nn.Module) -> Callable[..., Any] | None:
    """The checkpoint function a checkpointed layer calls."""
    return getattr(layer, CHECKPOINT_FUNC_ATTR, None)


def set_layer_checkpoint_func(layer: nn.Module, func: Callable[..., Any]) -> None:
    """Make a checkpointed layer call ``func`` instead of its checkpoint function."""
    setattr(layer, CHECKPOINT_FUNC_ATTR, func)


def causal_lm_loss_function() -> Callable[..., Any]:
    """transformers' causal-LM loss (``transformers.loss.loss_utils.ForCausalLMLoss``, 5.x): a model whose
    ``loss_function`` is this object computes the stock shifted cross-entropy."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


def forward_source(cls: type) -> str:
    """Source text of ``cls.forward`` (the token-wise and loss-head detectors read its shape)."""
    import inspect
    import textwrap

    return textwrap.dedent(inspect.getsource(cls.forward))


# --------------------------------------------------------------------------------------------------
# torch internals
# --------------------------------------------------------------------------------------------------


def storage_weak_ref(t: torch.Tensor) -> Any:
    """A weak reference to ``t``'s storage that compares equal for every view of it
    (``torch.multiprocessing.reductions.StorageWeakRef``, torch 2.0-2.13)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``Tensor._base``), or ``None``."""
    return t._base


def module_parameter_slots(module: nn.Module) -> dict[str, Any]:
    """The dict that holds ``module``'s own parameters (``nn.Module._parameters``): writing a plain
    tensor there makes ``module.<name>`` return it without registering a new parameter."""
    return module._parameters


def checkpoint_recompute_is_last(n_saved: int) -> bool:
    """True inside a non-reentrant checkpoint recompute (early stop on) when the next ``n_saved`` saved
    tensors are the last the recompute needs: it stops right after them, so the value of the current
    op's output is never read.

    Reads ``torch._C._autograd._top_saved_tensors_default_hooks`` and the closure of
    ``torch.utils.checkpoint``'s ``_recomputation_hook`` (``target_frame_ref``, ``gid``, the frame's
    ``early_stop``, ``recomp_counter``, ``weak_holders``): torch 2.4-2.13. Any surprise returns False,
    which callers treat as "compute as usual" (always correct, just slower).
    """
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if not hooks:
            return False
        fn = hooks[0]
        fn = getattr(fn, "__wrapped__", fn)
        if "_recomputation_hook" not in getattr(fn, "__qualname__", ""):
            return False
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))
        frame = cells["target_frame_ref"]()
        gid = cells["gid"]
        if frame is None or not frame.early_stop:
            return False
        return int(frame.recomp_counter[gid]) + n_saved == len(frame.weak_holders)
    except Exception:  # noqa: BLE001 - private internals changed: fall back to the always-correct path
        return False


# --------------------------------------------------------------------------------------------------
# deepspeed (checked against 0.19.8; imported lazily, never required)
# --------------------------------------------------------------------------------------------------


def z3_leaf_marked(module: nn.Module) -> bool:
    """True when ``module`` is flagged as a ZeRO-3 leaf module: ``deepspeed.utils.set_z3_leaf_modules``
    sets the private attribute ``module._z3_leaf`` (deepspeed 0.14-0.19.8), read at engine init."""
    return bool(getattr(module, "_z3_leaf", False))


def deepspeed_default_leaf_classes() -> frozenset[str]:
    """Qualified class names deepspeed marks as ZeRO-3 leaf modules by itself (the defaults of the
    ``zero_optimization.leaf_module`` config: ``deepspeed.runtime.zero.leaf_module_config.
    DEFAULT_LEAF_MODULE_CLASSES``, deepspeed >= 0.18; Mixtral / Qwen2-MoE / Qwen3-MoE sparse blocks in 0.19.8).
    Empty when deepspeed is missing or older."""
    try:
        from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
    except Exception:  # noqa: BLE001 - not installed, older, or its accelerator probe failed
        return frozenset()
    return frozenset(str(c) for c in DEFAULT_LEAF_MODULE_CLASSES)


# --------------------------------------------------------------------------------------------------
# long context (issue 14): checkpoint wrapper, flash kernels, fake tensors, buffers
# --------------------------------------------------------------------------------------------------


def in_checkpoint_recompute() -> bool:
    """True inside a non-reentrant checkpoint recompute (the top saved-tensor hook is
    ``torch.utils.checkpoint``'s ``_recomputation_hook``; torch 2.4-2.13)."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except Exception:  # noqa: BLE001 - moved: labels only
        return False
    if not hooks:
        return False
    fn = getattr(hooks[0], "__wrapped__", hooks[0])
    return "_recomputation_hook" in getattr(fn, "__qualname__", "")


def class_checkpoint_inner_forward(cls_forward: Any) -> Callable[..., Any] | None:
    """The forward inside transformers' class-level checkpoint wrapper, or ``None`` when ``cls_forward``
    is not that wrapper (always, before 5.23: 5.0-5.22 checkpoint the whole call in
    ``GradientCheckpointingLayer.__call__``, module hooks included, so an instance-level forward already
    runs inside the checkpoint). transformers 5.23 wraps ``cls.forward`` in ``forward_with_checkpointing``
    (``modeling_layers.GradientCheckpointingLayer.__init_subclass__``, ``functools.wraps``), which calls
    ``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)`` when the layer
    checkpoints in training; an instance-level forward replaces that wrapper and so bypasses it."""
    code = getattr(cls_forward, "__code__", None)
    if code is None or code.co_name != "forward_with_checkpointing":
        return None
    return getattr(cls_forward, "__wrapped__", None)


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[Any, Any, Any]:
    """Causal, dropout-free fused flash attention: ``(out, logsumexp, state_for_backward)``.

    CUDA: ``aten._scaled_dot_product_flash_attention`` (returns cum-seq/max-len/philox state, kept
    for the backward); CPU and meta: ``aten._scaled_dot_product_flash_attention_for_cpu``. These are the
    kernels ``F.scaled_dot_product_attention`` dispatches to (torch 2.5-2.13); K/V may have fewer heads.
    """
    if q.device.type == "cuda":
        o, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)
        return o, lse, (cq, ck, mq, mk, seed, offset)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return o, lse, None


def flash_attention_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                             lse: torch.Tensor, state: Any, scale: float) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` of :func:`flash_attention_forward` (its ``state`` on CUDA)."""
    if q.device.type == "cuda":
        cq, ck, mq, mk, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, o, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, o, lse, 0.0, True, scale=scale)


FLASH_CPU_BACKWARD_OP = "_scaled_dot_product_flash_attention_for_cpu_backward"


def fake_tensor_mode() -> Any:
    """A new ``torch._subclasses.fake_tensor.FakeTensorMode`` (tensors with shapes, no data)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def fake_from_meta(fake_mode: Any, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor on ``device`` with ``t``'s (meta) metadata (``FakeTensorConverter.from_meta_and_device``)."""
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, t, device)


def module_buffer_slots(module: nn.Module) -> dict[str, Any]:
    """The dict that holds ``module``'s own buffers (``nn.Module._buffers``), persistence unchanged."""
    return module._buffers
