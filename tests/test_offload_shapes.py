"""ActivationOffload under real data shapes (CPU, ``simulate=True`` copies through host buffers):

- 200 steps of random lengths: the bytes the host pool's slabs really hold stay within the largest step's need
  + max(granule, need / 64) (<= 2x by construction; measured 1.009x, asserted <= 1.01x: the README's figure);
- encoder-decoder models (tiny BART and T5, built from configs): a storage every decoder layer receives
  positionally (``encoder_hidden_states``; T5 also its position bias) is copied out once per step, every
  storage at most once, the bytes moved are exactly the distinct checkpoint inputs, and the training
  is bit-identical to stock non-reentrant checkpointing;
- the ``min_layer_bytes`` policy leaves small layers on the device and says why.
"""

from __future__ import annotations

import contextlib
import random
import warnings

import pytest
import torch
from torch import nn

from hf_ddpfix._compat import enable_model_checkpointing
from hf_ddpfix.integrations.checkpointing import CheckpointFunction, apply_checkpointing
from hf_ddpfix.ops.offload import ActivationOffload


def test_two_hundred_steps_of_random_lengths_keep_host_pool_within_the_largest_step_and_a_granule():
    hidden, layers = 128, 4  # fp32 rows of 512 bytes
    torch.manual_seed(0)
    blocks = [nn.Linear(hidden, hidden) for _ in range(layers)]
    off = ActivationOffload(min_bytes=0, simulate=True, max_pool_bytes=None)
    ckpt = CheckpointFunction(False, off)
    rng = random.Random(0)
    largest = 0
    allocated = []
    worst = 0.0
    for step in range(200):
        batch, length = rng.randint(1, 4), rng.randint(8, 256)
        x = torch.randn(batch, length, hidden)
        with off.step():
            h = x * 1
            h.requires_grad_()
            for block in blocks:
                h = ckpt(lambda a, block=block: torch.tanh(block(a)), h)
            h.sum().backward()
        s = off.stats
        need = (layers - 1) * batch * length * hidden * 4  # every layer input but the last one is moved
        assert s.offloaded_bytes == need and s.restored_tensors == layers - 1 and s.in_flight == 0, (step, s)
        largest = max(largest, need)
        assert s.pool_need_bytes == largest, (step, s)
        pools = list(off._transfers.pools.values())
        real = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for pool in pools for t in pool.host_tensors()}.values())  # what the slabs really hold
        assert real == s.pool_bytes, (step, real, s)
        granule = max(pool.granule for pool in pools)
        assert real <= largest + max(granule, largest // 64) and s.pool_peak_bytes <= 2 * largest, (step, s)
        worst = max(worst, real / largest)
        allocated.append(s.pool_allocated)
    # README / BENCHMARKS "<= 1.01x on varied shapes": measured 1.0090x here (2026-11-27; deterministic, seeded);
    # the bound by construction is 1 + 1/64 once the need passes 64 granules, 2x below
    assert worst <= 1.01, worst
    print(f"random shapes: held / largest need at worst {worst:.4f}")
    # slabs are allocated only while the largest need grows (log-many times), not once per new length
    assert allocated[-1] <= 40, allocated[-1]


# ---------------------------------------------------------------------------------------------------
# encoder-decoder models


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = BartForConditionalGeneration(cfg)
    return model, model.model.encoder.layers, model.model.decoder.layers, model.model.encoder


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=3, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(cfg)
    return model, model.encoder.block, model.decoder.block, model.encoder


BUILDERS = {"bart": _bart, "t5": _t5}


def _train_seq2seq(kind: str, mode: str, steps: int = 2):
    """Two AdamW steps (weight decay, clipping); per step: (loss, grads, stats, copies, expected)."""
    torch.manual_seed(0)
    model, enc_layers, dec_layers, encoder = BUILDERS[kind]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_model_checkpointing(model, {"use_reentrant": False})
    model.train()
    off = ActivationOffload(min_bytes=0, module=model, simulate=True, max_pool_bytes=None) if mode == "offload" else None
    assert apply_checkpointing(model, use_reentrant=False, offload=off) >= len(enc_layers) + len(dec_layers)

    calls: list[list[torch.Tensor]] = []  # positional tensor inputs of each checkpointed layer call
    for layer in (*enc_layers, *dec_layers):
        layer.register_forward_pre_hook(
            lambda _m, args: calls.append([a for a in args if isinstance(a, torch.Tensor)])
        )
    enc_out: list[int] = []
    encoder.register_forward_hook(lambda _m, _a, out: enc_out.append(out[0].untyped_storage()._cdata))
    copies: list[int] = []
    if off is not None:
        real = off._offload

        def counting(rec):
            copies.append(rec.ref.cdata)
            real(rec)

        off._offload = counting
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        calls.clear(), enc_out.clear(), copies.clear()
        src, tgt = 9 + 3 * step, 7 + 2 * step  # a new shape every step
        ids = torch.randint(3, 128, (2, src), generator=gen)
        labels = torch.randint(3, 128, (2, tgt), generator=gen)
        with off.step() if off is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=labels).loss
            n_forward = len(calls)
            loss.backward()
        del calls[n_forward:]  # transformers < 5.23 checkpoints `__call__`: the recompute runs the hooks again
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        # expected copies: every distinct input storage of the checkpointed calls; the storages first seen
        # in the last call stay on the device (the backward needs them first)
        seen: dict[int, int] = {}
        for args in calls[:-1]:
            for a in args:
                seen.setdefault(a.untyped_storage()._cdata, a.untyped_storage().nbytes())
        last = {a.untyped_storage()._cdata for a in calls[-1]} - set(seen)
        stats = off.stats.as_dict() if off is not None else None
        out.append((loss.detach(), grads, stats, list(copies), seen, last, enc_out[0], calls_count := len(calls)))
        assert calls_count == len(enc_layers) + len(dec_layers)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out, {n: p.detach().clone() for n, p in model.named_parameters()}, len(dec_layers)


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_encoder_decoder_shared_storages_are_copied_once_per_step_and_training_is_bit_identical(kind):
    ref_steps, ref_weights = _train_seq2seq(kind, "stock")[:2]
    steps, weights, dec_layers = _train_seq2seq(kind, "offload")
    for i, (ref, got) in enumerate(zip(ref_steps, steps, strict=True)):
        assert torch.equal(ref[0], got[0]), f"{kind} step {i}: loss"
        assert ref[1].keys() == got[1].keys() and ref[1]
        bad = [n for n in ref[1] if not torch.equal(ref[1][n], got[1][n])]
        assert not bad, f"{kind} step {i}: gradients differ: {bad[:3]}"
        _, _, s, copies, seen, last, enc_storage, _ = got
        assert len(copies) == len(set(copies)), f"{kind} step {i}: a storage was copied twice: {copies}"
        assert copies.count(enc_storage) == 1, f"{kind} step {i}: encoder output copied {copies.count(enc_storage)}x"
        expected = seen
        assert last and enc_storage in seen and enc_storage not in last
        assert set(copies) == set(expected), (kind, i)
        assert s["offloaded_bytes"] == sum(expected.values()) and s["offloaded_tensors"] == len(expected), s
        assert s["restored_tensors"] == len(expected) and s["in_flight"] == 0, s
        # each decoder layer after the first passes the encoder output again: found, not copied again
        assert s["deduped_tensors"] >= dec_layers - 1, s
    assert ref_weights.keys() == weights.keys()
    assert all(torch.equal(ref_weights[n], weights[n]) for n in ref_weights), f"{kind}: weights differ"


