"""The long-context plan line per decoder layer type (issue 47 item 1): what the plan says = what the run patches =
what its counters show, on today's hybrid and sliding families.

- Qwen3.5 (gated-delta-net linear-attention layers + gated full attention) and Qwen3-Next (a hybrid no issue names):
  the linear-attention layers stock with the reason, the gated full-attention layers patched (counted); Gemma 4
  (sliding + full layers, ``shared_kv_states``): every layer type named with its count and left stock with its reason;
  one training step with ``long_context=all`` equals stock to 2e-6 (the RMSNorm patch's backward), bit for bit with
  the layer features alone where every layer stays stock;
- Llama and Gemma 3 (sliding + full): every layer patched, each type's patched calls counted = its layer count;
- the verdict read from a meta-device model (``hf-ddpfix plan``) is the verdict the run acts on (same kinds, same
  reasons), and the plan's ``long_context`` lines are ``kind_lines`` of those kinds;
- ``hf-ddpfix plan --set long_context=all`` on a Qwen3.5-27B-shaped config prints 48 linear-attention layers stock
  and 16 full-attention layers stock, with the reasons.

Qwen3.5's and Qwen3-Next's gated full attention (``o_proj(attn * sigmoid(gate))``) runs patched: the structural
check finds the one multiplication between the kernel and ``o_proj`` and the patched layer applies it (the gate is
captured from the module's own forward, ``layer_forms.capture_attention_inputs(gate=True)``).

How each check was shown failing (2026-12-02): before the gate was applied, the same structure check refused these
layers ("output gate (mul) before o_proj") and the expectations below failed on ``patched``; with a gate applied in
the plan but not in the forward, the gated test fails on the loss (below); a layer without ``self_attn`` given a
``True`` verdict fails at ``apply_long_context`` (no ``self_attn`` to patch).
"""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
from fixtures import layer_family_config, layer_family_model, skip_unless_shipped

transformers = pytest.importorskip("transformers")

from hf_ddpfix.integrations.long_context.layer_kinds import kind_lines, layer_kinds  # noqa: E402
from hf_ddpfix.integrations.long_context.long_context import apply_long_context  # noqa: E402

SEQ, VOCAB = 12, 96

def _model(name: str):
    return layer_family_model(layer_family_config(name))


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _plan_lines(model) -> tuple[str, ...]:
    from hf_ddpfix.config.options import DDPFixConfig
    from hf_ddpfix.facts.gather import model_facts
    from hf_ddpfix.plan.resolve import resolve_plan
    from hf_ddpfix.plan.types import RunFacts

    facts = RunFacts(parallel="ddp", world_size=2, **model_facts(model, "ddp"))
    return resolve_plan(facts, DDPFixConfig(long_context="all")).long_context.details


#: family -> {layer type: (layers, patched?, words of the reason)}
EXPECTED = {
    "qwen3_5": {"linear_attention": (3, False, "recurrent scan: linear_attn (Qwen3_5GatedDeltaNet)"),
                "full_attention": (1, True, "pre-norm, probed at first call; output gate before o_proj applied")},
    "qwen3_next": {"linear_attention": (3, False, "recurrent scan: linear_attn (Qwen3NextGatedDeltaNet)"),
                   "full_attention": (1, True, "pre-norm, probed at first call; output gate before o_proj applied")},
    "gemma4": {"sliding_attention": (3, False, "attention needs shared_kv_states"),
               "full_attention": (1, False, "attention needs shared_kv_states")},
    "gemma3": {"sliding_attention": (3, True, "sandwich, probed at first call; calls over the 64-token window stock"),
               "full_attention": (1, True, "sandwich, probed at first call")},
    "llama": {"LlamaDecoderLayer": (2, True, "pre-norm, probed at first call")},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_hybrid_and_shared_kv_families_plan_line_equals_what_runs_and_counters(name):
    """The plan's lines per layer type = the run's patched layers = its counters; one step equals stock."""
    stock = _model(name)
    model = copy.deepcopy(stock)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    loss0, g0 = _step(stock, ids)
    with torch.device("meta"):  # the offline plan's model: the same config on the meta device
        meta = transformers.AutoModelForCausalLM.from_config(stock.config)
    offline = layer_kinds(meta)
    plan_lines = _plan_lines(model)
    handle = apply_long_context(model, "all", tokens_per_tile=5)
    loss1, g1 = _step(model, ids)
    # the plan (offline and at run time) and the run's patch act on the same verdicts
    assert [(k.label, k.count, k.patched, k.reason) for k in offline] == \
        [(k.label, k.count, k.patched, k.reason) for k in handle.kinds]
    assert plan_lines == kind_lines(handle.kinds), plan_lines
    expected = EXPECTED[name]
    assert {k.label: (k.count, k.patched, k.short) for k in handle.kinds} == expected, handle.kinds
    for label, (count, patched, _) in expected.items():
        layers = [e for e in handle.report if e.kind == label]
        assert len(layers) == count and all(bool(e.patched) == patched for e in layers), layers
        # every layer of a patched type ran patched once (no checkpointing: one forward); a stock type never did
        assert handle.stats[f"patched calls [{label}]"] == (count if patched else 0), dict(handle.stats)
        assert handle.stats[f"stock calls [{label}]"] == 0, dict(handle.stats)
    assert g0.keys() == g1.keys()
    # the RMSNorm patch's backward agrees to rounding (its fp32 sums in another order): measured 2026-12-02 on Gemma 4
    # (every layer stock, 25 norms patched) at most 1.7e-6 on a gradient of 1.47 (the embedding), 2.8e-7 elsewhere
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=2e-6, atol=2e-6, msg=n)
    handle.remove()
    if all(not p for _, p, _ in expected.values()):  # the layer features alone: every layer stock, bit for bit
        handle = apply_long_context(model, "attention,tiled_layer", tokens_per_tile=5)
        loss2, g2 = _step(model, ids)
        assert torch.equal(loss0, loss2), (loss0, loss2)
        bad = {n: float((g0[n] - g2[n]).abs().max()) for n in g0 if not torch.equal(g0[n], g2[n])}
        assert not bad, bad
        assert handle.stats["patched calls"] == 0, dict(handle.stats)
        handle.remove()


