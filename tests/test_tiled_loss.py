"""Tiled loss head: parity with HF ForCausalLMLoss (loss 1e-5 relative, gradients), never the full
logits, one gradient per weight, and the model patch on Llama, PEFT and Qwen2.5-VL."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_ddpfix.integrations.long_context.loss_patch import patch_model_loss, unpatch_model_loss
from hf_ddpfix.ops.tiled_loss import tiled_causal_lm_loss

torch.set_num_threads(1)
V, H = 97, 32


def make(batch: int = 2, seq: int = 13, bias: bool = False, dtype=torch.float32):
    torch.manual_seed(0)
    hidden = torch.randn(batch, seq, H, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, dtype=dtype, requires_grad=True)
    b = torch.randn(V, dtype=dtype, requires_grad=True) if bias else None
    labels = torch.randint(0, V, (batch, seq))
    labels[0, :4] = -100
    labels[-1, -3:] = -100
    return hidden, weight, b, labels


def hf_loss(hidden, weight, b, labels, **kw):
    logits = torch.nn.functional.linear(hidden, weight, b)
    return ForCausalLMLoss(logits, labels, vocab_size=V, **kw)


def grads_of(*ts):
    out = [t.grad.clone() for t in ts if t is not None]
    for t in ts:
        if t is not None:
            t.grad = None
    return out


@pytest.mark.parametrize("grad_in_forward", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("num_items", [None, 37])
def test_loss_and_gradients_match_hf_for_causal_lm_loss(chunk, num_items, grad_in_forward) -> None:
    hidden, weight, b, labels = make(bias=True)
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    ref = hf_loss(hidden, weight, b, labels, **kw)
    ref.backward()
    ref_grads = grads_of(hidden, weight, b)
    loss = tiled_causal_lm_loss(hidden, weight, labels, bias=b, chunk_tokens=chunk, grad_in_forward=grad_in_forward,
                                **kw)
    (loss * 2.0).backward()  # a non-unit upstream gradient is applied
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for got, want in zip(grads_of(hidden, weight, b), ref_grads, strict=True):
        torch.testing.assert_close(got, 2.0 * want, rtol=1e-5, atol=1e-7)


def test_shift_labels_softcapping_and_scale_match_a_manual_reference() -> None:
    hidden, weight, _, labels = make()
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    logits = torch.nn.functional.linear(hidden, weight) * 0.5
    logits = torch.tanh(logits / 3.0) * 3.0
    ref = torch.nn.functional.cross_entropy(logits.float().view(-1, V), shift.reshape(-1), ignore_index=-100)
    ref.backward()
    ref_grads = grads_of(hidden, weight)
    loss = tiled_causal_lm_loss(hidden, weight, shift_labels=shift, chunk_tokens=4, logit_scale=0.5,
                                logit_softcapping=3.0)
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for got, want in zip(grads_of(hidden, weight), ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="exactly one of labels= or shift_labels="):
        tiled_causal_lm_loss(hidden, weight, labels, shift_labels=shift)


def test_weight_gets_one_gradient_and_only_label_tokens_are_computed() -> None:
    hidden, weight, _, labels = make()
    fired = []
    weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    loss = tiled_causal_lm_loss(hidden, weight, labels, chunk_tokens=3)
    loss.backward()
    assert fired == [1]
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    ignored = (shift == -100).reshape(-1)
    assert torch.all(hidden.grad.reshape(-1, H)[ignored] == 0)


class MaxNumel(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_full_logits_are_never_materialised() -> None:
    hidden, weight, _, labels = make(batch=2, seq=64)
    with MaxNumel() as m:
        tiled_causal_lm_loss(hidden, weight, labels, chunk_tokens=8).backward()
    # largest tensor: one chunk's logits, the hidden grad [tokens, H] or the weight grad [V, H]
    assert m.max_numel <= max(8 * V, 2 * 64 * H, V * H) < 2 * 64 * V
    with MaxNumel() as m:
        hf_loss(hidden, weight, None, labels).backward()
    assert m.max_numel >= 2 * 64 * V


def test_bf16_autocast_close_to_hf() -> None:
    hidden, weight, _, labels = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = hf_loss(hidden, weight, None, labels)
        loss = tiled_causal_lm_loss(hidden, weight, labels, chunk_tokens=5, grad_in_forward=False)
    assert loss.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=0)
    loss.backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


# ---------------------------------------------------------------- model patch


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg)


def model_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_parity(ref_out, ref, out, got) -> None:
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=0)
    assert out.logits is None and ref_out.logits is not None
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("num_items", [None, 50])
def test_patched_llama_matches_its_own_loss(num_items) -> None:
    model = llama()
    ids = torch.randint(0, 256, (2, 17))
    labels = ids.clone()
    labels[0, :5] = -100
    labels[1, 12:] = -100
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    sig = inspect.signature(model.forward)
    ref_out, ref = model_grads(model, input_ids=ids, labels=labels, **kw)
    handle = patch_model_loss(model, chunk_tokens=6)
    assert inspect.signature(model.forward) == sig  # Trainer column filtering sees the real arguments
    out, got = model_grads(model, input_ids=ids, labels=labels, **kw)
    assert_parity(ref_out, ref, out, got)
    assert handle.calls == 1
    with torch.no_grad():  # evaluation keeps logits for metrics
        assert model(input_ids=ids, labels=labels).logits is not None
    assert patch_model_loss(model).target is model  # idempotent
    assert handle.remove() and "forward" not in model.__dict__
    assert not unpatch_model_loss(model)


def test_patched_peft_model_matches_and_patches_the_inner_model() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                               init_lora_weights=False))
    ids = torch.randint(0, 256, (2, 11))
    ref_out, ref = model_grads(model, input_ids=ids, labels=ids)
    handle = patch_model_loss(model)
    assert handle.target is model.get_base_model()
    out, got = model_grads(model, input_ids=ids, labels=ids)
    assert_parity(ref_out, ref, out, got)
    handle.remove()


def test_patched_qwen2_5_vl_with_an_image_matches_its_own_loss() -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, window_size=8,
                           fullatt_block_indexes=[1]),
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    ids = torch.randint(0, 280, (2, 12))
    ids[:, 2], ids[:, 3:7], ids[:, 7] = 292, 290, 293  # 4x4 patches merged 2x2 -> 4 image tokens
    inputs = dict(input_ids=ids, pixel_values=torch.randn(32, 24), image_grid_thw=torch.tensor([[1, 4, 4]] * 2))
    labels = ids.clone()
    labels[:, :2] = -100  # image tokens stay ordinary labels, as in the model's own loss
    ref_out, ref = model_grads(model, labels=labels, **inputs)
    assert any(n.startswith("model.visual") for n in ref)
    handle = patch_model_loss(model, chunk_tokens=5)
    out, got = model_grads(model, labels=labels, **inputs)
    assert_parity(ref_out, ref, out, got)
    handle.remove()


def test_models_whose_logits_are_transformed_are_refused_by_name() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma2 = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM.forward transforms the logits"):
        patch_model_loss(gemma2)
    lm_head_lora = get_peft_model(llama(), LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match=r"lm_head is .*not a plain nn.Linear"):
        patch_model_loss(lm_head_lora)
