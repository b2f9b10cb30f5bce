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
memory (``ops/host_pool.py``: power-of-two slabs sub-allocated exactly, a cap, release on pressure),
ordered against the compute stream with events and ``record_stream``; the last packed layer input
stays on the device (backward needs it first); while tensor ``i`` is restored, tensor ``i-1`` is
prefetched. A storage packed by several checkpoints of one step (an encoder-decoder's
``encoder_hidden_states`` passed positionally to every decoder layer) is copied out once and back
once. On CPU tensors nothing is copied (they already live on the host) but the bytes an accelerator
run would move are counted in ``stats.would_offload_bytes``.

When it pays (``min_layer_bytes``): a copy hides behind the layer's compute only when the layer is
big enough. Measured on one H100 80GB (2026-11-23, 1.1B Llama shape, bf16, LoRA, batch 1; step time
with offload / checkpointing alone): 1.57x at 2K tokens (8 MiB per layer input), 1.08x at 8K
(32 MiB), 0.99x at 16K (64 MiB), 1.01x at 32K (128 MiB). So by default a step copies only when its
largest checkpoint input is >= 64 MiB, or when the device was under memory pressure (the caching
allocator reserved >= 90% of the device in the previous step); other steps run as stock
checkpointing (``stats.policy`` says which and why).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .._compat import storage_weak_ref, view_base
from .host_pool import HostPool

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MIN_BYTES",
    "SaveOnCpuScope",
    "DEFAULT_MIN_LAYER_BYTES",
    "DEFAULT_PRESSURE_FRACTION",
    "ActivationOffload",
    "OffloadStats",
    "accelerator_available",
]

# 1 MiB: below this a copy costs more in launch latency and bookkeeping than it frees
# (DeepSpeed, axolotl and torchtune all skip tensors under ~1 MiB; REFERENCES.md §3).
DEFAULT_MIN_BYTES = 1 << 20

# 64 MiB: the smallest layer input at which the H100 measurement above showed no slowdown (0.99x at
# 16K tokens x 2048 hidden x bf16); at 32 MiB (8K) the step was 1.08x, at 8 MiB (2K) 1.57x.
DEFAULT_MIN_LAYER_BYTES = 64 << 20

# Offload whatever the size when the previous step left >= 90% of the device reserved: the copy
# costs time, running out of memory costs the run.
DEFAULT_PRESSURE_FRACTION = 0.9

_OFFLOAD_DEVICE_TYPES = ("cuda",)  # ROCm builds report "cuda" too


def accelerator_available() -> bool:
    """True when a device the asynchronous offload path supports (CUDA or ROCm) is present.

    Guarantees: never initializes a device context when there is no device; False on CPU-only builds.
    """
    return torch.cuda.is_available()


@dataclass
class OffloadStats:
    """Counters for one ``step()`` (reset when the next step begins), plus pool state.

    Bytes are storage bytes: what a copy moves. ``would_offload_bytes`` counts the bytes an accelerator
    run moves to the host on every device type (on CUDA it equals ``offloaded_bytes``; on CPU nothing
    is copied and ``offloaded_bytes`` stays 0).
    """

    steps: int = 0  # step() contexts completed since construction (cumulative)
    packed_tensors: int = 0  # tensors the pack hook saw
    packed_bytes: int = 0
    offloaded_tensors: int = 0  # storages actually copied to host buffers
    offloaded_bytes: int = 0
    would_offload_bytes: int = 0  # storages that were (or on an accelerator would be) moved to the host
    kept_tensors: int = 0  # offloadable storages left on the device because backward needs them first
    kept_bytes: int = 0
    deduped_tensors: int = 0  # packs that reused a storage already recorded this step
    skipped_small: int = 0  # below min_bytes
    skipped_params: int = 0  # parameters, buffers or views of them
    skipped_views: int = 0  # views that do not cover their whole storage
    skipped_other: int = 0  # subclasses, sparse/quantized/conj tensors, unsupported devices
    skipped_pool: int = 0  # the host pool refused (cap reached, host allocation failed): kept on device
    skipped_policy: int = 0  # storages left on the device because this step's layers are too small to pay
    policy: str = ""  # this step's offload decision and its reason (set at the first packed storage)
    restored_tensors: int = 0  # host-to-device copies (prefetched or on demand)
    prefetched_tensors: int = 0
    pool_buffers: int = 0  # host buffers still handed out at step exit (0 after a normal backward)
    pool_bytes: int = 0  # host bytes the pools hold at step exit (slabs, in use or idle)
    pool_need_bytes: int = 0  # the most host bytes any step had in use at once (the pools' P)
    pool_peak_bytes: int = 0  # the most host bytes the pools ever held
    pool_allocated: int = 0  # host slabs ever allocated (cumulative; flat once the pool is warm)
    in_flight: int = 0  # host buffers still owned by a live saved tensor at step exit (0 after backward)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# States of a recorded storage.
