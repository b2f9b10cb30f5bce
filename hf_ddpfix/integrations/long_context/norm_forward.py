"""The patched forward of one RMSNorm (``rms_norm`` feature of :mod:`.long_context`).

A norm recognised at apply time (:func:`.layer_forms.rms_norm_form`: bit-identical to
:func:`hf_ddpfix.ops.rms_norm.rms_norm` in Llama's or Gemma's form) runs the op from its first call. A norm
whose weight has no values at apply time because ZeRO-3 partitioned it (an empty placeholder until
DeepSpeed's pre-forward hook gathers it) is checked the same way at its **first call**, where the weight is
gathered, on a random input, outside autocast and without a collective of its own; it then runs the op,
or stays stock for good with the reason counted once as a fallback.

Guarantees: a norm runs the op only after its output on a random input equalled stock's bit for bit on its
real weight; any other call (not one tensor) runs stock, counted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...ops.feature_counts import record_amount, record_fallback
from ...ops.rms_norm import rms_norm
from .layer_forms import rms_norm_form

__all__ = ["DEFERRED", "NormForward"]

#: The form :func:`.layer_forms.rms_norm_form` gives a ZeRO-3-partitioned norm: checked at its first call.
DEFERRED = "deferred"
FEATURE = "long_context"


class NormForward:
    """Instance-level forward of an RMSNorm running :func:`rms_norm` (``form``: ``"weight"``,
    ``"unit_offset"`` or :data:`DEFERRED`)."""

    def __init__(self, module: nn.Module, prev: Any, chunk_tokens: int, form: str) -> None:
        self.module = module
        self.prev = prev
        self.chunk_tokens = chunk_tokens
        self.form: str | None = form
        self.refusal: str | None = None  # a deferred check that failed: stock for good

    def _stock(self, *args: Any, **kwargs: Any) -> Any:
        m = self.module
        return (self.prev if self.prev is not None else type(m).forward.__get__(m))(*args, **kwargs)

    def _check_now(self, x: torch.Tensor) -> None:
        with torch.autocast(device_type=x.device.type, enabled=False):
            form, why = rms_norm_form(self.module, chunk_tokens=self.chunk_tokens, forward=self._stock)
        if form is None or form == DEFERRED:
            self.form, self.refusal = None, f"rms_norm (checked at first call): {why or 'not an RMSNorm'}"
            record_fallback(FEATURE, self.refusal)
        else:
            self.form = form
            record_amount(FEATURE, "rms_norm_checked_at_first_call", 1)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        m = self.module
        x = None
        if len(args) + len(kwargs) == 1:
            x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor):  # not the one-tensor call an RMSNorm takes: stock
            record_fallback(FEATURE, f"rms_norm: called with {len(args)} positional, keywords {sorted(kwargs)}")
            return self._stock(*args, **kwargs)
        if self.form == DEFERRED:
            self._check_now(x)
        if self.form is None:
            return self._stock(*args, **kwargs)
        record_amount(FEATURE, "rms_norm_calls", 1)
        return rms_norm(x, m.weight, getattr(m, "variance_epsilon", getattr(m, "eps", None)),
                        chunk_tokens=self.chunk_tokens, unit_offset=self.form == "unit_offset")
