"""What the requested features did in one ``train()``: fallbacks reported as they happen, counts returned.

- :class:`FallbackWatch`: listens to :func:`hf_ddpfix.ops.feature_counts.record_fallback`. When a
  feature the plan turned on (its decision's value is truthy) runs stock code, it logs one warning on
  rank 0 per (feature, reason), naming the reason and the installed torch / transformers versions; with
  ``strict=True`` it raises :class:`FeatureFallbackError` at that call instead (a strict run never trains
  without a feature it asked for). Fallbacks of features the plan did not turn on are only counted.
- :func:`never_ran_warning`: at the end of ``train()``, the options asked on explicitly that the plan ran but
  whose counter's ``ran`` stayed 0 (no fallback needed for that: e.g. every MLP call too short to tile), named
  with their counts, as one warning (``run_with_plan`` logs it on rank 0).
- :func:`feature_metrics`: the counts as flat ``hf_ddpfix/<feature>/{ran,fell_back,<amount>}`` integers,
  for every feature that recorded anything (generic: whatever names the features use).

Counts are **rank-local**: each process reports what its own forwards did (no collective, so reporting
can never hang a run); ranks normally run the same code and report the same numbers, and the one that
matters for a warning is rank 0's. ``run_with_plan`` resets the table at the start of every ``train()``
and adds the metrics to the ``TrainOutput.metrics`` that ``train()`` returns, after the Trainer has logged
them (so ``state.log_history`` and ``trainer_state.json`` stay stock); ``FeatureCountsCallback`` does the
same for the metrics ``evaluate()`` returns during training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..ops.feature_counts import add_fallback_listener, as_metrics
from ..plan.types import Plan
from .errors import DDPFixError

__all__ = ["ATTACH_FIELDS_OF", "RAN_COUNTER", "FallbackWatch", "attach_fallbacks", "FeatureFallbackError", "feature_metrics",
           "never_ran_warning", "requested_features"]

logger = logging.getLogger("hf_ddpfix")

#: Counted feature name -> the plan decision that turns it on, where the two names differ.
PLAN_FIELD_OF = {"offload": "offload_activations", "stabilizer": "vlm_stabilizer",
                 "zero_vision": "vlm_stabilizer"}


class FeatureFallbackError(DDPFixError):
    """A feature the plan turned on ran stock code (raised at that call in strict mode)."""


#: Counted feature name -> every plan decision a fallback of it at attach time turns off (the ZeRO / DDP
#: stabiliser is one object for training and evaluation forwards: if it cannot attach, neither runs).
ATTACH_FIELDS_OF = {"stabilizer": ("vlm_stabilizer", "vlm_eval_sync"), "zero_vision": ("vlm_stabilizer", "vlm_eval_sync"),
                    "offload": ("offload_activations",)}


def attach_fallbacks() -> dict[str, str]:
    """Plan field -> reason, for every feature that recorded a fallback so far in this ``train()`` (called right
    after the runtime attached, before step 1: these are attach-time verdicts, e.g. a discovered VLM family
    whose dummy image failed its trial run). Feed to :meth:`~hf_ddpfix.plan.types.Plan.with_attach_fallbacks`."""
    from ..ops.feature_counts import snapshot

    out: dict[str, str] = {}
    for feature, count in snapshot().items():
        if not count.fallbacks:
            continue
        reason = "; ".join(sorted(count.fallbacks))
        for name in ATTACH_FIELDS_OF.get(feature, (PLAN_FIELD_OF.get(feature, feature),)):
            out[name] = reason
    return out


def requested_features(plan: Plan) -> dict[str, Any]:
    """Feature name -> the plan's value, for every decision that is on (``if value:``); counted names
    that differ from the decision's (``offload``, ``stabilizer``) are included under both."""
    on = {name: d.value for name, d in plan.decisions().items() if d.value}
    for feature, decision in PLAN_FIELD_OF.items():
        if decision in on:
            on[feature] = on[decision]
    return on


def _versions() -> str:
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


