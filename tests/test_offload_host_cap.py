"""The offload host pool's cap as an option: HF_DDPFIX_OFFLOAD_HOST_GIB / DDPFixConfig(offload_host_gib=...)."""

from __future__ import annotations

import pytest

from hf_ddpfix.config.options import DDPFixConfig
from hf_ddpfix.plan.memory import offload_max_pool_bytes
from hf_ddpfix.plan.types import RunFacts

GIB = 1 << 30


@pytest.mark.parametrize(("raw", "parsed"), [("auto", "auto"), ("Unlimited", "unlimited"), ("96", "96"),
                                             ("1.5", "1.5"), ("", None)])
def test_values_parse_from_the_environment(raw, parsed):
    assert DDPFixConfig.from_env({"HF_DDPFIX_OFFLOAD_HOST_GIB": raw}).offload_host_gib == parsed


@pytest.mark.parametrize("bad", ["0", "-3", "lots", "nan", "1e400"])
def test_bad_values_name_the_variable_and_the_allowed_values(bad):
    with pytest.raises(ValueError, match=r"HF_DDPFIX_OFFLOAD_HOST_GIB.*allowed: auto, unlimited"):
        DDPFixConfig.from_env({"HF_DDPFIX_OFFLOAD_HOST_GIB": bad})


def test_the_plan_turns_the_option_into_the_pools_cap():
    facts = RunFacts(host_memory_bytes=256 * GIB, local_processes=8)
    assert offload_max_pool_bytes(facts, DDPFixConfig()) == "default"  # a quarter of memory per process
    assert offload_max_pool_bytes(facts, DDPFixConfig.from_env({}, offload_host_gib="unlimited")) is None
    assert offload_max_pool_bytes(facts, DDPFixConfig.from_env({}, offload_host_gib="24")) == 24 * GIB
    assert offload_max_pool_bytes(RunFacts(), DDPFixConfig.from_env({}, offload_host_gib="24")) == 24 * GIB


def test_a_cap_the_host_cannot_hold_is_refused_before_training():
    facts = RunFacts(host_memory_bytes=256 * GIB, local_processes=8)
    c = DDPFixConfig.from_env({"HF_DDPFIX_OFFLOAD_HOST_GIB": "40"})
    with pytest.raises(ValueError, match=r"HF_DDPFIX_OFFLOAD_HOST_GIB=40.*8 process\(es\).*256\.0 GiB.*at most 32\.0"):
        offload_max_pool_bytes(facts, c)


def test_the_runtime_hands_the_cap_to_the_offload(monkeypatch):
    """runtime/attach.py builds ActivationOffload with the plan's cap (the pool refuses above it)."""
    import hf_ddpfix.runtime.attach as rt

    seen = {}

    class Spy:
        def __init__(self, **kw):
            seen.update(kw)
            raise RuntimeError("stop")

    monkeypatch.setattr(rt, "ActivationOffload", Spy)
    from hf_ddpfix.plan.types import Decision

    plan = type("P", (), {"offload_activations": Decision(True, ""), "offload_min_layer_bytes": 0,
                          "offload_max_pool_bytes": 5 * GIB})()
    from contextlib import ExitStack

    with pytest.raises(RuntimeError, match="stop"), ExitStack() as stack:
        rt.attach_runtime(None, None, plan, stack)
    assert seen.get("max_pool_bytes") == 5 * GIB


def test_resolve_plan_carries_the_cap_and_refuses_what_the_host_cannot_hold():
    from hf_ddpfix.plan.resolve import resolve_plan

    facts = RunFacts(host_memory_bytes=64 * GIB, local_processes=2)
    assert resolve_plan(facts, DDPFixConfig.from_env({}, offload_host_gib="8")).offload_max_pool_bytes == 8 * GIB
    with pytest.raises(ValueError, match="offload_host_gib|OFFLOAD_HOST_GIB"):
        resolve_plan(facts, DDPFixConfig.from_env({}, offload_host_gib="48"))
