"""`attach_runtime(trainer, model, plan, stack) -> Runtime`: apply a `Plan` for one `train()` call.

Reads the plan's decisions and calls the appliers of `hf_ddpfix.integrations` and `hf_ddpfix.ops`
(checkpoint function, offload, DeepSpeed / VLM stabiliser, parameter usage, hang guard, tiling, long
context, tiled loss) on the model and the trainer. Each applier registers its undo on the `ExitStack` it
is given, so everything per-run is detached when the training loop ends (normally or by an exception).
Checkpointing stays switched (the user asked for checkpointing; we only chose its implementation).
Under DDP with more than one rank, last, the buffer order is made the same on every rank
(`hf_ddpfix.ops.buffer_order`; not undone: the canonical order is harmless and keeps its names).
Called by `hf_ddpfix.trainer.run_with_plan`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from .._compat import (
    around_backward,
    before_gradient_clipping,
    checkpointable_layers,
    checkpointing_args,
    fsdp_plugin,
    is_checkpointing,
    layer_checkpoint_func,
)
from ..config.options import DDPFixConfig
from ..integrations.checkpointing import (
    apply_checkpointing,
    checkpoint_kwargs_without_mode,
    installed_checkpoint_functions,
    keep_tool_checkpointing,
    runs_own_function,
    tool_checkpoint_functions,
)
from ..integrations.deepspeed.zero import attach_deepspeed
from ..integrations.fsdp import apply_fsdp_units, join_tied_holders, rescope_on_wrap
from ..integrations.fsdp.buffers import keep_persistent_buffers_loadable
from ..integrations.fsdp.dummy import TowerDummyRefusal, attach_fsdp_dummy
from ..integrations.long_context.layer_kinds import kinds_summary
from ..integrations.long_context.long_context import LongContextHandle, apply_long_context
from ..integrations.long_context.loss_patch import TiledLossHandle, patch_model_loss
from ..integrations.long_context.tiled_mlp import TiledMLPHandle, apply_tiled_mlp
from ..integrations.sequence_parallel.trainer import SequenceParallelGroups, attach_sequence_parallel
from ..integrations.usage import HangGuard, ParameterUsage, UsageChanged
from ..integrations.usage.agreement import UsageAgreement
from ..integrations.usage.trainable_set import TrainableSetWatch
from ..integrations.vision.families import is_vision_language_model
from ..integrations.vision.mixed_guard import takes_visual_input
from ..integrations.vision.stabilizer import VisionStabilizer
from ..ops import feature_counts
from ..ops.buffer_order import BufferLayoutError, Layout, align_buffer_order
from ..ops.offload import ActivationOffload, SaveOnCpuScope
from ..plan.fsdp import fsdp_unit_classes, fsdp_units_ours
from ..plan.sequence_parallel import sp_size_of
from ..plan.types import Plan, PlanError
from ..plan.vision import NO_ZERO_DUMMY
from .errors import DDPFixError
from .evaluation import cpu_repack_off

logger = logging.getLogger("hf_ddpfix")


@dataclass
class Runtime:
    """The live per-run pieces (exposed as `trainer.hf_ddpfix_runtime` for inspection and tests)."""

    plan: Plan
    offload: ActivationOffload | None = None
    stabilizer: VisionStabilizer | None = None
    hang_guard: HangGuard | None = None
    usage: ParameterUsage | None = None
    zero_vision: Any = None  # ZeroVisionStabilizer under DeepSpeed ZeRO-2/3
    zero_skip_unused: Any = None  # ZeroSkipUnused under DeepSpeed ZeRO-1/2/3 (plan.zero_skip_unused)
    tiled_mlp: TiledMLPHandle | None = None
    tiled_loss: TiledLossHandle | None = None
    long_context: LongContextHandle | None = None
    sequence_parallel: SequenceParallelGroups | None = None
    trainable_set: TrainableSetWatch | None = None  # DDP / FSDP / DeepSpeed: parameters unfrozen after wrapping
    step_contexts: list[Callable[[], AbstractContextManager[Any]]] = field(default_factory=list)


def _mixed_image_guard_stage(trainer: Any, plan: Plan) -> int | None:
    """The ZeRO stage when the run gets the mixed-image guard (``integrations/vision/mixed_guard.py``), else None:
    several ranks and a VLM whose stabiliser is on (used if its trial fails) or off only for want of a dummy; under
    ZeRO-3 also a model not a VLM by its config whose forward takes pixels (UDOP; ZeRO-2 trains it: stock kept)."""
    d, state = plan.vlm_stabilizer, getattr(getattr(trainer, "accelerator", None), "state", None)
    stage = getattr(getattr(state, "deepspeed_plugin", None), "zero_stage", None)
    if plan.world_size < 2 or stage is None:
        return None
    if d.value is None:  # HF_DDPFIX_VLM_STABILIZER=0 keeps stock here too
        pixels = stage == 3 and takes_visual_input(getattr(trainer, "model", None) or nn.Module())
        return 3 if pixels and DDPFixConfig.from_env().vlm_stabilizer is not False else None
    return int(stage) if d.value or d.reason.startswith(NO_ZERO_DUMMY) else None  # else not needed, or disabled


def attach_runtime(trainer: Any, model: nn.Module, plan: Plan, stack: ExitStack) -> Runtime:
    """Apply every per-run piece of `plan` to `trainer` / `model`; undo callbacks go on `stack`."""
    rt = Runtime(plan)
    offload: Any = None
    if plan.offload_activations.value == "stock":  # non-CUDA accelerator: transformers' blocking offload kept
        offload = SaveOnCpuScope(_device_type(trainer))
    elif plan.offload_activations.value:
        rt.offload = offload = ActivationOffload(module=model, min_layer_bytes=plan.offload_min_layer_bytes,
                                                 max_pool_bytes=plan.offload_max_pool_bytes,
                                                 keep_on_device="auto")  # N from the budget, each step
        rt.step_contexts.append(_logged_offload_steps(trainer, rt.offload))
        stack.callback(rt.offload.clear_pool)
    if plan.parallel == "fsdp" and plan.quantization.value:  # 4-bit weights regathered every forward (_compat)
        cpu_repack_off(model, stack)  # restored when train() ends; an evaluate() after it turns it off again
    if _apply_checkpointing(trainer, model, plan, offload):
        _keep_plan_checkpointing(trainer, model, plan, offload, stack)
    if plan.parallel == "deepspeed":  # before deepspeed.initialize (inside the stock loop): see deepspeed.py
        leaf = plan.zero3_leaf_modules.value  # "A,B" or False / None
        rt.zero_vision = attach_deepspeed(model, stabilize=bool(plan.vlm_stabilizer.value), stack=stack,
                                          leaf_classes=tuple(leaf.split(",")) if leaf else (),
                                          log=lambda line: _log_rank0(trainer, "%s", line),
                                          sync_eval=bool(plan.vlm_eval_sync.value),
                                          guard_stage=_mixed_image_guard_stage(trainer, plan), error=DDPFixError)
    elif plan.parallel == "fsdp" and plan.fsdp_skippable.value == "shard" and plan.vlm_stabilizer.value:
        try:
            rt.zero_vision = attach_fsdp_dummy(model, stack, lambda fn: before_gradient_clipping(trainer, fn))
        except TowerDummyRefusal as err:  # tower units and no dummy that runs: refused before step 1
            raise PlanError(str(err)) from err
    elif plan.vlm_stabilizer.value:
        rt.stabilizer = _attach_stabilizer(trainer, model, plan, stack)
    if plan.zero_skip_unused.value:  # observe from the first forward; the optimizer is hooked at train begin
        from ..integrations.deepspeed.zero_unused import attach_zero_skip_unused

        rt.zero_skip_unused = attach_zero_skip_unused(trainer, model, stack)
    if fsdp_units_ours(plan.fsdp_units):  # before accelerate wraps the model (inside the stock loop)
        apply_fsdp_units(trainer, fsdp_unit_classes(plan.fsdp_units))
    if plan.fsdp_shared.value:  # while accelerate wraps the model (inside the stock loop)
        join_tied_holders(trainer, stack, log=lambda line: _log_rank0(trainer, "%s", line))
    if plan.parallel == "fsdp":  # cpu_ram_efficient_loading: persistent buffers loaded as non-persistent (buffers.py)
        keep_persistent_buffers_loadable(trainer, fsdp_plugin(trainer), stack,
                                         log=lambda line: _log_rank0(trainer, "%s", line))
    if plan.parameter_usage.value:
        # a parameter read by two reentrant layers fires its DDP hook twice: fine only with static graph (DDP)
        usage = ParameterUsage(model, allow_region_reuse=bool(plan.static_graph.value) or plan.parallel == "fsdp")
        rt.usage = _attach_usage(trainer, model, usage, stack, at_loss=plan.parallel != "fsdp")
        if plan.parallel == "fsdp":  # ties per FSDP2 unit, once accelerate has made them
            rescope_on_wrap(trainer, usage, stack, log=lambda line: _log_rank0(trainer, "%s", line))
            dummy = rt.zero_vision
            if hasattr(dummy, "fold_into") and usage.process_group is None and dummy.process_group is None:
                dummy.fold_into(usage)  # the dummy's "some rank saw an image" rides in the agreement
    if plan.hang_guard.value:
        if is_vision_language_model(model):
            rt.hang_guard = HangGuard(model).attach()
            stack.callback(rt.hang_guard.remove)
            _add_callback(trainer, _GuardWrappedModel(trainer, rt.hang_guard), stack)
        else:  # any model: every trainable parameter must get a gradient on every rank
            rt.usage = _attach_usage(trainer, model, ParameterUsage(model, tie=False, guard=True), stack)
    if plan.tiled_mlp.value:
        rt.tiled_mlp = _apply_tiled_mlp(trainer, model, plan, stack)
    if plan.long_context.value:
        rt.long_context = _apply_long_context(trainer, model, plan, stack)
    if plan.tiled_loss.value:
        rt.tiled_loss = _apply_tiled_loss(trainer, model, plan, stack)
    if plan.sequence_parallel.value and plan.sequence_parallel.value != "deepspeed":  # deepspeed: its own engine
        rt.sequence_parallel = attach_sequence_parallel(
            trainer, model, stack=stack, sp_size=sp_size_of(plan.sequence_parallel.value),
            stand_down_accelerate="parallelism_config" in str(plan.sequence_parallel.value))
    if plan.parallel in ("ddp", "fsdp") and plan.world_size > 1:  # requires_grad changed after wrapping
        rt.trainable_set = TrainableSetWatch(model, plan.parallel, step=lambda: trainer.state.global_step + 1)
        stack.callback(before_gradient_clipping(trainer, _watch_finalize(rt.usage, rt.trainable_set)))
        if rt.usage is not None and rt.usage.step_flag is not None:  # ranks that did not read the agreement
            _add_callback(trainer, _WatchLate(rt.usage, rt.trainable_set), stack)
            # FSDP2's clipping is a collective: a rank that changed its set alone raises with the others, late
            rt.trainable_set.defer_mismatch = plan.parallel == "fsdp"
        if plan.parallel == "fsdp":  # FSDP2 reduce-scatters what requires grad: the agreed set, held locally
            rt.step_contexts.append(rt.trainable_set.held_step)
    elif plan.parallel == "deepspeed" and plan.world_size > 1:  # the engine steps inside backward: check first
        rt.trainable_set = TrainableSetWatch(model, plan.parallel, step=lambda: trainer.state.global_step + 1)
        rt.trainable_set.defer_mismatch = True  # a rank that changed alone raises with the others at on_step_end
        agreement = UsageAgreement()
        rt.step_contexts.append(partial(rt.trainable_set.held_step, agreement))
        _add_callback(trainer, _WatchLate(agreement, rt.trainable_set), stack)
    if rt.step_contexts:
        _override(trainer, "training_step", lambda inner: _within(rt.step_contexts, inner), stack)
    _align_buffer_order(trainer, model, plan)
    return rt


def _align_buffer_order(trainer: Any, model: nn.Module, plan: Plan,
                        gather: Callable[[Layout], list[Layout]] | None = None) -> None:
    """DDP with more than one rank: one buffer order on every rank before the model is wrapped (one
    `all_gather_object` per `train()`; logged on rank 0 when it reorders). When the ranks' buffer names or
    modules differ, no order helps: a warning names the module and DDP runs as stock would (hf_ddpfix never
    fails a run stock runs). `gather` replaces the collective in tests.

    An always-on check, not a `Plan` decision: it costs one small collective, changes nothing when the
    ranks agree, and its only "off" would be training some ranks with the wrong tensors (no trade-off for
    an option to choose); what it finds is known only after a collective, and the plan is pure facts.
    """
    if plan.parallel != "ddp" or plan.world_size <= 1:
        return
    try:
        fix = align_buffer_order(model, gather)
    except BufferLayoutError as err:  # every rank sees the same layouts: all take this branch
        if trainer.is_world_process_zero():
            logger.warning("buffer_order: %s (left as stock DDP runs it)", err)
        return
    if fix:
        _log_rank0(trainer, "%s", fix.describe())


def _log_rank0(trainer: Any, message: str, *args: Any) -> None:
    if trainer.is_world_process_zero():
        logger.info(message, *args)


def _apply_tiled_mlp(trainer: Any, model: nn.Module, plan: Plan, stack: ExitStack) -> TiledMLPHandle:
    value = str(plan.tiled_mlp.value)
    handle = apply_tiled_mlp(model, shards=int(value) if value.isdigit() else value, sync=plan.parallel == "fsdp")
    stack.callback(handle.remove)
    skipped = "; ".join(f"{e.name}: {e.reason}" for e in handle.skipped[:3])
    _log_rank0(trainer, "tiled_mlp: %d MLP modules tiled (%s)%s", len(handle.patched), value,
               f"; not tiled: {skipped}" if skipped else "")
    return handle


def _apply_tiled_loss(trainer: Any, model: nn.Module, plan: Plan, stack: ExitStack) -> TiledLossHandle | None:
    value = str(plan.tiled_loss.value)
    try:
        handle = patch_model_loss(model, chunk_tokens=int(value) if value.isdigit() else None)
    except ValueError as err:  # an unsupported head: the stock loss stays, and the log says why
        _log_rank0(trainer, "tiled_loss: not applied: %s", err)
        return None
    stack.callback(handle.remove)
    _log_rank0(trainer, "tiled_loss: %s computes its loss in chunks", type(handle.target).__name__)
    return handle


def _apply_long_context(trainer: Any, model: nn.Module, plan: Plan, stack: ExitStack) -> LongContextHandle:
    handle = apply_long_context(model, str(plan.long_context.value), sync=plan.parallel == "fsdp")
    stack.callback(handle.remove)
    skipped = "; ".join([f"{e.name}: {e.reason}" for e in handle.report if not e.patched and not e.kind][:3])
    _log_rank0(trainer, "long_context: %d modules patched (%s)%s%s", len(handle.patched), plan.long_context.value,
               f"; decoder layers: {kinds_summary(handle.kinds)}" if handle.kinds else "",
               f"; not patched: {skipped}" if skipped else "")
    return handle


def _attach_stabilizer(trainer: Any, model: nn.Module, plan: Plan, stack: ExitStack) -> VisionStabilizer:
    """Dummy image on text-only steps; before gradients are clipped or measured, vision gradients are
    reset to `None` when no rank saw an image in the whole optimizer step (stock fu=True semantics).

    The finalize runs before the gradients are clipped or measured (`_compat.before_gradient_clipping`)
    because a zero and a `None` gradient give a different clipping norm in the last bit.
    """
    stab = VisionStabilizer(model, run_when_frozen=True if plan.parallel == "fsdp" else None,
                            sync_eval=bool(plan.vlm_eval_sync.value)).attach()
    stack.callback(stab.remove)
    stack.callback(before_gradient_clipping(trainer, stab.finalize_vision_grads))
    return stab


def _attach_usage(trainer: Any, model: nn.Module, usage: ParameterUsage, stack: ExitStack,
                  at_loss: bool = True) -> ParameterUsage:
    """Observe (and tie) every training forward and, decisively, the loss handed to `accelerator.backward`
    (what a trainer's `compute_loss` really back-propagates: `ParameterUsage.tie_loss`); before gradients
    are clipped or measured, gradients no rank used in the optimizer step are reset to `None` (stock fu=True
    semantics; see `_attach_stabilizer`). Attached after the checkpointing switch, so reentrant layers are
    observed with the function they will run.

    Under FSDP2 (`at_loss=False`) the loss is not observed: after the forward a unit's parameters are resharded,
    so a parameter is no longer the tensor its unit's graph holds, and a tie at the loss would give the sharded
    parameter a plain-tensor gradient; every tie is made in the unit's own forward instead (what
    tests/scripts/usage_fsdp.py verifies); the loss is only read, to add what it really uses outside the forward
    (`ParameterUsage.observe_loss`)."""
    usage.attach()
    stack.callback(usage.remove)
    if at_loss:
        usage.at_loss = usage.backward_retries = True
        stack.callback(around_backward(trainer.accelerator, usage.tie_loss, retry=UsageChanged))
    else:  # FSDP2: the loss only adds what it really uses (a head in compute_loss), never ties
        stack.callback(around_backward(trainer.accelerator, usage.observe_loss))
    stack.callback(before_gradient_clipping(trainer, usage.finalize))
    _add_callback(trainer, _GuardWrappedModel(trainer, usage), stack)
    return usage


class _GuardWrappedModel(TrainerCallback):
    """Hands the DDP-wrapped model to the hang guard once accelerate has wrapped it (train begin), so
    the guard can skip `no_sync` micro-batches."""

    def __init__(self, trainer: Any, guard: HangGuard | ParameterUsage):
        self.trainer, self.guard = trainer, guard

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.guard.ddp_module = self.trainer.model_wrapped


def _add_callback(trainer: Any, callback: TrainerCallback, stack: ExitStack) -> None:
    trainer.add_callback(callback)
    stack.callback(trainer.remove_callback, callback)


def _watch_finalize(usage: ParameterUsage | None, watch: TrainableSetWatch) -> Callable[[], None]:
    """The trainable-set check of an optimizer step. With the usage agreement running (same group), the watch's
    "my set changed" flag rides in its all-reduce (``ParameterUsage.step_flag``): no collective and, where no
    rank changed anything, no host read of its own; the usage finalize runs first here (a second call in the
    step is a no-op). A rank that did not read the flags reads them at ``on_step_end`` (``_WatchLate``), from host
    memory. Without the agreement, the watch's own one-byte all-gather."""
    if usage is None or usage.process_group is not None:
        return watch.finalize
    usage.step_flag = watch.changed

    def finalize() -> None:
        usage.finalize()
        watch.finalize(agreed=usage.take_step_flags())

    return finalize


