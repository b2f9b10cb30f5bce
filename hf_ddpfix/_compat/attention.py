"""Attention-side contracts: which attention function a transformers module calls, and a scoped override.

Part of the contract layer (:mod:`hf_ddpfix._compat`): torch-only at module level.

transformers 5.x attention modules look their kernel up at call time:
``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)``
(checked by tests/test_upstream_contracts.py). ``config._attn_implementation`` is private; the registry is
public (``AttentionInterface``). The long-context layer patch reads what an attention module hands its
kernel (q, k, v after any q/k norm and rotary, and the kernel keywords) by overriding that entry for one
call (:func:`attention_function_override`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .models import (
    model_attn_implementation as attention_implementation,  # the one reader of the private name
)

__all__ = ["attention_function_override", "attention_implementation", "current_attention_function",
           "stock_attention_function"]


def stock_attention_function(implementation: str) -> Callable[..., Any] | None:
    """transformers' own function for ``implementation`` ("sdpa": ``sdpa_attention_forward``), or ``None``
    when it is not a registry key (``"eager"`` is each model's own ``eager_attention_forward``)."""
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface._global_mapping.get(implementation)


def current_attention_function(implementation: str) -> Callable[..., Any] | None:
    """What an attention module dispatching on ``implementation`` calls now (a local override, such as
    the sequence-parallel wrapper, first)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get(implementation)


class attention_function_override:  # noqa: N801 - used as a function-style context manager
    """Inside the ``with`` block, modules dispatching on ``implementation`` call ``fn`` (a local override on
    the shared interface); the previous local override (or none) is restored on exit, exceptions included."""

    def __init__(self, implementation: str, fn: Callable[..., Any]) -> None:
        self.implementation, self.fn = implementation, fn

    def __enter__(self) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.local = ALL_ATTENTION_FUNCTIONS._local_mapping
        self.had, self.previous = self.implementation in self.local, self.local.get(self.implementation)
        self.local[self.implementation] = self.fn

    def __exit__(self, *exc: object) -> None:
        if self.had:
            self.local[self.implementation] = self.previous
        else:
            self.local.pop(self.implementation, None)