_ON_DEVICE = 0  # still on the device, original storage (pending or kept)
_ON_HOST = 1  # copied out; only the host buffer holds the data
_RESTORED = 2  # copied back to a new device storage


class _Record:
    """One storage packed during a step (views of the same storage share it: dedupe)."""

    __slots__ = (
        "__weakref__",
        "index",
        "nbytes",
        "device",
        "ref",
        "state",
        "dev",
        "host",
        "ready",
        "restored_event",
        "used",
        "shared",
        "release",
    )

    def __init__(self, index: int, nbytes: int, device: torch.device, ref: Any) -> None:
        self.index = index
        self.nbytes = nbytes
        self.device = device
        self.ref = ref  # keeps the StorageImpl address from being reused while we key on it
        self.state = _ON_DEVICE
        self.dev: torch.Tensor | None = None  # uint8 tensor over the device storage
        self.host: torch.Tensor | None = None  # uint8 host buffer
        self.ready: Any = None  # event: the source is produced (compute stream, recorded at pack)
        self.restored_event: Any = None  # event: the host-to-device copy finished (side stream)
        self.used = False  # unpacked at least once
        self.shared = False  # packed again by a later checkpoint after it was offloaded (not prefetched)
        self.release: weakref.finalize | None = None  # returns ``host`` to the pool exactly once


class _Handle:
    """What autograd stores instead of the tensor: the record plus the view's geometry."""

    __slots__ = ("record", "tensor", "dtype", "offset", "size", "stride")

    def __init__(self, record: _Record, t: torch.Tensor, keep_tensor: bool) -> None:
        self.record = record
        self.tensor = t if keep_tensor else None  # CPU accounting mode keeps the tensor itself
        self.dtype = t.dtype
        self.offset = t.storage_offset()
        self.size = t.size()
        self.stride = t.stride()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over ``t``'s whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _covers_storage(t: torch.Tensor, storage_bytes: int) -> bool:
    """True when ``t`` spans its storage from first to last byte (contiguous, transposed, reshaped)."""
    if t.storage_offset() != 0:
        return False
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return span * t.element_size() == storage_bytes


