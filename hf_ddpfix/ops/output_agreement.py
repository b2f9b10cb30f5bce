"""One structure for the prediction fields of a model's outputs on every rank and every evaluation step.

Problem (REFERENCES.md §14): the Trainer's ``evaluation_loop`` turns each forward's outputs (minus ``loss`` and its
``ignore_keys``) into a tuple and runs ``pad_across_processes`` then ``gather_for_metrics`` over every tensor in
it. A field present on some ranks only (transformers 5.24's ``image_outputs``, 5.23's ``image_hidden_states`` of
LLaVA, Gemma 3, Idefics2, InternVL: set only when the batch had an image) makes the ranks issue different
collectives (gloo "448 vs 8" bytes, NCCL a hang); a field whose nesting holds ``None`` (5.24's
``image_outputs.hidden_states``) cannot be gathered at all; a field present at one step and absent at the next
shifts the tuple positions that ``EvalLoopContainer`` concatenates step by step (silently misaligned).

Rule (pure, no collective: the caller exchanges :meth:`OutputAgreement.describe`'s small signatures):

- the **kept fields** of an evaluation are fixed at its first step: those every rank produces with the same
  structure (nesting, dtypes, numbers of dimensions) and that hold only tensors; every other field is dropped on
  every rank at every step (:attr:`OutputAgreement.dropped` says which and why);
- at later steps a kept field is handed over on every rank with the structure it had at the first step: a rank
  that lacks it (or has it with another structure) hands a placeholder of the Trainer's padding value -100, and
  every dimension but 1 (which the Trainer pads itself) is padded with -100 to the largest over the ranks;
- when nothing differs (the usual case, and always with one rank) the output object is returned untouched.

The signatures are exchanged once, at an evaluation's first step (per forward index); later steps use
:meth:`OutputAgreement.apply_local`, which needs no other rank: it hands over exactly the kept fields in the kept
structure (a placeholder of the kept structure, sized 0 in dimensions 0 and 1, where this rank lacks one) and
leaves the sizes to :func:`pad_all_dims`, the Trainer's own ``pad_across_processes`` padding every dimension to the
largest over the ranks from the sizes it gathers anyway (issue 48: one ``all_gather_object`` per step before).

Guarantees: ranks that pass the same list of signatures get outputs whose kept fields have identical structure and
identical shapes in every dimension but 1, the same kept fields at every step of one agreement; an output whose
fields agree on every rank is returned as the same object (tests/test_eval_outputs.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PAD", "OutputAgreement", "Signature", "describe", "gatherable", "pad_all_dims"]

#: The value the Trainer pads predictions with (``EvalLoopContainer(padding_index=-100)``,
#: ``pad_across_processes(pad_index=-100)``): a placeholder or a padded row reads as "no prediction here".
PAD = -100
#: Nesting deeper than this is not inspected: the field counts as not gatherable.
MAX_DEPTH = 12

#: ``("t", dtype, shape)`` a tensor; ``("seq", (child, ...))`` a tuple or list; ``("map", ((key, child), ...))`` a
#: mapping (a ``ModelOutput`` is one); ``("x", type name)`` anything the Trainer's gather cannot take (``None`` inside
#: a tuple, a ``Cache``, a string). Plain tuples of strings and ints: cheap to pickle, equal across ranks.
Signature = tuple


def describe(value: Any, depth: int = 0) -> Signature:
    """The signature of ``value`` (see :data:`Signature`); never raises."""
    if torch.is_tensor(value):
        return ("t", str(value.dtype).removeprefix("torch."), tuple(int(s) for s in value.shape))
    if depth > MAX_DEPTH:
        return ("x", f"{type(value).__name__} nested too deep")
    if isinstance(value, Mapping):
        return ("map", tuple((str(k), describe(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return ("seq", tuple(describe(v, depth + 1) for v in value))
    return ("x", type(value).__name__)


def _structure(sig: Signature) -> Signature:
    """``sig`` with every tensor's shape replaced by its number of dimensions (what must agree across ranks)."""
    kind = sig[0]
    if kind == "t":
        return ("t", sig[1], len(sig[2]))
    if kind == "seq":
        return ("seq", tuple(_structure(c) for c in sig[1]))
    if kind == "map":
        return ("map", tuple((k, _structure(c)) for k, c in sig[1]))
    return sig


