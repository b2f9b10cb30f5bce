"""Trainer callbacks: the plan report, a replica-sync check, and memory / throughput metrics in the logs.

- `PlanReportCallback(plan)`: logs `plan.report()` once, on rank 0, when training starts.
- `ReplicaSyncCallback(every_n_steps)`: every N optimizer steps, a checksum of the trainable parameters
  is compared across DDP ranks with one all-reduce; diverged replicas raise `ReplicaDivergenceError` on
  every rank, naming the first diverged parameters.
- `MemoryThroughputCallback()`: adds `hf_ddpfix/*` memory and tokens/s keys to every training log, so
  they reach TensorBoard / W&B / the console like the Trainer's own keys.
- `FeatureCountsCallback()`: adds the feature counts (`hf_ddpfix/<feature>/...`, rank-local) to the
  metrics `evaluate()` returns during training, after the Trainer logged them (log_history stays stock).
- `default_callbacks(plan, config)` and `install_callbacks(trainer, callbacks, stack)`: what runs by
  default and how it is attached for one `train()` call.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import DefaultFlowCallback, TrainerCallback

from ._compat import trainer_callbacks
from .config.options import DDPFixConfig
from .plan.types import Plan
from .runtime.errors import ReplicaDivergenceError

logger = logging.getLogger("hf_ddpfix")

#: Default `sync_check_steps`: one pass over the trainable weights + one all-reduce of 2 float64 per
#: trainable tensor every 50 optimizer steps (LoRA on a 7B model: ~450 tensors, 7 KB; microseconds).
DEFAULT_SYNC_CHECK_STEPS = 50

__all__ = [
    "DEFAULT_SYNC_CHECK_STEPS",
    "FeatureCountsCallback",
    "MemoryThroughputCallback",
    "PlanReportCallback",
    "ReplicaSyncCallback",
    "default_callbacks",
    "install_callbacks",
    "param_checksums",
]


def _dist_world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _collective_device() -> torch.device:
    """CPU for gloo, the current CUDA device for NCCL (NCCL only moves device tensors)."""
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PlanReportCallback(TrainerCallback):
    """Log `plan.report()` once at the start of training, on the world's process zero only.

    Args:
        plan: the `Plan` of this run.
        log: where to write (default: the `hf_ddpfix` logger at INFO).
    """

    def __init__(self, plan: Plan, log: logging.Logger | None = None):
        self.plan = plan
        self.log = log or logger
        self._done = False

    def on_train_begin(self, args, state, control, **kwargs):
        if not self._done and state.is_world_process_zero:
            self.log.info(self.plan.report())
        self._done = True


# ----------------------------------------------------------------------------------------------------
# Replica sync check
# ----------------------------------------------------------------------------------------------------


def param_checksums(model: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Per trainable parameter: float64 (sum, sum of squares). Deterministic for identical tensors.

    Returns:
        (names, tensor of shape [2 * len(names)]) on the parameters' device (the first one's).
    """
    names, parts = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        t = p.detach()
        local = getattr(t, "to_local", None)  # a DTensor (FSDP2): compare only what this rank holds
        if local is not None:
            t = local()
        t = t.to(torch.float64)
        names.append(name)
        parts.append(torch.stack([t.sum(), (t * t).sum()]))
    if not parts:
        return [], torch.zeros(0, dtype=torch.float64)
    device = parts[0].device
    return names, torch.cat([x.to(device) for x in parts])