class FallbackWatch:
    """Warn once (rank 0) or raise (strict) when a requested feature falls back.

    Args:
        plan: the run's plan (which features are on).
        strict: raise :class:`FeatureFallbackError` instead of warning.
        is_rank0: whether this process logs (the world's process zero).
    """

    def __init__(self, plan: Plan, strict: bool = False, is_rank0: bool = True) -> None:
        self.requested = requested_features(plan)
        self.strict = strict
        self.is_rank0 = is_rank0
        self.warned: set[tuple[str, str]] = set()
        self._remove: Callable[[], None] | None = None

    def message(self, feature: str, reason: str) -> str:
        return (f"{feature} was requested ({feature}={self.requested[feature]!r} in the plan) but a training "
                f"call ran stock code: {reason} ({_versions()}). The result is stock's; what {feature} saves "
                f"is not saved for such calls. hf_ddpfix/{feature}/fell_back in the train() metrics counts them.")

    def __call__(self, feature: str, reason: str) -> None:
        if feature not in self.requested:
            return
        if self.strict:
            raise FeatureFallbackError(self.message(feature, reason) + " strict=True: raising instead of "
                                       "training without it; unset strict (HF_DDPFIX_STRICT) to continue with "
                                       "stock for such calls.")
        if (feature, reason) not in self.warned:
            self.warned.add((feature, reason))
            if self.is_rank0:
                logger.warning("%s", self.message(feature, reason))

    def attach(self) -> FallbackWatch:
        if self._remove is None:
            self._remove = add_fallback_listener(self)
        return self

    def remove(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None


def feature_metrics() -> dict[str, int]:
    """``hf_ddpfix/<feature>/ran``, ``.../fell_back`` and ``.../<amount>`` for every counted feature
    (rank-local; see the module docstring)."""
    return as_metrics("hf_ddpfix/")


#: Option -> the counted feature whose ``ran`` counts each call (or step) it ran its own code, so ``ran == 0`` after
#: a ``train()`` with steps means it never ran. Options not listed have no such counter: the DDP flags, the hang
#: guard and the settings act on the wrapper, not on calls; the stabiliser counts dummy images (0 when every
#: micro-batch has one: nothing to stabilise, not a failure).
RAN_COUNTER = {"offload_activations": "offload", "tiled_mlp": "tiled_mlp", "tiled_loss": "tiled_loss",
               "long_context": "long_context", "parameter_usage": "parameter_usage",
               "zero_skip_unused": "zero_skip_unused", "sequence_parallel": "sequence_parallel"}
#: Feature -> amounts that are its own code running too, beside ``ran``: long context's patched norms (Gemma 4:
#: every decoder layer stays stock with its reason, its RMSNorms run the op; the feature ran, in part).
ALSO_RAN = {"long_context": ("rms_norm_calls",)}


def never_ran_warning(plan: Plan, asked: list[str], counts: dict[str, Any] | None = None) -> str | None:
    """The warning for the options in ``asked`` (asked on explicitly) that ``plan`` runs but whose counter's ``ran``
    is 0 (``counts``: a :func:`~hf_ddpfix.ops.feature_counts.snapshot`, default the live table); ``None``: none.

    Guarantees: names each such option with its counter's fallbacks and amounts; says nothing for an option the
    plan did not run (the plan log and its warning already say so) or that has no ``ran`` counter
    (tests/test_asked_options.py)."""
    from ..ops.feature_counts import snapshot

    table = snapshot() if counts is None else counts
    decisions = plan.decisions()
    lines = []
    for name in asked:
        feature = RAN_COUNTER.get(name)
        d = decisions.get(name)
        if feature is None or d is None or not d.value or d.value == "deepspeed":
            continue
        c = table.get(feature)
        if c is not None and (c.ran or any(c.amounts.get(k) for k in ALSO_RAN.get(feature, ()))):
            continue
        said = [f"hf_ddpfix/{feature}/ran = 0"]
        if c is not None and c.fallbacks:
            said.append("fell back: " + "; ".join(f"{r} (x{n})" for r, n in sorted(c.fallbacks.items())))
        if c is not None and c.amounts:
            said.append(", ".join(f"{k}={v}" for k, v in sorted(c.amounts.items())))
        elif c is None:
            said.append("never called (no module it patches ran, or none was found)")
        lines.append(f"  {name} = {d.text}: " + "; ".join(said))
    if not lines:
        return None
    return ("hf_ddpfix: asked for and on in the plan, but never ran in this train() (counts of this rank):\n"
            + "\n".join(lines))
