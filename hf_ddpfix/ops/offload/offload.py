"""Asynchronous CPU offload of activation-checkpoint inputs (``ActivationOffload``).

With non-reentrant checkpointing, a ``saved_tensors_hooks`` context around a ``checkpoint(...)`` call
sees only the checkpoint's positional tensor inputs (a decoder layer's hidden states); the recompute
runs under checkpoint's own hooks and keyword tensors are captured by closure, never packed (checked
on torch 2.13 by ``tests/test_offload.py``). Those inputs are all that a checkpointed model keeps per
layer, ``layers x batch x seq x hidden x bytes`` in total, so moving them to host memory during the
forward and back during the backward frees that much device memory (REFERENCES.md §3).

Usage::

    offload = ActivationOffload(min_bytes=1 << 20, module=model)   # reusable across steps
    ckpt = CheckpointFunction(False, offload)                         # what layers call to checkpoint
    with offload.step():                                           # forward AND backward of a step
        loss = model(**batch).loss
        loss.backward()

On a CUDA device: one side stream per device, non-blocking copies into a bounded pool of pinned host
memory (``ops/offload/host_pool.py``: power-of-two slabs sub-allocated exactly, a cap, release on pressure),
ordered against the compute stream with events and ``record_stream`` (``ops/offload/transfer.py``);
the last packed layer input stays on the device (backward needs it first); while tensor ``i`` is
restored, tensor ``i-1`` is prefetched. A storage packed by several checkpoints of one step (an
encoder-decoder's ``encoder_hidden_states`` passed positionally to every decoder layer) is copied out
once and back once. On CPU tensors nothing is copied (they already live on the host) but the bytes an accelerator
run would move are counted in ``stats.would_offload_bytes``.

Which storages move, and whether a step copies at all (under the plan's ``auto`` policy only when its
largest checkpoint input is >= 64 MiB, where the copy hides behind the layer's compute on an H100, or
under device memory pressure) is ``ops/offload/policy.py``; the counters are ``ops/offload/stats.py``. This module is the
saved-tensor hook pair and the step's bookkeeping: packing order, dedupe, keep-N and prefetch. What
really happened is also counted in ``ops/feature_counts.py`` under ``"offload"``: ``ran`` per step
that copied, amounts ``copies`` / ``bytes`` / ``kept`` / ``policy_skips``, fallbacks with their reason.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..._compat import storage_weak_ref
from ..feature_counts import record_amount, record_fallback, record_ran
from .budget import OffloadBudgetError, plan_offload_budget
from .policy import (
    DEFAULT_MIN_BYTES,
    DEFAULT_MIN_LAYER_BYTES,
    DEFAULT_PRESSURE_FRACTION,
    OFFLOAD_DEVICE_TYPES,
    OffloadPolicy,
    accelerator_available,
)
from .stats import OffloadStats
from .transfer import ON_DEVICE, ON_HOST, RESTORED, StorageRecord, Transfers

__all__ = [
    "DEFAULT_MIN_BYTES",
    "DEFAULT_MIN_LAYER_BYTES",
    "DEFAULT_PRESSURE_FRACTION",
    "ActivationOffload",
    "OffloadStats",
    "accelerator_available",
]


FEATURE = "offload"  # the name in ops/feature_counts.py
NO_ACCELERATOR = "no accelerator: activations already in host memory"
POOL_REFUSED = "host pool refused (max_pool_bytes or a failed pinned allocation): kept on the device"


class _Handle:
    """What autograd stores instead of the tensor: the record plus the view's geometry."""

    __slots__ = ("record", "tensor", "dtype", "offset", "size", "stride")

    def __init__(self, record: StorageRecord, t: torch.Tensor, keep_tensor: bool) -> None:
        self.record = record
        self.tensor = t if keep_tensor else None  # CPU accounting mode keeps the tensor itself
        self.dtype = t.dtype
        self.offset = t.storage_offset()
        self.size = t.size()
        self.stride = t.stride()


