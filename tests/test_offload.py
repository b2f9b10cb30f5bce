"""ActivationOffload on CPU: hook coverage, bit-identical training, byte accounting, pool lifetime, DDP.

``simulate=True`` runs the copying state machine (host buffers, dedupe, views, keep-last, prefetch) on
CPU tensors, so everything except streams and pinning is exercised without a GPU.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import pytest
import torch
from fixtures import lora_llama
from launch import torchrun
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_ddpfix.integrations.checkpointing import CheckpointFunction, apply_checkpointing
from hf_ddpfix.ops.offload import (
    DEFAULT_MIN_BYTES,
    ActivationOffload,
    accelerator_available,
)

REPO = Path(__file__).resolve().parents[1]
LAYERS, BATCH, SEQ, HIDDEN = 3, 2, 32, 64
LAYER_INPUT_BYTES = BATCH * SEQ * HIDDEN * 4  # float32 hidden states entering one decoder layer


def build_lora_llama(layers: int = LAYERS, seed: int = 0) -> nn.Module:
    return lora_llama(targets=("q_proj", "v_proj"), random_lora=False, seed=seed, num_hidden_layers=layers,
                      hidden_size=HIDDEN, max_position_embeddings=256)


def install_checkpointing(model: nn.Module, offload: ActivationOffload | None) -> int:
    """Non-reentrant checkpointing through hf_ddpfix's checkpoint function, with ``offload``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_* are deprecated aliases
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return apply_checkpointing(model, use_reentrant=False, offload=offload)


def train(offload: ActivationOffload | None, steps: int = 3, accumulate: int = 1, layers: int = LAYERS):
    """A few AdamW steps on the tiny LoRA Llama; returns (last grads, final weights, per-step stats)."""
    model = build_lora_llama(layers)
    model.train()
    assert install_checkpointing(model, offload) >= layers
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    grads, stats = {}, []
    for _ in range(steps):
        with offload.step() if offload is not None else contextlib.nullcontext():
            for _ in range(accumulate):
                ids = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
                model(input_ids=ids, labels=ids).loss.backward()
        if offload is not None:
            stats.append(offload.stats.as_dict())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return grads, weights, stats


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad[:5]}"


def test_hooks_around_nonreentrant_checkpoint_see_only_positional_inputs():
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True) * 1
    y, kw = torch.randn(3, 8), torch.randn(3, 8)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t)
        return t

    def unpack(t):
        unpacked.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = checkpoint(lambda a, b, k=None: (lin(a) * b + k).relu(), x, y, k=kw, use_reentrant=False)
    assert [t is x for t in packed] == [True, False] and packed[1] is y  # no weights, no keyword tensor
    out.sum().backward()
    assert len(unpacked) == 2  # the recompute's own saved tensors never reach these hooks


def test_gradients_and_weights_bit_identical_when_inputs_go_through_host_buffers():
    ref_grads, ref_weights, _ = train(None)
    grads, weights, stats = train(ActivationOffload(min_bytes=1024, simulate=True))
    assert_same(ref_grads, grads)
    assert_same(ref_weights, weights)
    moved = (LAYERS - 1) * LAYER_INPUT_BYTES  # every layer input but the last was copied out and back
    for s in stats:
        assert s["offloaded_bytes"] == s["would_offload_bytes"] == moved and s["restored_tensors"] == LAYERS - 1


def test_accounting_mode_hands_back_the_saved_tensor_itself_and_only_counts():
    """On CPU without ``simulate`` nothing is copied, so training equals stock by construction (no numeric
    comparison can tell); what must hold is that the very tensor is handed back and the count is exact."""
    off = ActivationOffload(min_bytes=0)
    ckpt = CheckpointFunction(False, off)
    lin = nn.Linear(16, 16)
    seen = []
    real_unpack = off._unpack
    off._unpack = lambda packed: seen.append((packed, real_unpack(packed))) or seen[-1][1]
    with off.step():
        h = torch.randn(4, 16) * 1
        h.requires_grad_()
        first = h
        for _ in range(3):
            h = ckpt(lin, h)
        h.sum().backward()
    handles = [(p, t) for p, t in seen if p is not t]
    assert handles and handles[-1][1] is first and handles[-1][0].tensor is first
    s = off.stats
    assert s.would_offload_bytes == 2 * 4 * 16 * 4 and s.offloaded_bytes == 0 and s.pool_allocated == 0