class ReplicaSyncCallback(TrainerCallback):
    """Every `every_n_steps` optimizer steps, check that all DDP replicas hold the same trainable weights.

    One all-reduce (MAX over `[c, -c]`, `c` = per-parameter float64 sum and sum of squares) gives every
    rank both the maximum and the minimum of each checksum; any difference means the replicas diverged
    (a rank skipped an all-reduce, a non-DDP parameter update, a rank-specific seed in an in-place op...).
    Also checked once when training ends. A no-op when torch.distributed is not initialised or the world
    size is 1. Compare only under DDP: under FSDP every rank holds different shards.

    Args:
        every_n_steps: check period in optimizer steps; 0 turns the callback off.
        max_names: how many diverged parameter names the error lists.

    Raises:
        ReplicaDivergenceError: on every rank at the same step (all ranks see the same reduced vector),
            after rank 0 saved its model under the run's `output_dir` (see `check`).

    Guarantees: the check is exact (identical replicas give bit-identical checksums); it never raises
    when the replicas are identical.
    """

    def __init__(self, every_n_steps: int = DEFAULT_SYNC_CHECK_STEPS, max_names: int = 5):
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be >= 0 (0: never)")
        self.every_n_steps = every_n_steps
        self.max_names = max_names
        self.last_checked_step: int | None = None
        self.last_good_step = 0  # replicas start equal (DDP broadcasts rank 0's weights when it wraps)
        self.checks = 0

    def check(self, model: nn.Module, step: int, output_dir: str | None = None) -> None:
        """Compare `model`'s trainable parameters across ranks now (collective: call on every rank).

        On divergence, rank 0 first saves its model (`save_pretrained`, else its trainable tensors) to
        `<output_dir>/hf_ddpfix-diverged-step-<step>` so the run's work is not lost, then every rank raises;
        the error lists the parameters by the size of their drift (largest first) and the window
        `(last_good_step, step]` in which the replicas went apart.
        """
        if _dist_world() <= 1:
            return
        names, sums = param_checksums(model)
        n = len(names)
        both = torch.cat([sums, -sums]).to(_collective_device())
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        hi, lo = both[: 2 * n].cpu().view(n, 2), -both[2 * n :].cpu().view(n, 2)
        self.last_checked_step = step
        self.checks += 1
        bad = [i for i in range(n) if bool((hi[i] != lo[i]).any())]
        if not bad:
            self.last_good_step = step
            return
        # drift size: the spread over ranks of the sum and (as a norm) of the sum of squares
        drift = {i: max(float(hi[i, 0] - lo[i, 0]), float(hi[i, 1].sqrt() - lo[i, 1].clamp(min=0).sqrt()))
                 for i in bad}
        bad.sort(key=lambda i: -drift[i])
        saved = _save_rank0(model, output_dir, step) if output_dir else None
        shown = bad[: self.max_names]
        spread = ", ".join(f"{names[i]} (drift {drift[i]:.3g}; sum over ranks {lo[i, 0]:.6g}..{hi[i, 0]:.6g})"
                           for i in shown)
        more = f" and {len(bad) - len(shown)} more" if len(bad) > len(shown) else ""
        window = (f"after step {self.last_good_step} (the last check that found them equal)"
                  if self.last_good_step else "since training started")
        keep = (f" Rank 0's model at step {step} was saved to {saved}; checkpoints saved at or before step "
                f"{self.last_good_step} hold weights every rank agreed on." if saved else "")
        raise ReplicaDivergenceError(
            f"hf_ddpfix: DDP replicas diverged: first seen at step {step}, {window}; checked every "
            f"{self.every_n_steps} steps and when training ends. {len(bad)} of {n} trainable parameters differ "
            f"between ranks, largest drift first: {spread}{more}. Gradients were not all-reduced for them (a "
            "parameter updated outside DDP or unfrozen after wrapping outside hf_ddpfix's Trainer, a rank that "
            f"skipped a step, or a model/optimizer change on one rank).{keep} Rerun with "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL; HF_DDPFIX_SYNC_CHECK_STEPS=1 finds the first bad step.",
            names=[names[i] for i in bad], step=step, last_good_step=self.last_good_step, saved_to=saved,
        )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every_n_steps and model is not None and state.global_step % self.every_n_steps == 0:
            self.check(model, state.global_step, getattr(args, "output_dir", None))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.every_n_steps and model is not None and self.last_checked_step != state.global_step:
            self.check(model, state.global_step, getattr(args, "output_dir", None))


def _save_rank0(model: nn.Module, output_dir: str, step: int) -> str | None:
    """Rank 0 saves `model` to `<output_dir>/hf_ddpfix-diverged-step-<step>` (no collective); returns the
    path on every rank, or `None` when saving failed (the divergence error is raised regardless)."""
    import os

    path = os.path.join(output_dir, f"hf_ddpfix-diverged-step-{step}")
    if dist.get_rank() != 0:
        return path
    try:
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(path)
        else:
            os.makedirs(path, exist_ok=True)
            torch.save({k: v.detach().cpu() for k, v in model.named_parameters() if v.requires_grad},
                       os.path.join(path, "trainable.pt"))
    except Exception as err:  # noqa: BLE001 - never hide the divergence behind a failed save
        logging.getLogger("hf_ddpfix").warning("hf_ddpfix: could not save the diverged model to %s: %s", path, err)
        return None
    return path


# ----------------------------------------------------------------------------------------------------
# Memory and throughput
# ----------------------------------------------------------------------------------------------------


def _peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes; Linux: KiB


