"""Tiled MLP: parity with the untiled module, one gradient per parameter, RNG/autocast replay,
checkpointing, module discovery, shard policy, and 2-process DDP / FSDP2 runs."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_ddpfix.integrations.long_context.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp
from hf_ddpfix.integrations.long_context.token_wise import is_token_wise, register_token_wise
from hf_ddpfix.ops.tiled import (
    DEFAULT_MIN_TOKENS,
    TiledMLPSetting,
    choose_shards,
    parse_tiled_mlp_setting,
    sync_shards,
    tiled_call,
)

torch.set_num_threads(1)


def llama_cfg(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaConfig(**{**base, **kw})


def llama_mlp() -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(llama_cfg())


def grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = [x.grad.clone()]
    out += [p.grad.clone() for p in module.parameters() if p.requires_grad]
    x.grad = None
    module.zero_grad(set_to_none=True)
    return out


def assert_close_all(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        torch.testing.assert_close(u, v, rtol=rtol, atol=atol, msg=lambda m, i=i: f"tensor {i}: {m}")


def tiled_forward_of(module: nn.Module):
    return module.__dict__["forward"]


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("shards", [1, 2, 4, 7])
def test_tiled_call_matches_untiled_outputs_and_all_gradients(shards: int, batch: int) -> None:
    mlp = llama_mlp()
    x = torch.randn(batch, 13, 64, requires_grad=True)  # 13 or 26 tokens: not divisible by 2, 4, 7
    g = torch.randn(batch, 13, 64)  # non-uniform upstream gradient
    ref_out = mlp(x)
    ref_out.backward(g)
    ref = grads(mlp, x)
    out = tiled_call(mlp, x, shards)
    out.backward(g)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    assert_close_all(grads(mlp, x), ref)


def test_each_trainable_parameter_gets_exactly_one_gradient_per_backward() -> None:
    mlp = llama_mlp()
    mlp.up_proj.weight.requires_grad_(False)  # frozen params are not inputs and get nothing
    fired: dict[str, int] = {}
    for name, p in mlp.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p, n=name: fired.__setitem__(n, fired.get(n, 0) + 1))
    x = torch.randn(2, 13, 64, requires_grad=True)
    tiled_call(mlp, x, 7).backward(torch.randn(2, 13, 64))
    assert fired == {"gate_proj.weight": 1, "down_proj.weight": 1}
    assert mlp.up_proj.weight.grad is None


def test_global_rng_state_is_left_as_the_forward_left_it() -> None:
    mlp = llama_mlp()
    x = torch.randn(1, 9, 64, requires_grad=True)
    out = tiled_call(mlp, x, 3)
    before = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), before)


def lora_llama(dropout: float):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(llama_cfg()), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
        target_modules=["gate_proj", "up_proj", "down_proj"]))
    model.train()
    return model


@pytest.mark.parametrize("shards", [2, 7])
def test_lora_dropout_masks_are_replayed_in_the_recompute(shards: int) -> None:
    model = lora_llama(dropout=0.1)
    mlp = model.get_base_model().model.layers[0].mlp
    x = torch.randn(2, 13, 64, requires_grad=True)
    g = torch.randn(2, 13, 64)
    # Reference: the untiled module run chunk by chunk with the same seed (same dropout draws).
    torch.manual_seed(7)
    ref_out = torch.cat([mlp(c) for c in x.reshape(-1, 64).tensor_split(shards)]).view_as(x)
    ref_out.backward(g)
    ref = grads(mlp, x)
    torch.manual_seed(7)
    out = tiled_call(mlp, x, shards)
    out.backward(g)
    got = grads(mlp, x)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    assert_close_all(got, ref)
    with torch.no_grad():
        mlp.eval()
        no_dropout = mlp(x)
        mlp.train()
    assert not torch.allclose(out, no_dropout), "dropout was not active"
    torch.manual_seed(7)
    tiled_call(mlp, x, shards).backward(g)  # same seed -> identical grads
    assert_close_all(grads(mlp, x), got, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(10))
def test_autocast_state_is_reentered_in_the_recompute(seed: int) -> None:
    """The backward recompute runs under the forward's autocast: every recomputed projection is bf16
    (a recompute without autocast would run fp32 matmuls, caught here on every seed, not by a tolerance)
    and the gradients match the untiled autocast reference."""
    mlp = llama_mlp()
    torch.manual_seed(seed)
    x = torch.randn(2, 13, 64, requires_grad=True)
    g = torch.randn(2, 13, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = mlp(x)
    ref_out.float().backward(g)
    ref = grads(mlp, x)
    calls: list[tuple[bool, torch.dtype]] = []  # (grad enabled = the backward's recompute, output dtype)
    hooks = [m.register_forward_hook(lambda _m, _i, out: calls.append((torch.is_grad_enabled(), out.dtype)))
             for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tiled_call(mlp, x, 4)
    out.float().backward(g)
    for h in hooks:
        h.remove()
    got = grads(mlp, x)
    recomputed = [dtype for grad_on, dtype in calls if grad_on]
    assert len(recomputed) == 3 * 4, calls  # three projections per chunk, four chunks
    assert set(recomputed) == {torch.bfloat16}, f"recompute left autocast: {recomputed}"
    assert {dtype for _, dtype in calls} == {torch.bfloat16}
    assert out.dtype == ref_out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- checkpointing


def tiny_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_cfg())


def train_grads(model, ids, ckpt: str | None) -> tuple[float, dict[str, torch.Tensor]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
        else:
            model.gradient_checkpointing_disable()
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
def test_tiled_mlp_inside_checkpointed_layers_matches_untiled(ckpt: str) -> None:
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 13))
    ref_loss, ref = train_grads(model, ids, None)
    handle = apply_tiled_mlp(model, shards=4)
    stats: dict[str, int] = {}
    for name in handle.patched:
        tiled_forward_of(model.get_submodule(name)).stats = stats
    loss, got = train_grads(model, ids, ckpt)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6)
    tokens = 2 * 13 * 2  # tokens x layers
    assert stats["backward_tokens"] == tokens
    if ckpt == "non_reentrant":
        # The checkpoint recompute skips the MLP (its output is never read): 2 MLP forwards per step.
        assert stats["forward_tokens"] == tokens and stats["skipped_recompute"] == 2
    else:
        assert stats["forward_tokens"] == 2 * tokens  # reentrant needs the recomputed output


def test_checkpoint_recompute_is_computed_when_its_output_is_used() -> None:
    """A tensor-saving op after the MLP inside the checkpoint: no skip, gradients still exact."""
    mlp = llama_mlp()
    apply_tiled_mlp(mlp, shards=3, min_tokens=0)
    stats: dict[str, int] = {}
    tiled_forward_of(mlp).stats = stats
    x = torch.randn(2, 7, 64, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(mlp(t)) * t  # tanh and mul save the MLP output

    checkpoint(block, x, use_reentrant=False).sum().backward()
    got = grads(mlp, x)
    remove_tiled_mlp(mlp)
    block(x).sum().backward()
    assert_close_all(got, grads(mlp, x))
    assert "skipped_recompute" not in stats and stats["forward_tokens"] == 2 * 14


# ---------------------------------------------------------------- discovery and patching


def test_apply_finds_llama_mlps_and_remove_restores_the_original_forward() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 9))
    ref = model(input_ids=ids).logits
    handle = apply_tiled_mlp(model, shards=3)
    assert handle.patched == ["model.layers.0.mlp", "model.layers.1.mlp"]
    torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=1e-5, atol=1e-6)
    again = apply_tiled_mlp(model, shards=2)  # idempotent: settings updated, no stacking
    assert again.patched == handle.patched
    fwd = tiled_forward_of(model.model.layers[0].mlp)
    assert fwd.prev is None and fwd.config.shards == 2
    clone = copy.deepcopy(model)  # the copy's forward is bound to the copy
    assert tiled_forward_of(clone.model.layers[0].mlp).module is clone.model.layers[0].mlp
    assert handle.remove() == 2
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert torch.equal(model(input_ids=ids).logits, ref)


def test_short_sequences_under_auto_run_the_original_forward() -> None:
    mlp = llama_mlp()
    apply_tiled_mlp(mlp)  # auto
    x = torch.randn(1, 16, 64, requires_grad=True)
    assert "Tiled" not in type(mlp(x).grad_fn).__name__
    assert choose_shards(16, 64, 128) == 1


def test_on_tiles_short_sequences_that_auto_leaves_whole_and_counts_them() -> None:
    """``on`` (HF_DDPFIX_TILED_MLP=1) asks for tiling: a 16-token call runs tiled (2 shards), counted as ran,
    with the untiled gradients."""
    from hf_ddpfix.ops import feature_counts

    mlp = llama_mlp()
    x = torch.randn(1, 16, 64, requires_grad=True)
    g = torch.randn(1, 16, 64)
    mlp(x).backward(g)
    ref = grads(mlp, x)
    feature_counts.reset()
    handle = apply_tiled_mlp(mlp, shards="on")
    try:
        out = mlp(x)
        assert "Tiled" in type(out.grad_fn).__name__
        got = feature_counts.snapshot()["tiled_mlp"]
        assert got.ran == 1 and got.amounts.get("shards") == 2 and not got.amounts.get("untiled_calls")
        out.backward(g)
        assert_close_all(grads(mlp, x), ref)
    finally:
        handle.remove()
        feature_counts.reset()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "gemma", "qwen3"])
def test_apply_finds_vlm_vision_and_other_family_mlps(family: str) -> None:
    import transformers as tf

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen2_vl":
        cfg = tf.Qwen2VLConfig(text_config={**text, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
                               vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2))
        model, expect = tf.Qwen2VLForConditionalGeneration(cfg), {"VisionMlp", "Qwen2MLP", "Sequential"}
    elif family == "qwen2_5_vl":
        cfg = tf.Qwen2_5_VLConfig(text_config={**text, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
                                  vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                     out_hidden_size=64))
        model, expect = tf.Qwen2_5_VLForConditionalGeneration(cfg), {"Qwen2_5_VLMLP", "Qwen2MLP", "Sequential"}
    elif family == "gemma":
        model, expect = tf.GemmaForCausalLM(tf.GemmaConfig(**text, head_dim=16)), {"GemmaMLP"}
    else:
        model, expect = tf.Qwen3ForCausalLM(tf.Qwen3Config(**text, head_dim=16)), {"Qwen3MLP"}
    handle = apply_tiled_mlp(model, shards=2)
    assert {e.cls for e in handle.report if e.tiled} == expect, handle.report
    assert handle.remove() == len(handle.patched)


def test_peft_lora_wrapped_projections_are_token_wise() -> None:
    model = lora_llama(dropout=0.1)
    handle = apply_tiled_mlp(model, shards=2)
    assert len(handle.patched) == 2 and all(".mlp" in n for n in handle.patched)


class MixingMLP(nn.Module):
    """Has the gated-MLP children but mixes tokens (cumulative sum over the sequence)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)).cumsum(-2) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MixingMLP()
        self.attn = nn.MultiheadAttention(8, 2)


