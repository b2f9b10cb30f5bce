"""The trainer's logged metrics under sequence parallelism equal stock DDP's ("metric replay").

On the gathered and head-whole routes every rank of an SP group calls the trainer's own `compute_loss` once per
batch of the group (N calls per micro-batch, batch `j` on call `j`). A trainer that logs statistics (TRL:
`self._metrics[mode][...]`, `self._stored_metrics`, `self._total_train_tokens`) computes them inside those calls,
usually over the world with `accelerator.gather` / `gather_for_metrics` / `reduce`. Left alone, every call
appends one entry (N per micro-batch, stock: one) and each world gather holds the group's batch `j` N times
(stock: each rank's own batch once): counts come out N x too high (`num_tokens`), min / max / ratios of sums over
other sets of rows (`min_reward`, `max_reward`, `mean_token_accuracy`, `entropy`).

`MetricReplay` makes them stock's, for any trainer that does so:
  * calls `0 .. N-2`: the trainer's metric state (every public instance attribute that is a number, or a dict /
    list holding only numbers, strings and such containers, up to `MAX_LEAVES` leaves; and TRL's private metric
    attributes, read only through `_compat.trl_metric_state`: the names `_compat.TRL_METRIC_STATE` lists for the
    installed TRL, e.g. `_metrics`, `_stored_metrics`, `_total_train_tokens`) is put back as it was before the
    call (in place for dicts and lists), and every accelerate gather / reduce's input is recorded (with the line
    that called it);
  * call `N-1` (the last batch of the group): each gather / reduce contributes, on rank `r`, the input
    recorded from the same line (and its two callers' lines; its m-th call there for the m-th) in call `r` (its *own* batch's, as stock's
    rank would), so the world sees
    exactly stock's tensors once each: what the trainer appends, adds up, takes the min or max of, is stock's.
The ranks agree before each such gather (one `all_reduce` of a flag over the world) that every one has its
own input recorded from that line; where one has not (its own batch took another branch, e.g. TRL KTO's
`if all_num_rejected > 0` when the own batch, gathered N times, had no rejected row), the gather takes the
current input and what the trainer derives from it may differ from stock: counted as the fallback
amount `metric_gathers_differ` (feature "sequence_parallel") and warned once per line, naming it.

The loss is untouched on calls `0 .. N-2`. A world gather that feeds the loss itself (TRL KTO's KL) is refused
by the plan (`facts.trainer_world_statistic`); an input that requires grad is never replaced.

What this cannot make stock's (docs/sequence-parallel-losses.md): a statistic a trainer keeps in a private attribute
of its own that `_compat.TRL_METRIC_STATE` does not name (a user's `self._my_counts`: counted N times), a statistic a trainer computes from its own
batch without a world gather (rank 0 logs the group's last batch's, stock rank 0 its own), and one computed on
the outputs at padding positions (TRL ORPO / CPO `logits/chosen`, `logits/rejected`: the unmasked mean of
the logits; a padding position's outputs under SP are those of a pad token that attends to itself only).
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..._compat.trl_metrics import put_back, restore_trl_metric_state, trl_metric_state
from ...ops.feature_counts import record_amount

__all__ = ["LIMITS", "MAX_LEAVES", "METRICS_DIFFER", "MetricReplay"]

logger = logging.getLogger("hf_ddpfix")
FEATURE = "sequence_parallel"
#: the accelerate collectives a trainer reduces its metrics with (the input: the first argument)
_METHODS = ("gather", "gather_for_metrics", "reduce")
#: a container with more leaves is not metric state (not copied per call)
MAX_LEAVES = 100_000
METRICS_DIFFER = ("a metric's world gather ran for the group's last batch where this rank's own batch did not reach it "
                  "(a branch on the data): that step's logged metrics from it may differ from stock DDP's")
#: said once per trainer that logs metrics (rank 0), at its first micro-batch under SP (docs/sequence-parallel-losses.md)
LIMITS = ("the trainer's logged metrics are replayed to equal stock DDP's, except a statistic computed on the outputs "
          "at padding positions (e.g. TRL ORPO / CPO logits/chosen, logits/rejected: the unmasked logits mean; a "
          "padding position under sequence parallelism attends to itself only) and one taken from the rank's own "
          "batch without an accelerate gather / reduce (rank 0 logs its group's last batch's)")
_warned: set[str] = set()


def _leaves(value: Any, budget: list[int]) -> bool:
    """`value` is plain metric state (numbers, strings, None in dicts / lists / tuples) within the leaf budget."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        budget[0] -= 1
        return budget[0] >= 0
    if isinstance(value, dict):
        return all(isinstance(k, str) and _leaves(v, budget) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_leaves(v, budget) for v in value)
    return False


def _is_metric_value(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) or \
        isinstance(value, (dict, list)) and _leaves(value, [MAX_LEAVES])


