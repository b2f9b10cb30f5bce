"""The `auto` memory plan (hf_ddpfix/plan/memory_fit.py): the cheapest prefix of the feature ladder that fits.

Pure: facts in, decisions out (no device). The figures are the CPU ledger's projections (docs/memory.md);
the device is an H100's 79.2 GiB and the model a Llama-8B shape (32 layers, hidden 4096, vocab 128256,
16.06 GB of bf16 weights).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from hf_ddpfix.config.options import DDPFixConfig
from hf_ddpfix.facts.gather import gather_memory_facts, tokens_per_step
from hf_ddpfix.plan.memory_fit import LADDER, fit_memory, project_bytes
from hf_ddpfix.plan.resolve import resolve_plan
from hf_ddpfix.plan.types import MemoryFacts, RunFacts

GIB = 1 << 30
H100 = MemoryFacts(device_total_bytes=int(79.2 * GIB), tokens=8192, tokens_source="SFTConfig.max_length", layers=32,
                   hidden=4096, vocab=128256, fixed_bytes=int(16.06e9), host_budget_bytes=64 * GIB)
AUTO = DDPFixConfig(tiled_mlp="auto", tiled_loss="auto", long_context="auto")
ALL_LC = "rms_norm,attention,tiled_layer"


def _facts(tokens: int | None, memory: MemoryFacts | None = H100, **kw) -> RunFacts:
    m = None if memory is None else replace(memory, tokens=tokens)
    return RunFacts(checkpointing="non_reentrant", accelerator_available=True, rank_device="cuda:0", memory=m, **kw)


def _values(plan) -> tuple:
    return plan.tiled_loss.value, plan.tiled_mlp.value, plan.long_context.value


def test_stock_fits_turns_nothing_on_and_says_so():
    plan = resolve_plan(_facts(32768), AUTO)  # 32K: stock projects 70.9 GiB (measured 70.97 on an H100)
    assert _values(plan) == (False, False, False)
    for d in (plan.tiled_loss, plan.tiled_mlp, plan.long_context):
        assert "auto: not needed" in d.reason and "stock fits" in d.reason and "GiB" in d.reason


@pytest.mark.parametrize("tokens, expected", [
    (65536, ("on", False, False)),  # the full-vocabulary logits are what no longer fits
    (131072, ("on", "auto", False)),  # + TiledMLP (auto shards: >= 8K tokens)
])
def test_longer_turns_on_the_cheapest_prefix_that_fits(tokens, expected):
    plan = resolve_plan(_facts(tokens), AUTO)
    assert _values(plan) == expected
    assert "cheapest set that fits" in plan.tiled_loss.reason


def test_long_context_layers_last_and_with_offload():
    """280K tokens fit only with every feature and the (explicit) offload (TiledMLP + offload would need more than
    the 64 GiB host budget): long_context turns on its full set."""
    c = replace(AUTO, offload_activations=True)
    plan = resolve_plan(_facts(280 * 1024), c)
    assert plan.offload_activations.value is True
    assert _values(plan) == ("on", "auto", ALL_LC)
    assert "tiled_loss+tiled_mlp+long_context" in plan.long_context.reason


def test_tiled_mlp_below_8k_gets_a_fixed_shard_count():
    """A small device where 6K tokens need TiledMLP: the auto shard rule would not tile below 8K tokens."""
    small = replace(H100, device_total_bytes=int(5 * GIB), fixed_bytes=int(0.5 * GIB), vocab=32000)
    fit = fit_memory(replace(small, tokens=6144), ("tiled_loss", "tiled_mlp", "long_context"), (), "non_reentrant")
    assert fit.features == ("tiled_loss", "tiled_mlp") and fit.fits
    plan = resolve_plan(_facts(6144, small), AUTO)
    assert plan.tiled_mlp.value == "3"  # ceil(6144 / 2048) shards


@pytest.mark.parametrize("tokens", [4096, 32768, 40000, 65536, 100000, 131072, 150000, 180000])
def test_the_choice_is_the_smallest_fitting_prefix(tokens):
    m = replace(H100, tokens=tokens)
    auto = ("tiled_loss", "tiled_mlp", "long_context")
    fit = fit_memory(m, auto, (), "non_reentrant")
    assert fit.fits and fit.features == auto[:len(fit.features)]
    assert project_bytes(m, frozenset(fit.features))[1]
    if fit.features:  # one feature fewer does not fit
        assert not project_bytes(m, frozenset(fit.features[:-1]))[1]


def test_impossible_length_warns_with_every_feature_on():
    plan = resolve_plan(_facts(1 << 20), AUTO)  # 1M tokens, no offload
    assert _values(plan) == ("on", "auto", ALL_LC)
    reason = plan.long_context.reason
    assert "WARNING projected not to fit even with every feature" in reason
    assert "longest that fits about" in reason and "HF_DDPFIX_OFFLOAD_ACTIVATIONS=1" in reason
    fit = fit_memory(replace(H100, tokens=1 << 20), ("tiled_loss", "tiled_mlp", "long_context"), (), "non_reentrant")
    assert not fit.fits and fit.need_bytes > fit.budget_bytes


@pytest.mark.parametrize("memory, tokens, why", [
    (None, 32768, "no device memory facts"),  # CPU: the gatherer returns None
    (H100, None, "tokens per step"),
    (replace(H100, unknown="fsdp: weights sharded"), 32768, "fsdp: weights sharded"),
])
def test_unknown_facts_keep_todays_rules_and_say_so(memory, tokens, why):
    plan = resolve_plan(_facts(tokens, memory), AUTO)
    assert _values(plan) == ("on", "auto", False)  # today: tiled loss on, TiledMLP's 8K rule, stock layers
    for d in (plan.tiled_loss, plan.tiled_mlp, plan.long_context):
        assert why in d.reason and "today's auto rule kept" in d.reason


def test_reentrant_checkpointing_is_not_projected():
    fit = fit_memory(replace(H100, tokens=1024), ("tiled_mlp",), (), "reentrant")
    assert not fit.known and "non-reentrant" in fit.reason


def test_explicit_options_are_unchanged_by_memory_facts():
    c = DDPFixConfig(tiled_mlp="4", tiled_loss="on", long_context="attention")
    for facts in (_facts(1024), _facts(1 << 20), _facts(1024, None)):
        assert _values(resolve_plan(facts, c)) == ("on", "4", "attention")
    assert _values(resolve_plan(_facts(1024), DDPFixConfig())) == (False, False, False)


def test_cpu_run_unchanged():
    """No accelerator: no memory facts, today's auto values (the CPU suite's runs)."""
    facts = RunFacts(checkpointing="non_reentrant")
    assert _values(resolve_plan(facts, AUTO)) == ("on", "auto", False)
    trainer = SimpleNamespace(args=SimpleNamespace(device="cpu"))
    assert gather_memory_facts(trainer, None, "single") is None


def test_config_keeps_auto():
    assert (AUTO.tiled_loss, AUTO.tiled_mlp, AUTO.long_context) == ("auto", "auto", "auto")
    assert DDPFixConfig(tiled_loss="on").tiled_loss == "on" and DDPFixConfig(long_context="all").long_context == ALL_LC


def test_tokens_per_step_sources():
    class SFTConfig(SimpleNamespace):
        pass

    class DPOConfig(SimpleNamespace):  # chosen + rejected concatenated: max_length is not one forward's tokens
        pass

    assert tokens_per_step(SimpleNamespace(args=SFTConfig(max_length=2048, per_device_train_batch_size=2)))[0] == 4096
    assert tokens_per_step(SimpleNamespace(args=DPOConfig(max_length=2048, per_device_train_batch_size=2)))[0] is None
    assert tokens_per_step(SimpleNamespace(args=SimpleNamespace(max_seq_length=512)))[0] == 512
    collator = SimpleNamespace(padding="max_length", max_length=1000)
    plain = SimpleNamespace(per_device_train_batch_size=1)
    assert tokens_per_step(SimpleNamespace(args=plain, data_collator=collator))[0] == 1000
    longest = SimpleNamespace(padding=True, max_length=1000)  # pads to the batch's longest: no bound
    tokens, why = tokens_per_step(SimpleNamespace(args=plain, data_collator=longest))
    assert tokens is None and "no sequence length" in why


def test_ladder_order():
    assert LADDER == ("tiled_loss", "tiled_mlp", "offload", "long_context")


def test_gather_memory_facts_on_a_cuda_device(monkeypatch):
    """The CUDA path of the gatherer (no GPU here: the device query is replaced; the model is real)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    model.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * GIB))
    args = SimpleNamespace(device="cuda:0", max_seq_length=512, per_device_train_batch_size=2, bf16=True)
    m = gather_memory_facts(SimpleNamespace(args=args), model, "ddp")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert m == MemoryFacts(device_total_bytes=80 * GIB, tokens=1024, tokens_source=m.tokens_source, layers=2,
                            hidden=32, vocab=128, dtype_bytes=2, fixed_bytes=params + 12 * 128 * 32,
                            host_budget_bytes=m.host_budget_bytes, unknown="")
    assert "max_seq_length=512" in m.tokens_source
    sharded = gather_memory_facts(SimpleNamespace(args=args), model, "fsdp")
    assert sharded.fixed_bytes is None and "sharded" in sharded.unknown


