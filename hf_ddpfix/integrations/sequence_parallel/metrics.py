"""The trainer's logged metrics under sequence parallelism equal stock DDP's ("metric replay").

On the gathered and head-whole routes every rank of an SP group calls the trainer's own `compute_loss` once per
batch of the group (N calls per micro-batch, batch `j` on call `j`). A trainer that logs statistics (TRL:
`self._metrics[mode][...]`, `self._stored_metrics`, `self._total_train_tokens`) computes them inside those calls,
usually over the world with `accelerator.gather` / `gather_for_metrics` / `reduce`. Left alone, every call
appends one entry (N per micro-batch, stock: one) and each world gather holds the group's batch `j` N times
(stock: each rank's own batch once): counts come out N x too high (`num_tokens`), min / max / ratios of sums over
other sets of rows (`min_reward`, `max_reward`, `mean_token_accuracy`, `entropy`).

`MetricReplay` makes them stock's, for any trainer that does so:
  * calls `0 .. N-2`: the trainer's metric state (every instance attribute that is a number, or a dict / list
    holding only numbers, strings and such containers, up to `MAX_LEAVES` leaves) is put back as it was
    before the call (in place for dicts and lists), and every accelerate gather / reduce's input is recorded
    (with the line that called it);
  * call `N-1` (the last batch of the group): each gather / reduce contributes, on rank `r`, the input
    recorded at the same position of call `r` (its *own* batch's, as stock's rank would), so the world sees
    exactly stock's tensors once each: what the trainer appends, adds up, takes the min or max of, is stock's.
The ranks agree before each such gather (one `all_reduce` of a flag over the world) that every one has its
own input recorded from the same line; where one has not (a data-dependent branch), the gather takes the
current input, and the metrics of that call may differ from stock: counted as the fallback `METRICS_DIFFER`
(feature "sequence_parallel") and warned once naming the line.

The loss is untouched on calls `0 .. N-2`. A world gather that feeds the loss itself (TRL KTO's KL) is refused
by the plan (`facts.trainer_world_statistic`); an input that requires grad is never replaced.

What this cannot make stock's (docs/sequence-parallel-losses.md): a statistic a trainer computes from its own
batch without a world gather (rank 0 logs the group's last batch's, stock rank 0 its own), and one computed on
the outputs at padding positions (TRL ORPO / CPO `logits/chosen`, `logits/rejected`: the unmasked mean of
the logits; a padding position's outputs under SP are those of a pad token that attends to itself only).
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...ops.feature_counts import record_amount, record_fallback

__all__ = ["MAX_LEAVES", "METRICS_DIFFER", "MetricReplay"]

logger = logging.getLogger("hf_ddpfix")
FEATURE = "sequence_parallel"
#: the accelerate collectives a trainer reduces its metrics with (the input: the first argument)
_METHODS = ("gather", "gather_for_metrics", "reduce")
#: a container with more leaves is not metric state (not copied per call)
MAX_LEAVES = 100_000
METRICS_DIFFER = ("a metric's world gather ran on another line for this rank's own batch than for the group's last "
                  "batch: that call's logged metrics may differ from stock DDP's")
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


def metric_state(trainer: Any) -> dict[str, Any]:
    """A deep copy of the trainer's instance attributes that are metric state (see the module docstring)."""
    out = {}
    for name, value in vars(trainer).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) or \
                isinstance(value, (dict, list)) and _leaves(value, [MAX_LEAVES]):
            out[name] = copy.deepcopy(value)
    return out


def restore_metric_state(trainer: Any, saved: dict[str, Any]) -> None:
    """Put back what `metric_state` saved: dicts and lists in place (a reference the trainer holds stays valid)."""
    for name, value in saved.items():
        current = vars(trainer).get(name)
        if isinstance(current, dict) and isinstance(value, dict):
            current.clear()
            current.update(value)
        elif isinstance(current, list) and isinstance(value, list):
            current[:] = value
        else:
            setattr(trainer, name, value)


def _detached(x: Any) -> Any:
    if torch.is_tensor(x):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x)
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


def _caller() -> str:
    frame = sys._getframe(3)  # the trainer's line (past collective and _collective) that called the accelerator's method
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class MetricReplay:
    """One micro-batch's N `compute_loss` calls on one rank (`rank` of `size` in its SP group); use `call(j, fn)`
    for batch `j` in order, inside `with MetricReplay(...)` (which wraps the trainer's accelerator methods)."""

    def __init__(self, trainer: Any, rank: int, size: int):
        self.trainer, self.rank, self.size = trainer, rank, size
        self.accelerator = getattr(trainer, "accelerator", None)
        self.recorded: list[list[tuple[str, str, Any]]] = [[] for _ in range(size)]
        self.j, self.k = 0, 0
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
        self.j, self.k = j, 0
        saved = metric_state(self.trainer) if j < self.size - 1 else None
        try:
            return fn()
        finally:
            if saved is not None:
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
        site, k = _caller(), self.k
        self.k += 1
        if self.j < self.size - 1:
            self.recorded[self.j].append((name, site, _detached(args[0]) if args else None))
            return original(*args, **kwargs)
        return original(*self._own(name, site, k, args), **kwargs)

    def _own(self, name: str, site: str, k: int, args: tuple) -> tuple:
        """The last call's arguments with this rank's own batch's input at position `k`, when every rank has it."""
        if self.rank == self.size - 1:  # its own batch is the last one
            mine, ok = args, bool(args)
        else:
            rec = self.recorded[self.rank]
            ok = bool(args) and k < len(rec) and rec[k][:2] == (name, site)
            mine = (rec[k][2], *args[1:]) if ok else args
        device = getattr(self.accelerator, "device", None) or torch.device("cpu")
        agreed = torch.tensor([int(ok)], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if int(agreed):
            self.replaced += 1
            record_amount(FEATURE, "metric_inputs_replayed", 1)
            return mine
        record_fallback(FEATURE, METRICS_DIFFER)
        if site not in _warned and dist.get_rank() == 0:
            _warned.add(site)
            logger.warning("sequence_parallel: %s (%s at %s)", METRICS_DIFFER, name, site)
        return args
