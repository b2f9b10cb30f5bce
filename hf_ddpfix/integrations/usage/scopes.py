"""Where each trainable parameter lives, and which forward output receives its tie (FSDP2 units).

``ParameterUsage`` (``integrations/usage/tracker.py``) addresses a trainable parameter by *slot*: the module
and attribute that hold it, not the tensor object, because FSDP2 swaps the unsharded and the sharded
tensor in and out of the same attribute. A *scope* is a module whose forward output receives the ties
for the slots it owns: the root module alone, or one per FSDP2 unit (a module passed to
``fully_shard``) plus the root for what no unit owns.

Contract:
    - :func:`collect_slots`: one slot per distinct trainable tensor, in ``named_modules()`` order,
      named as ``named_parameters()`` spells it.
    - :func:`build_scopes`: every slot is owned by exactly one scope, the innermost unit that contains
      its module (the root when none does); the root is always a scope.
    - :func:`unit_pre_hook`: a unit's inputs are where its own graph starts (the walk stops there).
      With several units, a floating input that needs no grad is made a leaf that requires grad on
      every rank, so FSDP2's reduce-scatter order is the same on every rank (its gradient is
      computed and dropped; parameter gradients are unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..._compat import module_parameter_slots
from ...ops.autograd_reach import output_tensors

__all__ = ["ParamSlot", "Scope", "build_scopes", "collect_slots", "unit_pre_hook"]

# Keyword inputs of a unit that carry the hidden states (the floating inputs aligned across ranks).
_HIDDEN_INPUTS = ("hidden_states", "inputs_embeds", "x")


@dataclass(frozen=True)
class ParamSlot:
    """One trainable parameter, addressed by where it lives (FSDP2 swaps the tensor object in and out)."""

    module: nn.Module
    attr: str
    name: str  # as ``model.named_parameters()`` spells it
    module_name: str

    def tensor(self) -> torch.Tensor | None:
        return module_parameter_slots(self.module).get(self.attr)


class Scope:
    """A module whose forward output receives the ties for the slots it owns (the root, or one FSDP unit).

    Attributes:
        module: the root or the unit.
        slots: indices into the slot list of the slots it owns.
        stop: autograd nodes of its inputs in the current forward (the graph walk stops there).
    """

    def __init__(self, module: nn.Module, slots: list[int]):
        self.module = module
        self.slots = slots
        self.stop: set[Any] = set()


def collect_slots(root: nn.Module) -> list[ParamSlot]:
    """Every distinct trainable tensor under ``root`` as a slot."""
    names = {id(p): n for n, p in root.named_parameters()}
    seen: set[int] = set()
    slots = []
    for mname, mod in root.named_modules():
        for attr, p in module_parameter_slots(mod).items():
            if p is None or not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            slots.append(ParamSlot(mod, attr, names.get(id(p), f"{mname}.{attr}".lstrip(".")), mname))
    return slots


def build_scopes(root: nn.Module, slots: list[ParamSlot], units: list[nn.Module]) -> list[Scope]:
    """One scope per unit (the root added when missing), each owning the slots of the modules it contains
    and no inner unit does; in the order of ``units``."""
    if not any(u is root for u in units):
        units = [*units, root]
    unit_ids = {id(u) for u in units}
    owner: dict[int, nn.Module] = {}

    def visit(mod: nn.Module, current: nn.Module) -> None:
        current = mod if id(mod) in unit_ids else current
        owner[id(mod)] = current
        for child in mod.children():
            visit(child, current)

    visit(root, root)
    scopes = {id(u): Scope(u, []) for u in units}
    for i, s in enumerate(slots):
        scopes[id(owner[id(s.module)])].slots.append(i)
    return [scopes[id(u)] for u in units]


def unit_pre_hook(scope: Scope, active: Callable[[], bool], several_units: bool) -> Callable[..., Any]:
    """A forward pre-hook (``with_kwargs=True``) for a unit: records where the unit's graph starts and,
    with ``several_units``, aligns its floating inputs across ranks. Under FSDP2 a floating input that
    needs no grad on one rank (text-only: ``inputs_embeds`` of a frozen embedding) but does on another
    (image features scattered in) would move the unit's post-backward reduce-scatter to the end of
    backward on that rank only: a collective-order mismatch. Does nothing while ``active()`` is False."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not active():
            return None
        changed = False

        def align(x: Any) -> Any:
            nonlocal changed
            if isinstance(x, torch.Tensor) and x.is_floating_point() and not x.requires_grad:
                changed = True
                return x.detach().requires_grad_()
            return x

        if several_units:
            args = tuple(align(a) for a in args)
            kwargs = {k: align(v) if k in _HIDDEN_INPUTS else v for k, v in kwargs.items()}
        scope.stop = {t.grad_fn for t in (*output_tensors(args), *output_tensors(kwargs)) if t.grad_fn is not None}
        return (args, kwargs) if changed else None

    return hook
