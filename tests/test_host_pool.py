"""HostPool (CPU, pin=False): bounded for any sequence of shapes, exact byte counts, cap, pressure."""

from __future__ import annotations

import random

import pytest
import torch

from hf_ddpfix.ops.offload.host_pool import ALIGNMENT, HostPool, default_max_bytes, pow2ceil

HIDDEN_BYTES = 128 * 4  # one token of fp32 hidden states: 512 bytes, so every buffer is ALIGNMENT-exact


def run_offload_like_step(pool: HostPool, sizes: list[int]) -> tuple[int, list[torch.Tensor]]:
    """Take ``sizes`` in order (forward), give back in reverse (backward); returns the step's need."""
    bufs, in_use, need = [], 0, 0
    for n in sizes:
        buf = pool.take(n)
        assert buf is not None and buf.numel() == n and buf.dtype == torch.uint8
        buf.fill_(len(bufs) % 251)
        bufs.append(buf)
        in_use += n
        need = max(need, in_use)
        assert pool.stats.in_use_bytes == in_use
    for i, buf in reversed(list(enumerate(bufs))):
        assert int(buf[0]) == i % 251 and int(buf[-1]) == i % 251  # nobody else wrote into it
        pool.give(buf)
    return need, bufs


def test_two_hundred_steps_of_random_lengths_keep_pool_within_twice_the_largest_step():
    rng = random.Random(0)
    pool = HostPool(pin=False, max_bytes=None, min_slab_bytes=0)
    layers = 6
    largest = 0
    for step in range(200):
        tokens = rng.randint(1, 64) * rng.randint(50, 400)  # batch x padded length, dynamic padding
        sizes = [tokens * HIDDEN_BYTES] * (layers - 1)
        need, _ = run_offload_like_step(pool, sizes)
        pool.end_step()
        largest = max(largest, need)
        s = pool.stats
        assert s.need_bytes == largest and s.in_use_bytes == 0
        assert s.held_bytes <= 2 * largest, (step, s)  # after each step
        assert s.peak_held_bytes <= 2 * largest, (step, s)  # at every moment so far
        assert s.slabs == 1
    # the exact-size pool of old allocated a new buffer set for nearly every new length
    assert pool.stats.slab_allocations < 40, pool.stats


def test_lengths_in_turn_reuse_one_slab():
    pool = HostPool(pin=False, max_bytes=None, min_slab_bytes=0)
    allocations = []
    for length in (100, 101, 102, 103, 104, 105) * 3:
        run_offload_like_step(pool, [length * HIDDEN_BYTES] * 3)
        pool.end_step()
        allocations.append(pool.stats.slab_allocations)
    # step 1 has no expectation (one 64 KiB slab per buffer), end_step folds them into one slab of
    # pow2ceil(3 x 100 x 512) = 256 KiB, which then holds every later length
    assert set(allocations) == {4}, allocations
    assert pool.stats.held_bytes == pow2ceil(3 * 100 * HIDDEN_BYTES) == 256 * 1024


def test_mixed_sizes_with_unaligned_requests_never_overlap_and_accounting_is_exact():
    rng = random.Random(1)
    pool = HostPool(pin=False, max_bytes=None, min_slab_bytes=0)
    live: dict[int, torch.Tensor] = {}
    expect_in_use = 0
    for i in range(400):
        if live and rng.random() < 0.45:
            key = rng.choice(list(live))
            buf = live.pop(key)
            assert bool((buf == key % 256).all())
            pool.give(buf)
            expect_in_use -= buf.numel()
        else:
            n = rng.randint(1, 50_000)
            buf = pool.take(n)
            assert buf is not None and buf.numel() == n
            buf.fill_(i % 256)
            live[i] = buf
            expect_in_use += n
        assert pool.stats.in_use_bytes == expect_in_use
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in live.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    offsets = [off for _, off, _, _ in pool._owner.values()]  # within each slab: 512-byte granules
    assert len(offsets) == len(live) and all(off % ALIGNMENT == 0 for off in offsets)
    for buf in live.values():
        pool.give(buf)
    with pytest.raises(ValueError, match="not a buffer"):
        pool.give(buf)


def test_cap_refuses_instead_of_growing_and_idle_slabs_are_released_first():
    cap = 4 * 1024 * 1024
    pool = HostPool(pin=False, max_bytes=cap, min_slab_bytes=0)
    a = pool.take(3 * 1024 * 1024)
    assert a is not None and pool.held_bytes == cap
    assert pool.take(2 * 1024 * 1024) is None and pool.stats.refused == 1  # would need 4 + 2 MiB
    pool.give(a)
    b = pool.take(1024 * 1024)  # fits in the idle 4 MiB slab
    assert b is not None and pool.held_bytes == cap
    pool.give(b)
    c = pool.take(cap)
    assert c is not None and pool.held_bytes == cap
    pool.give(c)
    pool.end_step()
    assert pool.held_bytes <= cap
    with pytest.raises(ValueError, match="max_bytes"):
        HostPool(pin=False, max_bytes=-1)


def test_end_step_folds_overflow_slabs_and_clear_releases_everything():
    pool = HostPool(pin=False, max_bytes=None, min_slab_bytes=0)
    need, _ = run_offload_like_step(pool, [1000 * 512, 3000 * 512, 7000 * 512])
    assert pool.stats.slabs >= 2  # first step: no expectation, one slab per overflow
    pool.end_step()
    assert pool.stats.slabs == 1 and pool.held_bytes == pow2ceil(need)
    run_offload_like_step(pool, [1000 * 512, 3000 * 512, 7000 * 512])
    pool.end_step()
    assert pool.stats.slab_allocations == 4  # 3 in step 1, 1 folded; step 2 reused it
    buf = pool.take(512)
    pool.clear()  # a buffer in use keeps its slab
    assert pool.stats.slabs == 1
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