def test_min_layer_bytes_policy_keeps_small_layers_on_device_and_says_why():
    hidden = 64
    blocks = [nn.Linear(hidden, hidden) for _ in range(3)]

    def run(off: ActivationOffload, rows: int) -> dict:
        ckpt = CheckpointFunction(False, off)
        with off.step():
            h = torch.randn(rows, hidden) * 1
            h.requires_grad_()
            for block in blocks:
                h = ckpt(block, h)
            h.sum().backward()
        return off.stats.as_dict()

    off = ActivationOffload(min_bytes=0, simulate=True, min_layer_bytes=100 * hidden * 4)
    small = run(off, 50)
    assert small["offloaded_tensors"] == 0 and small["skipped_policy"] == 3, small
    assert small["policy"].startswith("keep: checkpoint inputs < "), small["policy"]
    big = run(off, 100)
    assert big["offloaded_tensors"] == 2 and big["skipped_policy"] == 0, big
    assert big["policy"].startswith("copy: a checkpoint input of"), big["policy"]
    always = run(ActivationOffload(min_bytes=0, simulate=True), 50)
    assert always["offloaded_tensors"] == 2 and always["policy"] == "copy: always", always
    with pytest.raises(ValueError, match="min_layer_bytes"):
        ActivationOffload(min_layer_bytes=-1)


