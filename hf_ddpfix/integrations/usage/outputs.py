"""What one training forward did (:class:`UsageRecord`), and where a tie goes in a model's output.

Used by ``ParameterUsage`` (``integrations/usage/tracker.py``):

- :class:`UsageRecord`: the log record of the latest training forward. Parameter names are produced when
  read, not per forward (the hot path keeps slot indices only).
- :func:`anchor_of`: the output tensor that carries the loss (``loss``, else ``logits``, else the first
  float tensor that requires grad).
- :func:`replace_in`: the output with that tensor replaced by its tied copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..._compat import is_namedtuple
from .scopes import ParamSlot

__all__ = ["UsageRecord", "anchor_of", "replace_in"]


class UsageRecord:
    """What one training forward did (for logs and tests).

    Attributes:
        used: names of trainable parameters that receive a gradient from the forward itself (from the
            forward's own observation, else from the loss given to backward).
        tied: names tied in with an exact-zero gradient at the forward's output.
        region_used: the subset of ``used`` observed only inside reentrant checkpointed layers.
        tied_at_loss: names tied into the loss given to backward (``ParameterUsage.tie_loss``).
        seconds: time spent observing and tying.
    """

    def __init__(self, slots: Sequence[ParamSlot] = ()) -> None:
        self._slots = slots
        self.used_slots: set[int] = set()  # slot indices; names on demand (`used`)
        self.tied: list[str] = []
        self.region_used: list[str] = []
        self.tied_at_loss: list[str] = []
        self.seconds = 0.0

    @property
    def used(self) -> list[str]:
        return [s.name for i, s in enumerate(self._slots) if i in self.used_slots]

    def __repr__(self) -> str:
        return (f"UsageRecord(used={len(self.used_slots)}, tied={self.tied[:4]}, region_used={len(self.region_used)}, "
                f"tied_at_loss={self.tied_at_loss[:4]}, seconds={self.seconds:.4f})")


def anchor_of(output: Any) -> torch.Tensor | None:
    """The output tensor that carries the loss: ``loss``, else ``logits``, else the first float tensor
    that requires grad."""
    if isinstance(output, dict):
        for key in ("loss", "logits"):
            val = output.get(key)
            if isinstance(val, torch.Tensor) and val.requires_grad:
                return val
    top = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    for t in top:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
            return t
    return None


def replace_in(output: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    """``output`` with ``old`` (``output`` itself, or a top-level entry of a dict / tuple / list) replaced by ``new``."""
    if output is old:
        return new
    if isinstance(output, dict):  # ModelOutput: setting a key updates the attribute too
        for k, v in output.items():
            if v is old:
                output[k] = new
                return output
    if isinstance(output, (tuple, list)):
        for i, v in enumerate(output):
            if v is old:
                items = list(output)
                items[i] = new
                if isinstance(output, list):
                    return items
                return type(output)(*items) if is_namedtuple(output) else tuple(items)
    raise TypeError(f"hf_ddpfix: cannot tie into a {type(output).__name__} output")