class ActivationOffload:
    """Saved-tensor hooks that move checkpoint inputs to host memory between forward and backward.

    Args:
        min_bytes: storages smaller than this stay where they are (default 1 MiB).
        module: optional model whose parameters and buffers are never offloaded (their storages are
            collected when each ``step()`` begins); ``nn.Parameter`` and views of one are always skipped.
        keep_on_device: how many checkpoints' inputs, the last packed ones, stay on the device (default
            1: the backward needs the last one first, so copying it out and back only costs time). An
            int >= 1, or ``"auto"``: before each step, ``plan_offload_budget`` (``ops/offload/budget.py``)
            decides N from the device memory the previous step used (sampled from the caching allocator
            when its backward began) and the previous step's number and size of layer inputs: as many
            as fit under ``pressure_fraction`` of the device stay (fewest copies). Off CUDA ``"auto"``
            keeps 1 unless ``device_memory`` is given.
        prefetch: while a restored tensor is used, copy the previous one back ahead of time (default True).
        min_layer_bytes: copy a storage only when it has at least this many bytes, unless the device is
            under memory pressure (default 0: always; the plan's ``auto`` policy passes
            ``DEFAULT_MIN_LAYER_BYTES``, where the copy hides behind the layer's compute).
        pressure_fraction: with ``min_layer_bytes`` set, a step whose device had at least this fraction
            of its memory reserved by the caching allocator when the step began copies whatever the size
            (default 0.9; CUDA only).
        max_pool_bytes: cap on the host bytes each device's pool holds (default ``"default"``: a quarter
            of physical memory per local process, ``HostPool``'s default; None: no cap). At the cap a
            storage stays on the device (``stats.skipped_pool``).
        simulate: run the copying state machine on CPU tensors too (plain host buffers, no streams), so
            tests exercise pool, dedupe, views, keep-N, prefetch and bit-identity without a GPU.
        device_memory: ``f(device) -> (allocated_bytes, total_bytes)`` read by ``keep_on_device="auto"``
            (default: the CUDA caching allocator's host-side counters; tests pass a fake device).

    Raises:
        ValueError: a negative ``min_bytes`` / ``min_layer_bytes`` / ``max_pool_bytes``, a
            ``pressure_fraction`` outside (0, 1], or ``keep_on_device`` not an int >= 1 nor ``"auto"``.

    Guarantees:
        - Outside an active ``step()`` the hooks are not installed: forward and backward are stock.
        - Parameters, buffers, tensor subclasses, partial views and storages < ``min_bytes`` are never
          copied; a storage packed several times in a step (by one checkpoint or by several, e.g. an
          encoder output passed to every decoder layer) is copied out once and back once, and every
          view is restored with its exact dtype, offset, size and stride (bit-identical values).
        - The host pools stay bounded for any sequence of shapes, at every moment (``HostPool``: at most
          the most bytes in use at once so far plus max(``min_bytes``, 1/64 of them), so at most twice
          them; never above the cap).
        - The last ``keep_on_device`` checkpoints' inputs of a step are never copied (``stats.kept_*``).
        - On CPU tensors (``simulate=False``) nothing is copied or pinned; bytes are only counted.
        - On exit from ``step()``: the compute stream is ordered after every side-stream copy (a
          GPU-side wait: the host thread is not blocked) and each host buffer no longer needed by a
          live saved tensor is back in the pool (``stats.in_flight`` counts those still needed, 0
          after a normal backward).
        - A failure to pin host memory or the pool cap leaves the tensor on the device (one warning),
          never raises.
    """

    def __init__(
        self,
        min_bytes: int = DEFAULT_MIN_BYTES,
        *,
        module: nn.Module | None = None,
        keep_on_device: int | str = 1,
        prefetch: bool = True,
        min_layer_bytes: int = 0,
        pressure_fraction: float = DEFAULT_PRESSURE_FRACTION,
        max_pool_bytes: int | None | str = "default",
        simulate: bool = False,
        device_memory: Callable[[torch.device], tuple[int, int]] | None = None,
    ) -> None:
        self._policy = OffloadPolicy(min_bytes, min_layer_bytes, pressure_fraction)
        if max_pool_bytes != "default" and max_pool_bytes is not None and int(max_pool_bytes) < 0:
            raise ValueError(f"max_pool_bytes must be >= 0, None or 'default', got {max_pool_bytes}")
        if keep_on_device != "auto" and (
            isinstance(keep_on_device, bool) or not isinstance(keep_on_device, int) or keep_on_device < 1
        ):
            raise ValueError(f"keep_on_device must be an int >= 1 or 'auto', got {keep_on_device!r}")
        self.keep_auto = keep_on_device == "auto"
        self.keep_on_device = 1 if self.keep_auto else int(keep_on_device)  # this step's N
        self._device_memory = device_memory
        self._sampled: tuple[int, int] | None = None  # (allocated, total) when this step's backward began
        self._last_facts: tuple[int, int, int, tuple[int, int]] | None = None  # layers, layer bytes, kept, sample
        self.prefetch = prefetch
        self.simulate = simulate
        self._module_ref = weakref.ref(module) if module is not None else None
        self._transfers = Transfers(min_slab_bytes=self._policy.min_bytes, max_pool_bytes=max_pool_bytes)
        self._lock = threading.RLock()
        self._active = False
        self._records: weakref.WeakValueDictionary[int, StorageRecord] = weakref.WeakValueDictionary()
        self._order: list[weakref.ref[StorageRecord]] = []
        self._pending: list[list[StorageRecord]] = []  # per pack scope, oldest first: not yet offloaded
        self._scopes: list[int] = []  # per pack scope of this step: bytes of the storages it recorded
        self.stats = OffloadStats()

    # ------------------------------------------------------------------ public contexts

    @property
    def min_bytes(self) -> int:
        return self._policy.min_bytes

    @property
    def min_layer_bytes(self) -> int:
        return self._policy.min_layer_bytes

    @property
    def pressure_fraction(self) -> float:
        return self._policy.pressure_fraction

    @property
    def active(self) -> bool:
        """True inside ``step()``."""
        return self._active

    @contextlib.contextmanager
    def step(self) -> Iterator[ActivationOffload]:
        """Span one training step (forward and backward). Nested calls are no-ops.

        Guarantees: on exit (also on an exception) the compute stream waits for every copy (GPU-side),
        pending state is cleared, the host pools close the step (``HostPool.end_step``) and ``stats``
        holds this step's counters.
        """
        if self._active:
            yield self
            return
        self._begin()
        try:
            yield self
        finally:
            self._end()

    @contextlib.contextmanager
    def pack_scope(self) -> Iterator[None]:
        """Install the pack/unpack hooks around one ``checkpoint(...)`` call.

        Guarantees: a no-op when no ``step()`` is active; entering it starts moving the previous
        scope's inputs to the host (the current scope's inputs stay until the next scope begins).
        """
        if not self._active:
            yield
            return
        with self._lock:
            self._flush_pending()
            self._pending.append([])
            self._scopes.append(0)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def set_max_pool_bytes(self, max_bytes: int | None) -> None:
        """Cap each device's host pool at ``max_bytes`` (None: no cap), for pools made from now on and
        those already made (a pool above the new cap keeps its buffers and refuses to grow).

        Raises:
            ValueError: a negative ``max_bytes``.
        """
        if max_bytes is not None and int(max_bytes) < 0:
            raise ValueError(f"max_pool_bytes must be >= 0 or None, got {max_bytes}")
        with self._lock:
            self._transfers.max_pool_bytes = max_bytes
            for pool in self._transfers.pools.values():
                pool.max_bytes = None if max_bytes is None else int(max_bytes)

    def clear_pool(self) -> None:
        """Release every idle host slab (e.g. before a phase that needs host memory)."""
        with self._lock:
            self._transfers.clear()

    # ------------------------------------------------------------------ step bookkeeping

    def _begin(self) -> None:
        steps, allocated = self.stats.steps, self.stats.pool_allocated
        self.stats = OffloadStats(steps=steps, pool_allocated=allocated)
        self._policy.begin_step(self._module_ref() if self._module_ref is not None else None)
        self._records = weakref.WeakValueDictionary()
        self._order = []
        self._pending = []
        self._scopes = []
        if self.keep_auto:
            self.keep_on_device = self._auto_keep()
            if self._last_facts is not None and self.keep_on_device >= self._last_facts[0]:
                # every layer input now stays on the device: no copy this step, so the pinned slabs an
                # earlier step needed would sit idle (33 GB at 128K Llama-8B tokens on an H100)
                self._transfers.clear()
        self.stats.keep_on_device = self.keep_on_device
        self._sampled = None
        self._active = True

    def _end(self) -> None:
        with self._lock:
            self._active = False
            for scope in self._pending:
                for rec in scope:
                    self._count_kept(rec)
            self._pending = []
            layers = sum(1 for b in self._scopes if b)
            if layers and self._sampled is not None:
                self._last_facts = (layers, max(self._scopes), self.keep_on_device, self._sampled)
            self._scopes = []
            pools = self._transfers.end_step()
            in_flight = 0
            for ref in self._order:
                rec = ref()
                if rec is not None and rec.host is not None:
                    in_flight += 1
            self._order = []
            self._records = weakref.WeakValueDictionary()
            st = self.stats
            st.in_flight = in_flight
            st.steps += 1
            if st.offloaded_tensors:
                record_ran(FEATURE)
            st.pool_buffers = sum(p.in_use_buffers for p in pools)
            st.pool_bytes = sum(p.held_bytes for p in pools)
            st.pool_need_bytes = sum(p.need_bytes for p in pools)
            st.pool_peak_bytes = sum(p.peak_held_bytes for p in pools)
            st.pool_max_held_over_need = max((p.max_held_over_need for p in pools), default=0.0)
            st.pool_allocated = sum(p.slab_allocations for p in pools)

    def _read_device_memory(self, device: torch.device) -> tuple[int, int] | None:
        """(allocated, total) bytes of ``device`` from host-side counters (no sync); None if unknown."""
        if not self.keep_auto:
            return None
        if self._device_memory is not None:
            return self._device_memory(device)
        if device.type != "cuda":
            return None
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.memory_allocated(idx), torch.cuda.get_device_properties(idx).total_memory

    def _auto_keep(self) -> int:
        """N for the step about to begin, from the previous step's facts (1 before the first step)."""
        if self._last_facts is None:
            return 1
        layers, layer_bytes, kept, (allocated, total) = self._last_facts
        fixed = max(0, allocated - min(kept, layers) * layer_bytes)  # what the forward held besides kept inputs
        try:
            budget = plan_offload_budget(layers=layers, tokens=1, layer_bytes=layer_bytes,
                                         device_budget_bytes=int(self.pressure_fraction * total),
                                         host_budget_bytes=1 << 62, fixed_device_bytes=fixed)
        except OffloadBudgetError:
            return 1  # the device is short even with one input kept: offload everything we can
        return max(1, budget.keep_on_device)

    def _count_kept(self, rec: StorageRecord) -> None:
        self.stats.kept_tensors += 1
        self.stats.kept_bytes += rec.nbytes
        record_amount(FEATURE, "kept", 1)

    def _copies(self, device: torch.device) -> bool:
        """True when tensors on ``device`` are really copied (CUDA, or CPU under ``simulate``)."""
        return device.type in OFFLOAD_DEVICE_TYPES or (self.simulate and device.type == "cpu")

    # ------------------------------------------------------------------ hooks

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._active or not isinstance(t, torch.Tensor):
            return t
        with self._lock:
            st = self.stats
            st.packed_tensors += 1
            st.packed_bytes += t.numel() * t.element_size()
            reason = self._policy.skip_reason(t)
            if reason is not None:
                setattr(st, f"skipped_{reason}", getattr(st, f"skipped_{reason}") + 1)
                return t
            copies = self._copies(t.device)
            ref = storage_weak_ref(t)
            rec = self._records.get(ref.cdata)
            if rec is not None and not rec.ref.expired() and rec.state in (ON_DEVICE, ON_HOST):
                # the same storage again (a view, or a tensor every layer receives): one copy per step
                st.deduped_tensors += 1
                if rec.state == ON_HOST:
                    rec.shared = True
                else:
                    rec.produced_again(t)
            else:
                nbytes = t.untyped_storage().nbytes()
                if not self._policy.pays(nbytes, t.device, st):
                    st.skipped_policy += 1
                    record_amount(FEATURE, "policy_skips", 1)
                    return t
                rec = StorageRecord(len(self._order), nbytes, t.device, ref)
                if copies:
                    rec.watch(t)
                self._records[ref.cdata] = rec
                self._order.append(weakref.ref(rec))
                if self._pending:
                    self._pending[-1].append(rec)
                    self._scopes[-1] += nbytes
            return _Handle(rec, t, keep_tensor=not copies)

    def _flush_pending(self) -> None:
        """Start moving to the host (or count, on CPU) the storages of every scope but the last
        ``keep_on_device - 1`` (the scope about to begin is the N-th kept)."""
        with self._lock:
            keep = max(0, self.keep_on_device - 1)
            moving = self._pending[: len(self._pending) - keep] if len(self._pending) > keep else []
            self._pending = self._pending[len(moving):]
            for rec in (r for scope in moving for r in scope):
                if rec.used or rec.ref.expired():
                    continue  # already consumed by a backward (gradient accumulation) or freed
                self.stats.would_offload_bytes += rec.nbytes
                if self._copies(rec.device):
                    self._offload(rec)
                else:
                    record_fallback(FEATURE, NO_ACCELERATOR)

    def _offload(self, rec: StorageRecord) -> None:
        if self._transfers.offload(rec):
            self.stats.offloaded_tensors += 1
            self.stats.offloaded_bytes += rec.nbytes
            record_amount(FEATURE, "copies", 1)
            record_amount(FEATURE, "bytes", rec.nbytes)
        else:  # the pool's cap or a failed pinned allocation: it stays on the device
            record_fallback(FEATURE, POOL_REFUSED)
            self.stats.skipped_pool += 1
            self.stats.would_offload_bytes -= rec.nbytes

    def _restore(self, rec: StorageRecord, prefetch: bool) -> None:
        self._transfers.restore(rec)
        self.stats.restored_tensors += 1
        if prefetch:
            self.stats.prefetched_tensors += 1

    def _prefetch_before(self, index: int) -> None:
        for i in range(index - 1, -1, -1):
            prev = self._order[i]()
            if prev is None or prev.state == RESTORED or prev.shared:
                continue  # a shared storage is restored when first needed, once
            if prev.state == ON_HOST:
                self._restore(prev, prefetch=True)
            return

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        rec = packed.record
        with self._lock:
            if not rec.used:
                rec.used = True
                if self._sampled is None and self._active:  # the backward begins: the forward's peak
                    self._sampled = self._read_device_memory(rec.device)
                for scope in self._pending:  # the backward reached a kept scope: it stays on device
                    if rec in scope:
                        scope.remove(rec)
                        self._count_kept(rec)
                        break
            if packed.tensor is not None:
                return packed.tensor
            if rec.state == ON_HOST:
                self._restore(rec, prefetch=False)
            self._transfers.wait_restored(rec)
            dev = rec.dev
            assert dev is not None
            if (
                self.prefetch
                and not rec.shared
                and self._active
                and rec.index < len(self._order)
                and self._order[rec.index]() is rec
            ):
                self._prefetch_before(rec.index)
        out = torch.empty(0, dtype=packed.dtype, device=dev.device)
        return out.set_(dev.untyped_storage(), packed.offset, packed.size, packed.stride)