def gatherable(sig: Signature) -> bool:
    """True when ``sig`` holds only tensors in tuples, lists and mappings (what the Trainer's gather takes)."""
    kind = sig[0]
    if kind == "t":
        return True
    if kind == "seq":
        return all(gatherable(c) for c in sig[1])
    if kind == "map":
        return all(gatherable(c) for _, c in sig[1])
    return False


def _not_gatherable(sig: Signature) -> str:
    """The first thing in ``sig`` the gather cannot take, e.g. ``NoneType`` or ``DynamicCache``."""
    kind = sig[0]
    if kind == "x":
        return str(sig[1])
    children = sig[1] if kind == "seq" else [c for _, c in sig[1]] if kind == "map" else []
    return next((_not_gatherable(c) for c in children if not gatherable(c)), "")


def _max_shapes(sigs: list[Signature]) -> Signature:
    """One signature of the common structure whose tensor shapes are the per-dimension maxima of ``sigs``."""
    first = sigs[0]
    kind = first[0]
    if kind == "t":
        shape = tuple(max(s[2][d] for s in sigs) for d in range(len(first[2])))
        return ("t", first[1], shape)
    if kind == "seq":
        return ("seq", tuple(_max_shapes([s[1][i] for s in sigs]) for i in range(len(first[1]))))
    return ("map", tuple((k, _max_shapes([s[1][i][1] for s in sigs])) for i, (k, _) in enumerate(first[1])))


def _dtype(name: str) -> torch.dtype:
    got = getattr(torch, name, None)
    return got if isinstance(got, torch.dtype) else torch.float32


def _fill(dtype: torch.dtype) -> int | bool:
    """-100 where the dtype holds it (floats, signed integers); 0 / False otherwise."""
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point or dtype.is_complex or dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        return PAD
    return 0


def _types(value: Any) -> Any:
    """The container classes of ``value`` (``None`` for a tensor): placeholders are built of the same classes, as the
    Trainer's step-to-step concatenation (``nested_concat``) requires."""
    if isinstance(value, Mapping):
        return (type(value), {k: _types(v) for k, v in value.items()})
    if isinstance(value, (tuple, list)):
        return (type(value), [_types(v) for v in value])
    return None


def _placeholder(target: Signature, device: torch.device, types: Any = None) -> Any:
    kind = target[0]
    if kind == "t":
        dtype = _dtype(target[1])
        return torch.full(target[2], _fill(dtype), dtype=dtype, device=device)
    cls, sub = types if types is not None else (None, None)
    if kind == "seq":
        items = [_placeholder(c, device, sub[i] if sub else None) for i, c in enumerate(target[1])]
        return cls(items) if cls in (tuple, list) else tuple(items)
    values = {k: _placeholder(c, device, sub.get(k) if sub else None) for k, c in target[1]}
    return _rebuild_as(cls, values) if cls is not None else values


def _empty_placeholder(first: Signature) -> Signature:
    """A placeholder of ``first``'s structure whose tensors are sized 0 in dimensions 0 and 1 (the rest as at the
    first step): padded to the other ranks' sizes with -100 by :func:`pad_all_dims`."""
    kind = first[0]
    if kind == "t":
        shape = tuple(0 if d < 2 else n for d, n in enumerate(first[2]))
        return ("t", first[1], shape)
    if kind == "seq":
        return ("seq", tuple(_empty_placeholder(c) for c in first[1]))
    return ("map", tuple((k, _empty_placeholder(c)) for k, c in first[1]))


def pad_all_dims(tensor: torch.Tensor, sizes: list[list[int]], dim: int, pad_index: Any,
                 pad_first: bool = False) -> tuple[torch.Tensor, bool]:
    """``tensor`` padded with ``pad_index`` to the largest size over the ranks in every dimension (``sizes``: every
    rank's shape, as ``pad_across_processes`` gathers them), at the start of ``dim`` when ``pad_first``, else at the
    end; returns it and whether it was padded in a dimension other than ``dim`` (stock pads ``dim`` only, so where
    those agree the result is stock's)."""
    shape = list(tensor.shape)
    want = [max(int(s[d]) for s in sizes) for d in range(len(shape))]
    if want == shape:
        return tensor, False
    out = tensor.new_zeros(tuple(want)) + pad_index
    index = tuple(slice(want[d] - shape[d], want[d]) if (d == dim and pad_first) else slice(0, shape[d])
                  for d in range(len(shape)))
    out[index] = tensor
    return out, any(w != n for d, (w, n) in enumerate(zip(want, shape, strict=True)) if d != dim)


