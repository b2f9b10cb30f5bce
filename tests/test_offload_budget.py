"""plan_offload_budget: the last inputs stay on the device as far as the budget allows; short budgets fail early."""

from __future__ import annotations

import pytest

from hf_ddpfix.ops.offload.budget import OffloadBudgetError, max_tokens, plan_offload_budget

GIB = 1 << 30
KIB = 1 << 10


def _llama8b(tokens: int, **kw):
    args = dict(layers=32, tokens=tokens, layer_bytes=tokens * 8 * KIB, fixed_device_bytes=int(16 * GIB),
                working_bytes_per_token=80 * KIB, device_budget_bytes=int(76 * GIB), host_budget_bytes=int(100 * GIB))
    args.update(kw)
    return plan_offload_budget(**args)


def test_keeps_as_many_inputs_as_the_device_budget_allows():
    b = _llama8b(32768)  # 0.25 GiB per layer input; working set 16 + 2.5 GiB
    assert b.keep_on_device == 32 and b.offloaded == 0 and b.host_bytes == 0
    b = _llama8b(262144)  # 2 GiB per layer input; working 16 + 20 GiB -> 40 GiB spare -> 20 inputs
    assert (b.keep_on_device, b.offloaded) == (20, 12)
    assert b.device_bytes == int(16 * GIB) + 262144 * 80 * KIB + 20 * 2 * GIB <= b.device_budget
    assert b.host_bytes == 24 * GIB  # exactly the 12 offloaded inputs: the pool holds no power-of-two slack


def test_host_budget_short_fails_early_with_numbers_and_the_longest_fitting_sequence():
    with pytest.raises(OffloadBudgetError) as err:
        _llama8b(524288)
    e = err.value
    assert e.which == "host" and e.needed > e.budget == 100 * GIB
    assert "host memory budget" in str(e) and "Longest sequence" in str(e)
    assert 0 < e.max_tokens < 524288
    _llama8b(e.max_tokens)  # fits
    with pytest.raises(OffloadBudgetError):
        _llama8b(e.max_tokens + 1)


def test_device_budget_short_names_the_device():
    with pytest.raises(OffloadBudgetError) as err:
        _llama8b(1 << 20, host_budget_bytes=int(10_000 * GIB))
    assert err.value.which == "device" and "device memory budget" in str(err.value)


def test_max_tokens_matches_plan_and_a_coarser_pool_granule_never_raises_it():
    kw = dict(layers=32, bytes_per_token_per_layer=8 * KIB, device_budget_bytes=int(76 * GIB),
              host_budget_bytes=int(100 * GIB), fixed_device_bytes=int(16 * GIB), working_bytes_per_token=80 * KIB)
    t = max_tokens(**kw)
    assert t > 0 and max_tokens(**kw, host_granule_bytes=1 << 30) <= t
    assert max_tokens(**{**kw, "device_budget_bytes": int(8 * GIB)}) == 0


def test_pool_bytes_is_what_the_host_pool_really_holds():
    import random

    from hf_ddpfix.ops.offload import HostPool
    from hf_ddpfix.ops.offload.budget import pool_bytes

    rng = random.Random(0)
    for _ in range(30):
        granule = 1 << rng.randint(6, 20)
        need = rng.randint(1, 1 << 26) // 64 * 64 + 64
        pool = HostPool(pin=False, max_bytes=None, min_slab_bytes=granule)
        buf = pool.take(need)
        assert pool.held_bytes == pool_bytes(need, granule) <= need + max(granule, need // 64), (need, granule)
        pool.give(buf)


@pytest.mark.parametrize("bad", [{"tokens": -1}, {"host_budget_bytes": "lots"}, {"layers": True}])
def test_bad_arguments_name_the_argument(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        _llama8b(1024, **bad) if "tokens" not in bad else plan_offload_budget(
            layers=2, tokens=-1, layer_bytes=1, device_budget_bytes=1, host_budget_bytes=1)


def test_max_tokens_is_the_largest_fitting_length_even_where_fitting_is_not_monotonic():
    """A larger host budget never lowers the answer, and nothing above the answer fits (checked by scan)."""
    kw = dict(layers=8, bytes_per_token_per_layer=1000, device_budget_bytes=10_000_000, fixed_device_bytes=1_000_000,
              working_bytes_per_token=3000.0)
    prev = 0
    for host in (1_000_000, 3_000_000, 5_000_000, 20_000_000):
        t = max_tokens(host_budget_bytes=host, **kw)
        assert t >= prev
        prev = t
        for above in range(t + 1, t + 3000, 7):
            with pytest.raises(OffloadBudgetError):
                plan_offload_budget(layers=8, tokens=above, layer_bytes=above * 1000, device_budget_bytes=10_000_000,
                                    host_budget_bytes=host, fixed_device_bytes=1_000_000, working_bytes_per_token=3000.0)


def test_max_keep_models_an_offload_that_keeps_a_fixed_number_of_inputs():
    b = _llama8b(262144, max_keep=1, host_budget_bytes=int(1000 * GIB))
    assert (b.keep_on_device, b.offloaded) == (1, 31) and b.host_bytes == 62 * GIB  # exact: 31 x 2 GiB
    assert _llama8b(262144, max_keep=1).host_bytes == 62 * GIB  # 100 GiB allowed: fits (outside raises)
    with pytest.raises(OffloadBudgetError) as err:
        _llama8b(262144, max_keep=1, host_budget_bytes=int(31 * GIB))  # a quarter of 125 GiB does not
    assert err.value.which == "host"
    t = err.value.max_tokens
    kw = dict(layers=32, bytes_per_token_per_layer=8 * KIB, device_budget_bytes=int(76 * GIB),
              host_budget_bytes=int(31 * GIB), fixed_device_bytes=int(16 * GIB), working_bytes_per_token=80 * KIB)
    assert t == max_tokens(**kw, max_keep=1) < max_tokens(**kw)