def test_gradient_accumulation_in_one_step_is_bit_identical_and_keeps_each_last_input():
    ref_grads, ref_weights, _ = train(None, steps=2, accumulate=2)
    grads, weights, stats = train(ActivationOffload(min_bytes=0, simulate=True), steps=2, accumulate=2)
    assert_same(ref_grads, grads)
    assert_same(ref_weights, weights)
    assert stats[-1]["would_offload_bytes"] == 2 * (LAYERS - 1) * LAYER_INPUT_BYTES
    assert stats[-1]["kept_tensors"] == 2 and stats[-1]["in_flight"] == 0


def test_would_offload_bytes_equal_layer_input_formula_and_last_layer_is_kept():
    _, _, stats = train(ActivationOffload(min_bytes=1024), steps=1)
    s = stats[0]
    assert s["would_offload_bytes"] == (LAYERS - 1) * BATCH * SEQ * HIDDEN * 4
    assert s["kept_bytes"] == LAYER_INPUT_BYTES and s["kept_tensors"] == 1
    assert s["packed_tensors"] == LAYERS and s["skipped_params"] == 0
    assert s["offloaded_bytes"] == 0 and s["pool_allocated"] == 0  # CPU: counted, never copied or pinned


def test_tensors_below_min_bytes_are_not_counted():
    _, _, stats = train(ActivationOffload(min_bytes=LAYER_INPUT_BYTES + 1), steps=1)
    assert stats[0]["would_offload_bytes"] == 0 and stats[0]["kept_bytes"] == 0
    assert stats[0]["skipped_small"] == LAYERS
    assert DEFAULT_MIN_BYTES == 1 << 20


def test_parameters_and_buffers_are_never_offloaded():
    lin = nn.Linear(512, 512)
    lin.register_buffer("table", torch.randn(512, 512))
    off = ActivationOffload(min_bytes=0, module=lin, simulate=True)
    ckpt = CheckpointFunction(False, off)
    x = torch.randn(4, 512, requires_grad=True)

    def fn(a, w, table_view, bias):
        return (a @ w.t() + bias) @ table_view

    with off.step():
        out = ckpt(fn, x * 1, lin.weight, lin.table.detach(), lin.bias)
        out.sum().backward()
    s = off.stats
    assert s.skipped_params == 3  # a Parameter, a buffer (found by storage), another Parameter
    assert s.offloaded_tensors == 0 and s.kept_tensors == 1  # only x*1, kept as the last input
    assert lin.weight.grad is not None and x.grad is not None


def test_same_storage_copied_once_and_views_restored_exactly():
    w = torch.randn(64, 64, requires_grad=True)

    def fn(a, a_t, a_flat, part):
        return (a @ w).sum() + (a_t @ w).sum() + a_flat.square().sum() + part.sum()

    def run(off):
        w.grad = None
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
        base = x * 2
        ckpt = CheckpointFunction(False, off)
        with off.step() if off is not None else contextlib.nullcontext():
            out = ckpt(fn, base, base.t(), base.view(-1), base[:8])
            out2 = ckpt(lambda a: (a @ w).sum(), base + 1)  # a later scope: moves the first one out
            (out + out2).backward()
        return x.grad.clone(), w.grad.clone()

    ref = run(None)
    off = ActivationOffload(min_bytes=0, simulate=True)
    got = run(off)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    s = off.stats
    assert s.deduped_tensors == 2 and s.skipped_views == 1  # .t() and .view() share; [:8] is partial
    assert s.offloaded_tensors == 1 and s.offloaded_bytes == 64 * 64 * 4 and s.kept_tensors == 1


def test_fifty_steps_keep_pool_bounded_and_nothing_in_flight():
    layers = [nn.Linear(256, 256) for _ in range(4)]
    off = ActivationOffload(min_bytes=0, simulate=True)
    ckpt = CheckpointFunction(False, off)
    x0 = torch.randn(8, 256)
    allocated = []
    for _ in range(50):
        with off.step():
            h = x0.requires_grad_(False) * 1
            h.requires_grad_()
            for layer in layers:
                h = ckpt(lambda a, layer=layer: torch.tanh(layer(a)), h)
            h.sum().backward()
        s = off.stats
        assert s.in_flight == 0 and s.offloaded_tensors == 3 and s.restored_tensors == 3
        allocated.append(s.pool_allocated)
    # step 1 grows by exactly each missing 8 KiB buffer (a power of two: one slab each); then reused
    assert set(allocated) == {3}
    assert off.stats.pool_buffers == 0 and off.stats.steps == 50  # nothing handed out after backward
    assert off.stats.pool_need_bytes == 3 * 8 * 256 * 4  # three layer inputs in use at once
    assert off.stats.pool_bytes == 24576 == off.stats.pool_need_bytes  # exact: no power-of-two rounding
    assert off.stats.pool_max_held_over_need == 1.0


