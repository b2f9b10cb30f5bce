"""ActivationOffload on real models (CPU): a LoRA Qwen2.5-VL with checkpointed vision blocks and decoder
layers, and a LoRA Llama under FSDP2 (``fully_shard``, 2 gloo processes).

``simulate=True`` copies every offloaded checkpoint input into a host buffer and back (the CUDA state
machine minus streams and pinning); ``simulate=False`` on CPU only counts bytes. Both must leave the
loss, every gradient and the trained weights bit-identical to stock non-reentrant checkpointing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import warnings

import pytest
import torch
from launch import torchrun
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))

from fixtures import add_lora, build_qwen2_5_vl, make_batch  # noqa: E402

from hf_ddpfix._compat import enable_model_checkpointing  # noqa: E402
from hf_ddpfix.integrations.checkpointing import apply_checkpointing  # noqa: E402
from hf_ddpfix.ops.offload import ActivationOffload  # noqa: E402

STEPS = 2


def _blocks(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    inner = model.get_base_model().model
    return list(inner.visual.blocks), list(inner.language_model.layers)


def _vlm(mode: str):
    """LoRA Qwen2.5-VL, checkpointing switched on through transformers' API, then our function with an
    offload in ``mode`` ("stock", "simulate" or "accounting")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft reads the deprecated is_gradient_checkpointing
        model = add_lora(build_qwen2_5_vl(0))
        enable_model_checkpointing(model, {"use_reentrant": False})
    model.train()
    vision, decoder = _blocks(model)
    on = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    # transformers 5.23 checkpoints the vision blocks too, not only the decoder layers
    assert sum(m in on for m in vision) == len(vision) == model.config.vision_config.depth == 2
    assert sum(m in on for m in decoder) == len(decoder) == model.config.text_config.num_hidden_layers == 2
    off = None
    if mode != "stock":
        off = ActivationOffload(min_bytes=0, module=model, simulate=(mode == "simulate"))
    assert apply_checkpointing(model, use_reentrant=False, offload=off) == len(on)
    return model, off


def _train(mode: str):
    """Two AdamW steps on image batches: per-step (loss, grads, stats, checkpoint-input sizes), weights."""
    model, off = _vlm(mode)
    vision, decoder = _blocks(model)
    inputs: list[tuple[str, int]] = []  # (kind, bytes) of each checkpointed layer's input, in call order
    for kind, mods in (("vision", vision), ("decoder", decoder)):
        for m in mods:  # 5.23: hooks run outside the checkpoint; < 5.23 also on recompute (cut below)
            m.register_forward_pre_hook(
                lambda _m, args, kind=kind: inputs.append((kind, args[0].untyped_storage().nbytes()))
            )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    steps = []
    for step in range(STEPS):
        inputs.clear()
        batch = make_batch(True, seed=10 + step)
        with off.step() if off is not None else contextlib.nullcontext():
            loss = model(**batch).loss
            n_forward = len(inputs)
            loss.backward()
        del inputs[n_forward:]
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        steps.append((loss.detach(), grads, off.stats.as_dict() if off else None, list(inputs), batch))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys() and a, what
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {len(bad)} differ, e.g. {bad[:3]}"


def test_qwen2_5_vl_lora_offload_of_vision_and_decoder_inputs_is_bit_identical():
    ref_steps, ref_weights = _train("stock")
    model, _ = _vlm("stock")
    cfg = model.config
    for loss, grads, _, _, _ in ref_steps:  # the comparison covers the vision tower: it gets gradients
        vision_lora = [n for n in grads if ".visual." in n and "lora_" in n]
        assert vision_lora and all(grads[n].abs().sum() > 0 for n in vision_lora)
        assert all(g.abs().sum() > 0 for g in grads.values()) and torch.isfinite(loss)

    for mode in ("simulate", "accounting"):
        steps, weights = _train(mode)
        for i, ((ref_loss, ref_grads, *_), (loss, grads, s, inputs, batch)) in enumerate(
            zip(ref_steps, steps, strict=True)
        ):
            assert torch.equal(ref_loss, loss), f"{mode} step {i}: loss"
            _assert_same(ref_grads, grads, f"{mode} step {i}: gradients")

            # Expected inputs, from the shapes: every vision block sees (patches, vision hidden) and every
            # decoder layer (batch, seq, hidden), float32. All four layers ran, in that order.
            patches = int(batch["image_grid_thw"].prod(-1).sum())
            vis_bytes = patches * cfg.vision_config.hidden_size * 4
            dec_bytes = math.prod(batch["input_ids"].shape) * cfg.text_config.hidden_size * 4
            expected = [("vision", vis_bytes)] * 2 + [("decoder", dec_bytes)] * 2
            assert inputs == expected, inputs
            sizes = [b for _, b in expected]
            moved = sum(sizes[:-1])  # all but the last checkpoint's input (decoder layer 1: kept)
            copied = mode == "simulate"
            assert s["packed_tensors"] == 4 and s["packed_bytes"] == sum(sizes) == 2 * 2048 + 2 * 4096, s
            assert s["would_offload_bytes"] == moved == 2 * vis_bytes + dec_bytes, s
            assert (s["offloaded_tensors"], s["offloaded_bytes"]) == ((3, moved) if copied else (0, 0)), s
            assert s["restored_tensors"] == (3 if copied else 0), s
            assert (s["kept_tensors"], s["kept_bytes"]) == (1, dec_bytes), s
            assert s["skipped_small"] == s["skipped_params"] == s["skipped_views"] == s["skipped_other"] == 0
            assert s["deduped_tensors"] == 0 and s["in_flight"] == 0, s
            # step 1 grows by exactly each missing buffer (2 KiB, 2 KiB, 4 KiB: one slab each); step 2 reuses them
            assert s["pool_allocated"] == (3 if copied else 0), s
            assert s["pool_bytes"] == (moved if copied else 0), s  # exact: the pool holds the need
        _assert_same(ref_weights, weights, f"{mode}: weights after {STEPS} AdamW steps")


@pytest.fixture(scope="module")
def fsdp_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("offload_fsdp") / "result.json"
    torchrun("offload_fsdp.py", "--out", str(out), timeout=120)
    return json.loads(out.read_text())


@pytest.mark.multiprocess
def test_fsdp2_lora_llama_offload_weights_bit_identical_and_ranks_equal(fsdp_result):
    r = fsdp_result
    assert r["ok"] and r["errors"] == [] and r["world_size"] == 2, r
    assert r["ranks_equal"] and len(set(r["digests"])) == 1
    assert r["trained"] == r["trainable_tensors"] > 0  # every LoRA tensor moved in 3 steps
    sim, acc = r["simulate_stats_last_step"], r["accounting_stats_last_step"]
    layer_bytes = 2 * 24 * 64 * 4  # batch x seq x hidden x float32, 3 decoder layers
    assert sim["offloaded_tensors"] == 2 and sim["offloaded_bytes"] == 2 * layer_bytes
    assert acc["would_offload_bytes"] == 2 * layer_bytes and acc["offloaded_bytes"] == 0
    assert sim["kept_bytes"] == acc["kept_bytes"] == layer_bytes and sim["in_flight"] == 0


@pytest.mark.multiprocess
def test_fsdp2_offload_with_module_argument(fsdp_result):
    assert fsdp_result["module_arg_errors"] == []
