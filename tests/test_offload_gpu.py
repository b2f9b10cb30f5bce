"""ActivationOffload's CUDA path: pinned pool reuse, stream sync, bit-identical grads, measured memory drop."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

from hf_ddpfix.integrations.checkpointing import CheckpointFunction, apply_checkpointing
from hf_ddpfix.ops.offload import ActivationOffload
from hf_ddpfix.ops.offload.host_memory import release_torch_host_cache

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


def test_cuda_variable_lengths_bit_identical_and_pinned_pool_bounded():
    """Dynamic padding: a new sequence length every step. Gradients equal stock bit for bit at every step,
    the bytes moved equal the theory, the pool is pinned and holds at most twice the largest step's need."""
    lengths = [256, 200, 320, 96, 320, 256, 17, 400]
    gen = torch.Generator("cuda").manual_seed(0)
    batches = [torch.randint(0, 1024, (2, n), device="cuda", generator=gen) for n in lengths]
    per_mode = []
    offload = ActivationOffload(min_bytes=0)
    pinned = []  # the bytes torch's pinned allocator really holds (current, peak) after each step
    for mode in (None, offload):
        model = build_llama(layers=4, hidden=256)
        install(model, mode)
        if mode is not None:
            torch.cuda.synchronize()
            release_torch_host_cache()  # torch >= 2.6: empty_host_cache is newer
            torch.cuda.reset_peak_host_memory_stats()
            base = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
        steps = []
        largest = 0
        for step, ids in enumerate(batches):
            model.zero_grad(set_to_none=True)
            one_step(model, mode, ids)
            steps.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
            if mode is None:
                continue
            s = mode.stats
            need = 3 * ids.numel() * 256 * 4  # 3 of 4 layer inputs leave the device (fp32, hidden 256)
            largest = max(largest, need)
            assert s.offloaded_bytes == need and s.kept_tensors == 1, (step, s)
            assert s.in_flight == 0 and s.restored_tensors == 3 and s.pool_buffers == 0, (step, s)
            assert s.pool_need_bytes == largest and s.pool_bytes <= 2 * largest, (step, s)
            assert s.pool_peak_bytes <= 2 * largest and s.pool_max_held_over_need <= 2, (step, s)
            real = torch.cuda.host_memory_stats()
            pinned.append((real["allocated_bytes.current"] - base, real["allocated_bytes.peak"] - base))
            # torch rounds pinned blocks to powers of two: the pool's slabs are powers of two, so the real
            # pinned bytes equal the pool's held bytes, and stay within twice the need at every moment
            assert pinned[-1][0] == s.pool_bytes and pinned[-1][1] <= 2 * largest, (step, pinned[-1], s)
            slabs = [slab for pool in mode._transfers.pools.values() for slab in pool._slabs]
            assert slabs and all(slab.tensor.is_pinned() for slab in slabs)
        per_mode.append(steps)
    for step, (ref, got) in enumerate(zip(*per_mode, strict=True)):
        assert ref.keys() == got.keys() and ref
        bad = [k for k in ref if not torch.equal(ref[k], got[k])]
        assert not bad, f"step {step} (length {lengths[step]}): {bad[:3]}"
    print("pinned bytes (current, peak) per step:", pinned)


def test_cuda_encoder_output_copied_once_per_step_and_gradients_bit_identical():
    from transformers import BartConfig, BartForConditionalGeneration

    def build():
        torch.manual_seed(0)
        cfg = BartConfig(vocab_size=512, d_model=256, encoder_layers=2, decoder_layers=4, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512, dropout=0.0,
                         attention_dropout=0.0, activation_dropout=0.0, attn_implementation="eager")
        model = BartForConditionalGeneration(cfg).cuda()
        model.train()
        return model

    gen = torch.Generator("cuda").manual_seed(1)
    batches = [(torch.randint(3, 512, (2, n), device="cuda", generator=gen),
                torch.randint(3, 512, (2, m), device="cuda", generator=gen)) for n, m in ((96, 64), (130, 40))]
    grads = []
    offload = ActivationOffload(min_bytes=0)
    for mode in (None, offload):
        model = build()
        install(model, mode)
        copies: list[int] = []
        if mode is not None:
            real = mode._offload
            mode._offload = lambda rec, real=real, copies=copies: (copies.append(rec.ref.cdata), real(rec))[1]
        per_step = []
        for ids, labels in batches:
            copies.clear()
            model.zero_grad(set_to_none=True)
            with mode.step() if mode is not None else contextlib.nullcontext():
                model(input_ids=ids, labels=labels).loss.backward()
            per_step.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            if mode is not None:
                assert len(copies) == len(set(copies)), f"a storage was copied twice: {copies}"
                assert mode.stats.deduped_tensors >= 3 and mode.stats.in_flight == 0, mode.stats
        grads.append(per_step)
    for ref, got in zip(*grads, strict=True):
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_cuda_step_exit_orders_compute_after_every_copy_without_blocking_the_host():
    """The step exit makes the compute stream wait for the copy streams (GPU-side, no host sync): once
    the compute stream is done, so is every copy."""
    model = build_llama(layers=3, hidden=256)
    offload = ActivationOffload(min_bytes=0)
    install(model, offload)
    one_step(model, offload, torch.randint(0, 1024, (2, 512), device="cuda"))
    torch.cuda.current_stream().synchronize()  # only the compute stream
    assert offload._transfers.side_streams and all(s.query() for s in offload._transfers.side_streams.values())
    assert offload.stats.in_flight == 0 and offload.stats.restored_tensors == 2


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