def _pad(value: Any, target: Signature) -> tuple[Any, int]:
    """``value`` with every tensor padded (-100, at the end) to ``target``'s shape in every dimension but 1;
    returns it and how many tensors were padded (``value`` itself when none was)."""
    kind = target[0]
    if kind == "t":
        shape = tuple(value.shape)
        want = tuple(shape[d] if d == 1 else max(shape[d], target[2][d]) for d in range(len(shape)))
        if want == shape:
            return value, 0
        out = value.new_full(want, _fill(value.dtype))
        out[tuple(slice(0, s) for s in shape)] = value
        return out, 1
    if kind == "seq":
        parts = [_pad(v, t) for v, t in zip(value, target[1], strict=True)]
        if not any(n for _, n in parts):
            return value, 0
        return type(value)(p for p, _ in parts), sum(n for _, n in parts)
    padded = {k: _pad(value[k], t) for k, t in target[1]}
    n = sum(c for _, c in padded.values())
    if not n:
        return value, 0
    return _rebuild(value, {k: v for k, (v, _) in padded.items()}), n


def _rebuild(output: Mapping[str, Any], values: dict[str, Any]) -> Any:
    """A mapping of ``output``'s type holding ``values`` (a ``ModelOutput`` dataclass: built from its fields, so
    the key order is the dataclass's on every rank); a plain ``dict`` when the type cannot be built so."""
    return _rebuild_as(type(output), values)


def _rebuild_as(cls: type, values: dict[str, Any]) -> Any:
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
        if set(values) <= names:
            return cls(**values)
    try:
        return cls(values)
    except Exception:  # noqa: BLE001 - a mapping type that cannot be built from a dict: a dict
        return dict(values)


