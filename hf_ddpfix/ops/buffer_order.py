"""One buffer order on every rank: DDP copies buffers from rank 0 *by position*, not by name.

`DistributedDataParallel` lists the model's buffers (``named_buffers()``: modules in ``named_modules()``
order, each module's buffers in registration order) once, when it is built, and broadcasts rank 0's
tensors into that list on every rank: at construction (``_sync_module_states``) and, with
``broadcast_buffers=True`` (the default), before every forward. If one rank registered a module's buffers
in another order, it silently receives the wrong tensors. transformers 5.0-5.15 do exactly that for the
rotary tables of Gemma 3 / Gemma 3n / ModernBERT / OLMo 3 / T5Gemma 2 ... (``for layer_type in
list(set(config.layer_types))``: the order depends on each process's hash seed, which torchrun varies per
worker), so in about half of the launches rank 1 trains with the sliding-window and global RoPE tables
swapped; 5.18 sorts the list; CohereCompass is still unsorted in 5.23.

Contract:
  - :func:`buffer_layout` -> this rank's ``[(module name, (buffer names in registration order)), ...]``
    for every module holding a (non-``None``) buffer, in the order DDP walks them.
  - :func:`modules_to_reorder` (pure) compares every rank's layout: ``[]`` when all agree; the modules
    whose buffer *order* differs on some rank; :class:`BufferLayoutError` naming the module when the
    *sets* differ (or modules with buffers differ): no order makes DDP copy the right tensors then.
  - :func:`sort_buffers` puts the named modules' buffers in one canonical order (sorted by name) -
    identical on every rank by construction. Values stay attached to their names, persistence is kept
    (the non-persistent set is by name), ``state_dict()`` keys are unchanged (only their order follows).
  - :func:`align_buffer_order` does the three with one ``all_gather_object``, before the model is wrapped;
    a no-op (no collective) without an initialised process group of more than one rank.

Pure torch (no transformers / accelerate). Buffer dicts are reached through
:func:`hf_ddpfix._compat.module_buffer_slots` (``nn.Module._buffers`` is private).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from .._compat import module_buffer_slots
from .dist import dist_ready

#: One rank's buffers: (module name, its buffer names in registration order), modules in DDP's order.
Layout = list[tuple[str, tuple[str, ...]]]


class BufferLayoutError(RuntimeError):
    """The ranks' models hold different buffers (names or modules): DDP would copy wrong tensors.

    Raised on every rank (each compares the same gathered layouts), before the model is wrapped.
    """


@dataclass(frozen=True)
class BufferOrderFix:
    """What :func:`align_buffer_order` did: ``modules`` reordered (empty: every rank agreed) and, for the
    first of them, each rank's order before (``orders[rank]``), for the log line."""

    modules: tuple[str, ...] = ()
    orders: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.modules)

    def describe(self) -> str:
        """One line: what was reordered and why ("" when nothing was)."""
        if not self.modules:
            return ""
        first = self.modules[0]
        seen = "; ".join(f"rank {r}: {list(o)}" for r, o in sorted(self.orders.items()))
        more = f" and {len(self.modules) - 1} more" if len(self.modules) > 1 else ""
        return (f"buffer_order: the ranks registered the buffers of {first or '<model>'}{more} in different "
                f"orders ({seen}); DDP copies rank 0's buffers by position, so a rank would train with the "
                "wrong tensors (transformers 5.0-5.15 register rotary tables in hash-seed order): their "
                "buffers now follow one order (sorted by name) on every rank")


def buffer_layout(model: nn.Module) -> Layout:
    """This rank's buffer layout, in the order DDP lists the buffers (``None`` buffers left out)."""
    out: Layout = []
    for name, mod in model.named_modules():
        names = tuple(k for k, v in module_buffer_slots(mod).items() if v is not None)
        if names:
            out.append((name, names))
    return out


def modules_to_reorder(layouts: Sequence[Layout]) -> list[str]:
    """The modules (rank 0's order) whose buffer order differs on some rank; ``[]`` when all agree.

    Raises:
        BufferLayoutError: a rank has buffers in other modules, or a module with other buffer names.
    """
    ref = layouts[0]
    ref_modules = [m for m, _ in ref]
    differ: dict[str, None] = {}
    for rank, layout in enumerate(layouts[1:], start=1):
        if layout == ref:
            continue
        modules = [m for m, _ in layout]
        if modules != ref_modules:
            only0 = sorted(set(ref_modules) - set(modules))[:3]
            only_r = sorted(set(modules) - set(ref_modules))[:3]
            raise BufferLayoutError(
                f"rank 0 and rank {rank} hold buffers in different modules (only on rank 0: {only0}, only on "
                f"rank {rank}: {only_r}, or another module order); DDP copies rank 0's buffers by position and "
                "would put them into the wrong modules: build the same model on every rank")
        for (name, names0), (_, names) in zip(ref, layout, strict=True):
            if names == names0:
                continue
            if set(names) != set(names0):
                raise BufferLayoutError(
                    f"module {name or '<model>'!r} has buffers {sorted(names0)} on rank 0 but {sorted(names)} on "
                    f"rank {rank}; DDP copies rank 0's buffers by position and would write wrong tensors "
                    "into them: build the same model on every rank")
            differ[name] = None
    return [m for m in ref_modules if m in differ]


def sort_buffers(model: nn.Module, modules: Iterable[str]) -> None:
    """Re-register the buffers of each named module of ``model`` in name order, in place (same tensors,
    same names, same persistence; ``None`` buffers included)."""
    by_name = dict(model.named_modules())
    for name in modules:
        slots = module_buffer_slots(by_name[name])
        ordered = sorted(slots.items())
        slots.clear()
        slots.update(ordered)


def _all_gather(layout: Layout) -> list[Layout]:
    out: list[Layout | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, layout)
    return [list(x) for x in out]  # type: ignore[arg-type]


def align_buffer_order(model: nn.Module, gather: Callable[[Layout], list[Layout]] | None = None) -> BufferOrderFix:
    """Make every rank's buffer order the same before DDP wraps ``model`` (see the module docstring).

    Args:
        model: the unwrapped model, on every rank (a collective: call it on all ranks).
        gather: every rank's layout from this rank's (tests); default one ``all_gather_object`` over the
            default process group, skipped (no-op) without one of more than one rank.

    Raises:
        BufferLayoutError: the buffer names differ across ranks (on every rank).
    """
    if gather is None:
        if not dist_ready():
            return BufferOrderFix()
        gather = _all_gather
    layouts = gather(buffer_layout(model))
    modules = modules_to_reorder(layouts)
    if not modules:
        return BufferOrderFix()
    orders = {r: dict(layout)[modules[0]] for r, layout in enumerate(layouts)}
    sort_buffers(model, modules)
    return BufferOrderFix(tuple(modules), orders)
