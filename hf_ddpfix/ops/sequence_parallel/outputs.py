"""What a model's outputs hold: every tensor, however nested (pure, no collective).

Under sequence parallelism each rank's forward returns outputs of its own slice of the group's padded batch. The
evaluation / prediction path (``integrations/sequence_parallel/trainer.py``) makes the loss and the logits whole;
any other output a caller receives must be made whole too or the call must run unsharded. A check that looks only
at top-level tensors misses ``hidden_states`` / ``attentions`` (tuples of ``[B, s, ...]``), a KV ``Cache`` object,
a dict or a dataclass of tensors. :func:`held_tensors` finds them all.

Usage::

    held = held_tensors({k: v for k, v in outputs.items() if k not in ("loss", "logits")})
    if held:  # e.g. ["hidden_states[0]", "hidden_states[1]", "past_key_values.layers[0].keys"]
        ...   # make them whole, or run the call unsharded (counted, with the names)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["held_tensors"]

#: Values that hold no tensor.
_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, type)
#: Deeper than this, a value counts as holding a tensor (it cannot be shown not to).
MAX_DEPTH = 12


def held_tensors(value: Any, path: str = "", *, limit: int = 8) -> list[str]:
    """The paths of the tensors ``value`` holds, in order, at most ``limit`` of them.

    Walks mappings (a ``ModelOutput`` is one), lists, tuples and sets, dataclasses and any other object's attributes
    (``vars()`` / ``__slots__``, e.g. a ``DynamicCache`` and its layers). An object that cannot be looked into (no
    attributes, not a known leaf such as ``None``, a number or a string), or nesting deeper than ``MAX_DEPTH``, is
    reported as if it held a tensor, with its type in the path: the caller cannot show it is safe.

    Args:
        value: what to search (e.g. a model's outputs without ``loss`` and ``logits``).
        path: the name of ``value`` in the returned paths (``""`` for a top-level mapping: its keys alone).
        limit: stop after this many paths.

    Returns:
        e.g. ``["hidden_states[0]", "past_key_values.layers[0].keys"]``; ``[]`` when ``value`` holds no tensor.

    Guarantees: a tensor anywhere in ``value`` (a cycle visited once) yields a non-empty result.
    """
    found: list[str] = []
    _walk(value, path, found, limit, set(), 0)
    return found


def _walk(value: Any, path: str, found: list[str], limit: int, seen: set[int], depth: int) -> None:
    if len(found) >= limit or isinstance(value, _LEAVES):
        return
    if torch.is_tensor(value):
        found.append(path or "<tensor>")
        return
    if id(value) in seen:
        return
    seen.add(id(value))
    if depth > MAX_DEPTH:
        found.append(f"{path} ({type(value).__name__} nested too deep to inspect)")
        return
    if isinstance(value, Mapping):
        items = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif isinstance(value, (set, frozenset)):
        items = [(f"{path}{{}}", v) for v in value]
    elif dataclasses.is_dataclass(value):
        items = [(f"{path}.{f.name}", getattr(value, f.name, None)) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__") or hasattr(type(value), "__slots__"):
        attrs = dict(vars(value)) if hasattr(value, "__dict__") else {}
        for cls in type(value).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if isinstance(slot, str) and slot not in attrs and hasattr(value, slot):
                    attrs[slot] = getattr(value, slot)
        items = [(f"{path}.{k}", v) for k, v in attrs.items()]
    else:
        found.append(f"{path} ({type(value).__name__}, cannot be inspected)")
        return
    for sub_path, sub in items:
        _walk(sub, sub_path, found, limit, seen, depth + 1)