def metric_state(trainer: Any) -> dict[str, Any]:
    """A deep copy of the trainer's metric state (see the module docstring): its public instance attributes that
    are metric values, and TRL's named private ones (``_compat.trl_metric_state``), by name."""
    out: dict[str, Any] = {}
    for name, value in vars(trainer).items():
        if not name.startswith("_") and _is_metric_value(value):
            out[name] = copy.deepcopy(value)
    for name, value in trl_metric_state(trainer).items():
        if _is_metric_value(value):
            out[name] = copy.deepcopy(value)
    return out


def restore_metric_state(trainer: Any, saved: dict[str, Any]) -> None:
    """Put back what `metric_state` saved: dicts and lists in place (a reference the trainer holds stays valid)."""
    for name, value in saved.items():
        if not name.startswith("_"):  # TRL's private state: through the contract layer below
            put_back(trainer, name, value)
    restore_trl_metric_state(trainer, {name: v for name, v in saved.items() if name.startswith("_")})


def _detached(x: Any) -> Any:
    if torch.is_tensor(x):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x)
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


def _caller(depth: int = 3) -> str:
    """The lines that called the accelerator's method: the trainer's and `depth - 1` callers above it (a helper
    called from several lines, e.g. TRL GRPO's `global_masked_mean`, is told apart by its caller)."""
    frame, lines = inspect.currentframe(), []
    for _ in range(3):  # past _caller, _collective and the wrapper
        frame = frame.f_back if frame is not None else None
    while frame is not None and len(lines) < depth:
        lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(lines)


class MetricReplay:
    """One micro-batch's N `compute_loss` calls on one rank (`rank` of `size` in its SP group); use `call(j, fn)`
    for batch `j` in order, inside `with MetricReplay(...)` (which wraps the trainer's accelerator methods)."""

    def __init__(self, trainer: Any, rank: int, size: int):
        self.trainer, self.rank, self.size = trainer, rank, size
        self.accelerator = getattr(trainer, "accelerator", None)
        #: per call: (method, calling line) -> the inputs given there, in order
        self.recorded: list[dict[tuple[str, str], list[Any]]] = [{} for _ in range(size)]
        self.seen: dict[tuple[str, str], int] = {}
        self.j = 0
        self.replaced, self._depth = 0, 0
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> MetricReplay:
        acc = self.accelerator
        if acc is None:
            return self
        for name in _METHODS:
            original = getattr(acc, name, None)
            if original is None:
                continue
            own = name in vars(acc)
            setattr(acc, name, self._wrap(name, original))
            self._undo.append(lambda name=name, original=original, own=own:
                              setattr(acc, name, original) if own else vars(acc).pop(name, None))
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._undo:
            self._undo.pop()()

    def call(self, j: int, fn: Callable[[], Any]) -> Any:
        """Run `fn` (the trainer's compute_loss on batch `j`); on calls before the last, put its metric state back."""
        self.j, self.seen = j, {}
        saved = metric_state(self.trainer) if j < self.size - 1 else None
        try:
            return fn()
        finally:
            if saved is not None:
                if j == 0 and not getattr(self.trainer, "_hf_ddpfix_sp_metrics_said", False) and \
                        metric_state(self.trainer) != saved:  # the trainer logs metrics of its own: say the limits
                    self.trainer._hf_ddpfix_sp_metrics_said = True
                    if dist.get_rank() == 0:
                        logger.warning("sequence_parallel: %s", LIMITS)
                restore_metric_state(self.trainer, saved)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # accelerate's own inner call (gather_for_metrics -> gather): the outer one decided
                return original(*args, **kwargs)
            self._depth += 1
            try:
                return self._collective(name, original, args, kwargs)
            finally:
                self._depth -= 1

        return collective

    def _collective(self, name: str, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not args:  # given by keyword: the input under its own name
            key = next(iter(kwargs), None)
            args = (kwargs.pop(key),) if key is not None else ()
        site = (name, _caller())
        seen = self.seen.setdefault(site, 0)  # the how-many-th call from this line in this compute_loss
        self.seen[site] = seen + 1
        if self.j < self.size - 1:
            self.recorded[self.j].setdefault(site, []).append(_detached(args[0]) if args else None)
            return original(*args, **kwargs)
        return original(*self._own(site, seen, args), **kwargs)

    def _own(self, site: tuple[str, str], seen: int, args: tuple) -> tuple:
        """The last call's arguments with this rank's own batch's input from the same line (its `seen`-th call
        there), when every rank has it."""
        if self.rank == self.size - 1:  # its own batch is the last one
            mine, ok = args, bool(args)
        else:
            rec = self.recorded[self.rank].get(site, [])
            ok = bool(args) and seen < len(rec)
            mine = (rec[seen], *args[1:]) if ok else args
        device = getattr(self.accelerator, "device", None) or torch.device("cpu")
        agreed = torch.tensor([int(ok)], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if int(agreed):
            self.replaced += 1
            record_amount(FEATURE, "metric_inputs_replayed", 1)
            return mine
        record_amount(FEATURE, "metric_gathers_differ", 1)  # not a fallback: the loss and training are exact
        where = f"{site[0]} at {site[1]}"
        if where not in _warned and dist.get_rank() == 0:
            _warned.add(where)
            logger.warning("sequence_parallel: %s (%s)", METRICS_DIFFER, where)
        return args
