"""`DDPFixTrainer` and `patch_trainer()`: two entry points, one implementation (`run_with_plan`).

`run_with_plan` runs the stock `Trainer._inner_training_loop` under the plan: where checkpointing is on
and the DDP kwargs are final, before `accelerator.prepare()` wraps the model in DDP/FSDP (the loop's start
on transformers 5.3-5.23, right after its `_wrap_model` on 5.0-5.2: `_compat.when_ready_to_prepare`), it
gathers facts, resolves the plan, sets the DDP kwargs the wrapper will be built with and attaches the
per-run pieces (`hf_ddpfix.runtime.attach`) and callbacks; everything is detached when the loop ends.
`resolve_resume` makes `train(resume_from_checkpoint=True)` pick the newest *complete* checkpoint.

Guarantees: DDP kwargs are decided before the model is wrapped (no DDP internals touched mid-run);
`patch_trainer()` wraps whatever `Trainer` methods are installed when it is called (another library's
patch included; see `hf_ddpfix.integrations.trainer_hooks.TrainerPatchLayer`), is idempotent, and
`unpatch_trainer()` removes only its own layer (tests/test_trainer_entry_points.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from transformers import Trainer

from ._compat import TRAINER_INNER_LOOP, set_ddp_kwargs, unwrap_parallel, when_ready_to_prepare
from .callbacks import default_callbacks, install_callbacks
from .config.options import DDPFixConfig
from .facts.gather import gather_facts, launch_world_mismatch
from .integrations.eval_outputs import agreed_eval_outputs
from .integrations.fsdp import apply_fsdp_units, join_tied_holders
from .integrations.sequence_parallel.trainer import attach_sequence_parallel
from .integrations.trainer_hooks import TrainerPatchLayer
from .ops.dist import destroy_default_group_at_exit
from .ops.feature_counts import reset as reset_feature_counts
from .plan.asked import asked_options, not_applied_warning
from .plan.evaluation import decide_eval_outputs
from .plan.fsdp import (
    decide_fsdp_shared,
    decide_fsdp_skippable,
    decide_fsdp_units,
    fsdp_unit_classes,
    fsdp_units_ours,
)
from .plan.resolve import resolve_plan
from .plan.sequence_parallel import decide_sequence_parallel, sp_size_of
from .plan.types import Decision, Plan, PlanError
from .plan.vision import decide_eval_sync, fsdp_eval_sync
from .runtime.attach import attach_runtime
from .runtime.checkpoints import last_complete_checkpoint
from .runtime.errors import readable_ddp_errors
from .runtime.evaluation import attach_eval_sync, cpu_repack_off
from .runtime.feature_report import FallbackWatch, attach_fallbacks, feature_metrics, never_ran_warning
from .runtime.launcher_errors import is_known_error, report_to_launcher

logger = logging.getLogger("hf_ddpfix")

_patch_options: dict[str, Any] | None = None


class _Formatter(logging.Formatter):
    """``[hf_ddpfix] message``; a warning or an error says so (``[hf_ddpfix] WARNING: message``), so a reader,
    and a test counting them, can tell a warning from the plan log."""

    def format(self, record: logging.LogRecord) -> str:
        level = f"{record.levelname}: " if record.levelno >= logging.WARNING else ""
        return f"[hf_ddpfix] {level}{super().format(record)}"  # the message (and any traceback)


def _ensure_log_handler() -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_Formatter())
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def plan_for_trainer(trainer: Trainer, config: DDPFixConfig | None = None) -> Plan:
    """The plan `trainer` would run with now (no side effects)."""
    return resolve_plan(gather_facts(trainer), config or DDPFixConfig.from_env())


def _set_ddp_kwargs(trainer: Trainer, plan: Plan) -> None:
    """Point accelerate's DDP kwargs handler at the plan's values (it is read when `prepare` wraps)."""
    if plan.parallel != "ddp":
        return
    set_ddp_kwargs(trainer.accelerator, **plan.ddp_kwargs())
    wrapped = trainer.model_wrapped
    if wrapped is not trainer.model and hasattr(wrapped, "find_unused_parameters"):
        current = {"find_unused_parameters": wrapped.find_unused_parameters, "static_graph": wrapped.static_graph}
        if current != plan.ddp_kwargs():
            logger.warning("model already wrapped in DDP with %s; the plan's %s applies from the next wrap",
                           current, plan.ddp_kwargs())


def run_with_plan(trainer: Trainer, inner_loop: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `inner_loop` (the stock `_inner_training_loop`) under the hf_ddpfix plan.

    Raises:
        PlanError: strict mode and a known-bad explicit setting, or a process launched as one of
            ``WORLD_SIZE > 1`` whose Trainer sees world size 1 (``facts.launch_world_mismatch``; a warning
            without strict), before anything is wrapped.
        DDPFixError: a known DDP/FSDP failure escaped a step; it says the likely cause in this plan and
            the option that fixes it (the original error is its `__cause__`).
    """
    if getattr(trainer, "_hf_ddpfix_active", False):  # DDPFixTrainer under patch_trainer(): apply once
        return inner_loop(*args, **kwargs)
    try:
        return _run_with_plan(trainer, inner_loop, *args, **kwargs)
    except Exception as exc:
        if is_known_error(exc):  # the launcher's summary ends with our message, not only "exitcode: 1"
            report_to_launcher(exc)
        raise