def test_modules_that_cannot_be_shown_token_wise_are_skipped_or_rejected_by_name() -> None:
    block = Block()
    handle = apply_tiled_mlp(block, shards=2)
    assert handle.patched == []
    (entry,) = handle.skipped
    assert entry.name == "mlp" and "MixingMLP.forward does not match" in entry.reason
    with pytest.raises(ValueError, match=r"cannot tile 'mlp'.*MixingMLP"):
        apply_tiled_mlp(block, modules=["mlp"])
    with pytest.raises(ValueError, match=r"cannot tile 'attn'"):
        apply_tiled_mlp(block, modules=["attn"])
    with pytest.raises(ValueError, match="no module named 'nope'"):
        apply_tiled_mlp(block, modules=["nope"])
    assert is_token_wise(nn.Sequential(nn.Linear(4, 4), nn.Softmax(dim=0)))[0] is False
    register_token_wise(MixingMLP)  # the user vouches for it
    try:
        assert apply_tiled_mlp(block, modules=[block.mlp]).patched == ["mlp"]
    finally:
        from hf_ddpfix.integrations.long_context import token_wise

        token_wise._REGISTERED.pop(MixingMLP)
        remove_tiled_mlp(block)


# ---------------------------------------------------------------- shard policy


def test_choose_shards_rules() -> None:
    h, i = 4096, 14336
    assert choose_shards(DEFAULT_MIN_TOKENS - 1, h, i) == 1
    assert choose_shards(16384, h, i) == 8  # 2048 tokens per shard
    assert choose_shards(16385, h, i) == 9
    assert choose_shards(16384, h, i, "arctic") == 4  # ceil(seq / hidden)
    assert choose_shards(100, h, i, 7) == 7 and choose_shards(5, h, i, 7) == 5
    assert choose_shards(16384, h, i, "off") == 1
    # on (forced): tiles at every length, 2K tokens per shard and at least 2 (auto leaves these whole)
    assert choose_shards(100, h, i, "on") == 2 and choose_shards(100, h, i, "auto") == 1
    assert choose_shards(6144, h, i, "on") == 3 and choose_shards(16384, h, i, "on") == 8
    assert choose_shards(1, h, i, "on") == 1  # one token cannot be split
    # target: 16K tokens x 5.5 x 14336 x 2 bytes = 2.4 GiB -> 3 shards under 1 GiB, 5 under 0.5 GiB
    assert choose_shards(16384, h, i, "target") == 3
    assert choose_shards(16384, h, i, "target:0.5") == 5
    assert choose_shards(100, h, i, "target:1000") == 1
    with pytest.raises(ValueError, match="shards=0"):
        choose_shards(10, h, i, 0)


