"""Exact live-tensor byte accounting per op (``MemoryLedger``), on real, meta or fake tensors.

A ``TorchDispatchMode`` that sees every aten op's outputs, registers each new storage with its byte
size and a weak reference, and drops it the moment its last tensor dies. ``peak`` is the largest sum
of live storage bytes seen at an op boundary (measured after an op's outputs exist and before its
inputs can be released, as an allocator sees it). On ``meta`` tensors nothing is computed, so the
working set of a Llama-8B layer at 64K tokens is counted in a second on a CPU.

What it counts: storages created by ops while the mode is active, plus tensors handed to
:meth:`MemoryLedger.track` (inputs that live on the device during the measured region, e.g. a
layer input and its incoming gradient). What it does not count: storages that existed before
(parameters, buffers) unless tracked, storages passed to :meth:`MemoryLedger.ignore`, and memory a
kernel allocates internally without returning it (e.g. FlashAttention's backward workspace, which
callers model separately), allocator rounding and fragmentation.

Usage::

    with MemoryLedger() as ledger:
        ledger.track(x, "layer input")
        out = layer(x)
        ledger.phase = "backward"
        out.backward(grad)
    print(ledger.peak, ledger.peak_breakdown())

Guarantees: on real tensors ``peak`` equals the peak of the sum of ``untyped_storage().nbytes()`` over
live storages created inside the region (plus tracked ones), counted once per storage however many
views share it; the same program on ``meta`` tensors gives the same numbers (tests/test_memory_ledger.py).
"""

from __future__ import annotations

import gc
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import (
    TorchDispatchMode,
    in_checkpoint_recompute,
    profiler_memory_events,
    storage_weak_ref,
    tree_flatten,
)

__all__ = ["AllocatorPeak", "LedgerEntry", "MemoryLedger", "OpRecord"]



@dataclass(frozen=True)
class LedgerEntry:
    """One live storage: who created it (phase, module, op), its bytes, shape and dtype."""

    phase: str
    module: str
    op: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class OpRecord:
    """One op call: phase, module label, op name, bytes newly allocated, live bytes after it."""

    phase: str
    module: str
    op: str
    new_bytes: int
    live_after: int


class _Live:
    __slots__ = ("ref", "entry")

    def __init__(self, ref: Any, entry: LedgerEntry) -> None:
        self.ref = ref
        self.entry = entry