# ---------------------------------------------------------------------------------------------------
# the pinned pool at every moment, for shapes that do not scale together (issue: the pool of old sized a
# step's slab from the previous step's first request and held 12.8x (BART), 4x (VLM), 791x (random),
# 1708x (two micro-batches) the largest step's need during a step)


def _pool_figure(off: ActivationOffload) -> float:
    """The pools' largest held / need(t) at any moment so far (need(t): most bytes in use at once)."""
    pool = next(iter(off._transfers.pools.values()))
    assert pool.stats.max_held_over_need == off.stats.pool_max_held_over_need
    return pool.stats.max_held_over_need


def _chain(off: ActivationOffload, blocks, x: torch.Tensor) -> torch.Tensor:
    ckpt = CheckpointFunction(False, off)
    h = x * 1
    h.requires_grad_()
    for block in blocks:
        h = ckpt(lambda a, block=block: torch.tanh(block(a)), h)
    return h


def _bart_steps(off, steps: int = 6) -> None:
    model, *_ = _bart()
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_model_checkpointing(model, {"use_reentrant": False})
    apply_checkpointing(model, use_reentrant=False, offload=off)
    gen = torch.Generator().manual_seed(3)
    for src, tgt in [(40, 4), (4, 40), (48, 2), (3, 60), (30, 30), (2, 50)][:steps]:  # independent lengths
        with off.step():
            model(input_ids=torch.randint(3, 128, (1, src), generator=gen),
                  labels=torch.randint(3, 128, (1, tgt), generator=gen)).loss.backward()


def _vlm_steps(off, steps: int = 4) -> None:
    from fixtures import add_lora, build_qwen2_5_vl, make_batch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = add_lora(build_qwen2_5_vl(0))
        enable_model_checkpointing(model, {"use_reentrant": False})
    model.train()
    off._module_ref = __import__("weakref").ref(model)
    apply_checkpointing(model, use_reentrant=False, offload=off)
    for step in range(steps):  # text, image, text, image: the vision inputs come and go
        with off.step():
            model(**make_batch(step % 2 == 1, seed=step)).loss.backward()


def _micro_batch_steps(off, steps: int = 8) -> None:
    torch.manual_seed(0)
    blocks = [nn.Linear(64, 64) for _ in range(4)]
    rng = random.Random(5)
    for _ in range(steps):
        with off.step():  # two micro-batches of different lengths accumulate in one optimizer step
            for length in (rng.randint(1, 8), rng.randint(100, 400)):
                _chain(off, blocks, torch.randn(length, 64)).sum().backward()


def _random_steps(off, steps: int = 60) -> None:
    torch.manual_seed(0)
    blocks = [nn.Linear(64, 64) for _ in range(4)]
    rng = random.Random(6)
    for _ in range(steps):
        with off.step():
            _chain(off, blocks, torch.randn(rng.choice([1, 2, 3, 500, 1000]) * rng.randint(1, 3), 64)).sum().backward()


@pytest.mark.parametrize("shapes", ["bart_independent_lengths", "vlm_image_and_text", "two_micro_batches", "random"])
def test_host_pool_holds_at_most_twice_the_need_at_every_moment(shapes):
    run = {"bart_independent_lengths": _bart_steps, "vlm_image_and_text": _vlm_steps,
           "two_micro_batches": _micro_batch_steps, "random": _random_steps}[shapes]
    off = ActivationOffload(min_bytes=0, simulate=True, max_pool_bytes=None)
    run(off)
    figure = _pool_figure(off)
    s = off.stats
    assert s.steps >= 4 and s.offloaded_tensors > 0 and s.in_flight == 0 and s.pool_buffers == 0, s
    # the largest step's need over the whole run bounds every moment too
    assert s.pool_peak_bytes <= 2 * s.pool_need_bytes + 64 * s.pool_allocated, s  # ALIGNMENT per buffer at most
    print(f"{shapes}: pool held / need at worst {figure:.4f} (peak {s.pool_peak_bytes} B, need {s.pool_need_bytes} B)")
    assert 1.0 <= figure <= 2.0, figure