@pytest.mark.parametrize("value,expected", [
    ("arctic", TiledMLPSetting("arctic")),
    ("target", TiledMLPSetting("target")),
    ("target:2.5", TiledMLPSetting("target", target_gb=2.5)),
    ("TRUE", TiledMLPSetting("on")),
    ("1", TiledMLPSetting("on")),
    ("on", TiledMLPSetting("on")),
    ("Auto", TiledMLPSetting("auto")),
    ("0", TiledMLPSetting("off")),
    (" off ", TiledMLPSetting("off")),
    ("8", TiledMLPSetting("fixed", shards=8)),
])
def test_parse_tiled_mlp_setting_accepts_compat_spellings(value: str, expected: TiledMLPSetting) -> None:
    assert parse_tiled_mlp_setting(value) == expected


@pytest.mark.parametrize("value", ["arctik", "target:", "target:-1", "target:abc", "-3"])
def test_parse_tiled_mlp_setting_errors_name_the_setting_and_allowed_values(value: str) -> None:
    with pytest.raises(ValueError, match=r"UNSLOTH_TILED_MLP=.*Allowed: .*arctic.*target:<GB>"):
        parse_tiled_mlp_setting(value)


def test_sync_shards_single_process(tmp_path) -> None:
    import torch.distributed as dist

    assert sync_shards(5) == 5  # no process group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert sync_shards(3) == 3
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- 2 processes


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("script,tag", [("tiled_ddp.py", "TILED_DDP"), ("tiled_fsdp.py", "TILED_FSDP")])
def test_two_process_training_equals_single_process_reference(script: str, tag: str, tmp_path) -> None:
    from launch import torchrun

    out = tmp_path / "result.json"
    proc = torchrun(script, "--out", str(out), timeout=180)
    assert "ready only once" not in proc.stdout and "marked ready twice" not in proc.stdout
    records = json.loads(out.read_text())
    assert records and all(r["ok"] for r in records), records
    if tag == "TILED_DDP":
        assert {r["setting"] for r in records} >= {"fu_false", "fu_true_ckpt", "static_graph_ckpt"}