@dataclass
class OutputAgreement:
    """The per-evaluation state: which fields are kept (per forward index within a step) and what was done.

    Usage, on every rank, for each forward whose outputs the Trainer gathers::

        sigs = all_gather_object(agreement.describe(output))   # one small collective
        output = agreement.apply(output, sigs, index)          # same structure on every rank

    Args:
        rank: this process's index into the exchanged signatures.
        skip: keys left alone (``loss`` and the Trainer's ``ignore_keys``: never gathered as predictions).
    """

    rank: int
    skip: Collection[str] = ()
    kept: dict[int, dict[str, Signature]] = field(default_factory=dict)  # index -> field -> first-step signature
    kept_types: dict[int, dict[str, Any]] = field(default_factory=dict)  # index -> field -> this rank's classes
    dropped: dict[str, str] = field(default_factory=dict)  # field -> why (first reason seen)
    forwards: int = 0  # forwards agreed
    changed: int = 0  # forwards whose output was rebuilt
    placeholders: int = 0  # kept fields a rank lacked at a later step (filled with -100)
    padded: int = 0  # tensors padded in a dimension other than 1
    not_mappings: int = 0  # forwards whose output was no mapping (a tuple): left to stock

    def describe(self, output: Any) -> dict[str, Signature] | None:
        """This rank's signatures of ``output``'s candidate prediction fields (``None`` values are not fields:
        ``ModelOutput.items()`` leaves them out), or ``None`` when ``output`` is not a mapping."""
        if not isinstance(output, Mapping):
            return None
        return {str(k): describe(v) for k, v in output.items() if k not in self.skip and k != "loss" and v is not None}

    def apply(self, output: Any, sigs: list[dict[str, Signature] | None], index: int = 0) -> Any:
        """``output`` with exactly the kept fields, in the kept structure (see the module docstring).

        Args:
            output: this rank's forward output.
            sigs: every rank's :meth:`describe` of its output, by rank.
            index: which forward of the evaluation step this is (a trainer may run several per step).
        """
        self.forwards += 1
        if any(s is None for s in sigs):
            self.not_mappings += 1
            return output
        ranks: list[dict[str, Signature]] = [s for s in sigs if s is not None]
        if index not in self.kept:
            self.kept[index] = self._first_step(ranks)
            self.kept_types[index] = {k: _types(output[k]) for k in self.kept[index]}  # every rank has each one
        kept = self.kept[index]
        mine = ranks[self.rank]
        changed = self._drop_unkept(mine, kept)
        values: dict[str, Any] = {}
        device = next((v.device for v in output.values() if torch.is_tensor(v)), torch.device("cpu"))
        for k, first in kept.items():
            structure = _structure(first)
            have = [r[k] for r in ranks if k in r and _structure(r[k]) == structure]
            target = _max_shapes(have or [first])
            if k in mine and _structure(mine[k]) == structure:
                values[k], n = _pad(output[k], target)
                self.padded += n
                changed |= bool(n)
            else:
                values[k] = _placeholder(target, device, self.kept_types[index].get(k))
                self.placeholders += 1
                changed = True
        if not changed:
            return output
        return self._rebuilt(output, values)

    def agreed(self, index: int) -> bool:
        """True once the kept fields of forward ``index`` are fixed (its first step exchanged the signatures)."""
        return index in self.kept

    def apply_local(self, output: Any, index: int = 0) -> Any:
        """A later step's ``output`` with exactly the kept fields of forward ``index`` in their kept structure, from
        this rank alone (no exchange): a field not kept is left out, a kept field this rank lacks (or has with
        another structure) becomes a -100 placeholder sized 0 in dimensions 0 and 1, which the Trainer's padding
        (:func:`pad_all_dims` behind ``pad_across_processes``) grows to the other ranks' sizes. ``output``
        itself when it holds exactly the kept fields in the kept structure. Call only where :meth:`agreed`."""
        self.forwards += 1
        if not isinstance(output, Mapping):
            self.not_mappings += 1
            return output
        kept = self.kept[index]
        mine = {k: describe(v) for k, v in output.items() if k not in self.skip and k != "loss" and v is not None}
        changed = self._drop_unkept(mine, kept)
        values: dict[str, Any] = {}
        device = next((v.device for v in output.values() if torch.is_tensor(v)), torch.device("cpu"))
        for k, first in kept.items():
            if k in mine and _structure(mine[k]) == _structure(first):
                values[k] = output[k]
            else:
                values[k] = _placeholder(_empty_placeholder(first), device, self.kept_types[index].get(k))
                self.placeholders += 1
                changed = True
        if not changed:
            return output
        return self._rebuilt(output, values)

    def _drop_unkept(self, mine: Mapping[str, Any], kept: Mapping[str, Any]) -> bool:
        """Note each field of this rank's output not kept (the reason, once); whether there was one."""
        for k in mine:
            if k not in kept and k not in self.dropped:
                self.dropped[k] = "not produced on every rank at the first evaluation step"
        return any(k not in kept for k in mine)

    def _rebuilt(self, output: Any, values: dict[str, Any]) -> Any:
        """``output`` as a dict of its loss, ``values`` (the kept fields in order) and the fields it skips."""
        self.changed += 1
        loss = {k: v for k, v in output.items() if k == "loss"}
        ignored = {k: v for k, v in output.items() if k in self.skip and k != "loss"}
        return _rebuild(output, {**loss, **values, **ignored})

    def _first_step(self, ranks: list[dict[str, Signature]]) -> dict[str, Signature]:
        kept: dict[str, Signature] = {}
        order = list(dict.fromkeys(k for r in ranks for k in r))
        for k in order:
            missing = [i for i, r in enumerate(ranks) if k not in r]
            if missing:
                self.dropped.setdefault(k, f"absent on rank {missing[0]} at the first evaluation step")
                continue
            sig = ranks[0][k]
            other = next((i for i, r in enumerate(ranks) if _structure(r[k]) != _structure(sig)), None)
            if other is not None:
                self.dropped.setdefault(k, f"structure differs on rank {other} at the first evaluation step")
            elif not gatherable(sig):
                self.dropped.setdefault(k, f"holds a {_not_gatherable(sig)}, which the Trainer's gather cannot take")
            else:
                kept[k] = sig
        return kept