def _run_with_plan(trainer: Trainer, inner_loop: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    config = _trainer_config(trainer)
    _ensure_log_handler()
    alone = launch_world_mismatch(trainer)  # every process says it: each one believes it is rank 0
    if alone and config.strict:
        raise PlanError(f"hf_ddpfix (strict): {alone}")
    if alone:
        logger.warning("%s", alone)
    destroy_default_group_at_exit()  # a gloo group left to interpreter shutdown can abort the process
    trainer._hf_ddpfix_active = True
    try:
        with ExitStack() as stack:

            def setup() -> None:  # checkpointing on, DDP kwargs final, model not wrapped yet
                facts = gather_facts(trainer)
                plan = resolve_plan(facts, config)
                trainer.hf_ddpfix_plan = plan
                watch = FallbackWatch(plan, strict=bool(config.strict), is_rank0=trainer.is_world_process_zero())
                stack.callback(watch.attach().remove)  # requested features that fall back: warned / raised
                _set_ddp_kwargs(trainer, plan)
                trainer.hf_ddpfix_runtime = attach_runtime(trainer, unwrap_parallel(trainer.model), plan, stack)
                plan = plan.with_attach_fallbacks(attach_fallbacks())  # the report says what runs, before step 1
                trainer.hf_ddpfix_plan = plan
                said = not_applied_warning(plan)  # options asked on that this run does not run: one warning
                if said and trainer.is_world_process_zero():
                    logger.warning("%s", said)
                install_callbacks(trainer, default_callbacks(plan, config), stack)  # plan report, sync, metrics
                model = unwrap_parallel(trainer.model)
                names = lambda: [n for n, p in model.named_parameters() if p.requires_grad]  # noqa: E731 DDP's order
                stack.enter_context(readable_ddp_errors(plan, facts=facts, param_names=names))  # sees loop errors first

            reset_feature_counts()  # counts are per train() call
            stack.callback(when_ready_to_prepare(trainer, setup))  # now, or inside the loop (5.0-5.2)
            result = inner_loop(*args, **kwargs)
            add_feature_metrics(result)
            _warn_never_ran(trainer, config)
            return result
    finally:
        trainer._hf_ddpfix_active = False


def add_feature_metrics(result: Any) -> None:
    """Add the feature counts (``hf_ddpfix/<feature>/...``, rank-local) to the metrics ``train()`` returns.
    The Trainer has already logged its own copy of them, so ``log_history`` / ``trainer_state.json`` stay
    stock."""
    metrics = getattr(result, "metrics", None)
    if isinstance(metrics, dict):
        metrics.update(feature_metrics())


def _warn_never_ran(trainer: Trainer, config: DDPFixConfig) -> None:
    """One warning (rank 0) naming the options asked on that the plan ran but whose counters say never ran."""
    plan = getattr(trainer, "hf_ddpfix_plan", None)
    if plan is None or not trainer.state.global_step or not trainer.is_world_process_zero():
        return
    said = never_ran_warning(plan, asked_options(config))
    if said:
        logger.warning("%s", said)


def run_evaluation_with_plan(trainer: Trainer, eval_loop: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `eval_loop` (the stock `evaluation_loop`, behind `evaluate()` and `predict()`) with the plan's
    `eval_outputs` (inside `train()` too: every rank hands the Trainer's prediction gathers the same fields,
    `hf_ddpfix.integrations.eval_outputs`) and, outside `train()`, `vlm_eval_sync` (`_evaluate_under_plan`)."""
    if getattr(trainer, "_hf_ddpfix_outputs_active", False):  # DDPFixTrainer under patch_trainer(): apply once
        return _evaluate_under_plan(trainer, eval_loop, *args, **kwargs)
    destroy_default_group_at_exit()  # evaluate()/predict() without train(): the group still ends before shutdown
    trainer._hf_ddpfix_outputs_active = True
    try:
        with agreed_eval_outputs(trainer, _eval_outputs_decision(trainer), args, kwargs):
            return _evaluate_under_plan(trainer, eval_loop, *args, **kwargs)
    finally:
        trainer._hf_ddpfix_outputs_active = False


def _eval_outputs_decision(trainer: Trainer) -> Decision:
    """The plan's `eval_outputs`: the training plan's inside `train()`, else decided now (and logged once on rank 0
    when no training plan was). A run that cannot be read gets stock gathers, with the reason logged."""
    plan = getattr(trainer, "hf_ddpfix_plan", None)
    if getattr(trainer, "_hf_ddpfix_active", False) and plan is not None:
        return plan.eval_outputs
    try:
        decision = decide_eval_outputs(gather_facts(trainer), _trainer_config(trainer))
    except Exception as err:  # noqa: BLE001 - reading the run must not fail an evaluation stock runs
        _ensure_log_handler()
        logger.warning("eval_outputs: not applied, the run could not be read (%s): stock gathers", err)
        return Decision(None, "")
    if decision.value is not None and plan is None and not getattr(trainer, "_hf_ddpfix_outputs_logged", False):
        trainer._hf_ddpfix_outputs_logged = True
        if trainer.is_world_process_zero():
            _ensure_log_handler()
            logger.info("eval_outputs = %s  %s", decision.text, decision.reason)
    return decision


def _evaluate_under_plan(trainer: Trainer, eval_loop: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`eval_loop` with the plan's `vlm_eval_sync`: under ZeRO-3 / FSDP, a VLM's evaluation forwards agree across
    ranks on images (see `hf_ddpfix.plan.vision`), and under FSDP2 bitsandbytes' in-place CPU repack of 4-bit
    weights is off for the loop (`eval_setup.cpu_repack_off`). Inside `train()` the training runtime already carries
    both. Reading the run never fails an evaluation stock runs: if the facts cannot be read, stock evaluation runs
    and the log says why.
    """
    if getattr(trainer, "_hf_ddpfix_active", False) or getattr(trainer, "_hf_ddpfix_eval_active", False):
        return eval_loop(*args, **kwargs)
    try:
        facts = gather_facts(trainer)
        config = _trainer_config(trainer)
        skippable = decide_fsdp_skippable(facts, config)  # None outside FSDP2
        units = decide_fsdp_units(facts, config, skippable)  # None outside FSDP2
        shared = decide_fsdp_shared(facts)
        decision = fsdp_eval_sync(facts, units, decide_eval_sync(facts, config), skippable)
        if fsdp_units_ours(units):  # an evaluate() before train(): accelerate wraps the model in this loop
            apply_fsdp_units(trainer, fsdp_unit_classes(units))
    except Exception as err:  # noqa: BLE001 - reading the run must not fail an evaluation stock runs
        _ensure_log_handler()
        logger.warning("vlm_eval_sync: not applied, the run could not be read (%s): stock evaluation", err)
        return eval_loop(*args, **kwargs)
    logged = getattr(trainer, "_hf_ddpfix_eval_logged", False) or getattr(trainer, "hf_ddpfix_plan", None) is not None
    if decision.value is not None and not logged:  # the training plan's report already has the line
        trainer._hf_ddpfix_eval_logged = True
        if trainer.is_world_process_zero():
            _ensure_log_handler()
            logger.info("vlm_eval_sync = %s  %s", decision.text, decision.reason)
    sp = _eval_sequence_parallel(trainer, facts)
    trainer._hf_ddpfix_eval_active = True
    try:
        with ExitStack() as stack:
            trainer.hf_ddpfix_eval_sync = attach_eval_sync(unwrap_parallel(trainer.model), decision,
                                                           facts.parallel, stack)
            if shared.value:  # an evaluate() before train(): accelerate wraps the model in this loop
                join_tied_holders(trainer, stack)
            if facts.parallel == "fsdp" and facts.quant is not None:  # as inside train(), undone after the loop
                cpu_repack_off(unwrap_parallel(trainer.model), stack)
            if sp > 1:  # sharded evaluation, as inside train() (integrations/sequence_parallel/trainer.py)
                attach_sequence_parallel(trainer, unwrap_parallel(trainer.model), sp_size=sp, stack=stack,
                                         stand_down_accelerate=True)  # no-op without ParallelismConfig(sp_size>1)
            return eval_loop(*args, **kwargs)
    finally:
        trainer._hf_ddpfix_eval_active = False


def _eval_sequence_parallel(trainer: Trainer, facts: Any) -> int:
    """N for an evaluation outside `train()` from the plan's `sequence_parallel` decision (1: off). A
    combination the plan refuses runs stock evaluation with the reason logged (evaluation never fails
    where stock's runs)."""
    try:
        decision = decide_sequence_parallel(facts, _trainer_config(trainer))
    except Exception as err:  # noqa: BLE001 - PlanError: training would refuse; evaluation runs stock
        if trainer.is_world_process_zero():
            _ensure_log_handler()
            logger.warning("sequence_parallel: evaluation runs unsharded (%s)", err)
        return 1
    return sp_size_of(decision.value)


def resolve_resume(trainer: Trainer, resume_from_checkpoint: str | bool | None) -> str | bool | None:
    """`resume_from_checkpoint=True` means the newest *complete* checkpoint (stock: the newest folder,
    which a rank that died while saving leaves half-written). Other values pass through.

    Raises:
        ValueError: `True` and no complete checkpoint in `output_dir` (stock raises the same).
    """
    if resume_from_checkpoint is not True:
        return resume_from_checkpoint
    from transformers.trainer_utils import get_last_checkpoint

    out = trainer.args.output_dir
    path = last_complete_checkpoint(out, trainer.args.world_size)
    if path is None:
        raise ValueError(f"No valid checkpoint found in output directory ({out}): no checkpoint-N with a "
                         "trainer_state.json and every rank's RNG state")
    newest = get_last_checkpoint(out)
    if newest is not None and os.path.abspath(newest) != os.path.abspath(path) and trainer.is_world_process_zero():
        _ensure_log_handler()
        logger.warning("resuming from %s: %s was not completely written (a rank died while saving?)", path, newest)
    return path


def _trainer_config(trainer: Trainer) -> DDPFixConfig:
    """Options: the trainer's own (`DDPFixTrainer(ddpfix_config=...)`) or `patch_trainer(**options)`'s,
    resolved against the environment now (plan time)."""
    own = getattr(trainer, "ddpfix_config", None)
    if isinstance(own, DDPFixConfig):
        explicit = {f.name: getattr(own, f.name) for f in dataclasses.fields(own) if f.name != "sources"}
        return DDPFixConfig.from_env(**explicit)
    return DDPFixConfig.from_env(**(_patch_options or {}))


class DDPFixTrainer(Trainer):
    """A `transformers.Trainer` that runs under the hf_ddpfix plan.

    Args:
        ddpfix_config: hf_ddpfix options (unset fields come from the environment at train time).
        *args, **kwargs: as for `transformers.Trainer`.

    Example:
        >>> trainer = DDPFixTrainer(model=model, args=args, train_dataset=ds,
        ...                         ddpfix_config=DDPFixConfig(offload_activations=True))
    """

    def __init__(self, *args: Any, ddpfix_config: DDPFixConfig | None = None, **kwargs: Any):
        self.ddpfix_config = ddpfix_config
        destroy_default_group_at_exit()  # before any use: an evaluate-only script never reaches train()
        super().__init__(*args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        return super().train(resolve_resume(self, resume_from_checkpoint), *args, **kwargs)

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        return run_with_plan(self, getattr(super(), TRAINER_INNER_LOOP), *args, **kwargs)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        return run_evaluation_with_plan(self, super().evaluation_loop, *args, **kwargs)


_layer: TrainerPatchLayer | None = None


def patch_trainer(**options: Any) -> None:
    """Run every `transformers.Trainer` (and subclass: TRL's included) under the hf_ddpfix plan.

    Args:
        **options: `DDPFixConfig` fields, e.g. `patch_trainer(offload_activations=True, strict=True)`;
            unset ones come from `HF_DDPFIX_*` / `UNSLOTH_*` variables when training starts.

    Raises:
        ValueError: an unknown option or an invalid value (checked now, not at train time).

    Guarantees: wraps `Trainer._inner_training_loop` and `Trainer.train` as installed at call time (a
    patch another library applied before is kept, called inside ours); idempotent (a second call only
    replaces the options); undone by `unpatch_trainer()`.
    """
    global _patch_options, _layer
    try:
        DDPFixConfig.from_env(**options)  # validate now
    except ValueError as exc:
        report_to_launcher(exc)  # the launcher's summary ends with the setting and its allowed values
        raise
    _patch_options = dict(options)
    destroy_default_group_at_exit()  # registered early: atexit handlers the user adds later run before it
    if _layer is None:
        _layer = TrainerPatchLayer(run_with_plan, resolve_resume, run_evaluation_with_plan)
        _layer.install()


def unpatch_trainer() -> None:
    """Remove hf_ddpfix's layer from `Trainer` (only ours: other patches stay). Safe when not patched."""
    global _patch_options, _layer
    _patch_options = None
    if _layer is not None:
        _layer.remove()
        _layer = None


def is_patched() -> bool:
    """True while `patch_trainer()` is in effect (our layer is installed and enabled)."""
    return _layer is not None and _layer.enabled