def test_synced_shard_count_is_all_reduced_only_for_an_mlp_that_is_or_holds_an_fsdp_unit(monkeypatch) -> None:
    """Under FSDP (``sync=True``) an MLP inside a unit (a decoder layer's, a VLM tower folded into the root, which
    text-only ranks never call) issues no shard-count collective: its chunks gather nothing, and a collective only
    the image ranks issue hung Qwen2.5-VL (tests/test_fsdp_features.py, ``vlm_memory``). An MLP whose Linear is a
    unit of its own (each chunk all-gathers) still all-reduces its count."""
    from torch.distributed.fsdp import FSDPModule

    import hf_ddpfix.integrations.long_context.tiled_mlp as tiled_mlp_mod
    from hf_ddpfix.ops import feature_counts

    synced: list[int] = []
    monkeypatch.setattr(tiled_mlp_mod, "sync_shards", lambda n, group=None: synced.append(n) or n)
    mlp = llama_mlp()
    handle = apply_tiled_mlp(mlp, 3, sync=True)
    feature_counts.reset()
    x = torch.randn(1, 9, 64, requires_grad=True)
    mlp(x).sum().backward()
    assert synced == [] and feature_counts.snapshot()["tiled_mlp"].as_dict()["amounts"]["local_count_calls"] == 1
    mlp.down_proj.__class__ = type("FSDPLinear", (FSDPModule, nn.Linear), {})  # as fully_shard swaps the class
    mlp(x).sum().backward()
    assert synced == [3], synced
    handle.remove()
