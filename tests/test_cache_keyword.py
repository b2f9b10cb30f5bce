"""The KV cache under both names: transformers 5.24 renamed the forwards' ``past_key_values=`` to ``cache=``
(``past_key_values=`` stays a deprecated alias until 5.40). Every forward hf_ddpfix replaces or hooks and that
can see a cache accepts it under either name and passes it through unchanged (or refuses it, by either name,
where it refuses one):

- the long-context decoder layer and RMSNorm patches and the tiled loss on a tiny Llama of the installed release: a prefill and a decode step with a cache passed under each name give stock's logits, the
  caller's cache object grows as stock's does, and the tiled loss returns it (the RMSNorm / MLP forwards take
  one hidden-states tensor and no cache: tests/test_call_contracts.py);
- the Mllama cross-attention dummy (FSDP): a decode step (cache already holding tokens) is told from a prefill by
  the cache under either name;
- sequence parallelism's head-whole decoder forward and the VLM decoder hook: a call with a cache is refused,
  named, under either name.

Runs on every CI stack (5.0 oldest, 5.23 pinned, 5.24 newest). Shown failing (2026-12-02): the cross-attention
dummy reading ``kwargs.get("past_key_values")`` (as before) fails ``test_cross_attention_dummy_tells_a_decode_step
_by_either_cache_name[cache]``; the head-whole forward popping ``past_key_values`` only fails
``test_sequence_parallel_refuses_a_cache_under_either_name[cache]``; the tiled loss dropping the cache field of
its output fails ``test_patched_forwards_pass_a_cache_under_either_name_through_unchanged[cache]`` on 5.24.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_ddpfix import _compat  # noqa: E402
from tests.fixtures import tiny_llama  # noqa: E402

NAMES = ("cache", "past_key_values")


def test_passed_cache_reads_every_name_and_skips_none():
    c = object()
    assert _compat.passed_cache({"cache": c}) is c
    assert _compat.passed_cache({"past_key_values": c, "cache": None}) is c
    assert _compat.passed_cache({"past_key_value": c}) is c
    assert _compat.passed_cache({"use_cache": True}) is None


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # releases whose DynamicCache takes no config
        return DynamicCache()


def _decode(model, name: str, ids: torch.Tensor, labels: bool):
    """With a cache passed as `name=`: prefill `ids[:, :-1]` then one decode step (logits, with grad: the
    long-context layer's patched path is asked), or a prefill with labels (its loss, in evaluation: the tiled
    loss's `in_eval` path). Returns the logits / loss, the cache's length, and whether each output carried the
    caller's cache object."""
    cache = _new_cache(model)
    out, returned = [], []
    parts = (ids,) if labels else (ids[:, :-1], ids[:, -1:])
    with torch.set_grad_enabled(not labels):
        for part in parts:
            kw = {name: cache, "use_cache": True, **({"labels": part} if labels else {})}
            o = model(input_ids=part, **kw)
            out.append((o.loss if labels else o.logits).detach())
            returned.append(_compat.output_cache(o) is cache)
    return out, cache.get_seq_length(), returned


@pytest.mark.parametrize("name", NAMES)
def test_patched_forwards_pass_a_cache_under_either_name_through_unchanged(name):
    """Long context (RMSNorm, attention, tiled layer) and the tiled loss (in evaluation too): under a cache passed
    as `name=`, logits (bit for bit) and the cache's length equal stock's on the same call (with grad: the
    patched layer leaves a call with a cache to stock, whichever its name), each output carries the caller's
    cache where stock's does; the tiled loss gives stock's loss (1e-5 relative: another summation order). On a
    release whose forwards do not know `name` (`cache=` before 5.24) stock ignores it, and so must the patches."""
    from hf_ddpfix.integrations.long_context.long_context import apply_long_context
    from hf_ddpfix.integrations.long_context.loss_patch import patch_model_loss

    model = tiny_llama(num_hidden_layers=2, attn_implementation="sdpa").eval()
    ids = torch.randint(1, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = [_decode(model, name, ids, labels) for labels in (False, True)]
    handles = [apply_long_context(model, "all"), patch_model_loss(model, in_eval=True)]
    try:
        ours = [_decode(model, name, ids, labels) for labels in (False, True)]
    finally:
        for h in reversed(handles):
            h.remove()
    (logits, length, returned), (loss, loss_length, loss_returned) = ours
    (ref_logits, ref_length, ref_returned), (ref_loss, ref_loss_length, ref_loss_returned) = ref
    assert (length, loss_length) == (ref_length, ref_loss_length)
    assert (returned, loss_returned) == (ref_returned, ref_loss_returned)
    if name in _model_params(model):  # this release's name: the cache is used and returned
        assert ref_length == ids.shape[1] and ref_loss_length == ids.shape[1] and all(ref_loss_returned)
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=0) for a, b in zip(loss, ref_loss, strict=True))


def _model_params(model) -> set[str]:
    import inspect

    return set(inspect.signature(type(model).forward).parameters)


class _Cache:
    """Stands in for a KV cache that already holds tokens (a decode step)."""

    def get_seq_length(self) -> int:
        return 3


@pytest.mark.parametrize("name", NAMES)
def test_cross_attention_dummy_tells_a_decode_step_by_either_cache_name(name):
    """An image rank's decode step (a cache with tokens the dummy never saw) runs the model as stock (the hook
    returns None, injects nothing); a prefill (no cache) injects the zero cross-attention states."""
    from hf_ddpfix.integrations.fsdp.cross_attention import CrossAttentionDummy
    from tests.zoo import ZOO

    dummy = CrossAttentionDummy(ZOO["mllama"].model(0))
    ids = torch.randint(1, 60, (1, 1))
    assert dummy._inject(dummy.language_model, (), {"input_ids": ids, name: _Cache()}) is None
    injected = dummy._inject(dummy.language_model, (), {"input_ids": ids, name: None})
    assert injected is not None and injected[1]["cross_attention_states"] is not None


@pytest.mark.parametrize("name", NAMES)
def test_sequence_parallel_refuses_a_cache_under_either_name(name):
    """The head-whole route's decoder forward and the VLM decoder hook refuse a call with a KV cache before any
    collective, whichever name carries it."""
    from hf_ddpfix.integrations.sequence_parallel.head import DecoderShardedForward
    from hf_ddpfix.integrations.sequence_parallel.vision import VisionSequenceSharding

    def original(**kwargs):
        raise AssertionError(f"the decoder ran with a cache: {sorted(kwargs)}")

    forward = DecoderShardedForward(original, group=None, pad_token_id=0)
    with pytest.raises(RuntimeError, match="KV cache"):
        forward(input_ids=torch.ones(1, 4, dtype=torch.long), **{name: _Cache()})
    hook = object.__new__(VisionSequenceSharding)
    hook._expect = object()
    with pytest.raises(NotImplementedError, match="KV cache"):
        hook._pre_hook(torch.nn.Identity(), (), {"inputs_embeds": torch.zeros(1, 4, 2), name: _Cache()})