class MemoryLedger(TorchDispatchMode):
    """Live storage bytes at every op boundary; see the module docstring.

    Args:
        record_ops: keep an ``OpRecord`` per op call in ``ops`` (default True).
        workspace: op name -> ``fn(*args, **kwargs) -> bytes`` of memory the kernel allocates
            internally and frees before returning (invisible to a dispatch mode). It counts towards
            ``peak`` at that op (on top of the op's outputs) as an entry labelled ``"<op> workspace
            (modelled)"``; it is a model, reported separately in ``modelled_workspace_peak``.

    Attributes:
        phase: label for ops that follow (``"forward"`` or ``"backward"``; ops run inside a
            non-reentrant checkpoint recompute are labelled ``"recompute"`` automatically).
        module: label for ops that follow (set by :meth:`label_modules` hooks, or by hand).
        current: live bytes now (as of the last op boundary).
        peak: the largest ``current`` seen.
        peak_phase: the phase of the op at which ``peak`` was reached.
        ops: the ``OpRecord`` list.
    """

    def __init__(self, *, record_ops: bool = True, workspace: dict[str, Callable[..., int]] | None = None) -> None:
        super().__init__()
        self.workspace = dict(workspace or {})
        self.phase = "forward"
        self.module = ""
        self.current = 0
        self.peak = 0
        self.peak_phase = ""
        self.peak_op = ""
        self.record_ops = record_ops
        self.ops: list[OpRecord] = []
        self._live: dict[Any, _Live] = {}
        self._ignored: dict[Any, Any] = {}
        self._peak_entries: list[LedgerEntry] = []
        self._hooks: list[Any] = []
        self.modelled_workspace_peak = 0

    # -- bookkeeping -----------------------------------------------------------------------------
    def _sweep(self) -> None:
        dead = [k for k, v in self._live.items() if v.ref.expired()]
        for k in dead:
            self.current -= self._live.pop(k).entry.nbytes

    def _add(self, t: torch.Tensor, phase: str, module: str, op: str, seen: set[Any] | None = None) -> int:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return 0
        ref = storage_weak_ref(t)
        key = ref.cdata
        if key in self._live or key in self._ignored or (seen is not None and key in seen):
            return 0
        nbytes = int(t.untyped_storage().nbytes())
        entry = LedgerEntry(phase, module, op, nbytes, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        self._live[key] = _Live(ref, entry)
        self.current += nbytes
        return nbytes

    def _update_peak(self, op: str) -> None:
        if self.current > self.peak:
            self.peak = self.current
            self.peak_phase = self._phase_now()
            self.peak_op = op
            self._peak_entries = [v.entry for v in self._live.values()]

    def _phase_now(self) -> str:
        return "recompute" if self.phase != "forward" and in_checkpoint_recompute() else self.phase

    # -- public API ------------------------------------------------------------------------------
    def track(self, tensors: torch.Tensor | Iterable[torch.Tensor], label: str) -> None:
        """Count these (already existing) tensors' storages as live from now until they die."""
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        self._sweep()
        for t in ts:
            self._add(t, "input", label, "tracked")
        self._update_peak("tracked")

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (e.g. parameters, or an output owned elsewhere)."""
        for t in tensors:
            ref = storage_weak_ref(t)
            live = self._live.pop(ref.cdata, None)
            if live is not None:
                self.current -= live.entry.nbytes
            self._ignored[ref.cdata] = ref

    def label_modules(self, root: torch.nn.Module, prefix: str = "") -> None:
        """Label ops with the innermost module running (forward pre/post hooks on every submodule).

        Labels only; they never change what is counted. Removed by ``__exit__``.
        """
        for name, m in root.named_modules():
            full = f"{prefix}{name}" if name else (prefix.rstrip(".") or type(root).__name__)

            def pre(_m: Any, _a: Any, _n: str = full) -> None:
                self.module = _n

            def post(_m: Any, _a: Any, _o: Any, _n: str = full) -> None:
                self.module = _n.rpartition(".")[0]

            self._hooks.append(m.register_forward_pre_hook(pre))
            self._hooks.append(m.register_forward_hook(post))

    def live_bytes(self) -> int:
        """Live bytes now (drops storages freed since the last op first)."""
        self._sweep()
        return self.current

    def peak_breakdown(self) -> list[LedgerEntry]:
        """The storages live at the peak, largest first."""
        return sorted(self._peak_entries, key=lambda e: -e.nbytes)

    def by_op(self) -> dict[tuple[str, str, str], int]:
        """Bytes newly allocated per (phase, module, op), summed over calls."""
        out: dict[tuple[str, str, str], int] = defaultdict(int)
        for r in self.ops:
            if r.new_bytes:
                out[(r.phase, r.module, r.op)] += r.new_bytes
        return dict(out)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._sweep()
        phase = self._phase_now()
        op = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        # An output sharing an input's storage (a view, an in-place or out= op) allocates nothing, also
        # when that input is not counted (a view of a parameter).
        inputs = {storage_weak_ref(t).cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        new = 0
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                new += self._add(t, phase, self.module, op, inputs)
        self._update_peak(op)
        model = self.workspace.get(op)
        if model is not None:
            ws = int(model(*args, **(kwargs or {})))
            if self.current + ws > self.peak:
                self.peak = self.current + ws
                self.peak_phase = phase
                self.peak_op = f"{op} workspace (modelled)"
                self._peak_entries = [v.entry for v in self._live.values()] + [
                    LedgerEntry(phase, self.module, f"{op} workspace (modelled)", ws, (), "")
                ]
            self.modelled_workspace_peak = max(self.modelled_workspace_peak, ws)
        if self.record_ops:
            self.ops.append(OpRecord(phase, self.module, op, new, self.current))
        return out

    def __exit__(self, *exc: Any) -> Any:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return super().__exit__(*exc)


class AllocatorPeak:
    """The CPU allocator's own account of a region: every allocation and free torch's allocator reports
    (``torch.profiler`` memory events), summed in time order.

    ``peak`` is the most bytes allocated inside the region and not yet freed, at any moment -- including
    buffers a kernel allocates and frees inside one op through torch's allocator (the attention backward's
    internal buffers), which a per-op ledger cannot see. Not seen: memory a kernel takes from ``malloc`` or
    the stack directly (none on the CPU paths measured here, so the real figure is a lower bound only for
    such kernels), and on CUDA the cuDNN/FlashAttention workspace (measure with ``torch.cuda`` stats).

    Usage::

        with AllocatorPeak() as real:
            ...                             # CPU work
        real.peak                           # bytes; tensors alive before the region are not counted

    Guarantees: ``peak >= 0``; ``current`` is the net bytes the region left allocated. Python's automatic
    garbage collection is off inside the region (restored after): a collection that happened to run there freed
    tensors a reference cycle held, and the same region's peak read 20 % lower in one process than in another
    (the gemma3_text layer, 2026-12-03); without it a tensor held by a cycle lives to the region's end, every time.
    """

    def __init__(self) -> None:
        self.peak = 0
        self.current = 0
        self._prof: Any = None
        self._gc_was_on = False

    def __enter__(self) -> AllocatorPeak:
        from torch.profiler import ProfilerActivity, profile

        self._gc_was_on = gc.isenabled()
        gc.disable()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._prof.__exit__(*exc)
        finally:
            if self._gc_was_on:
                gc.enable()
        cur = peak = 0
        for _, nbytes in profiler_memory_events(self._prof):
            cur += nbytes
            peak = max(peak, cur)
        self.peak, self.current = peak, cur
