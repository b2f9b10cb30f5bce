"""Stock DDP's optimizer semantics over flat partitions: a parameter no rank used is left out of the step.

Stock DDP (``find_unused_parameters=True``) leaves the gradient of a parameter that no rank used in an
optimizer step ``None``; ``torch.optim.AdamW`` then skips it: its weights, ``exp_avg`` / ``exp_avg_sq``
and its *own* step count stay as they were. ZeRO-1/2/3 optimizers step flat fp32 partitions holding many
parameters at once (a zero gradient where none was computed): AdamW moves the unused elements by weight
decay and momentum, and the one step count of the flat tensor advances for every element.

:class:`SkipUnusedSteps` restores that per parameter, around each step of the inner optimizer:

- **before** the step, for every slice (:class:`FlatSlice`: the elements of one parameter in a flat tensor
  the optimizer is about to step) whose parameter no rank used, it copies the slice of the flat tensor and
  of every optimizer state tensor of the flat tensor's shape (``exp_avg``, ``exp_avg_sq``; a state not
  created yet counts as zeros, Adam's initial value);
- **after** the step it writes those copies back (the parameter and its optimizer state untouched), and
  counts one skipped step for the parameter;
- a parameter that skipped ``k`` steps and is used again has taken ``T - k`` steps of its own when the
  flat tensor's count is ``T``; AdamW's bias correction ``1 - beta ** step`` then differs. For
  ``torch.optim.Adam`` / ``AdamW`` (the Trainer's default optimizer) the slice is recomputed from its
  pre-step value and the new moments with its own count (:func:`adam_update_`), the formula of
  ``torch.optim.adamw``. Other optimizers are refused (:func:`unsupported_reason`).

Pure torch: no process group, no DeepSpeed. The caller says which parameters no rank used (one
all-reduce per step, made by the caller) and which flat tensors are stepped.

Guarantees: over a flat AdamW on concatenated parameters, with the mask of the parameters whose
gradient stock DDP would leave ``None``, every parameter and its ``exp_avg`` / ``exp_avg_sq`` end equal
(1e-6 relative in fp32, the fused and the for-loop kernels round differently) to per-parameter
``torch.optim.AdamW`` skipping them, whatever the order of used and skipped steps
(tests/test_skip_unused.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FlatSlice", "SkipUnusedSteps", "adam_update_", "unsupported_reason"]


@dataclass(frozen=True)
class FlatSlice:
    """Elements ``[start, start + numel)`` of ``flat`` (a 1-D tensor the optimizer steps) hold part or all
    of parameter ``index`` (an index into the caller's parameter list)."""

    index: int
    flat: torch.Tensor
    start: int
    numel: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The same elements of ``tensor`` (a tensor of ``flat``'s shape): a view."""
        return tensor.narrow(0, self.start, self.numel)


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why :class:`SkipUnusedSteps` cannot give ``optimizer`` stock DDP's per-parameter semantics, or ``None``.

    Supported: ``torch.optim.Adam`` and ``torch.optim.AdamW`` (for-loop, foreach or fused kernel) without
    ``amsgrad``, ``maximize`` or ``capturable``: their state is ``step`` plus per-element moments that
    start at zero, and their update can be recomputed with a per-parameter step count.
    """
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam (torch >= 2.7)
        return (f"{type(optimizer).__module__}.{type(optimizer).__qualname__} is not torch.optim.Adam/AdamW (the "
                "per-parameter step count and state initialisation are known only for those)")
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag):
                return f"AdamW with {flag}=True is not supported"
    return None


def adam_update_(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: float,
                 lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool) -> None:
    """In place: ``param`` (its value before the step) becomes what ``torch.optim.Adam/AdamW`` gives it
    when its moments after the step are ``exp_avg`` / ``exp_avg_sq`` and its own step count is ``step``.

    The moments already hold this step's gradient (and, for Adam, the L2 term); only the weight decay and
    the bias-corrected update are applied here, in ``torch.optim.adamw``'s order.
    """
    if decoupled and weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def _step_count(optimizer: torch.optim.Optimizer, flat: torch.Tensor) -> float | None:
    value = optimizer.state.get(flat, {}).get("step")
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _moment_keys(state: dict[str, Any], flat: torch.Tensor) -> list[str]:
    return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == flat.shape]


@dataclass
class _Saved:
    slice: FlatSlice
    weights: torch.Tensor
    state: dict[str, torch.Tensor]  # moment name -> slice copy (absent: the state did not exist yet)
    used: bool


class SkipUnusedSteps:
    """Around each step of ``optimizer`` (an Adam/AdamW over flat tensors): restore the slices of the
    parameters no rank used, and recompute the bias correction of those used again after skipping.

    Args:
        optimizer: the inner optimizer (its ``param_groups`` hold the flat tensors).
        slices: every slice of a trainable parameter held by this rank's flat tensors.
        n_params: the length of the ``used`` masks given to :meth:`before_step`.

    Raises:
        ValueError: ``optimizer`` is not supported (:func:`unsupported_reason`).

    Call :meth:`before_step` with the flat tensors about to be stepped and :meth:`after_step` right after
    (``torch.optim.Optimizer.register_step_pre_hook`` / ``register_step_post_hook`` do it).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, slices: Sequence[FlatSlice], n_params: int) -> None:
        reason = unsupported_reason(optimizer)
        if reason:
            raise ValueError(reason)
        self.optimizer = optimizer
        self.by_flat: dict[int, list[FlatSlice]] = {}
        for s in slices:
            self.by_flat.setdefault(id(s.flat), []).append(s)
        self.skipped = torch.zeros(n_params, dtype=torch.long)  # steps each parameter skipped so far
        self._saved: list[tuple[torch.Tensor, float | None, list[_Saved]]] = []
        self.restored_elements = 0  # elements written back (weights), over all steps
        self.recomputed_elements = 0  # elements whose bias correction used their own step count
        self.steps = 0

    def stepped_flats(self) -> list[torch.Tensor]:
        """The flat tensors the next ``optimizer.step()`` updates (those in its param groups now)."""
        return [p for g in self.optimizer.param_groups for p in g["params"] if id(p) in self.by_flat]

    def before_step(self, flats: Iterable[torch.Tensor], used: torch.Tensor) -> None:
        """Copy what :meth:`after_step` needs: the slices of unused parameters (weights and moments), and
        the pre-step weights of used parameters that skipped steps before.

        Args:
            flats: the flat tensors about to be stepped.
            used: bool, one per parameter: some rank used it in this optimizer step (agreed by the caller).
        """
        self._saved = []
        for flat in flats:
            state = self.optimizer.state.get(flat, {})
            keys = _moment_keys(state, flat)
            saved = []
            for s in self.by_flat.get(id(flat), []):
                if s.numel == 0:
                    continue
                was_used = bool(used[s.index])
                if was_used and int(self.skipped[s.index]) == 0:
                    continue
                moments = {k: s.of(state[k]).clone() for k in keys} if not was_used else {}
                saved.append(_Saved(s, s.of(flat.data).clone(), moments, was_used))
            self._saved.append((flat, _step_count(self.optimizer, flat), saved))

    def after_step(self) -> None:
        """Write back the unused slices; recompute the used slices with their own step count."""
        counted: set[int] = set()
        for flat, before, saved in self._saved:
            after = _step_count(self.optimizer, flat)
            if before is not None and after is not None and after <= before:
                continue  # the optimizer skipped this tensor (e.g. no gradient): nothing moved
            group = next(g for g in self.optimizer.param_groups if any(p is flat for p in g["params"]))
            state = self.optimizer.state.get(flat, {})
            keys = _moment_keys(state, flat)
            for item in saved:
                s = item.slice
                if not item.used:
                    s.of(flat.data).copy_(item.weights)
                    for k in keys:
                        if k in item.state:
                            s.of(state[k]).copy_(item.state[k])
                        else:  # created by this step: a parameter never stepped has zero moments
                            s.of(state[k]).zero_()
                    self.restored_elements += s.numel
                    if s.index not in counted:
                        counted.add(s.index)
                        self.skipped[s.index] += 1
                    continue
                own = (after or 0.0) - int(self.skipped[s.index])
                weights = item.weights
                beta1, beta2 = group["betas"]
                adam_update_(weights, s.of(state["exp_avg"]), s.of(state["exp_avg_sq"]), step=own, lr=float(group["lr"]),
                             beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                             weight_decay=float(group["weight_decay"]),
                             decoupled=bool(group.get("decoupled_weight_decay", False)))
                s.of(flat.data).copy_(weights)
                self.recomputed_elements += s.numel
        self._saved = []
        self.steps += 1