def test_sequence_parallel_divides_the_tokens_per_device():
    from hf_ddpfix.plan.memory import decide_memory_fit
    from hf_ddpfix.plan.types import Decision

    facts, off = _facts(65536), Decision(False, "not requested")
    assert decide_memory_fit(facts, AUTO, "non_reentrant", off).features == ("tiled_loss",)
    fit = decide_memory_fit(facts, AUTO, "non_reentrant", off, sp_size=2)  # 32K tokens per device: stock fits
    assert fit.features == () and fit.tokens == 32768 and "sequence_parallel=2" in fit.reason


def test_explicit_features_count_in_every_prefix():
    """An explicit tiled loss makes 64K fit with no auto feature; the reason does not claim stock fits."""
    c = DDPFixConfig(tiled_mlp="auto", tiled_loss="on", long_context="auto")
    plan = resolve_plan(_facts(65536), c)
    assert _values(plan) == ("on", False, False)
    assert "fits with the explicit tiled_loss" in plan.tiled_mlp.reason and "stock fits" not in plan.tiled_mlp.reason


@pytest.mark.parametrize("env, option", [
    ({"HF_DDPFIX_TILED_MLP": "on"}, "tiled_mlp"), ({"HF_DDPFIX_TILED_MLP": "1"}, "tiled_mlp"),
    ({"UNSLOTH_TILED_MLP": "1"}, "tiled_mlp"), ({"HF_DDPFIX_TILED_LOSS": "1"}, "tiled_loss"),
    ({"HF_DDPFIX_LONG_CONTEXT": "on"}, "long_context"), ({"HF_DDPFIX_OFFLOAD_ACTIVATIONS": "true"}, "offload_activations"),
])
def test_an_explicit_on_runs_where_stock_fits(env, option):
    """on/1/true asks for the feature: it runs where the memory plan would leave `auto` off (stock fits at 8K
    tokens on an H100), and only `auto` consults the fit."""
    c = DDPFixConfig.from_env(env)
    explicit = resolve_plan(_facts(8192), c)
    decision = getattr(explicit, option)
    assert decision.value and decision.value != "auto" and "not needed" not in decision.reason, decision
    auto = resolve_plan(_facts(8192), DDPFixConfig.from_env({k: "auto" for k in env}))
    assert not getattr(auto, option).value and "stock fits" in getattr(auto, option).reason