class ActivationOffload:
    """Saved-tensor hooks that move checkpoint inputs to host memory between forward and backward.

    Args:
        min_bytes: storages smaller than this stay where they are (default 1 MiB).
        module: optional model whose parameters and buffers are never offloaded (their storages are
            collected when each ``step()`` begins); ``nn.Parameter`` and views of one are always skipped.
        keep_last: keep the last packed checkpoint's inputs on the device (default True: the backward
            needs them first, so copying them out and back only costs time).
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
            tests exercise pool, dedupe, views, keep-last, prefetch and bit-identity without a GPU.

    Guarantees:
        - Outside an active ``step()`` the hooks are not installed: forward and backward are stock.
        - Parameters, buffers, tensor subclasses, partial views and storages < ``min_bytes`` are never
          copied; a storage packed several times in a step (by one checkpoint or by several, e.g. an
          encoder output passed to every decoder layer) is copied out once and back once, and every
          view is restored with its exact dtype, offset, size and stride (bit-identical values).
        - The host pools stay bounded for any sequence of shapes (``HostPool``'s guarantees: after each
          step at most twice the most bytes any step had in use at once, never above the cap).
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
        keep_last: bool = True,
        prefetch: bool = True,
        min_layer_bytes: int = 0,
        pressure_fraction: float = DEFAULT_PRESSURE_FRACTION,
        max_pool_bytes: int | None | str = "default",
        simulate: bool = False,
    ) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        if min_layer_bytes < 0:
            raise ValueError(f"min_layer_bytes must be >= 0, got {min_layer_bytes}")
        if not 0 < pressure_fraction <= 1:
            raise ValueError(f"pressure_fraction must be in (0, 1], got {pressure_fraction}")
        if max_pool_bytes != "default" and max_pool_bytes is not None and int(max_pool_bytes) < 0:
            raise ValueError(f"max_pool_bytes must be >= 0, None or 'default', got {max_pool_bytes}")
        self.min_bytes = int(min_bytes)
        self.min_layer_bytes = int(min_layer_bytes)
        self.pressure_fraction = float(pressure_fraction)
        self.keep_last = keep_last
        self.prefetch = prefetch
        self.simulate = simulate
        self._module_ref = weakref.ref(module) if module is not None else None
        self._max_pool_bytes = max_pool_bytes
        self._pools: dict[tuple[str, int], HostPool] = {}  # per device: buffers follow one side stream
        self._pressure: dict[int, bool] = {}  # per CUDA device, decided once per step
        self._side_streams: dict[int, Any] = {}
        self._lock = threading.RLock()
        self._active = False
        self._param_storages: set[int] = set()
        self._records: weakref.WeakValueDictionary[int, _Record] = weakref.WeakValueDictionary()
        self._order: list[weakref.ref[_Record]] = []
        self._pending: list[_Record] = []
        self._warned: set[str] = set()
        self.stats = OffloadStats()

    # ------------------------------------------------------------------ public contexts

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
        self._flush_pending()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def clear_pool(self) -> None:
        """Release every idle host slab (e.g. before a phase that needs host memory)."""
        with self._lock:
            for pool in self._pools.values():
                pool.clear()

    # ------------------------------------------------------------------ step bookkeeping

    def _begin(self) -> None:
        steps, allocated = self.stats.steps, self.stats.pool_allocated
        self.stats = OffloadStats(steps=steps, pool_allocated=allocated)
        self._param_storages = set()
        module = self._module_ref() if self._module_ref is not None else None
        if module is not None:
            self._param_storages = _storage_ptrs((*module.parameters(), *module.buffers()))
        self._records = weakref.WeakValueDictionary()
        self._order = []
        self._pending = []
        self._pressure = {}
        self._active = True

    def _end(self) -> None:
        with self._lock:
            self._active = False
            for rec in self._pending:
                self._count_kept(rec)
            self._pending = []
            for idx, stream in self._side_streams.items():
                # order later compute after our copies without blocking the host thread (a CPU sync
                # here stalled every micro-batch until its backward had nearly finished on the GPU)
                torch.cuda.current_stream(idx).wait_stream(stream)
            for pool in self._pools.values():
                pool.end_step()
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
            pools = [p.stats for p in self._pools.values()]
            st.pool_buffers = sum(p.in_use_buffers for p in pools)
            st.pool_bytes = sum(p.held_bytes for p in pools)
            st.pool_need_bytes = sum(p.need_bytes for p in pools)
            st.pool_peak_bytes = sum(p.peak_held_bytes for p in pools)
            st.pool_allocated = sum(p.slab_allocations for p in pools)

    def _count_kept(self, rec: _Record) -> None:
        self.stats.kept_tensors += 1
        self.stats.kept_bytes += rec.nbytes

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)

    def _copies(self, device: torch.device) -> bool:
        """True when tensors on ``device`` are really copied (CUDA, or CPU under ``simulate``)."""
        return device.type in _OFFLOAD_DEVICE_TYPES or (self.simulate and device.type == "cpu")

    def _pool(self, device: torch.device) -> HostPool:
        is_cuda = device.type == "cuda"
        idx = (device.index if device.index is not None else torch.cuda.current_device()) if is_cuda else -1
        pool = self._pools.get((device.type, idx))
        if pool is None:
            pool = self._pools[(device.type, idx)] = HostPool(
                pin=is_cuda, max_bytes=self._max_pool_bytes, min_slab_bytes=self.min_bytes
            )
        return pool

    def _under_pressure(self, device: torch.device) -> bool:
        """The caching allocator held >= ``pressure_fraction`` of ``device`` when this step first packed
        on it (host-side counters: no device sync). Always False off CUDA."""
        if device.type != "cuda":
            return False
        idx = device.index if device.index is not None else torch.cuda.current_device()
        hit = self._pressure.get(idx)
        if hit is None:
            total = torch.cuda.get_device_properties(idx).total_memory
            hit = self._pressure[idx] = torch.cuda.memory_reserved(idx) >= self.pressure_fraction * total
        return hit

    def _pays(self, nbytes: int, device: torch.device) -> bool:
        """The offload policy for one storage; records this step's reason in ``stats.policy``."""
        if nbytes >= self.min_layer_bytes:
            if not self.stats.policy:
                self.stats.policy = (
                    "copy: always" if not self.min_layer_bytes
                    else f"copy: a checkpoint input of {nbytes / 2**20:.0f} MiB >= {self.min_layer_bytes / 2**20:.0f} MiB"
                )
            return True
        if self._under_pressure(device):
            self.stats.policy = f"copy: device memory >= {self.pressure_fraction:.0%} reserved (pressure)"
            return True
        if not self.stats.policy.startswith("copy"):
            self.stats.policy = (
                f"keep: checkpoint inputs < {self.min_layer_bytes / 2**20:.0f} MiB, where the copy does not "
                "hide behind the layer's compute"
            )
        return False

    def _side_stream(self, device: torch.device) -> Any:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._side_streams.get(idx)
        if stream is None:
            stream = self._side_streams[idx] = torch.cuda.Stream(device=idx)
        return stream

    # ------------------------------------------------------------------ hooks

    def _skip_reason(self, t: torch.Tensor) -> str | None:
        if isinstance(t, nn.Parameter) or isinstance(view_base(t), nn.Parameter):
            return "params"
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized:
            return "other"
        if t.is_conj() or t.is_neg() or t.numel() == 0:
            return "other"
        if t.device.type != "cpu" and t.device.type not in _OFFLOAD_DEVICE_TYPES:
            self._warn_once(
                t.device.type,
                f"ActivationOffload: {t.device.type} tensors are kept on device "
                "(the asynchronous path supports CUDA/ROCm only).",
            )
            return "other"
        storage = t.untyped_storage()
        if storage.data_ptr() in self._param_storages:
            return "params"
        if storage.nbytes() < self.min_bytes:
            return "small"
        if not _covers_storage(t, storage.nbytes()):
            return "views"
        return None

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._active or not isinstance(t, torch.Tensor):
            return t
        with self._lock:
            st = self.stats
            st.packed_tensors += 1
            st.packed_bytes += t.numel() * t.element_size()
            reason = self._skip_reason(t)
            if reason is not None:
                setattr(st, f"skipped_{reason}", getattr(st, f"skipped_{reason}") + 1)
                return t
            copies = self._copies(t.device)
            ref = storage_weak_ref(t)
            rec = self._records.get(ref.cdata)
            if rec is not None and not rec.ref.expired() and rec.state in (_ON_DEVICE, _ON_HOST):
                # the same storage again (a view, or a tensor every layer receives): one copy per step
                st.deduped_tensors += 1
                if rec.state == _ON_HOST:
                    rec.shared = True
                elif rec.ready is not None:  # the copy must also follow this later producer
                    rec.ready.record(torch.cuda.current_stream(t.device))
            else:
                nbytes = t.untyped_storage().nbytes()
                if not self._pays(nbytes, t.device):
                    st.skipped_policy += 1
                    return t
                rec = _Record(len(self._order), nbytes, t.device, ref)
                if copies:
                    rec.dev = _bytes_of(t)
                    if t.device.type == "cuda":
                        rec.ready = torch.cuda.Event()
                        rec.ready.record(torch.cuda.current_stream(t.device))
                self._records[ref.cdata] = rec
                self._order.append(weakref.ref(rec))
                self._pending.append(rec)
            return _Handle(rec, t, keep_tensor=not copies)

    def _flush_pending(self) -> None:
        """Start moving the previous scope's storages to the host (or count them, on CPU)."""
        with self._lock:
            pending, self._pending = self._pending, []
            for rec in pending:
                if rec.used or rec.ref.expired():
                    continue  # already consumed by a backward (gradient accumulation) or freed
                self.stats.would_offload_bytes += rec.nbytes
                if self._copies(rec.device):
                    self._offload(rec)

    def _offload(self, rec: _Record) -> None:
        assert rec.dev is not None
        is_cuda = rec.device.type == "cuda"
        pool = self._pool(rec.device)
        host = pool.take(rec.nbytes)
        if host is None:  # the pool's cap, or the host refused pinned memory (OOM, locked-memory limit)
            self._warn_once(
                "pool",
                f"ActivationOffload: no host buffer for {rec.nbytes} bytes (pool holds "
                f"{pool.held_bytes} of max_pool_bytes={pool.max_bytes}, or the pinned allocation failed); "
                "keeping those activations on the device.",
            )
            self.stats.skipped_pool += 1
            self.stats.would_offload_bytes -= rec.nbytes
            return
        if is_cuda:
            side = self._side_stream(rec.device)
            side.wait_event(rec.ready)
            with torch.cuda.stream(side):
                host.copy_(rec.dev, non_blocking=True)
            rec.dev.record_stream(side)  # the allocator must not reuse the storage before the copy ends
        else:
            host.copy_(rec.dev)
        rec.host = host
        rec.release = weakref.finalize(rec, pool.give, host)  # also runs if the graph is dropped unused
        rec.release.atexit = False
        rec.dev = None
        rec.ready = None
        rec.state = _ON_HOST
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += rec.nbytes

    def _restore(self, rec: _Record, prefetch: bool) -> None:
        """Copy a host storage back to a new device storage (asynchronously on CUDA)."""
        assert rec.host is not None
        if rec.device.type == "cuda":
            compute = torch.cuda.current_stream(rec.device)
            side = self._side_stream(rec.device)
            dev = torch.empty(rec.nbytes, dtype=torch.uint8, device=rec.device)  # allocated on compute
            side.wait_stream(compute)  # the block may still be read by queued compute kernels
            with torch.cuda.stream(side):
                dev.copy_(rec.host, non_blocking=True)
                rec.restored_event = torch.cuda.Event()
                rec.restored_event.record(side)
            dev.record_stream(side)
        else:
            dev = rec.host.clone()
        rec.dev = dev
        rec.host = None
        rec.state = _RESTORED
        # Later users of this buffer (another offload) run on the same side stream, after this copy.
        if rec.release is not None:
            rec.release()
            rec.release = None
        self.stats.restored_tensors += 1
        if prefetch:
            self.stats.prefetched_tensors += 1

    def _prefetch_before(self, index: int) -> None:
        for i in range(index - 1, -1, -1):
            prev = self._order[i]()
            if prev is None or prev.state == _RESTORED or prev.shared:
                continue  # a shared storage is restored when first needed, once
            if prev.state == _ON_HOST:
                self._restore(prev, prefetch=True)
            return

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        rec = packed.record
        with self._lock:
            if not rec.used:
                rec.used = True
                if rec in self._pending:  # the backward reached the last scope: it stays on device
                    self._pending.remove(rec)
                    self._count_kept(rec)
            if packed.tensor is not None:
                return packed.tensor
            if rec.state == _ON_HOST:
                self._restore(rec, prefetch=False)
            if rec.restored_event is not None:
                torch.cuda.current_stream(rec.device).wait_event(rec.restored_event)
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


class SaveOnCpuScope:
    """Stock's offload as a ``pack_scope`` provider: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
    around each checkpoint call, exactly what transformers' ``activation_checkpointing_kwargs={"offload":
    True}`` installs (transformers 5.23 ``_activation_checkpointing_enable``). Used on accelerators the
    asynchronous path does not support (MPS, XPU) so a run keeps the memory stock's offload freed.

    Args:
        device_type: the accelerator type (``"mps"``, ``"xpu"``, ...) the saved tensors come from.

    Guarantees: the same hooks and copies as stock (blocking); no pool, no streams.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def pack_scope(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=self.device_type)


def _storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Storage addresses of `tensors`; a DTensor (FSDP2 parameter) contributes its local shard's storage
    (the python DTensor wrapper has no storage of its own)."""
    from torch.distributed.tensor import DTensor

    ptrs = set()
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.layout == torch.strided:
            ptrs.add(local.untyped_storage().data_ptr())
    return ptrs