class _WatchLate(TrainerCallback):
    """At ``on_step_end`` (before the Trainer's next collective: its log gather, the next step's token count
    gather and forward), a rank that did not read the step's agreement reads its flags from host memory and
    raises where another rank changed its trainable set (``TrainableSetWatch.finalize_late``); a rank that changed
    its set alone raises its pending error there (FSDP2, DeepSpeed). ``usage``: the ``ParameterUsage`` whose
    agreement carries the flags, or (DeepSpeed) the ``UsageAgreement`` itself."""

    def __init__(self, usage: ParameterUsage | UsageAgreement, watch: TrainableSetWatch):
        self.agreement: UsageAgreement = getattr(usage, "agreement", usage)
        self.watch = watch

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.watch.finalize_late(self.agreement.late_flags())


def _within(contexts: list[Callable[[], AbstractContextManager[Any]]], inner: Callable[..., Any]) -> Callable:
    """`inner` (one micro-batch's forward + backward) run inside every context of `contexts`."""

    def training_step(*args: Any, **kwargs: Any) -> Any:
        with ExitStack() as step_stack:
            for make in contexts:
                step_stack.enter_context(make())
            return inner(*args, **kwargs)

    return training_step


def _override(obj: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]], stack: ExitStack) -> None:
    """Shadow `obj.name` with `wrap(obj.name)` on the instance; the undo goes on `stack`."""
    had_own = name in vars(obj)
    previous = vars(obj).get(name)
    setattr(obj, name, wrap(getattr(obj, name)))

    def restore() -> None:
        if had_own:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)

    stack.callback(restore)


