"""Which leaf tensors a backward will reach, and which tensors a region of code reads: pure autograd.

- :func:`reachable_leaf_ids`: walk the autograd graph from some outputs to the ``AccumulateGrad`` nodes
  (the parameters that will receive a gradient), optionally stopping at given nodes.
- :class:`ParamReadMode`: a ``TorchFunctionMode`` recording which watched tensors any torch function
  reads (used inside reentrant checkpoints, whose forward builds no graph).
- :func:`output_tensors`: every tensor in a nested output structure.

Used by :class:`hf_ddpfix.integrations.usage.ParameterUsage`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["ParamReadMode", "output_tensors", "reachable_leaf_ids", "reachable_leaf_ids_split"]


def output_tensors(x: Any) -> Iterable[torch.Tensor]:
    """Every tensor inside an output structure (ModelOutput / dict / list / tuple / tensor)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from output_tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from output_tensors(v)


def reachable_leaf_ids(roots: Iterable[torch.Tensor], stop: set[Any] | None = None) -> set[int]:
    """``id`` of every leaf tensor whose ``AccumulateGrad`` node backward from ``roots`` reaches.

    Args:
        roots: tensors to start from (those without ``grad_fn`` are leaves themselves).
        stop: autograd nodes not to walk past (a unit's inputs: what lies before it is not its own).

    Returns:
        The ids of the leaves that receive a gradient when ``roots`` are back-propagated.

    Guarantees: a parameter whose module ran but whose output was discarded is not in the set
    (tests/test_usage.py).
    """
    stop = stop or set()
    ids: set[int] = set()
    seen: set[Any] = set()
    stack = []
    for t in roots:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            ids.add(id(t))
    while stack:
        node = stack.pop()
        if node in seen or node in stop:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            ids.add(id(var))
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return ids


def reachable_leaf_ids_split(
    roots: Iterable[torch.Tensor], side_inputs: Callable[[Any], bool],
    passthrough: Callable[[Any], bool] = lambda node: False,
    real_nodes: set[Any] | None = None, side_nodes: set[Any] | None = None,
) -> tuple[set[int], set[int]]:
    """Leaves reached from ``roots``, split into those reached through real computation and those reached
    only through the side inputs of some nodes.

    Args:
        roots: tensors to start from (e.g. the loss given to ``backward``).
        side_inputs: true for a node whose inputs after the first carry no real gradient (an exact-zero
            tie, :class:`hf_ddpfix.ops.zero_tie.ZeroTie`): only its first input counts as real.
        passthrough: true for an identity node whose gradient of output ``i`` goes to input ``i`` only
            (DDP's ``_DDPSink``): walked through along the edge taken. Both predicates must depend on the
            node's type only (each is asked once per type).
        real_nodes / side_nodes: when given, filled with the autograd nodes the walk reached through real
            computation / only through side inputs (e.g. to tell whether a reentrant checkpoint's output
            node feeds the loss for real).

    Returns:
        ``(used, tied_only)``: ids of leaves some real path reaches, and ids of leaves reached only through
        side inputs. Their union is every leaf whose ``AccumulateGrad`` the backward of ``roots`` runs.

    Guarantees: each node is visited once (one walk); a leaf in ``used`` is never in ``tied_only``.
    """
    used: set[int] = set()
    seen: set[Any] = set()
    side: list[Any] = []
    stack = []
    # what a node is depends on its type only (AccumulateGrad, a side-input node, a pass-through): classified
    # once per type, so the walk makes no predicate call and no failing attribute lookup per node
    kinds: dict[type, int] = {}

    def kind(node: Any) -> int:
        cls = type(node)
        k = kinds.get(cls)
        if k is None:
            k = _LEAF if hasattr(node, "variable") else _PASS if passthrough(node) else _SIDE if side_inputs(node) else 0
            kinds[cls] = k
        return k

    def through(node: Any, output_nr: int) -> Any:
        while node is not None and kind(node) == _PASS:
            nexts = node.next_functions
            if output_nr >= len(nexts):
                return node  # not the layout expected: walk it whole (may over-count, never under-count)
            node, output_nr = nexts[output_nr]
        return node

    for t in roots:
        if t.grad_fn is not None:
            stack.append(through(t.grad_fn, t.output_nr))
        elif t.requires_grad:
            used.add(id(t))

    def walk(stack: list[Any], into: set[int], collect_side: bool) -> None:
        pop, push, add = stack.pop, stack.append, seen.add
        while stack:
            node = pop()
            if node is None or node in seen:
                continue
            add(node)
            k = kinds.get(type(node))
            if k is None:
                k = kind(node)
            if k == _LEAF:
                into.add(id(node.variable))
                continue
            nexts = node.next_functions
            if k == _SIDE and collect_side and nexts:
                side.extend(through(n, nr) for n, nr in nexts[1:] if n is not None)
                nexts = nexts[:1]
            for nxt, nr in nexts:
                if nxt is not None and nxt not in seen:
                    k = kinds.get(type(nxt))
                    if k is None:
                        k = kind(nxt)
                    push(through(nxt, nr) if k == _PASS else nxt)  # a pass-through: only the edge taken

    walk(stack, used, True)
    if real_nodes is not None:
        real_nodes.update(seen)
    before_side = set(seen) if side_nodes is not None else set()
    tied: set[int] = set()
    walk(side, tied, False)  # nodes already walked for real are not revisited: they stay "used"
    if side_nodes is not None:
        side_nodes.update(seen - before_side)
    return used, tied - used


_LEAF, _PASS, _SIDE = 1, 2, 3  # node kinds of `reachable_leaf_ids_split` (0: an ordinary node)


class ParamReadMode(TorchFunctionMode):
    """Records which watched tensors (by id) any torch function reads (args one level deep)."""

    def __init__(self, watched: set[int]):
        super().__init__()
        self.watched = watched
        self.seen: set[int] = set()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                if id(a) in self.watched:
                    self.seen.add(id(a))
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor) and id(b) in self.watched:
                        self.seen.add(id(b))
        return func(*args, **kwargs)