def test_cli_plan_names_each_layer_type_of_a_qwen3_5_27b_shaped_config():
    """``hf-ddpfix plan --set long_context=all`` on a Qwen3.5-27B shape (64 layers: 48 linear, 16 full attention)."""
    skip_unless_shipped("Qwen3_5TextConfig")
    from hf_ddpfix.cli import main

    argv = ["plan", "--model", "qwen3_5_text", "--config-kwargs",
            '{"num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 24, "num_key_value_heads": 4, '
            '"intermediate_size": 17408, "head_dim": 256}', "--set", "long_context=all", "--world-size", "2"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    out = buf.getvalue()
    assert "16 of 64 patched by structure" in out, out
    assert "layers: 48 linear_attention (Qwen3_5DecoderLayer) stock: recurrent scan: linear_attn " \
           "(Qwen3_5GatedDeltaNet)" in out, out
    assert "layers: 16 full_attention (Qwen3_5DecoderLayer) patched: pre-norm, probed at first call; output gate " \
           "before o_proj applied" in out, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_gated_full_attention_runs_patched_under_checkpointing_and_in_evaluation(name):
    """The gated full-attention layer (its output times ``sigmoid(gate)`` before ``o_proj``) patched with the layer
    features alone: non-reentrant checkpointing (forward + recompute each counted), loss and gradients to 1e-6 of
    stock; an evaluation forward without a cache (the untiled path under no_grad) equal to 1e-6.
    Shown failing (2026-12-02): without ``a * gate[0]`` in the tiled forward (long_context.py) the loss is 4.5818
    instead of stock's 4.6089 (the probe, which applies the gate itself, still admits the layer)."""
    stock = _model(name)
    model = copy.deepcopy(stock)
    for m in (stock, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    loss0, g0 = _step(stock, ids)
    handle = apply_long_context(model, "attention,tiled_layer", tokens_per_tile=5)
    loss1, g1 = _step(model, ids)
    assert handle.stats["patched calls [full_attention]"] == 2, dict(handle.stats)  # forward + recompute
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-6, atol=1e-6, msg=n)
    for m in (stock, model):
        m.eval()
    with torch.no_grad():
        want = stock(input_ids=ids, use_cache=False).logits
        got = model(input_ids=ids, use_cache=False).logits
    assert handle.stats["patched calls [full_attention]"] == 3, dict(handle.stats)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    handle.remove()


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_gated_norm_of_the_linear_attention_layers_stays_stock_with_its_reason(name):
    """The gated delta net's ``RMSNormGated`` (``norm(x, gate)``) is no one-tensor RMSNorm: the norm patch leaves it
    stock and says why (before 2026-12-02 the reason was a caught TypeError read as "e.g. a weight already sharded
    (DTensor)"); the decoder norms beside it are patched.
    Shown failing (2026-12-02): with the signature check removed from ``rms_norm_form`` the reason is the TypeError's."""
    from hf_ddpfix.integrations.long_context.layer_forms import rms_norm_form

    model = _model(name)
    gated = [m for n, m in model.named_modules() if n.endswith("linear_attn.norm")]
    assert len(gated) == 3, [n for n, _ in model.named_modules() if "norm" in n]
    form, why = rms_norm_form(gated[0])
    assert form is None and "requires gate beside the hidden states (a gated norm): stock" in why, why
    assert rms_norm_form(model.model.norm)[0] in ("weight", "unit_offset")
