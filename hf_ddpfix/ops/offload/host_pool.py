"""``HostPool``: a bounded pool of (pinned) host memory for activation offload, held near the need.

Why a buffer may be scattered over several pieces: a pool of contiguous buffers must guess a step's
shape before the step ends. The pool of old sized a step's slab from the previous step's first request
(dynamic padding scales every layer input alike), and held up to 12.8x the largest step's need during
a tiny BART step whose source and target lengths vary independently, 4x on a VLM alternating image and
text batches, up to 1708x with two micro-batches of different lengths per optimizer step (measured in
simulate mode, CPU). Here a request is served from *any* free bytes: a ``HostBuffer`` is a list of
extents (usually one), the copy out and back runs once per extent. Nothing is ever "too fragmented",
so the pool grows only by the bytes missing, never by a guess.

Why power-of-two slabs: torch's pinned allocator (``CachingHostAllocator``) rounds every block up to
a power of two and caches freed blocks until ``empty_host_cache()``. The pool allocates what is
missing as a few power-of-two slabs (the binary digits of the size, rounded to a granule ``q``), so
torch's rounding adds nothing and the pool's ``held_bytes`` are the pinned bytes torch holds for it.

    need(t) = the most bytes in use at once up to moment t (each buffer rounded up to ``ALIGNMENT``)
    q(n)    = max(granule, pow2floor(n) / 64)   (granule = pow2floor(min_slab_bytes), >= ALIGNMENT)

A ``take`` that finds fewer free bytes than it asks for allocates the ``missing`` bytes rounded up to
``q(missing)`` (at most ``SLAB_DIGITS`` slabs). ``end_step()`` with nothing in use and more than
``MAX_SLABS`` slabs re-lays the pool out as the digits of ``need`` rounded up to ``q(need)``.

Usage::

    pool = HostPool(pin=True)                   # one per device / copy stream
    buf = pool.take(nbytes)                     # HostBuffer of exactly nbytes, or None (cap / host refused)
    buf.copy_from(dev_bytes)                    # device uint8 [nbytes] -> host (per extent)
    buf.copy_to(dev_bytes)                      # host -> device
    pool.give(buf)                              # back to the free lists (exactly once)
    pool.end_step()                             # after each step

Guarantees (``tests/test_host_pool.py``, ``tests/test_offload_shapes.py``):
    - At **every** moment ``held_bytes <= need(t) + max(granule, need(t) / 64)``, so ``<= 2 x need(t)``
      whenever one request so far was at least one granule (the offload's requests are >= its
      ``min_bytes``, the granule) -- whatever the order and sizes of the requests, across steps and
      micro-batches. ``stats.peak_held_bytes`` and ``stats.max_held_over_need`` record it.
    - ``held_bytes`` never exceeds ``max_bytes``; a request that does not fit under it returns ``None``
      (the caller keeps its tensor where it is).
    - A failed pinned allocation (host out of memory, locked-memory limit) releases torch's cached
      pinned blocks, retries once, else returns ``None`` (a growth is all or nothing).
    - Host pressure (pinned pools by default): a new slab that would leave less than
      ``min_free_fraction`` of physical memory available (``MemAvailable``, Linux; read by
      ``ops/offload/host_memory.py``) is not allocated and the request is refused (``None``).
    - Extents handed out never overlap; ``give`` of a buffer not from this pool raises ``ValueError``.
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
    "MAX_SLABS",
    "SLAB_DIGITS",
    "HostBuffer",
    "HostPool",
    "HostPoolStats",
    "default_max_bytes",
    "host_available_bytes",
]

# Extents start on 64-byte boundaries (a cache line; DMA engines copy any alignment, vectorised host
# copies want 64). Activation rows are multiples of 64 bytes for every hidden size >= 32 in bf16.
ALIGNMENT = 64

# Growth is rounded to 1/64 of its size: at most 1.6% over the missing bytes, at most 7 slabs per growth.
_DIGIT_SHIFT = 6
SLAB_DIGITS = _DIGIT_SHIFT + 1

# More slabs than this after a step (many small growths) -> re-laid out as the digits of the need.
MAX_SLABS = 16


def _pow2floor(n: int) -> int:
    return 1 << (int(n).bit_length() - 1) if n >= 1 else 0


def _align(n: int) -> int:
    return -(-int(n) // ALIGNMENT) * ALIGNMENT


def _round_up(n: int, q: int) -> int:
    return -(-int(n) // q) * q


@dataclass
class HostPoolStats:
    """Byte counters of a ``HostPool`` (exact bytes; slabs counted at their full size)."""

    held_bytes: int = 0  # bytes of every slab the pool owns (in use or idle)
    slabs: int = 0
    in_use_bytes: int = 0  # requested bytes of the buffers handed out and not given back
    in_use_buffers: int = 0
    step_need_bytes: int = 0  # most requested bytes in use at once since the last end_step()
    need_bytes: int = 0  # the largest step need so far (requested bytes)
    peak_held_bytes: int = 0  # largest held_bytes ever
    max_held_over_need: float = 0.0  # largest held_bytes / need(t) at any moment (<= 2 by the guarantee)
    slab_allocations: int = 0  # slabs ever allocated (cumulative; flat once the pool is warm)
    slab_releases: int = 0  # slabs ever released (re-layout, clear, a failed growth)
    takes: int = 0
    extents: int = 0  # extents handed out (== takes when every buffer is contiguous)
    refused: int = 0  # takes answered None (cap reached or host allocation failed)

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


class _Slab:
    """One host allocation; ``free`` holds sorted, non-adjacent ``[offset, size]`` ranges."""

    __slots__ = ("tensor", "size", "free", "used")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.size = int(tensor.numel())
        self.free: list[list[int]] = [[0, self.size]]
        self.used = 0  # aligned bytes handed out from this slab

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


class HostBuffer:
    """``nbytes`` of host memory handed out by a ``HostPool``: one or more uint8 extents, in order.

    Guarantees: ``sum(e.numel() for e in extents) == nbytes``; the extents overlap no other buffer.
    """

    __slots__ = ("extents", "nbytes", "_pieces", "__weakref__")

    def __init__(self, extents: list[torch.Tensor], pieces: list[tuple[_Slab, int, int]], nbytes: int) -> None:
        self.extents = extents
        self.nbytes = nbytes
        self._pieces = pieces  # (slab, offset, aligned length) per extent

    def copy_from(self, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy a uint8 tensor of ``nbytes`` elements (any device) into the extents."""
        off = 0
        for e in self.extents:
            e.copy_(src[off : off + e.numel()], non_blocking=non_blocking)
            off += e.numel()

    def copy_to(self, dst: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy the extents into a uint8 tensor of ``nbytes`` elements (any device)."""
        off = 0
        for e in self.extents:
            dst[off : off + e.numel()].copy_(e, non_blocking=non_blocking)
            off += e.numel()

    def to_tensor(self) -> torch.Tensor:
        """The bytes as one new (unpinned) CPU uint8 tensor."""
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        self.copy_to(out)
        return out


class HostPool:
    """Bounded host memory served from power-of-two slabs (see the module docstring).

    Args:
        pin: allocate page-locked memory (needed for asynchronous device copies; False on CPU runs).
        max_bytes: cap on ``held_bytes`` (default: ``default_max_bytes()``, a quarter of physical
            memory per local process; ``None`` when that cannot be read means no cap).
        min_slab_bytes: the growth granule is ``pow2floor(min_slab_bytes)`` (at least ``ALIGNMENT``);
            the offload passes its ``min_bytes`` (default 1 MiB), the smallest tensor it moves.
        min_free_fraction: never allocate a slab that leaves less than this fraction of physical memory
            available (default: 0.1 for pinned memory, which cannot be swapped out; 0 for plain memory;
            0 turns the check off).

    Raises:
        ValueError: ``max_bytes`` or ``min_slab_bytes`` negative, ``min_free_fraction`` outside [0, 1).
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
        self.granule = max(ALIGNMENT, _pow2floor(int(min_slab_bytes)))
        self._slabs: list[_Slab] = []
        self._owner: dict[int, HostBuffer] = {}  # id -> buffer handed out
        self._lock = threading.Lock()
        self._aligned_in_use = 0  # in_use_bytes with each buffer rounded up to ALIGNMENT
        self._free = 0  # free bytes over every slab
        self._max_aligned_need = 0  # need(t)
        self.stats = HostPoolStats()

    # ------------------------------------------------------------------ public

    @property
    def held_bytes(self) -> int:
        return self.stats.held_bytes

    def host_tensors(self) -> list[torch.Tensor]:
        """The host tensor of every slab the pool owns, in use or idle: for an audit of ``held_bytes``
        (the bytes their storages hold are the bytes the pool really holds; ``tests/test_host_pool.py``)."""
        with self._lock:
            return [slab.tensor for slab in self._slabs]

    def take(self, nbytes: int) -> HostBuffer | None:
        """A ``HostBuffer`` of exactly ``nbytes``, or None when the cap or the host refuses.

        Guarantees: never overlaps another buffer in use; contents are undefined; afterwards
        ``held_bytes <= need(t) + max(granule, need(t) / 64)``.
        """
        n = int(nbytes)
        if n <= 0:
            raise ValueError(f"take: nbytes must be > 0, got {nbytes}")
        a = _align(n)
        with self._lock:
            st = self.stats
            st.takes += 1
            if self._free < a and not self._grow(a - self._free):
                st.refused += 1
                return None
            pieces = self._gather(a)
            extents, left = [], n
            for slab, off, length in pieces:
                k = min(length, left)
                extents.append(slab.tensor[off : off + k])
                left -= k
            buf = HostBuffer(extents, pieces, n)
            self._owner[id(buf)] = buf
            st.extents += len(pieces)
            st.in_use_bytes += n
            st.in_use_buffers += 1
            self._aligned_in_use += a
            self._max_aligned_need = max(self._max_aligned_need, self._aligned_in_use)
            st.step_need_bytes = max(st.step_need_bytes, st.in_use_bytes)
            st.need_bytes = max(st.need_bytes, st.step_need_bytes)
            st.max_held_over_need = max(st.max_held_over_need, st.held_bytes / self._max_aligned_need)
            return buf

    def give(self, buf: HostBuffer) -> None:
        """Return a buffer from ``take`` (exactly once).

        Raises:
            ValueError: ``buf`` is not a buffer of this pool currently handed out.
        """
        with self._lock:
            if self._owner.pop(id(buf), None) is not buf:
                raise ValueError("HostPool.give: not a buffer handed out by this pool (or given twice)")
            for slab, off, length in buf._pieces:
                slab.put_back(off, length)
                self._free += length
            self.stats.in_use_bytes -= buf.nbytes
            self.stats.in_use_buffers -= 1
            self._aligned_in_use -= sum(length for _, _, length in buf._pieces)

    def end_step(self) -> None:
        """Close a step; with nothing in use and more than ``MAX_SLABS`` slabs, re-lay the pool out as
        the power-of-two digits of need(t) rounded up to q(need).

        Guarantees: afterwards ``held_bytes <= need(t) + max(granule, need(t) / 64)`` still (at most
        ``SLAB_DIGITS`` slabs after a re-layout).
        """
        with self._lock:
            st = self.stats
            st.step_need_bytes = st.in_use_bytes
            if st.in_use_buffers or len(self._slabs) <= MAX_SLABS:
                return  # a graph kept alive past the step still holds buffers: re-lay out later
            self._drop_idle()
            self._allocate_digits(self._rounded(self._max_aligned_need))  # within the bound by construction

    def clear(self) -> None:
        """Release every idle slab (buffers in use stay valid and are freed when given back)."""
        with self._lock:
            self._drop_idle()

    # ------------------------------------------------------------------ internals (lock held)

    def _rounded(self, n: int) -> int:
        """``n`` rounded up to q(n) = max(granule, pow2floor(n) >> 6)."""
        return _round_up(n, max(self.granule, _pow2floor(n) >> _DIGIT_SHIFT)) if n > 0 else 0

    def _gather(self, a: int) -> list[tuple[_Slab, int, int]]:
        """Cut ``a`` free bytes: the smallest single range that holds them, else the largest ranges first."""
        best = None
        for slab in self._slabs:
            for i, (_, size) in enumerate(slab.free):
                if size >= a and (best is None or size < best[2]):
                    best = (slab, i, size)
        if best is not None:
            slab, i, _ = best
            self._free -= a
            return [(slab, slab.cut(i, a), a)]
        ranges = sorted(((size, off, slab) for slab in self._slabs for off, size in slab.free),
                        key=lambda r: -r[0])
        pieces, left = [], a
        for size, off, slab in ranges:
            k = min(size, left)
            i = bisect.bisect_left(slab.free, [off, 0])
            pieces.append((slab, slab.cut(i, k), k))
            left -= k
            if not left:
                break
        self._free -= a
        return pieces

    def _grow(self, missing: int) -> bool:
        """Allocate ``missing`` bytes rounded up to q (power-of-two slabs) under the cap; False if not."""
        size = self._rounded(missing)
        if self.max_bytes is not None and self.stats.held_bytes + size > self.max_bytes:
            size = _round_up(missing, self.granule)  # the finest growth may still fit under the cap
            if self.stats.held_bytes + size > self.max_bytes:
                return False
        return self._allocate_digits(size)

    def _allocate_digits(self, size: int) -> bool:
        """Add slabs whose sizes are the binary digits of ``size``; all or nothing."""
        digits = [1 << b for b in range(size.bit_length()) if size >> b & 1]
        made: list[_Slab] = []
        for d in sorted(digits, reverse=True):
            tensor = self._allocate(d)
            if tensor is None:
                for slab in made:  # all or nothing: a half-grown pool would only hold more bytes
                    self._slabs.remove(slab)
                    self._account(-slab.size, released=True)
                return False
            slab = _Slab(tensor)
            made.append(slab)
            self._slabs.append(slab)
            self._account(slab.size)
            self.stats.slab_allocations += 1
        return True

    def _account(self, size: int, released: bool = False) -> None:
        st = self.stats
        st.held_bytes += size
        self._free += size
        st.slabs = len(self._slabs)
        st.peak_held_bytes = max(st.peak_held_bytes, st.held_bytes)
        if released:
            st.slab_releases += 1

    def _drop_idle(self) -> None:
        idle = [s for s in self._slabs if s.idle]
        if not idle:
            return
        self._slabs = [s for s in self._slabs if not s.idle]
        for slab in idle:
            self._account(-slab.size, released=True)
        if self.pin:
            release_torch_host_cache()

    def _allocate(self, size: int) -> torch.Tensor | None:
        if leaves_too_little(size, self.min_free_fraction):  # host pressure: refuse rather than swap
            return None
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError:  # pinned allocation failed: release torch's cached pinned blocks, retry once
            release_torch_host_cache()
            try:
                return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            except RuntimeError:
                return None