def _logged_offload_steps(trainer: Any, offload: ActivationOffload) -> Callable[[], AbstractContextManager[Any]]:
    """``offload.step`` for each micro-batch; logs (rank 0) whenever the policy switches between copying
    and keeping, with its reason (e.g. a long batch after short ones)."""
    last: list[str] = [""]

    @contextmanager
    def step() -> Iterator[Any]:
        with offload.step() as off:
            yield off
        kind = offload.stats.policy.split(":")[0]
        if kind and kind != last[0]:
            last[0] = kind
            _log_rank0(trainer, "offload: %s", offload.stats.policy)

    return step


def _device_type(trainer: Any) -> str:
    return torch.device(trainer.args.device).type


def _apply_checkpointing(trainer: Any, model: nn.Module, plan: Plan, offload: Any) -> bool:
    """Install the plan's checkpoint function; True when hf_ddpfix's own function was installed."""
    mode = plan.checkpointing.value
    if not mode:
        return False
    kept = keep_tool_checkpointing(model, use_reentrant=mode == "reentrant", offload=offload is not None)
    if kept:  # a trainer's / tool's function that already runs the plan's variant: its own features stay
        feature_counts.record_amount("checkpointing", "tool_functions_kept", 1)
        _log_rank0(trainer, "checkpointing: %s", kept)
        return False
    replaced = tool_checkpoint_functions(model)
    if replaced:
        feature_counts.record_amount("checkpointing", "tool_functions_replaced", len(replaced))
        why = ("hf_ddpfix's activation offload needs its own checkpoint function" if offload is not None
               else f"the plan runs {mode} checkpointing ({plan.checkpointing.reason})")
        logger.warning("checkpointing: replaced the model's own checkpoint function %s: %s; its own features "
                       "(e.g. offloading) are not used", "; ".join(replaced), why)
    extra = checkpoint_kwargs_without_mode(checkpointing_args(trainer.args)[1])
    n = apply_checkpointing(model, use_reentrant=mode == "reentrant", offload=offload, **extra)
    if n == 0:
        logger.warning("checkpointing is %s in the plan but the model has no checkpointed layers", mode)
    return n > 0


