"""Moving one recorded storage to host memory and back: host pools, side streams and events.

``ActivationOffload`` (``ops/offload/offload.py``) decides *what* moves and *when*; this module does the move.
A :class:`StorageRecord` is one device storage packed during a step (every view of it shares the
record); :class:`Transfers` owns, per device, one bounded host pool (``ops/offload/host_pool.py``) and, on
CUDA, one side stream.

Ordering on CUDA (nothing here blocks the host thread):
    - offload: the side stream waits for the event recorded on the compute stream when the storage was
      (last) produced, copies into a pinned buffer without blocking, and ``record_stream`` keeps the
      caching allocator from reusing the device block before the copy ends;
    - restore: a new device block is allocated on the compute stream, the side stream waits for the
      compute stream (the block may still be read by queued kernels), copies back and records
      ``restored_event``; the consumer's stream waits for that event (:meth:`Transfers.wait_restored`);
    - end of step: each compute stream waits for its side stream (a GPU-side wait).
On CPU (``simulate``) the same state machine runs with plain host buffers and synchronous copies.

Contract: a host buffer is given back to its pool exactly once: when the storage is restored, or when
the record dies unrestored (the graph was dropped). A pool that refuses a buffer (cap, pinned
allocation failure) leaves the storage on the device with one warning; nothing here raises for it.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from .host_pool import HostBuffer, HostPool, HostPoolStats

logger = logging.getLogger(__name__)

__all__ = ["ON_DEVICE", "ON_HOST", "RESTORED", "StorageRecord", "Transfers"]

# States of a recorded storage.
ON_DEVICE = 0  # still on the device, original storage (pending or kept)
ON_HOST = 1  # copied out; only the host buffer holds the data
RESTORED = 2  # copied back to a new device storage


class StorageRecord:
    """One storage packed during a step (views of the same storage share it: dedupe).

    Args:
        index: position in the step's packing order (the prefetch walks it backwards).
        nbytes: the storage's size in bytes.
        device: where the storage lives.
        ref: a weak reference to the storage (keeps its address from being reused while it is a key).
    """

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
        self.state = ON_DEVICE
        self.dev: torch.Tensor | None = None  # uint8 tensor over the device storage
        self.host: HostBuffer | None = None  # the host bytes (one or more pinned extents)
        self.ready: Any = None  # event: the source is produced (compute stream, recorded at pack)
        self.restored_event: Any = None  # event: the host-to-device copy finished (side stream)
        self.used = False  # unpacked at least once
        self.shared = False  # packed again by a later checkpoint after it was offloaded (not prefetched)
        self.release: weakref.finalize | None = None  # returns ``host`` to the pool exactly once

    def watch(self, t: torch.Tensor) -> None:
        """Take ``t``'s whole storage as the bytes to copy; on CUDA the copy will wait for its producer."""
        self.dev = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        if t.device.type == "cuda":
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(t.device))

    def produced_again(self, t: torch.Tensor) -> None:
        """A later pack of the same storage: the copy must also follow this producer."""
        if self.ready is not None:
            self.ready.record(torch.cuda.current_stream(t.device))


class Transfers:
    """Per-device host pools and side streams; copies a record's bytes out and back.

    Args:
        min_slab_bytes: the pools' smallest slab (the offload's ``min_bytes``).
        max_pool_bytes: cap on each device's pool (``HostPool``'s ``max_bytes``).
    """

    def __init__(self, *, min_slab_bytes: int, max_pool_bytes: int | None | str) -> None:
        self.min_slab_bytes = min_slab_bytes
        self.max_pool_bytes = max_pool_bytes
        self.pools: dict[tuple[str, int], HostPool] = {}  # per device: buffers follow one side stream
        self.side_streams: dict[int, Any] = {}
        self._warned = False

    def offload(self, rec: StorageRecord) -> bool:
        """Start copying ``rec`` to a host buffer (asynchronously on CUDA); False when no buffer was
        available (the storage stays on the device, warned about once)."""
        assert rec.dev is not None
        is_cuda = rec.device.type == "cuda"
        pool = self._pool(rec.device)
        host = pool.take(rec.nbytes)
        if host is None:  # the pool's cap, or the host refused pinned memory (OOM, locked-memory limit)
            if not self._warned:
                self._warned = True
                logger.warning(
                    f"ActivationOffload: no host buffer for {rec.nbytes} bytes (pool holds "
                    f"{pool.held_bytes} of max_pool_bytes={pool.max_bytes}, or the pinned allocation failed); "
                    "keeping those activations on the device."
                )
            return False
        if is_cuda:
            side = self._side_stream(rec.device)
            side.wait_event(rec.ready)
            with torch.cuda.stream(side):
                host.copy_from(rec.dev, non_blocking=True)
            rec.dev.record_stream(side)  # the allocator must not reuse the storage before the copy ends
        else:
            host.copy_from(rec.dev)
        rec.host = host
        rec.release = weakref.finalize(rec, pool.give, host)  # also runs if the graph is dropped unused
        rec.release.atexit = False
        rec.dev = None
        rec.ready = None
        rec.state = ON_HOST
        return True

    def restore(self, rec: StorageRecord) -> None:
        """Copy a host storage back to a new device storage (asynchronously on CUDA)."""
        assert rec.host is not None
        if rec.device.type == "cuda":
            compute = torch.cuda.current_stream(rec.device)
            side = self._side_stream(rec.device)
            dev = torch.empty(rec.nbytes, dtype=torch.uint8, device=rec.device)  # allocated on compute
            side.wait_stream(compute)  # the block may still be read by queued compute kernels
            with torch.cuda.stream(side):
                rec.host.copy_to(dev, non_blocking=True)
                rec.restored_event = torch.cuda.Event()
                rec.restored_event.record(side)
            dev.record_stream(side)
        else:
            dev = rec.host.to_tensor()
        rec.dev = dev
        rec.host = None
        rec.state = RESTORED
        # Later users of this buffer (another offload) run on the same side stream, after this copy.
        if rec.release is not None:
            rec.release()
            rec.release = None

    @staticmethod
    def wait_restored(rec: StorageRecord) -> None:
        """Order the consumer's (current) stream after ``rec``'s host-to-device copy."""
        if rec.restored_event is not None:
            torch.cuda.current_stream(rec.device).wait_event(rec.restored_event)

    def end_step(self) -> list[HostPoolStats]:
        """Order each compute stream after its side stream's copies, close the step in every pool, and
        return the pools' stats."""
        for idx, stream in self.side_streams.items():
            # order later compute after our copies without blocking the host thread (a CPU sync
            # here stalled every micro-batch until its backward had nearly finished on the GPU)
            torch.cuda.current_stream(idx).wait_stream(stream)
        for pool in self.pools.values():
            pool.end_step()
        return [p.stats for p in self.pools.values()]

    def clear(self) -> None:
        """Release every idle host slab of every pool."""
        for pool in self.pools.values():
            pool.clear()

    def _pool(self, device: torch.device) -> HostPool:
        is_cuda = device.type == "cuda"
        idx = (device.index if device.index is not None else torch.cuda.current_device()) if is_cuda else -1
        pool = self.pools.get((device.type, idx))
        if pool is None:
            pool = self.pools[(device.type, idx)] = HostPool(
                pin=is_cuda, max_bytes=self.max_pool_bytes, min_slab_bytes=self.min_slab_bytes
            )
        return pool

    def _side_stream(self, device: torch.device) -> Any:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        stream = self.side_streams.get(idx)
        if stream is None:
            stream = self.side_streams[idx] = torch.cuda.Stream(device=idx)
        return stream
