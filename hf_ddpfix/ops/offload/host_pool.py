"""``HostPool``: a bounded pool of (pinned) host buffers for activation offload.

Why not one buffer per exact byte size: with dynamic padding every step has a new sequence length,
so a pool keyed by exact size never reuses a buffer and grows without bound (lengths 100..105 in turn
gave 3, 6, 9, 12, 15, 18 pooled buffers on torch 2.13). Why not size classes over separate buffers:
torch's pinned allocator (``CachingHostAllocator``) rounds every pinned block up to a power of two
and caches freed blocks until ``torch.accelerator.empty_host_cache()``, so per-buffer classes waste
up to 2x on top of whatever the classes waste, and every dropped buffer stays pinned in torch's cache.

The design here: a few **slabs** whose sizes are powers of two (so torch's rounding adds nothing),
each sub-allocated exactly (best fit over a free list with coalescing, ``ALIGNMENT``-byte granules).
An offload step allocates in stack order (forward: layer 0, 1, ...; backward frees in reverse), so
one slab at least as large as a step's need is reused by every later step of that size or less.

    need(step)   = the most bytes the step had handed out at once, each buffer rounded up to
                   ``ALIGNMENT`` (exact for activations whose rows are multiples of 512 bytes, and
                   < 0.05% above the requested bytes for the >= 1 MiB tensors the offload moves)
    P            = the largest need of any step so far

Sizing: the first ``take`` while nothing is in use (a step or micro-batch starting) sizes the main
slab for the step it expects: the previous step's need scaled by this request's size over the
previous step's first request (dynamic padding scales every layer input alike), rounded up to a power
of two. A request that fits nowhere gets an overflow slab of ``pow2ceil(request)`` (at most 2x its
bytes). ``end_step()`` folds overflow slabs into one main slab of ``pow2ceil(need)``.

Usage::

    pool = HostPool(pin=True)                   # one per device / copy stream
    buf = pool.take(nbytes)                     # uint8 [nbytes] host view, or None (cap reached)
    ...                                         # copy into it, copy back out
    pool.give(buf)                              # back to the free list (exactly once)
    pool.end_step()                             # after each step: records the need, consolidates

Guarantees (``tests/test_host_pool.py``):
    - After every ``end_step()`` with nothing in use, ``held_bytes <= max(2 * P, min_slab_bytes)``.
    - ``held_bytes`` never exceeds ``max_bytes``; a request that does not fit under the cap even after
      every idle slab is released returns ``None`` (the caller keeps its tensor where it is).
    - A failed pinned allocation (host out of memory, locked-memory limit) releases idle slabs and
      torch's cached pinned blocks, retries once with the smallest slab that fits, else returns ``None``.
    - Host pressure (pinned pools by default): a new slab that would leave less than ``min_free_fraction``
      of physical memory available (``MemAvailable``, Linux; read by ``ops/offload/host_memory.py``) is not
      allocated; idle slabs are released first, then the request is refused (``None``) rather than
      pushing the host into swap or the OOM killer.
    - Buffers handed out never overlap; ``give`` of a buffer not from this pool raises ``ValueError``.
    - Thread-safe (autograd runs unpack hooks on its device threads).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import asdict, dataclass

import torch

from .host_memory import (
    DEFAULT_HOST_FRACTION,
    default_max_bytes,
    host_available_bytes,
    leaves_too_little,
    release_torch_host_cache,
)

__all__ = [
    "ALIGNMENT",
    "DEFAULT_HOST_FRACTION",
    "HostPool",
    "HostPoolStats",
    "default_max_bytes",
    "host_available_bytes",
    "pow2ceil",
]

# Sub-allocations start on 512-byte boundaries: DMA engines and vectorised host copies want at least
# 256-byte alignment; 512 keeps the waste per buffer below 0.05% for the >= 1 MiB tensors offloaded.
ALIGNMENT = 512


def pow2ceil(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _align(n: int) -> int:
    return -(-int(n) // ALIGNMENT) * ALIGNMENT


@dataclass
class HostPoolStats:
    """Byte counters of a ``HostPool`` (exact bytes; slabs counted at their full size)."""

    held_bytes: int = 0  # bytes of every slab the pool owns (in use or idle)
    slabs: int = 0
    in_use_bytes: int = 0  # requested bytes of the buffers handed out and not given back
    in_use_buffers: int = 0
    step_need_bytes: int = 0  # most requested bytes in use at once since the last end_step()
    need_bytes: int = 0  # P: the largest step need so far
    peak_held_bytes: int = 0  # largest held_bytes ever
    slab_allocations: int = 0  # slabs ever allocated (cumulative; flat once the pool is warm)
    slab_releases: int = 0  # slabs ever released (consolidation, pressure, cap, clear)
    takes: int = 0
    refused: int = 0  # takes answered None (cap reached or host allocation failed)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Slab:
    """One host allocation; ``free`` holds sorted, non-adjacent ``[offset, size]`` ranges."""

    __slots__ = ("tensor", "size", "free", "used")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.size = int(tensor.numel())
        self.free: list[list[int]] = [[0, self.size]]
        self.used = 0  # aligned bytes handed out from this slab

    def best_fit(self, n: int) -> int | None:
        """Index into ``free`` of the smallest range that holds ``n`` bytes (None: none does)."""
        best, best_size = None, None
        for i, (_, size) in enumerate(self.free):
            if size >= n and (best_size is None or size < best_size):
                best, best_size = i, size
        return best

    def cut(self, i: int, n: int) -> int:
        off, size = self.free[i]
        if size == n:
            del self.free[i]
        else:
            self.free[i] = [off + n, size - n]
        self.used += n
        return off

    def put_back(self, off: int, n: int) -> None:
        i = bisect.bisect_left(self.free, [off, 0])
        self.free.insert(i, [off, n])
        if i + 1 < len(self.free) and off + n == self.free[i + 1][0]:  # merge with the next range
            self.free[i][1] += self.free.pop(i + 1)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:  # merge with the previous one
            self.free[i - 1][1] += self.free.pop(i)[1]
        self.used -= n

    @property
    def idle(self) -> bool:
        return self.used == 0

    @property
    def largest_free(self) -> int:
        return max((s for _, s in self.free), default=0)


class HostPool:
    """Bounded host buffers sub-allocated from power-of-two slabs (see the module docstring).

    Args:
        pin: allocate page-locked memory (needed for asynchronous device copies; False on CPU runs).
        max_bytes: cap on ``held_bytes`` (default: ``default_max_bytes()``, a quarter of physical
            memory per local process; ``None`` when that cannot be read means no cap).
        min_slab_bytes: smallest slab allocated (default 1 MiB, the offload's smallest tensor).
        min_free_fraction: never allocate a slab that leaves less than this fraction of physical memory
            available (default: 0.1 for pinned memory, which cannot be swapped out; 0 for plain memory;
            0 turns the check off).

    Raises:
        ValueError: ``max_bytes`` or ``min_slab_bytes`` negative.
    """

    def __init__(self, *, pin: bool, max_bytes: int | None | str = "default", min_slab_bytes: int = 1 << 20,
                 min_free_fraction: float | None = None):
        if max_bytes == "default":
            max_bytes = default_max_bytes()
        if max_bytes is not None and int(max_bytes) < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        if min_slab_bytes < 0:
            raise ValueError(f"min_slab_bytes must be >= 0, got {min_slab_bytes}")
        if min_free_fraction is None:
            min_free_fraction = 0.1 if pin else 0.0
        if not 0 <= min_free_fraction < 1:
            raise ValueError(f"min_free_fraction must be in [0, 1), got {min_free_fraction}")
        self.min_free_fraction = float(min_free_fraction)
        self.pin = pin
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.min_slab_bytes = int(min_slab_bytes)
        self._slabs: list[_Slab] = []
        self._owner: dict[int, tuple[_Slab, int, int, int]] = {}  # data_ptr -> (slab, off, aligned, requested)
        self._lock = threading.Lock()
        self._aligned_in_use = 0  # in_use_bytes with each buffer rounded up to ALIGNMENT
        self._step_aligned_need = 0
        self._max_aligned_need = 0  # P with every buffer rounded up to ALIGNMENT
        self._last_need = 0  # aligned need of the last step that took anything
        self._last_first = 0  # its first request
        self._first = 0  # this step's first request
        self.stats = HostPoolStats()

    # ------------------------------------------------------------------ public

    @property
    def held_bytes(self) -> int:
        return self.stats.held_bytes

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 host tensor of exactly ``nbytes`` elements, or None when the cap or the host refuses.

        Guarantees: never overlaps another buffer in use; contents are undefined.
        """
        n = int(nbytes)
        if n <= 0:
            raise ValueError(f"take: nbytes must be > 0, got {nbytes}")
        a = _align(n)
        with self._lock:
            st = self.stats
            st.takes += 1
            if st.in_use_buffers == 0:
                self._size_main_for_step(n)
            if not self._first:
                self._first = n
            slab, off = self._fit(a)
            if slab is None:
                slab = self._grow(a, self._slab_size(a))
                if slab is None:
                    st.refused += 1
                    return None
                off = slab.cut(0, a)
            buf = slab.tensor[off : off + n]
            self._owner[buf.data_ptr()] = (slab, off, a, n)
            st.in_use_bytes += n
            st.in_use_buffers += 1
            self._aligned_in_use += a
            self._step_aligned_need = max(self._step_aligned_need, self._aligned_in_use)
            self._max_aligned_need = max(self._max_aligned_need, self._step_aligned_need)
            st.step_need_bytes = max(st.step_need_bytes, st.in_use_bytes)
            st.need_bytes = max(st.need_bytes, st.step_need_bytes)
            return buf

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from ``take`` (exactly once).

        Raises:
            ValueError: ``buf`` is not a buffer of this pool currently handed out.
        """
        with self._lock:
            entry = self._owner.pop(buf.data_ptr(), None)
            if entry is None:
                raise ValueError("HostPool.give: not a buffer handed out by this pool (or given twice)")
            slab, off, a, n = entry
            slab.put_back(off, a)
            self.stats.in_use_bytes -= n
            self.stats.in_use_buffers -= 1
            self._aligned_in_use -= a

    def end_step(self) -> None:
        """Close a step: record its need, fold overflow slabs into one, keep ``held <= 2 * P``.

        Guarantees: with nothing in use afterwards, at most one slab remains and
        ``held_bytes <= max(2 * P, min_slab_bytes)``.
        """
        with self._lock:
            st = self.stats
            if self._step_aligned_need:
                self._last_need, self._last_first = self._step_aligned_need, self._first
            self._first = 0
            st.step_need_bytes = st.in_use_bytes
            self._step_aligned_need = self._aligned_in_use
            if st.in_use_buffers:
                return  # a graph kept alive past the step still holds buffers: consolidate later
            target = self._slab_size(self._last_need) if self._last_need else 0
            if len(self._slabs) > 1 or (self._slabs and self._slabs[0].size > max(target, 2 * self._max_aligned_need)):
                self._drop_idle()
                if target:
                    self._grow(target, target)

    def clear(self) -> None:
        """Release every idle slab (buffers in use stay valid and are freed when given back)."""
        with self._lock:
            self._drop_idle()

    # ------------------------------------------------------------------ internals (lock held)

    def _slab_size(self, a: int) -> int:
        return pow2ceil(max(a, self.min_slab_bytes))

    def _fit(self, a: int) -> tuple[_Slab | None, int | None]:
        best_slab, best_i, best_size = None, None, None
        for slab in self._slabs:
            i = slab.best_fit(a)
            if i is not None and (best_size is None or slab.free[i][1] < best_size):
                best_slab, best_i, best_size = slab, i, slab.free[i][1]
        if best_slab is None or best_i is None:
            return None, None
        return best_slab, best_slab.cut(best_i, a)

    def _size_main_for_step(self, n: int) -> None:
        """Nothing in use: make sure one slab can hold what this step is expected to need."""
        if not self._last_need or not self._last_first:
            return
        expect = _align(self._last_need * n // self._last_first)
        if any(s.largest_free >= expect for s in self._slabs):
            return
        size = self._slab_size(expect)
        if self.max_bytes is not None and size > self.max_bytes:
            return  # let the requests come one by one under the cap
        self._drop_idle()
        self._grow(size, size)

    def _drop_idle(self) -> None:
        before = len(self._slabs)
        kept = [s for s in self._slabs if not s.idle]
        dropped = before - len(kept)
        if not dropped:
            return
        self._slabs = kept
        self.stats.slab_releases += dropped
        self.stats.slabs = len(kept)
        self.stats.held_bytes = sum(s.size for s in kept)
        if self.pin:
            release_torch_host_cache()

    def _allocate(self, size: int) -> torch.Tensor | None:
        if leaves_too_little(size, self.min_free_fraction):  # host pressure: give back what is idle, then look again
            self._drop_idle()
            if leaves_too_little(size, self.min_free_fraction):
                return None
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError:  # pinned allocation failed: release what we can and retry once
            self._drop_idle()
            release_torch_host_cache()
            try:
                return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            except RuntimeError:
                return None

    def _grow(self, a: int, size: int) -> _Slab | None:
        """Add a slab of ``size`` bytes (or the smallest that holds ``a``) under the cap; None if not."""
        smallest = self._slab_size(a)
        for want in dict.fromkeys((size, smallest)):
            if self.max_bytes is not None and self.stats.held_bytes + want > self.max_bytes:
                self._drop_idle()
                if self.stats.held_bytes + want > self.max_bytes:
                    continue
            tensor = self._allocate(want)
            if tensor is None:
                continue
            slab = _Slab(tensor)
            self._slabs.append(slab)
            st = self.stats
            st.slab_allocations += 1
            st.slabs = len(self._slabs)
            st.held_bytes += slab.size
            st.peak_held_bytes = max(st.peak_held_bytes, st.held_bytes)
            return slab
        return None
