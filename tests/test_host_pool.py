"""HostPool (CPU, pin=False): bounded for any sequence of shapes, exact byte counts, cap, pressure."""

from __future__ import annotations

import random

import pytest
import torch

from hf_ddpfix.ops.offload.host_pool import ALIGNMENT, MAX_SLABS, HostBuffer, HostPool, default_max_bytes

HIDDEN_BYTES = 128 * 4  # one token of fp32 hidden states: 512 bytes, a multiple of ALIGNMENT


def real_held_bytes(pool: HostPool) -> int:
    """The bytes the pool's slabs really hold: their storages' sizes (each storage once), not the pool's counter."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in pool.host_tensors()}
    return sum(storages.values())


class Watched:
    """Drives a pool and checks its bound after every take: held <= need(t) + max(granule, need/64) <= 2 need."""

    def __init__(self, pool: HostPool) -> None:
        self.pool, self.in_use, self.need, self.worst = pool, 0, 0, 0.0
        self.live: dict[int, HostBuffer] = {}

    def take(self, key: int, n: int) -> HostBuffer:
        buf = self.pool.take(n)
        assert buf is not None and buf.nbytes == n == sum(e.numel() for e in buf.extents)
        for e in buf.extents:  # mark both ends of every extent (whole-buffer fills cost seconds here)
            e[0] = e[-1] = key % 251
        self.live[key] = buf
        self.in_use += -(-n // ALIGNMENT) * ALIGNMENT
        self.need = max(self.need, self.in_use)
        held = real_held_bytes(self.pool)
        assert held == self.pool.held_bytes == self.pool.stats.held_bytes, (held, self.pool.held_bytes)
        assert held <= self.need + max(self.pool.granule, self.need // 64) and held <= 2 * self.need, (held, self.need)
        self.worst = max(self.worst, held / self.need)
        assert self.pool.stats.in_use_bytes == sum(b.nbytes for b in self.live.values())
        return buf

    def give(self, key: int) -> None:
        buf = self.live.pop(key)
        assert all(int(e[0]) == int(e[-1]) == key % 251 for e in buf.extents)  # nobody else wrote into it
        self.pool.give(buf)
        self.in_use -= -(-buf.nbytes // ALIGNMENT) * ALIGNMENT


def run_offload_like_step(w: Watched, sizes: list[int], base: int = 0) -> None:
    """Take ``sizes`` in order (forward), give back in reverse (backward)."""
    for i, n in enumerate(sizes):
        w.take(base + i, n)
    for i in reversed(range(len(sizes))):
        w.give(base + i)


def test_two_hundred_steps_of_random_lengths_keep_pool_within_twice_the_need_at_every_moment():
    rng = random.Random(0)
    w = Watched(HostPool(pin=False, max_bytes=None, min_slab_bytes=0))
    for _ in range(200):
        tokens = rng.randint(1, 64) * rng.randint(50, 400)  # batch x padded length, dynamic padding
        run_offload_like_step(w, [tokens * HIDDEN_BYTES] * 5)
        w.pool.end_step()
        assert w.pool.stats.in_use_bytes == 0 and w.pool.stats.slabs <= MAX_SLABS
    # the README / BENCHMARKS figure "<= 1.01x on varied shapes" (measured 1.0047 here, 2026-11-27; the bound by
    # construction is 1 + 1/64 = 1.0156 once the need passes 64 granules)
    assert w.pool.stats.max_held_over_need == w.worst <= 1.01, w.worst
    print(f"random lengths: held / need at worst {w.worst:.4f}, {w.pool.stats.slab_allocations} slabs allocated")
    assert w.pool.stats.slab_allocations < 200, w.pool.stats  # grows only when the need grows


def test_any_order_of_takes_and_gives_stays_bounded_never_overlaps_and_counts_exactly():
    """Sizes and order adversarial for a contiguous pool: tiny then huge, interleaved frees."""
    rng = random.Random(1)
    w = Watched(HostPool(pin=False, max_bytes=None, min_slab_bytes=0))
    for i in range(600):
        if w.live and rng.random() < 0.45:
            w.give(rng.choice(list(w.live)))
        else:
            w.take(i, rng.choice([rng.randint(1, 4096), rng.randint(1, 300_000), rng.randint(1, 3_000_000)]))
        if rng.random() < 0.05:
            w.pool.end_step()
    spans = sorted((e.data_ptr(), e.data_ptr() + e.numel()) for b in w.live.values() for e in b.extents)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    assert w.pool.stats.extents >= w.pool.stats.takes  # some buffers were scattered over several slabs
    print(f"adversarial order: held / need at worst {w.worst:.4f}, {w.pool.stats.extents} extents for "
          f"{w.pool.stats.takes} takes")
    for key in list(w.live):
        w.give(key)
    with pytest.raises(ValueError, match="not a buffer"):
        w.pool.give(HostBuffer([], [], 1))


def test_slabs_are_powers_of_two_and_hold_exactly_the_need_at_the_granule():
    pool = HostPool(pin=False, max_bytes=None, min_slab_bytes=1 << 20)
    w = Watched(pool)
    run_offload_like_step(w, [3 * (1 << 20) + 5000, 5 * (1 << 20)])
    assert all(s.size & (s.size - 1) == 0 for s in pool._slabs)  # torch's pinned rounding adds nothing
    assert pool.held_bytes == real_held_bytes(pool) == 9 << 20  # 8 MiB + 5000 bytes rounded up to the 1 MiB granule


def test_cap_refuses_instead_of_growing():
    cap = 4 * 1024 * 1024
    pool = HostPool(pin=False, max_bytes=cap, min_slab_bytes=0)
    a = pool.take(3 * 1024 * 1024)
    assert a is not None and pool.held_bytes == 3 * 1024 * 1024
    assert pool.take(2 * 1024 * 1024) is None and pool.stats.refused == 1  # would need 3 + 2 MiB
    b = pool.take(1024 * 1024)  # exactly fills the cap
    assert b is not None and pool.held_bytes == cap
    pool.give(a)
    pool.give(b)
    c = pool.take(cap)  # every free byte serves, in several extents
    assert c is not None and pool.held_bytes == cap and len(c.extents) == 3  # slabs of 2, 1 and 1 MiB
    pool.give(c)
    pool.end_step()
    assert pool.held_bytes <= cap
    with pytest.raises(ValueError, match="max_bytes"):
        HostPool(pin=False, max_bytes=-1)


def test_end_step_relays_many_small_slabs_out_and_clear_releases_everything():
    pool = HostPool(pin=False, max_bytes=None, min_slab_bytes=0)
    w = Watched(pool)
    for k in range(1, 40):  # the need grows a little every step: one small growth each
        run_offload_like_step(w, [k * 4096 + 64])
        pool.end_step()
        assert pool.stats.slabs <= MAX_SLABS
    assert pool.stats.slab_releases > 0  # re-laid out at least once
    buf = pool.take(512)
    pool.clear()  # a buffer in use keeps its slab
    assert pool.stats.slabs >= 1
    pool.give(buf)
    pool.clear()
    assert pool.held_bytes == 0 and pool.stats.slabs == 0


def test_failed_host_allocation_returns_none(monkeypatch):
    pool = HostPool(pin=False, max_bytes=None, min_slab_bytes=0)
    real_empty = torch.empty

    def failing_empty(*args, **kwargs):
        raise RuntimeError("cudaHostAlloc: out of memory")

    monkeypatch.setattr(torch, "empty", failing_empty)
    assert pool.take(4096) is None and pool.stats.refused == 1
    monkeypatch.setattr(torch, "empty", real_empty)
    assert pool.take(4096) is not None


def test_default_cap_is_a_quarter_of_memory_per_local_process():
    one = default_max_bytes(env={})
    four = default_max_bytes(env={"LOCAL_WORLD_SIZE": "4"})
    assert one is not None and one > 0 and four == one // 4
    assert HostPool(pin=False).max_bytes == default_max_bytes()


def test_host_pressure_refuses_a_slab_that_would_leave_too_little_memory(monkeypatch):
    import hf_ddpfix.ops.offload.host_memory as hm

    total = 1 << 30
    available = {"bytes": 200 << 20}
    monkeypatch.setattr(hm, "physical_bytes", lambda: total)
    monkeypatch.setattr(hm, "host_available_bytes", lambda: available["bytes"])
    pool = HostPool(pin=False, max_bytes=None, min_slab_bytes=0, min_free_fraction=0.1)  # keep 102.4 MiB free
    small = pool.take(64 << 20)  # 200 - 64 = 136 MiB left: fine
    assert small is not None
    available["bytes"] -= 64 << 20
    assert pool.take(64 << 20) is None and pool.stats.refused == 1  # 136 - 64 = 72 MiB < 102.4 MiB
    pool.give(small)
    assert pool.stats.held_bytes == 64 << 20  # the idle slab stays while nothing needs its memory
    assert HostPool(pin=False, max_bytes=None, min_free_fraction=0).take(64 << 20) is not None  # check off
    with pytest.raises(ValueError, match="min_free_fraction"):
        HostPool(pin=False, min_free_fraction=1.0)