class MemoryThroughputCallback(TrainerCallback):
    """Peak memory and tokens/second for the log writers (TensorBoard, W&B, the printer), log-only.

    What the Trainer stores and returns stays stock: the values are *not* written into
    `state.log_history`, `trainer_state.json` or the metrics `train()` returns (they depend on wall time
    and process-lifetime memory, so a resumed run would store different numbers than an uninterrupted
    one). They reach the other callbacks' `on_log` as an extended copy of `logs`, through
    :func:`install_callbacks` (which hf_ddpfix uses) or :meth:`deliver_to`. `in_history=True` restores
    the old behaviour (values merged into `logs` and the last `log_history` entry) for users who want
    them stored.

    Keys (numbers only, so every reporter accepts them):
        `hf_ddpfix/peak_mem_gb`: this rank's peak since training started. On CUDA:
            `torch.cuda.max_memory_allocated` (tensors only; reset at train start). Without CUDA: the
            process's peak resident set size (`resource.getrusage`, whole process and lifetime: an upper
            bound, not tensor bytes).
        `hf_ddpfix/peak_mem_gb_max`: the maximum over ranks (distributed runs).
        `hf_ddpfix/tokens_per_sec`: tokens per second over the last logging interval, all ranks together.
        `hf_ddpfix/tokens_per_sec_rank`: the same for this rank alone (in the end-of-training summary:
            this rank's whole-run average). Evaluation logs get the memory key only.
    The log writers (TensorBoard, W&B) run on rank 0, so they record rank 0's `_rank` values.

    Tokens: the non-padding tokens of each training forward (`attention_mask.sum()`, else
    `input_ids.numel()`), counted by a forward pre-hook on the model (no trainer changes, eval forwards
    skipped). The mask sums are added up on the mask's device and read once per log (no device->host
    read per micro-batch: on a GPU `int(mask.sum())` would wait for the queued work each forward). The
    cross-rank numbers cost one all-gather of 3 floats per training log, only on the Trainer's periodic
    training logs (those with a "loss" key, emitted by every rank at the same step).

    Args:
        cross_rank: gather the max/sum over ranks (default on).
        in_history: also store the values in `logs` / `state.log_history` (default off: log-only).

    Guarantees: with `in_history=False` an hf_ddpfix run stores the same `log_history`, checkpoint
    `trainer_state.json` and `train()` metrics as without this callback (tests/test_callbacks.py).
    """

    def __init__(self, cross_rank: bool = True, in_history: bool = False):
        self.cross_rank = cross_rank
        self.in_history = in_history
        self.extras: dict[str, float] = {}  # the values computed for the latest `logs`
        self._extras_for: int | None = None  # id() of that `logs` dict
        self._hook: Any = None
        self._host_tokens = 0  # counted without reading a device (input_ids.numel())
        self._device_tokens: torch.Tensor | None = None  # attention-mask sums, on the mask's device
        self._last_tokens = 0
        self._last_time = self._start_time = 0.0
        self._cuda = False

    # counting ------------------------------------------------------------------------------------
    def _count(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training:
            return
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            with torch.no_grad():
                count = mask.sum(dtype=torch.int64)
                if self._device_tokens is None or self._device_tokens.device != count.device:
                    self._host_tokens += self.tokens(reset_device=True)
                    self._device_tokens = count
                else:
                    self._device_tokens.add_(count)
        elif isinstance(ids, torch.Tensor):
            self._host_tokens += ids.numel()

    def tokens(self, reset_device: bool = False) -> int:
        """Training tokens counted since train begin (one device->host read when a mask was summed).
        ``reset_device``: return only the device part and forget it (the caller adds it to the host part)."""
        if self._device_tokens is None:
            return 0 if reset_device else self._host_tokens
        on_device = int(self._device_tokens)
        if reset_device:
            self._device_tokens = None
            return on_device
        return self._host_tokens + on_device

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._cuda = torch.cuda.is_available() and torch.device(args.device).type == "cuda"
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(args.device)
        if model is not None and self._hook is None:
            self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)
        self._host_tokens = self._last_tokens = 0
        self._device_tokens = None
        self._last_time = self._start_time = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def peak_memory_bytes(self, device: Any = None) -> int | None:
        if self._cuda:
            return int(torch.cuda.max_memory_allocated(device))
        return _peak_rss_bytes()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self._hook is None:
            return
        peak = self.peak_memory_bytes(args.device)
        new: dict[str, float] = {}
        if peak is not None:
            new["hf_ddpfix/peak_mem_gb"] = round(peak / 2**30, 4)
        if "loss" in logs:  # the periodic training log: throughput over the interval since the last one
            now = time.perf_counter()
            dt = max(now - self._last_time, 1e-9)
            seen = self.tokens()
            tokens = seen - self._last_tokens
            self._last_time, self._last_tokens = now, seen
            new["hf_ddpfix/tokens_per_sec_rank"] = round(tokens / dt, 2)
            total = tokens / dt
            if self.cross_rank and _dist_world() > 1:
                mine = torch.tensor([(peak or 0) / 2**30, float(tokens), dt], dtype=torch.float64,
                                    device=_collective_device())
                gathered = [torch.empty_like(mine) for _ in range(_dist_world())]
                dist.all_gather(gathered, mine)
                rows = torch.stack(gathered).cpu()
                if peak is not None:
                    new["hf_ddpfix/peak_mem_gb_max"] = round(float(rows[:, 0].max()), 4)
                total = float(rows[:, 1].sum()) / max(float(rows[:, 2].max()), 1e-9)
            new["hf_ddpfix/tokens_per_sec"] = round(total, 2)
        elif "train_runtime" in logs:  # the end-of-training summary: this rank's whole-run average
            elapsed = max(time.perf_counter() - self._start_time, 1e-9)
            new["hf_ddpfix/tokens_per_sec_rank"] = round(self.tokens() / elapsed, 2)
        self.extras, self._extras_for = new, id(logs)
        if not self.in_history:
            return
        logs.update(new)
        # the Trainer copied `logs` into log_history before calling on_log: keep both in step
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == state.global_step and all(
            history[-1].get(k) == v for k, v in logs.items() if k not in new
        ):
            history[-1].update(new)

    def extras_for(self, logs: Any) -> dict[str, float]:
        """The values computed for this very `logs` dict (empty for any other)."""
        return self.extras if logs is not None and id(logs) == self._extras_for else {}

    def deliver_to(self, callbacks: list[Any], stack: ExitStack) -> None:
        """Make each of `callbacks` (reporters running after this one) receive `{**logs, **extras}` in
        `on_log`, as an instance-level wrapper undone through `stack`. `DefaultFlowCallback` and other
        hf_ddpfix callbacks are skipped."""
        for cb in callbacks:
            if cb is self or isinstance(cb, (DefaultFlowCallback, MemoryThroughputCallback)) or "on_log" in vars(cb):
                continue
            cb.on_log = self._with_extras(cb.on_log)
            stack.callback(vars(cb).pop, "on_log", None)

    def _with_extras(self, on_log: Any) -> Any:
        def wrapped(args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> Any:
            extra = self.extras_for(logs)
            return on_log(args, state, control, logs={**logs, **extra} if extra else logs, **kwargs)

        return wrapped


class FeatureCountsCallback(TrainerCallback):
    """Put the feature counts into the metrics `evaluate()` returns (while hf_ddpfix runs a `train()`).

    `Trainer.evaluate` logs its metrics (a copy goes into `state.log_history`) and then calls
    `on_evaluate` with the dict it returns: the counts are added there, so what the Trainer stores stays
    stock. Counts are this rank's, since the start of the current `train()` (`hf_ddpfix.runtime.feature_report`).
    """

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if isinstance(metrics, dict):
            from .runtime.feature_report import feature_metrics

            metrics.update(feature_metrics())


# ----------------------------------------------------------------------------------------------------
# Defaults and attaching
# ----------------------------------------------------------------------------------------------------


def default_callbacks(plan: Plan, config: DDPFixConfig | None = None) -> list[TrainerCallback]:
    """The callbacks hf_ddpfix runs by default ("on where cheap").

    - `PlanReportCallback` unless `log_plan=0`.
    - `ReplicaSyncCallback(sync_check_steps or DEFAULT_SYNC_CHECK_STEPS)` under multi-process DDP,
      unless `sync_check_steps=0`.
    - `MemoryThroughputCallback()` always (a forward pre-hook and, per log, one all-gather of 3 numbers).
    - `FeatureCountsCallback()` always (feature counts in the metrics `evaluate()` returns; no collective).
    """
    c = config or DDPFixConfig()
    out: list[TrainerCallback] = []
    if c.log_plan is not False:
        out.append(PlanReportCallback(plan))
    steps = DEFAULT_SYNC_CHECK_STEPS if c.sync_check_steps is None else int(c.sync_check_steps)
    if plan.parallel == "ddp" and plan.world_size > 1 and steps > 0:
        out.append(ReplicaSyncCallback(steps))
    out.append(MemoryThroughputCallback())
    out.append(FeatureCountsCallback())
    return out


def install_callbacks(trainer: Any, callbacks: list[TrainerCallback], stack: ExitStack) -> None:
    """Put `callbacks` first in `trainer`'s callback list for one `train()` call; removed via `stack`.

    First, so the values a `MemoryThroughputCallback` computes are ready when TensorBoard / W&B / the
    printer see `logs`: each of those receives an extended copy (log-only, see the callback's docstring).
    """
    handler_callbacks = trainer_callbacks(trainer)
    for cb in reversed(callbacks):
        handler_callbacks.insert(0, cb)
    for cb in callbacks:
        if isinstance(cb, MemoryThroughputCallback) and not cb.in_history:
            cb.deliver_to(list(handler_callbacks), stack)

    def remove() -> None:
        for cb in callbacks:
            if cb in handler_callbacks:
                handler_callbacks.remove(cb)

    stack.callback(remove)
