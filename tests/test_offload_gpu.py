"""ActivationOffload's CUDA path: pinned pool reuse, stream sync, bit-identical grads, measured memory drop."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

from hf_ddpfix.integrations.checkpointing import CheckpointFunction, apply_checkpointing
from hf_ddpfix.ops.offload import ActivationOffload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA: the pinned pool and side stream only exist on an accelerator",
    ),
]


def build_llama(
    layers: int, hidden: int, dtype: torch.dtype = torch.float32, attn: str = "eager"
) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        attn_implementation=attn,  # eager: deterministic backward, so offload vs stock compare bitwise
    )
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=dtype)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    model.train()
    return model


def install(model: nn.Module, offload: ActivationOffload | None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_checkpointing(model, use_reentrant=False, offload=offload)


def one_step(model: nn.Module, offload: ActivationOffload | None, ids: torch.Tensor) -> None:
    with offload.step() if offload is not None else contextlib.nullcontext():
        model(input_ids=ids, labels=ids).loss.backward()


def test_cuda_gradients_bit_identical_and_pool_reused_across_steps():
    ids = torch.randint(0, 1024, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    grads = []
    for offload in (None, ActivationOffload(min_bytes=0)):
        model = build_llama(layers=4, hidden=256)
        install(model, offload)
        for step in range(3):
            model.zero_grad()
            one_step(model, offload, ids)
            if offload is not None:
                s = offload.stats
                assert s.offloaded_bytes == 3 * 2 * 256 * 256 * 4 and s.kept_tensors == 1
                assert s.in_flight == 0 and s.restored_tensors == 3 and s.pool_buffers == 3
                assert s.pool_allocated == 3, f"step {step}: pool not reused"
                assert all(
                    b.is_pinned() for p in offload._pools.values() for q in p._free.values() for b in q
                )
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_cuda_step_exit_leaves_no_stream_work_in_flight():
    model = build_llama(layers=3, hidden=256)
    offload = ActivationOffload(min_bytes=0)
    install(model, offload)
    one_step(model, offload, torch.randint(0, 1024, (2, 512), device="cuda"))
    assert offload._side_streams and all(s.query() for s in offload._side_streams.values())
    assert offload.stats.in_flight == 0


def test_cuda_parameters_never_offloaded_with_module_given():
    lin = nn.Linear(1024, 1024, device="cuda")
    offload = ActivationOffload(min_bytes=0, module=lin)
    ckpt = CheckpointFunction(False, offload)
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    with offload.step():
        ckpt(lambda a, w: a @ w.t(), x * 1, lin.weight.detach()).sum().backward()
    assert offload.stats.skipped_params == 1 and offload.stats.offloaded_tensors == 0


def test_cuda_peak_memory_drops_by_about_the_offloaded_layer_inputs():
    layers, batch, seq, hidden = 8, 1, 4096, 1024
    input_bytes = batch * seq * hidden * 2  # bf16 hidden states
    ids = torch.randint(0, 1024, (batch, seq), device="cuda")
    peaks = []
    for offload in (None, ActivationOffload()):
        model = build_llama(layers=layers, hidden=hidden, dtype=torch.bfloat16, attn="sdpa")
        install(model, offload)
        one_step(model, offload, ids)  # warm-up (allocator, pinned pool)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        one_step(model, offload, ids)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del model
        torch.cuda.empty_cache()
    drop = peaks[0] - peaks[1]
    # Theory: (layers - 1) inputs leave the device; one prefetched input comes back early.
    assert drop >= 0.5 * (layers - 2) * input_bytes, f"peaks {peaks}, drop {drop}"