def test_restored_inputs_are_freed_layer_by_layer_during_backward():
    from hf_ddpfix.ops.offload.transfer import RESTORED

    model = build_lora_llama(layers=6)
    model.train()
    off = ActivationOffload(min_bytes=0, simulate=True, module=model)
    install_checkpointing(model, off)
    live = []

    def probe(*_):
        records = [ref() for ref in off._order]
        live.append(sum(1 for r in records if r is not None and r.state == RESTORED))

    for layer in model.base_model.model.model.layers:
        layer.mlp.register_full_backward_hook(probe)
    ids = torch.randint(0, 256, (BATCH, SEQ))
    with off.step():
        model(input_ids=ids, labels=ids).loss.backward()
    assert len(live) == 6 and max(live) <= 2  # the one in use + the prefetched one, never all of them
    assert off.stats.prefetched_tensors == 5 and off.stats.would_offload_bytes == 5 * LAYER_INPUT_BYTES


def test_backward_after_step_exit_still_correct_and_reports_in_flight():
    lin = nn.Linear(128, 128)
    x = torch.randn(16, 128)

    def run(off):
        lin.zero_grad()
        ckpt = CheckpointFunction(False, off)
        with off.step() if off is not None else contextlib.nullcontext():
            h = x.requires_grad_(False) * 1
            h.requires_grad_()
            for _ in range(3):
                h = ckpt(lin, h)
        if off is not None:
            assert off.stats.in_flight == 2  # the graph still needs its host copies
        h.sum().backward()
        return lin.weight.grad.clone()

    assert torch.equal(run(None), run(ActivationOffload(min_bytes=0, simulate=True)))


def test_retain_graph_second_backward_unpacks_again():
    lin = nn.Linear(128, 128)
    x = torch.randn(16, 128, requires_grad=True)

    def run(off):
        x.grad = None
        ckpt = CheckpointFunction(False, off)
        with off.step() if off is not None else contextlib.nullcontext():
            h = x * 1
            for _ in range(3):
                h = ckpt(lin, h)
            h.sum().backward(retain_graph=True)
            h.square().sum().backward()
        return x.grad.clone()

    assert torch.equal(run(None), run(ActivationOffload(min_bytes=0, simulate=True)))


def test_outside_step_the_checkpoint_fn_is_stock_and_never_crashes():
    off = ActivationOffload(min_bytes=0, simulate=True)
    ckpt = CheckpointFunction(False, off)
    lin = nn.Linear(32, 32)
    x = torch.randn(4, 32, requires_grad=True)
    ckpt(lin, x * 1).sum().backward()
    with off.pack_scope():
        pass
    assert off.stats.packed_tensors == 0 and not off.active and x.grad is not None


def test_checkpoint_function_with_offload_is_non_reentrant_and_inspectable():
    off = ActivationOffload()
    fn = CheckpointFunction(False, off, preserve_rng_state=False)
    assert fn.use_reentrant is False and fn.offload is off
    assert fn.checkpoint_kwargs == {"preserve_rng_state": False}
    with pytest.raises(ValueError, match="use_reentrant"):
        CheckpointFunction(True, off)
    with pytest.raises(ValueError, match="min_bytes"):
        ActivationOffload(min_bytes=-1)
    assert accelerator_available() == torch.cuda.is_available()


@pytest.mark.multiprocess
def test_two_process_ddp_weights_identical_with_offload_and_across_ranks(tmp_path):
    out = tmp_path / "result.json"
    torchrun("offload_ddp.py", "--out", str(out), timeout=120)
    result = json.loads(out.read_text())
    assert result["errors"] == [] and result["world_size"] == 2, result
    assert all(result["checks"].values()), result["checks"]
    assert set(result["checks"]) == {"simulate_weights_equal_stock", "accounting_weights_equal_stock",
                                     "accounting_hands_back_the_tensor", "simulate_counts_exact",
                                     "accounting_counts_exact"}
    assert result["ranks_equal"] is True


# ---------------------------------------------------------------------------------------------------
# keep-N on the device, and the feature counts


def _four_layer_step(off: ActivationOffload, rows: int = 32) -> torch.Tensor:
    torch.manual_seed(0)
    blocks = [nn.Linear(64, 64) for _ in range(4)]
    ckpt = CheckpointFunction(False, off)
    with off.step():
        h = torch.randn(rows, 64) * 1
        h.requires_grad_()
        for block in blocks:
            h = ckpt(lambda a, block=block: torch.tanh(block(a)), h)
        h.sum().backward()
    return torch.cat([b.weight.grad.flatten() for b in blocks])


