"""apply_long_context on a tiny Llama + LoRA: gradients equal stock, features patch what they say.

Every case runs a 2-layer Llama with LoRA on all linear layers under non-reentrant checkpointing,
twice from the same weights and batch (stock, then patched), and compares the loss and every
trainable parameter's gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_ddpfix.integrations.long_context.long_context import (  # noqa: E402
    apply_long_context,
    parse_long_context_setting,
    remove_long_context,
)


def _model(dtype: torch.dtype, lora_dropout: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=8, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=97, attn_implementation="sdpa", rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).to(dtype)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                             lora_dropout=lora_dropout, init_lora_weights=False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _grads(model, ids, seed: int = 1):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    ("features", "tokens_per_tile", "dtype", "exact"),
    [
        ("rms_norm", 2048, torch.bfloat16, True),
        ("attention", 2048, torch.bfloat16, True),
        ("tiled_layer", 4096, torch.bfloat16, True),  # one tile: the same ops on the same rows
        ("all", 4096, torch.bfloat16, True),
        ("tiled_layer", 7, torch.float64, False),  # many tiles: parameter grads summed per tile
        ("all", 5, torch.float64, False),
    ],
)
def test_patched_llama_gradients_equal_stock(features, tokens_per_tile, dtype, exact):
    model = _model(dtype)
    ids = torch.randint(0, 97, (2, 23))
    loss0, g0 = _grads(model, ids)
    handle = apply_long_context(model, features, tokens_per_tile=tokens_per_tile, norm_chunk_tokens=9)
    assert handle.patched, handle.report
    loss1, g1 = _grads(model, ids)
    assert handle.stats["patched calls"] > 0 or features == "rms_norm", dict(handle.stats)
    assert g0.keys() == g1.keys()
    if exact:
        assert torch.equal(loss0, loss1)
        for n in g0:
            assert torch.equal(g0[n], g1[n]), n
    else:
        torch.testing.assert_close(loss1, loss0, rtol=1e-12, atol=1e-12)
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-10, atol=1e-12, msg=n)
    assert handle.remove() > 0
    loss2, g2 = _grads(model, ids)
    assert torch.equal(loss2, loss0) and all(torch.equal(g2[n], g0[n]) for n in g0)


def test_lora_dropout_replayed_in_tiles():
    """With dropout, one tile consumes the RNG exactly as stock does: gradients equal bit for bit."""
    model = _model(torch.bfloat16, lora_dropout=0.3)
    ids = torch.randint(0, 97, (1, 19))
    _, g0 = _grads(model, ids, seed=5)
    apply_long_context(model, "tiled_layer", tokens_per_tile=4096)
    _, g1 = _grads(model, ids, seed=5)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    # Several tiles: masks differ from stock's but forward and recompute agree (same loss, same grads twice).
    apply_long_context(model, "tiled_layer", tokens_per_tile=4)
    la, ga = _grads(model, ids, seed=5)
    lb, gb = _grads(model, ids, seed=5)
    assert torch.equal(la, lb) and all(torch.equal(ga[n], gb[n]) for n in ga)


def test_checkpointing_still_recomputes_the_patched_layer():
    """transformers 5.2x checkpoints inside the class forward: the patch must keep that (forward + recompute)."""
    model = _model(torch.bfloat16)
    handle = apply_long_context(model, "all", tokens_per_tile=4)
    _grads(model, torch.randint(0, 97, (1, 13)))
    assert handle.stats["patched calls"] == 2 * 2  # 2 layers x (forward + checkpoint recompute)
    model.gradient_checkpointing_disable()
    handle.stats.clear()
    _grads(model, torch.randint(0, 97, (1, 13)))  # use_cache on without checkpointing: a cache is built
    assert handle.stats["stock: KV cache"] == 2 and handle.stats["patched calls"] == 0
    model.config.use_cache = False
    handle.stats.clear()
    _grads(model, torch.randint(0, 97, (1, 13)))
    assert handle.stats["patched calls"] == 2, dict(handle.stats)


def test_no_grad_forward_is_untiled_and_equals_stock():
    """Evaluation runs the patched layer untiled (no tile-count collective): logits equal stock."""
    model = _model(torch.bfloat16)
    model.eval()
    ids = torch.randint(0, 97, (2, 17))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    handle = apply_long_context(model, "all", tokens_per_tile=3, sync=True)  # no process group: sync is a no-op
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    assert handle.stats["patched calls"] == 2 and torch.equal(ref, got)


def test_each_parameter_gets_one_gradient_hook_call():
    model = _model(torch.float32)
    apply_long_context(model, "all", tokens_per_tile=3)
    calls: dict[str, int] = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p, _n=n: calls.__setitem__(_n, calls.get(_n, 0) + 1))
    _grads(model, torch.randint(0, 97, (2, 11)))
    assert calls and set(calls.values()) == {1}, calls


def test_masked_or_cached_calls_run_stock_and_are_counted():
    model = _model(torch.float32)
    ids = torch.randint(0, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    loss0 = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    handle = apply_long_context(model, "all")
    loss1 = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    assert torch.equal(loss0, loss1)
    assert any(k.startswith("stock: attention mask") for k in handle.stats), dict(handle.stats)
    model.eval()
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=2, do_sample=False)
    assert any("KV cache" in k or "keyword" in k for k in handle.stats), dict(handle.stats)


def test_apply_is_idempotent_and_reversible():
    model = _model(torch.float32)
    base = copy.deepcopy(model.state_dict())
    h1 = apply_long_context(model, "all")
    h2 = apply_long_context(model, "rms_norm,tiled_layer")
    assert len(h1.patched) == len(h2.patched)  # 5 norms + 2 layers, never stacked
    assert remove_long_context(model) == len(h2.patched)
    assert remove_long_context(model) == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in base.items())
    layer = model.base_model.model.model.layers[0]
    assert "forward" not in layer.__dict__


def test_layers_no_form_reproduces_run_stock_with_the_probes_reason():
    """A layer is recognised by what it computes: one whose forward changes the math (here: a scaled
    output) is refused by the first-call probe and runs stock (loss and gradients equal stock, the reason
    counted); a layer without a known norm/MLP wiring is reported at apply time and keeps its forward."""
    model = _model(torch.float32)
    layers = model.base_model.model.model.layers

    class ScaledLayer(type(layers[0])):
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states, *args, **kwargs) * 1.5

    layers[0].__class__ = ScaledLayer
    ids = torch.randint(0, 97, (2, 11))
    loss0, g0 = _grads(model, ids)
    handle = apply_long_context(model, "attention,tiled_layer", tokens_per_tile=4)
    assert [e.name.rsplit(".", 2)[-2:] for e in handle.report if e.patched] == [["layers", "0"], ["layers", "1"]]
    loss1, g1 = _grads(model, ids)
    refused = [k for k in handle.stats if k.startswith("stock: ScaledLayer")]
    assert refused and "differs from stock" in refused[0], dict(handle.stats)
    assert handle.stats["patched calls"] == 2, dict(handle.stats)  # layer 1: forward + recompute
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)
    handle.remove()

    del layers[0].post_attention_layernorm  # no known wiring any more: reported, never patched
    handle = apply_long_context(model, "attention,tiled_layer")
    skipped = [e for e in handle.report if not e.patched]
    assert [e.name.rsplit(".", 2)[-2:] for e in skipped] == [["layers", "0"]], handle.report
    assert "no known norm/MLP wiring" in skipped[0].reason
    assert "forward" not in layers[0].__dict__ and "forward" in layers[1].__dict__
    handle.remove()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_process_ddp_equals_single_process_stock_reference(tmp_path):
    """DDP (fu=False, static graph) and FSDP2 + every feature, AdamW with weight decay, clipping, lengths
    varying per rank and step: weights equal a one-process stock run (tests/scripts/long_context_ddp.py)."""
    import json

    from launch import torchrun

    out = tmp_path / "result.json"
    proc = torchrun("long_context_ddp.py", "--out", str(out), timeout=200)
    assert "ready only once" not in proc.stdout and "marked ready twice" not in proc.stdout
    records = json.loads(out.read_text())
    assert len(records) == 4 and all(r["ok"] for r in records), records
    assert any(r["family"] == "gemma3_text" and r["ddp_kwargs"] is None for r in records)  # FSDP2, another family


@pytest.mark.parametrize("bad", ["tiled", "rms_norm,bogus", "maybe"])
def test_bad_setting_names_the_variable_and_allowed_values(bad):
    with pytest.raises(ValueError, match="HF_DDPFIX_LONG_CONTEXT.*Allowed"):
        parse_long_context_setting(bad)
    assert parse_long_context_setting("on") == ("rms_norm", "attention", "tiled_layer")
    assert parse_long_context_setting("Tiled-Layer") == ("tiled_layer",)
    with pytest.raises(ValueError, match="tokens_per_tile"):
        apply_long_context(torch.nn.Linear(2, 2), "all", tokens_per_tile=0)


@pytest.mark.parametrize("not_a_norm", [False, True])
def test_norms_whose_weight_zero3_partitioned_are_checked_at_their_first_call(not_a_norm):
    """ZeRO-3 leaves a norm's weight an empty placeholder (with a ``ds_id``) until the module's forward
    gathers it. Simulated here as DeepSpeed does it (``param.data`` swapped in a pre-forward hook): the
    norm is reported as checked at its first call, then runs the op, bit-equal to stock; a module that
    turns out not to compute an RMSNorm stays stock with the reason counted once."""
    from hf_ddpfix.ops import feature_counts

    stock = _model(torch.bfloat16)
    model = copy.deepcopy(stock)
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    if not_a_norm:  # a forward that is not an RMSNorm (in both models): the first-call check must refuse it
        for m in [*norms, *(m for m in stock.modules() if type(m).__name__ == "LlamaRMSNorm")]:
            m.forward = (lambda mod: (lambda x: mod.weight * x))(m)
    full = {}
    for m in norms:
        w = m.weight
        full[id(w)] = w.data
        w.ds_id = len(full)
        w.data = torch.empty(0, dtype=w.dtype)

        def gather(mod, args):
            if mod.weight.numel() == 0:
                mod.weight.data = full[id(mod.weight)]
        m.register_forward_pre_hook(gather)
    handle = apply_long_context(model, "rms_norm")
    deferred = [e for e in handle.report if "checked against stock at its first call" in e.reason]
    assert len(deferred) == len(norms) == 5 and all(e.patched == ("rms_norm",) for e in deferred)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    feature_counts.reset()
    loss1, g1 = _grads(model, ids)
    counts = feature_counts.snapshot()["long_context"]
    loss0, g0 = _grads(stock, ids)
    assert torch.equal(loss0, loss1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    if not_a_norm:
        assert counts.fell_back == len(norms) and counts.amounts.get("rms_norm_calls", 0) == 0, counts
    else:
        assert counts.fell_back == 0 and counts.amounts["rms_norm_checked_at_first_call"] == len(norms), counts
        assert counts.amounts["rms_norm_calls"] > 0, counts
    handle.remove()
