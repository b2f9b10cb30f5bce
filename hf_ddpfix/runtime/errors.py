"""Readable DDP errors: turn torch's distributed failures into what happened, why here, and the fix.

`explain(exc, plan)` recognises the stock DDP failures of REFERENCES.md §1 and collective timeouts, and
writes three lines: what happened, the likely cause in *this* run (from its `Plan`, and `RunFacts` when
given), and the exact option or environment variable that fixes it. `readable_ddp_errors(plan)` is a
context manager around the training loop that re-raises such errors as `DDPFixError` with the original
exception as `__cause__`; anything it does not recognise passes through unchanged.

Guarantees: a matching error is re-raised as a `DDPFixError` (a `RuntimeError`, so existing handlers
still catch it) whose message quotes the original first line and names a fix; a non-matching error is
re-raised as the very same object.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .._compat import checkpointing_arg_names
from ..plan.types import Plan, RunFacts

__all__ = ["DDPFixError", "ReplicaDivergenceError", "explain", "readable_ddp_errors"]


class DDPFixError(RuntimeError):
    """A distributed-training failure explained by hf_ddpfix (cause and fix in the message)."""


class ReplicaDivergenceError(DDPFixError):
    """DDP replicas hold different trainable weights (raised by `ReplicaSyncCallback` on every rank).

    Attributes:
        names: the diverged parameter names, largest drift first.
        step: the optimizer step at which the check ran (the first check that saw the divergence).
        last_good_step: the last checked step at which the replicas were equal (0: the start).
        saved_to: where rank 0's model was saved before raising, or ``None``.
    """

    def __init__(self, message: str, names: list[str] | None = None, step: int | None = None,
                 last_good_step: int | None = None, saved_to: str | None = None):
        super().__init__(message)
        self.names = list(names or [])
        self.step = step
        self.last_good_step = last_good_step
        self.saved_to = saved_to


# (key, regex on the error text). Order matters: the first match wins.
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("ready_twice", re.compile(r"Expected to mark a variable ready only once|marked (as )?ready twice", re.I)),
    ("unfinished_reduction", re.compile(r"Expected to have finished reduction in the prior iteration", re.I)),
    ("outside_backward", re.compile(r"gradient which is undefined, but still allreduced", re.I)),
    ("graph_changed", re.compile(r"graph has changed", re.I)),
    ("autograd_hooks", re.compile(r"expect_autograd_hooks_", re.I)),
    ("peer_closed", re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe", re.I)),
    ("timeout", re.compile(r"Watchdog caught collective operation timeout|Timed out|timed out|"
                           r"NCCL communicator was aborted|Socket Timeout", re.I)),
)

# Timeouts and closed connections are common words: count them only with a sign of torch.distributed.
_DIST_CONTEXT = re.compile(r"gloo|nccl|collective|ProcessGroup|c10d|barrier|all_?reduce|all_?gather|broadcast|"
                           r"TCPStore|rendezvous|Work[A-Z]", re.I)

_HOW_TO_SEE_NAMES = ("Set TORCH_DISTRIBUTED_DEBUG=DETAIL to get the parameter names in torch's message.")


def _v(plan: Plan | None, field: str) -> Any:
    if plan is None:
        return None
    return getattr(plan, field).value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 240 else line[:237] + "..."


def _unused_names(text: str, param_names: Sequence[str] | None = None) -> str | None:
    """Torch lists the parameters without a gradient (names only with TORCH_DISTRIBUTED_DEBUG=DETAIL;
    otherwise indices into DDP's parameter list, i.e. the trainable parameters in module order, which
    ``param_names`` turns into names)."""
    m = re.search(r"Parameters which did not receive grad for rank \d+: ([^\n]+)", text)
    if m:
        return m.group(1).strip()
    m = re.search(r"Parameter indices which did not receive grad for rank \d+: ([^\n]+)", text)
    if not m:
        return None
    raw = m.group(1).strip()
    idx = [int(x) for x in re.findall(r"\d+", raw)]
    if param_names and idx and all(i < len(param_names) for i in idx):
        names = [param_names[i] for i in idx]
        return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f"indices {raw}"


def _ready_twice(plan: Plan | None, facts: RunFacts | None) -> tuple[str, str, str]:
    what = ("DDP saw a parameter's gradient hook fire twice in one backward pass "
            "('Expected to mark a variable ready only once').")
    ckpt, fu = _v(plan, "checkpointing"), _v(plan, "find_unused_parameters")
    flag, kwargs = checkpointing_arg_names()  # activation_checkpointing* (5.23) or gradient_checkpointing*
    if plan is None:
        cause = ("reentrant activation checkpointing together with find_unused_parameters=True (stock Trainer "
                 "picks that for every peft model), or a module that calls backward() per chunk (TiledMLP-style).")
        fix = ("Run the Trainer under hf_ddpfix (hf_ddpfix.patch_trainer(), or PYTHONPATH=patches), or set "
               f"{kwargs}={{'use_reentrant': False}}.")
    elif ckpt == "reentrant":
        cause = (f"this run uses reentrant checkpointing (plan: {plan.checkpointing.reason}) with "
                 f"find_unused_parameters={fu}; reentrant checkpointing re-runs each layer inside backward, "
                 "which DDP counts as a second use.")
        fix = ("HF_DDPFIX_CHECKPOINTING=non_reentrant (or unset HF_DDPFIX_CHECKPOINTING so the plan picks it), "
               f"or {kwargs}={{'use_reentrant': False}}.")
    else:
        cause = (f"the plan's checkpointing is {plan.checkpointing.text} and find_unused_parameters={fu}, so the "
                 "extra hook comes from code outside the plan: a module that calls backward()/autograd per chunk "
                 f"(e.g. another library's TiledMLP; hf_ddpfix tiling is {plan.tiled_mlp.text}), reentrant "
                 "checkpointing enabled directly on some layers, or a parameter used in two checkpointed regions.")
        fix = ("Use hf_ddpfix's DDP-safe tiling instead of per-chunk backward (HF_DDPFIX_TILED_MLP=auto and "
               "unset UNSLOTH_TILED_MLP in the other library), and enable checkpointing only through "
               f"TrainingArguments({flag}=True).")
    return what, cause, fix


def _unfinished_reduction(plan: Plan | None, facts: RunFacts | None, text: str,
                          param_names: Sequence[str] | None = None) -> tuple[str, str, str]:
    what = ("DDP started a step while the previous step's gradient all-reduce was incomplete: some trainable "
            "parameters received no gradient ('Expected to have finished reduction in the prior iteration').")
    names = _unused_names(text, param_names)
    seen = f" Parameters without a gradient: {names}." if names else " " + _HOW_TO_SEE_NAMES
    fu = _v(plan, "find_unused_parameters")
    stab = _v(plan, "vlm_stabilizer")
    if plan is None:
        cause = "find_unused_parameters=False while some trainable parameters are not used in every step."
    elif stab is False and (facts is None or facts.trainable_vision_params or plan.hang_guard.value is not None):
        cause = (f"find_unused_parameters={fu} ({plan.find_unused_parameters.reason}) and the VLM stabiliser is "
                 f"off ({plan.vlm_stabilizer.reason}): trainable vision parameters go unused on text-only steps.")
    elif _v(plan, "parameter_usage"):
        cause = (f"find_unused_parameters={fu} because parameter_usage ties every trainable parameter into the "
                 "loss given to accelerator.backward; these got no gradient, so the loss of that step was "
                 "back-propagated without passing through accelerator.backward (loss.backward() called "
                 "directly, or a second backward from another tensor).")
    elif facts is not None and facts.conditional_params:
        cause = (f"find_unused_parameters={fu}: conditionally used parameters (MoE experts) got no tokens "
                 "on this rank.")
    else:
        cause = (f"find_unused_parameters={fu} ({plan.find_unused_parameters.reason}), but a trainable "
                 "parameter was not used in the loss (a LoRA target or head outside the forward path).")
    fix = ("HF_DDPFIX_FIND_UNUSED_PARAMETERS=1 (or TrainingArguments(ddp_find_unused_parameters=True)); for a "
           "VLM prefer HF_DDPFIX_VLM_STABILIZER=1 (keeps find_unused off).")
    return what, cause + seen, fix


def _outside_backward() -> tuple[str, str, str]:
    what = ("DDP met a parameter's gradient hook outside the backward it reduces ('Encountered gradient which is "
            "undefined, but still allreduced by DDP reducer').")
    cause = ("a term over parameters the model's forward does not use was back-propagated apart from the loss "
             "(a second accelerator.backward / loss.backward before the optimizer step, or a backward inside a "
             "hook): DDP reduces gradients only within the backward of the forward it wrapped, and stock DDP "
             "fails here with either find_unused_parameters setting.")
    fix = ("Add the term to the loss before it is back-propagated (in compute_loss, or in an Accelerator "
           "subclass's backward): hf_ddpfix keeps such a gradient and DDP reduces it.")
    return what, cause, fix


def _graph_changed(plan: Plan | None, facts: RunFacts | None) -> tuple[str, str, str]:
    what = ("DDP static_graph=True, but the set of parameters used changed between iterations "
            "('Your training graph has changed').")
    if plan is not None and _v(plan, "static_graph"):
        cause = (f"the plan turned static graph on ({plan.static_graph.reason}), yet this step used a different "
                 "parameter set (image/text mix, MoE routing, or a conditional branch the facts did not show).")
    else:
        cause = "static_graph=True with a graph that varies from step to step."
    fix = "HF_DDPFIX_STATIC_GRAPH=0 (or TrainingArguments(ddp_static_graph=False))."
    return what, cause, fix


def _autograd_hooks(plan: Plan | None, facts: RunFacts | None) -> tuple[str, str, str]:
    what = "DDP's reducer hit an internal assert (expect_autograd_hooks_) on a gradient-accumulation micro-step."
    ga = facts.grad_accum_steps if facts is not None else None
    static = _v(plan, "static_graph")
    cause = ("static_graph=True together with gradient accumulation (accelerate's no_sync micro-steps); "
             "accelerate #3679.")
    if static is not None or ga is not None:
        cause += f" This run: static_graph={static}, gradient_accumulation_steps={ga if ga else 'unknown'}."
    fix = ("HF_DDPFIX_STATIC_GRAPH=0 (or TrainingArguments(ddp_static_graph=False)), or "
           "gradient_accumulation_steps=1.")
    return what, cause, fix


def _collective_failure(key: str, plan: Plan | None, facts: RunFacts | None) -> tuple[str, str, str]:
    if key == "peer_closed":
        what = "Another rank's connection closed mid-collective: that process exited or crashed first."
        causes = ["the first failing rank's own traceback (torchrun prints it as 'Root Cause') is the real error"]
    else:
        what = "A collective operation timed out: the ranks stopped issuing the same collectives in step."
        causes = ["one rank crashed, is stuck, or runs long rank-0-only work (saving, evaluation, tokenising) "
                  "past the timeout"]
    if plan is not None:
        vlm_stab, guard = _v(plan, "vlm_stabilizer"), _v(plan, "hang_guard")
        if vlm_stab is False and plan.parallel == "fsdp":
            causes.append("FSDP with a VLM and the stabiliser off: ranks without images skip the vision "
                          "tower's all-gathers (fix: HF_DDPFIX_VLM_STABILIZER=1)")
        elif vlm_stab is False and guard is False and _v(plan, "find_unused_parameters") is False:
            causes.append("VLM with find_unused_parameters=False and neither stabiliser nor hang guard: ranks "
                          "with and without images disagree (fix: HF_DDPFIX_VLM_STABILIZER=1 or "
                          "HF_DDPFIX_HANG_GUARD=1)")
        if _v(plan, "static_graph"):
            causes.append("static_graph=True with a changing graph can hang instead of raising "
                          "(fix: HF_DDPFIX_STATIC_GRAPH=0)")
    cause = "; ".join(causes) + "."
    fix = ("Find the first rank that failed in the launcher's log; rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL "
           "(and NCCL_DEBUG=WARN on GPUs) to see which collective disagreed; for slow rank-0-only work raise "
           "TrainingArguments(ddp_timeout=...) (seconds, default 1800).")
    return what, cause, fix


def explain(exc: BaseException, plan: Plan | None = None, *, facts: RunFacts | None = None,
            param_names: Sequence[str] | None = None) -> str | None:
    """Explain a distributed-training error, or return `None` if it is not one hf_ddpfix knows.

    Args:
        exc: the exception (its message, and its `__cause__`'s, are matched).
        plan: the run's `Plan` (for the cause in this run); `None` gives the general explanation.
        facts: the run's `RunFacts` (gradient accumulation, MoE, vision params), optional.
        param_names: the names of the trainable parameters in module order (DDP's parameter list), to
            name the parameters torch reports by index.

    Returns:
        A multi-line message: what happened, the likely cause, the fix, and the original first line.
    """
    if isinstance(exc, DDPFixError):
        return None
    texts = [str(exc)]
    if exc.__cause__ is not None:
        texts.append(str(exc.__cause__))
    text = "\n".join(texts)
    key = next((k for k, pat in _PATTERNS if pat.search(text)), None)
    if key is None:
        return None
    if key in ("peer_closed", "timeout") and not (_is_dist_error(exc) or _DIST_CONTEXT.search(text)):
        return None
    if key == "ready_twice":
        what, cause, fix = _ready_twice(plan, facts)
    elif key == "unfinished_reduction":
        what, cause, fix = _unfinished_reduction(plan, facts, text, param_names)
    elif key == "graph_changed":
        what, cause, fix = _graph_changed(plan, facts)
    elif key == "outside_backward":
        what, cause, fix = _outside_backward()
    elif key == "autograd_hooks":
        what, cause, fix = _autograd_hooks(plan, facts)
    else:
        what, cause, fix = _collective_failure(key, plan, facts)
    where = f" ({plan.parallel}, world size {plan.world_size})" if plan is not None else ""
    return (f"hf_ddpfix{where}: {what}\n"
            f"  Likely cause in this run: {cause}\n"
            f"  Fix: {fix}\n"
            f"  Original error ({type(exc).__name__}): {_first_line(exc)}")


def _is_dist_error(exc: BaseException) -> bool:
    try:  # DistError and its subclasses (DistBackendError, DistNetworkError, DistStoreError)
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(exc, DistError)


def _is_candidate(exc: BaseException) -> bool:
    return isinstance(exc, (RuntimeError, TimeoutError, ConnectionError)) or _is_dist_error(exc)


@contextmanager
def readable_ddp_errors(plan: Plan | None = None, *, facts: RunFacts | None = None,
                        param_names: Callable[[], Sequence[str]] | None = None) -> Iterator[None]:
    """Re-raise known DDP failures inside the block as `DDPFixError` (original as `__cause__`).

    Args:
        plan: the run's `Plan`; facts: its `RunFacts` (optional), both used only for the message.
        param_names: returns the trainable parameter names in module order (read when an error is
            explained), so parameters torch reports by index are named.

    Example:
        >>> with readable_ddp_errors(trainer.hf_ddpfix_plan):
        ...     trainer.train()
    """
    try:
        yield
    except Exception as exc:
        names = param_names() if (param_names is not None and _is_candidate(exc)) else None
        message = explain(exc, plan, facts=facts, param_names=names) if _is_candidate(exc) else None
        if message is None:
            raise
        raise DDPFixError(message) from exc