@pytest.mark.parametrize("keep", [1, 2, 3, 4])
def test_keep_on_device_keeps_the_last_n_inputs_and_gradients_are_bit_identical(keep):
    from hf_ddpfix.ops import feature_counts

    feature_counts.reset()
    ref = _four_layer_step(ActivationOffload(min_bytes=0, keep_on_device=4))  # CPU: nothing copied
    off = ActivationOffload(min_bytes=0, simulate=True, keep_on_device=keep)
    assert torch.equal(ref, _four_layer_step(off))
    s = off.stats
    layer = 32 * 64 * 4
    assert (s.kept_tensors, s.kept_bytes) == (keep, keep * layer), s
    assert (s.offloaded_tensors, s.restored_tensors, s.keep_on_device) == (4 - keep, 4 - keep, keep), s
    c = feature_counts.snapshot()["offload"]
    assert c.amounts.get("copies", 0) == 4 - keep and c.amounts.get("bytes", 0) == (4 - keep) * layer
    assert c.ran == (1 if keep < 4 else 0) and c.amounts["kept"] == 4 + keep  # reference run kept all 4


def test_keep_on_device_rejects_values_it_cannot_honour():
    for bad in (0, -1, True, 1.5, "all"):
        with pytest.raises(ValueError, match="keep_on_device"):
            ActivationOffload(keep_on_device=bad)


def test_auto_keep_on_device_asks_the_budget_with_the_previous_steps_memory():
    layer = 32 * 64 * 4
    fixed = 10 * layer

    def device_memory(_device):  # what the forward held when the backward began: fixed + the kept inputs
        return fixed + off.keep_on_device * layer, total["bytes"]

    total = {"bytes": int((fixed + 3.5 * layer) / 0.9)}  # room for 3 inputs under pressure_fraction 0.9
    off = ActivationOffload(min_bytes=0, simulate=True, keep_on_device="auto", device_memory=device_memory)
    _four_layer_step(off)
    assert off.stats.keep_on_device == 1  # nothing known before the first step
    _four_layer_step(off)
    assert off.stats.keep_on_device == 3 and off.stats.kept_tensors == 3 and off.stats.offloaded_tensors == 1
    assert off.stats.pool_bytes > 0  # the offloaded input's slab is held for the next step
    total["bytes"] = int((fixed + 4.5 * layer) / 0.9)  # all four fit: nothing is copied any more ...
    _four_layer_step(off)
    _four_layer_step(off)
    assert off.stats.keep_on_device == 4 and off.stats.offloaded_tensors == 0
    assert off.stats.pool_bytes == 0  # ... and the pool gave its idle slabs back
    total["bytes"] = int((fixed + 1.2 * layer) / 0.9)  # the device shrank: only one fits
    _four_layer_step(off)
    _four_layer_step(off)
    assert off.stats.keep_on_device == 1 and off.stats.offloaded_tensors == 3
    total["bytes"] = fixed  # short even with one: still keeps one (the minimum), offloads the rest
    _four_layer_step(off)
    _four_layer_step(off)
    assert off.stats.keep_on_device == 1


def test_cpu_without_simulate_records_the_fallback_reason_per_storage():
    from hf_ddpfix.ops import feature_counts
    from hf_ddpfix.ops.offload.offload import NO_ACCELERATOR

    feature_counts.reset()
    off = ActivationOffload(min_bytes=0)
    _four_layer_step(off)
    c = feature_counts.snapshot()["offload"]
    assert c.fallbacks == {NO_ACCELERATOR: 3} and c.ran == 0 and "copies" not in c.amounts
    assert off.stats.would_offload_bytes == 3 * 32 * 64 * 4 and off.stats.offloaded_bytes == 0


def test_policy_skips_are_counted():
    from hf_ddpfix.ops import feature_counts

    feature_counts.reset()
    _four_layer_step(ActivationOffload(min_bytes=0, simulate=True, min_layer_bytes=1 << 30))
    c = feature_counts.snapshot()["offload"]
    assert c.amounts["policy_skips"] == 4 and c.ran == 0


def test_pool_cap_set_later_keeps_storages_on_the_device_and_says_why():
    from hf_ddpfix.ops import feature_counts
    from hf_ddpfix.ops.offload.offload import POOL_REFUSED

    feature_counts.reset()
    off = ActivationOffload(min_bytes=0, simulate=True)
    off.set_max_pool_bytes(32 * 64 * 4)  # room for one of the three layer inputs
    ref = _four_layer_step(ActivationOffload(min_bytes=0))
    assert torch.equal(ref, _four_layer_step(off))
    s = off.stats
    assert (s.offloaded_tensors, s.skipped_pool, s.pool_bytes) == (1, 2, 32 * 64 * 4), s
    assert feature_counts.snapshot()["offload"].fallbacks[POOL_REFUSED] == 2
    with pytest.raises(ValueError, match="max_pool_bytes"):
        off.set_max_pool_bytes(-1)