def _keep_plan_checkpointing(trainer: Any, model: nn.Module, plan: Plan, offload: Any, stack: ExitStack) -> None:
    """Re-install the plan's checkpoint function before a training forward where something replaced it.

    The plan (the checkpoint variant, and from it find_unused / static_graph) holds only while every
    checkpointed layer runs the function installed at the start. A trainer may re-enable checkpointing
    mid-run with the user's arguments (TRL's ``disable_gradient_checkpointing`` around its reference
    forward calls ``gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)`` after it), which
    puts the uncorrected variant back from the next step on: under ``static_graph`` DDP then fails with
    "Your training graph has changed". Checked at each training forward of the root: each checkpointing
    layer's function is tested by identity (:func:`runs_own_function`: ours, or hf_ddpfix's own usage
    observer around ours, is not a replacement), over the checkpointable layers read once here (a model's
    layers do not change in training; a layer switched on later is in the list, its flag is read each
    time). Each forward it re-installs before is counted (``checkpointing`` / ``reinstalled``) and the first
    is logged; a plain run re-installs nothing and logs nothing (tests/test_trainer_entry_points.py).
    """
    mode = plan.checkpointing.value
    extra = checkpoint_kwargs_without_mode(checkpointing_args(trainer.args)[1])
    warned: list[bool] = []
    layers = list(checkpointable_layers(model))

    def pre_hook(module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if all(runs_own_function(layer_checkpoint_func(m)) for m in layers if is_checkpointing(m)):
            return  # every checkpointing layer still calls ours
        if not installed_checkpoint_functions(model):
            return
        apply_checkpointing(model, use_reentrant=mode == "reentrant", offload=offload, **extra)
        feature_counts.record_amount("checkpointing", "reinstalled", 1)
        if not warned:
            warned.append(True)
            logger.warning("checkpointing: the model's checkpoint function was replaced during training (e.g. a "
                           "trainer re-enabled checkpointing with its own arguments); the plan's %s function is "
                           "re-installed before each training forward that needs it", mode)

    handle = model.register_forward_pre_hook(pre_hook, prepend=True)
    stack.callback(handle.remove)

