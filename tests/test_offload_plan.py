"""The offload decision: on CUDA with the `auto` policy threshold and its reason; truthful on MPS/XPU."""

from __future__ import annotations

import torch

from hf_ddpfix.config.options import DDPFixConfig
from hf_ddpfix.ops.offload import SaveOnCpuScope
from hf_ddpfix.plan import RunFacts, resolve_plan
from hf_ddpfix.plan.memory import DEFAULT_OFFLOAD_MIN_LAYER_MIB


def facts(device: str = "cuda:0", requested: bool = True) -> RunFacts:
    return RunFacts(parallel="ddp", world_size=2, checkpointing="non_reentrant", offload_requested=requested,
                    accelerator_available=True, rank_device=device)


def test_cuda_offload_is_on_with_the_measured_threshold_in_the_plan_log():
    plan = resolve_plan(facts())
    d = plan.offload_activations
    assert d.value is True and d.changed
    assert plan.offload_min_layer_bytes == DEFAULT_OFFLOAD_MIN_LAYER_MIB << 20 == 64 << 20
    assert ">= 64 MiB" in d.reason and "1.57x" in d.reason and "0.99x" in d.reason
    assert "(default)" in d.reason


def test_min_layer_mib_zero_copies_every_step_and_a_value_sets_the_threshold():
    always = resolve_plan(facts(), DDPFixConfig.from_env({"HF_DDPFIX_OFFLOAD_MIN_LAYER_MIB": "0"}))
    assert always.offload_min_layer_bytes == 0 and "every step copies" in always.offload_activations.reason
    custom = resolve_plan(facts(), DDPFixConfig.from_env({}, offload_min_layer_mib=16))
    assert custom.offload_min_layer_bytes == 16 << 20 and ">= 16 MiB" in custom.offload_activations.reason


def test_mps_and_xpu_keep_transformers_offload_and_never_claim_ours():
    for device in ("mps", "xpu:0"):
        stock = resolve_plan(facts(device))
        assert stock.offload_activations.value == "stock", stock.offload_activations
        assert "CUDA/ROCm only" in stock.offload_activations.reason
        assert "transformers' own offload kept" in stock.offload_activations.reason
        ours = resolve_plan(facts(device, requested=False), DDPFixConfig.from_env({}, offload_activations=True))
        assert ours.offload_activations.value is False and "CUDA/ROCm only" in ours.offload_activations.reason


def test_save_on_cpu_scope_is_stocks_hook():
    scope = SaveOnCpuScope("cpu").pack_scope()
    assert isinstance(scope, torch.autograd.graph.save_on_cpu)


def test_runtime_logs_when_the_policy_switches_between_keeping_and_copying(caplog):
    import logging

    from torch import nn

    from hf_ddpfix.integrations.checkpointing import CheckpointFunction
    from hf_ddpfix.ops.offload import ActivationOffload
    from hf_ddpfix.runtime.attach import _logged_offload_steps

    class _Rank0:
        def is_world_process_zero(self) -> bool:
            return True

    off = ActivationOffload(min_bytes=0, simulate=True, min_layer_bytes=100 * 16 * 4)
    step = _logged_offload_steps(_Rank0(), off)
    ckpt = CheckpointFunction(False, off)
    lin = nn.Linear(16, 16)
    with caplog.at_level(logging.INFO, logger="hf_ddpfix"):
        for rows in (10, 10, 200, 200, 10):
            with step():
                h = torch.randn(rows, 16) * 1
                h.requires_grad_()
                for _ in range(3):
                    h = ckpt(lin, h)
                h.sum().backward()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("offload: ")]
    assert [line.split(":")[1].strip() for line in lines] == ["keep", "copy", "keep"], lines


def test_trainer_runs_the_offload_each_step_in_simulate_mode_and_trains_as_stock(tmp_path, monkeypatch):
    """Through DDPFixTrainer: the plan turns offload on (an accelerator is reported), the runtime's
    ActivationOffload copies through host buffers (simulate: CPU tensors, the CUDA state machine), the
    feature counts show it ran every step, and the weights equal a run without offload bit for bit."""
    import dataclasses
    import functools

    from test_runtime import BATCH, HIDDEN, LAYERS, SEQ, build, trainable

    import hf_ddpfix.runtime.attach as runtime_mod
    import hf_ddpfix.trainer as trainer_mod
    from hf_ddpfix.ops import feature_counts
    from hf_ddpfix.ops.offload import ActivationOffload

    ref_model, ref = build(tmp_path / "ref", {"use_reentrant": False})
    ref.train()
    real = trainer_mod.gather_facts
    monkeypatch.setattr(trainer_mod, "gather_facts",
                        lambda tr: dataclasses.replace(real(tr), accelerator_available=True))
    monkeypatch.setattr(runtime_mod, "ActivationOffload", functools.partial(ActivationOffload, min_bytes=0, simulate=True))
    monkeypatch.setenv("HF_DDPFIX_OFFLOAD_MIN_LAYER_MIB", "0")  # copy always: these layers are tiny
    feature_counts.reset()
    model, trainer = build(tmp_path / "off", {"use_reentrant": False, "offload": True})
    trainer.train()
    off = trainer.hf_ddpfix_runtime.offload
    assert trainer.hf_ddpfix_plan.offload_activations.value is True and off.keep_auto
    layer = BATCH * SEQ * HIDDEN * 4
    assert off.stats.steps == 2 and off.stats.offloaded_tensors == LAYERS - 1 and off.stats.in_flight == 0, off.stats
    assert off.stats.policy == "copy: always"
    c = feature_counts.snapshot()["offload"]
    assert c.ran == 2 and c.amounts["copies"] == 2 * (LAYERS - 1) and c.amounts["bytes"] == 2 * (LAYERS - 1) * layer
    assert c.fell_back == 0
    a, b = trainable(ref_model), trainable(model)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