def test_tiled_mlp_on_is_forced_not_the_auto_rule():
    plan = resolve_plan(_facts(8192), DDPFixConfig(tiled_mlp="on", tiled_loss="auto"))
    assert plan.tiled_mlp.value == "on" and "on as asked" in plan.tiled_mlp.reason
    assert "fits with the explicit tiled_mlp" in plan.tiled_mlp.reason  # on in every projection


OFFLOAD_AUTO = replace(AUTO, offload_activations="auto")


@pytest.mark.parametrize("tokens, offload, expected", [
    (131072, False, ("on", "auto", False)),  # fits without copying: no offload
    (200 * 1024, True, ("on", "auto", False)),  # offload before the long-context layers (the ladder's order)
    (280 * 1024, True, ("on", "auto", ALL_LC)),  # TiledMLP + offload would need more than the 64 GiB host cap
])
def test_offload_auto_is_a_rung_of_the_ladder(tokens, offload, expected):
    plan = resolve_plan(_facts(tokens), OFFLOAD_AUTO)
    assert plan.offload_activations.value is offload and _values(plan) == expected
    assert "auto memory plan" in plan.offload_activations.reason


def test_offload_auto_unknown_or_ineligible_is_unset():
    assert DDPFixConfig(offload_activations="auto").offload_activations == "auto"
    assert DDPFixConfig(offload_activations="1").offload_activations is True
    cpu = resolve_plan(RunFacts(checkpointing="non_reentrant"), OFFLOAD_AUTO)  # today: auto meant unset
    assert cpu.offload_activations.value is False and "today's auto rule kept" in cpu.offload_activations.reason
    reentrant = replace(_facts(280 * 1024), checkpointing="reentrant", parallel="single")
    assert resolve_plan(reentrant, OFFLOAD_AUTO).offload_activations.value is False
    # transformers' own offload request stays what it was
    asked = replace(_facts(1024), offload_requested=True)
    assert resolve_plan(asked, OFFLOAD_AUTO).offload_activations.value is True


def test_offload_auto_on_mps_keeps_transformers_offload_as_unset_does():
    facts = RunFacts(checkpointing="non_reentrant", accelerator_available=True, rank_device="mps", offload_requested=True)
    assert resolve_plan(facts, OFFLOAD_AUTO).offload_activations == resolve_plan(facts, DDPFixConfig()).offload_activations
