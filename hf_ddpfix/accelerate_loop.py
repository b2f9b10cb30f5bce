"""`prepare_accelerate_loop(accelerator, model)`: the hf_ddpfix plan for a training loop on accelerate alone.

For loops without a `Trainer` (nanoGPT / LatentWire style: `accelerator.prepare(...)`, then
`accelerator.backward(loss)`, `accelerator.clip_grad_norm_`, `optimizer.step()`). One call, **before**
`accelerator.prepare` wraps the model, does what `patch_trainer()` does for a `Trainer`:

1. gathers the facts (parallel mode and gradient accumulation from the accelerator, checkpointing from the
   model, explicit `find_unused_parameters` / `static_graph` from the accelerator's
   `DistributedDataParallelKwargs`) and resolves the plan (logged on the main process);
2. switches the model's checkpointed layers to the plan's variant (reentrant -> non-reentrant under DDP);
3. sets the DDP kwargs `accelerator.prepare` will wrap with (decided before wrapping, never after);
4. under DDP, attaches `ParameterUsage`: every loss given to `accelerator.backward` is observed and every
   trainable parameter it does not reach is tied into it (exact-zero gradient); before
   `accelerator.clip_grad_norm_` (while gradients sync) and before any optimizer step, gradients no rank
   used in the step are reset to `None` (stock `find_unused_parameters=True` semantics). With the
   mechanism off and `find_unused_parameters` forced off, the same hook is the hang guard (every rank
   raises naming the parameters, before backward).

Example::

    accelerator = Accelerator(gradient_accumulation_steps=2)
    run = prepare_accelerate_loop(accelerator, model)          # before prepare
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(compute_my_loss(model, batch))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); optimizer.zero_grad()
    run.close()                                                # detaches everything (also `with run:`)

Under FSDP / DeepSpeed the plan is resolved and logged and the checkpointing variant applied; nothing else
is attached (their Trainer-only pieces need the Trainer's loop).

Guarantees: the loss, the gradients of used parameters and the weights after each step equal a stock loop
with `find_unused_parameters=True` and non-reentrant checkpointing (1e-6; bit-equal where the math is
unchanged: tests/scripts/accelerate_loop.py).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any

from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._compat import around_backward, ddp_kwargs_handler, set_ddp_kwargs, unwrap_parallel
from .config.options import DDPFixConfig, check_disable
from .facts.gather import has_conditional_params, is_peft_model
from .integrations.checkpointing import apply_checkpointing, detect_checkpointing
from .integrations.usage import ParameterUsage, UsageChanged
from .integrations.vision import families
from .ops.dist import destroy_default_group_at_exit
from .plan.asked import mark_not_run_by, not_applied_warning
from .plan.resolve import resolve_plan
from .plan.types import ParallelMode, Plan, RunFacts

__all__ = ["AccelerateLoopRun", "accelerate_loop_facts", "prepare_accelerate_loop"]

logger = logging.getLogger("hf_ddpfix")


def _parallel(accelerator: Any) -> ParallelMode:
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return "deepspeed"
    if kind == DistributedType.FSDP:
        return "fsdp"
    if kind == DistributedType.MULTI_CPU or accelerator.num_processes > 1:
        return "ddp"
    return "single"


def accelerate_loop_facts(accelerator: Any, model: nn.Module) -> RunFacts:
    """`RunFacts` of an accelerate loop: read-only, from the accelerator and the (unwrapped) model."""
    model = unwrap_parallel(model)
    handler = ddp_kwargs_handler(accelerator)
    vision = families.is_vision_language_model(model)
    adapter = families.find_vision_adapter(model) if vision else None
    return RunFacts(
        parallel=_parallel(accelerator),
        world_size=int(accelerator.num_processes or 1),
        checkpointing=detect_checkpointing(model),  # type: ignore[arg-type]
        is_peft=is_peft_model(model),
        is_vlm=vision,
        vlm_adapter=adapter.family.name if adapter is not None else None,
        trainable_vision_params=vision and families.has_trainable_vision_params(model),
        conditional_params=has_conditional_params(model),
        grad_accum_steps=int(accelerator.gradient_accumulation_steps or 1),
        # accelerate's own default is find_unused_parameters=False: a loop that set no handler asked for it
        user_find_unused=handler.find_unused_parameters if handler is not None else False,
        user_static_graph=handler.static_graph if handler is not None else None,
        accelerator_available=accelerator.device.type not in ("cpu", "meta"),
    )


class AccelerateLoopRun:
    """What :func:`prepare_accelerate_loop` attached: the `plan`, the `usage` tracker (or None); `close()`
    detaches every hook and restores the accelerator (a context manager too)."""

    def __init__(self, plan: Plan, usage: ParameterUsage | None, stack: ExitStack) -> None:
        self.plan, self.usage, self._stack = plan, usage, stack

    def finalize(self) -> None:
        """Reset the gradients no rank used in this optimizer step to `None` (a no-op when called twice;
        the hooks call it before clipping and before `optimizer.step()`)."""
        if self.usage is not None:
            self.usage.finalize()

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> AccelerateLoopRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: The options this entry point runs (steps 2-4 above, and the run-wide ones); any other option asked on is said
#: not to run (plan line and warning, plan/asked.py).
LOOP_RUNS = frozenset({"checkpointing", "find_unused_parameters", "static_graph", "static_graph_with_checkpointing",
                       "assume_checkpointing", "parameter_usage", "hang_guard", "strict", "log_plan"})


def prepare_accelerate_loop(accelerator: Any, model: nn.Module, config: DDPFixConfig | None = None,
                            **options: Any) -> AccelerateLoopRun:
    """Apply the hf_ddpfix plan to an accelerate training loop; call before `accelerator.prepare(model)`.

    Args:
        accelerator: the loop's `accelerate.Accelerator` (its `ddp_handler` is rewritten with the plan's
            DDP kwargs; `backward` and `clip_grad_norm_` get instance shadows until `close()`).
        model: the model, not yet wrapped (checkpointing already enabled if wanted).
        config: hf_ddpfix options; `**options` are `DDPFixConfig` fields (unset ones come from `HF_DDPFIX_*`).

    Returns:
        An :class:`AccelerateLoopRun` (`plan`, `usage`, `close()`).

    Raises:
        ValueError: the model is already wrapped by DDP / FSDP (the DDP kwargs must be set before wrapping),
            or an unknown option (from `DDPFixConfig`).
        PlanError: strict mode and an explicit setting known to fail.
    """
    if unwrap_parallel(model) is not model:
        raise ValueError("hf_ddpfix.prepare_accelerate_loop: call it with the model before accelerator.prepare "
                         f"wraps it (got a {type(model).__name__}): DDP's kwargs are fixed when it is built")
    if config is not None and options:
        raise ValueError("prepare_accelerate_loop: pass either config or **options, not both")
    check_disable()  # HF_DDPFIX_DISABLE is validated on every route, a given config too
    destroy_default_group_at_exit()  # a gloo group left to interpreter shutdown can abort the finished loop
    cfg = DDPFixConfig.from_env(**options) if config is None else config
    plan = mark_not_run_by(resolve_plan(accelerate_loop_facts(accelerator, model), cfg), cfg, LOOP_RUNS,
                           "prepare_accelerate_loop")
    if accelerator.is_main_process:
        logger.info("%s", plan.report())
        said = not_applied_warning(plan)  # options asked on that this loop does not run: one warning
        if said:
            logger.warning("%s", said)
    stack = ExitStack()
    try:
        if plan.checkpointing.value and plan.checkpointing.changed:
            apply_checkpointing(model, use_reentrant=plan.checkpointing.value == "reentrant")
        if plan.ddp_kwargs():
            set_ddp_kwargs(accelerator, **plan.ddp_kwargs())
        usage = None
        if plan.parameter_usage.value:
            usage = ParameterUsage(model, allow_region_reuse=bool(plan.static_graph.value))
        elif plan.hang_guard.value and plan.parallel == "ddp":
            usage = ParameterUsage(model, tie=False, guard=True)
        if usage is not None:
            _attach(accelerator, usage, stack)
    except BaseException:
        stack.close()
        raise
    return AccelerateLoopRun(plan, usage, stack)


def _attach(accelerator: Any, usage: ParameterUsage, stack: ExitStack) -> None:
    usage.attach()
    stack.callback(usage.remove)
    usage.at_loss = usage.backward_retries = True
    stack.callback(around_backward(accelerator, usage.tie_loss, retry=UsageChanged))
    stock_clip = accelerator.clip_grad_norm_

    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        if accelerator.sync_gradients:
            usage.finalize()
        return stock_clip(*args, **kwargs)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    stack.callback(lambda: vars(accelerator).pop("clip_grad_norm_", None)
                   if vars(accelerator).get("clip_grad_norm_") is clip_grad_norm_ else None)
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: usage.finalize())
    stack.callback(handle.remove)
