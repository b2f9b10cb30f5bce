"""Contracts of every patched call site: what the installed transformers really passes to each forward
hf_ddpfix replaces, checked against what the patched forward accepts (issue: transformers 5.24 renamed
the decoder layer's ``past_key_values`` to ``cache`` and every long-context call silently ran stock).

Each test records the real calls (module pre-hooks with keywords, on a tiny model of the installed
release) and asserts (1) every argument binds to the stock forward's signature, (2) the patched forward
reads every argument by role (nothing unknown, the KV cache under one of ``_compat.CACHE_KEYWORDS``) and
(3) a real training forward runs the patched code: ``feature_counts`` shows ``ran`` > 0 and no fallback.
Runs on every CI stack (pinned, oldest, newest).
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_ddpfix import _compat  # noqa: E402
from hf_ddpfix.integrations.long_context.layer_call import HARMLESS_LAYER_KEYWORDS, bind_layer_call  # noqa: E402
from hf_ddpfix.integrations.long_context.long_context import apply_long_context  # noqa: E402
from hf_ddpfix.integrations.long_context.loss_patch import _known_extra_keywords, patch_model_loss  # noqa: E402
from hf_ddpfix.integrations.long_context.tiled_mlp import apply_tiled_mlp  # noqa: E402
from hf_ddpfix.ops import feature_counts  # noqa: E402
from tests.fixtures import padded_collate, tiny_llama, variable_length_ids  # noqa: E402

VERSION = f"transformers {transformers.__version__}"


def _broken(what: str) -> str:
    return f"upstream call contract broken on {VERSION}: {what} (see hf_ddpfix/integrations/long_context/layer_call.py)"


def _model():
    # use_cache=False: what a training run has (checkpointing turns it off; a training forward with
    # use_cache=True builds a KV cache, which the long-context patch leaves to stock, counted as a fallback)
    model = tiny_llama(num_hidden_layers=2, attn_implementation="sdpa", use_cache=False)
    model.train()
    return model


def _record(modules, calls):
    def hook(module, args, kwargs):
        calls.append((module, args, dict(kwargs)))

    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]


def _stock_layer_signature(layer) -> inspect.Signature:
    cls_forward = type(layer).forward
    inner = _compat.class_checkpoint_inner_forward(cls_forward)
    return inspect.signature((inner if inner is not None else cls_forward).__get__(layer))


# Roles the patched decoder layer reads; a parameter outside these makes a call run stock (and this fails).
_LAYER_ROLES = {"hidden_states", "attention_mask", "position_ids", "position_embeddings", "use_cache",
                *_compat.CACHE_KEYWORDS, *HARMLESS_LAYER_KEYWORDS}


def test_decoder_layer_signature_has_only_parameters_the_patch_reads():
    layer = _model().model.layers[0]
    sig = _stock_layer_signature(layer)
    named = [p.name for p in sig.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    assert named[0] == "hidden_states", _broken(f"decoder layer's first parameter is {named[0]!r}")
    unknown = sorted(set(named) - _LAYER_ROLES)
    assert not unknown, _broken(f"LlamaDecoderLayer.forward has parameters the patch does not read: {unknown}")
    caches = [n for n in named if n in _compat.CACHE_KEYWORDS]
    assert len(caches) == 1, _broken(f"KV-cache parameter of the decoder layer: {caches or named}")


def test_the_model_calls_each_decoder_layer_with_keywords_the_patch_reads():
    model = _model()
    layers = list(model.model.layers)
    calls: list = []
    handles = _record(layers, calls)
    ids = torch.randint(1, 60, (2, 9))
    try:
        model(input_ids=ids, labels=ids)  # training forward: no cache, no mask
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)  # inference: the KV cache under this release's name
    finally:
        for h in handles:
            h.remove()
    assert len(calls) == 2 * len(layers)
    for i, (layer, args, kwargs) in enumerate(calls):
        sig = _stock_layer_signature(layer)
        call = bind_layer_call(sig, args, kwargs)
        assert call.unbound is None, _broken(call.unbound or "")
        assert not call.unknown, _broken(f"the layer loop passes keywords the patch does not read: {call.unknown}")
        assert isinstance(call.hidden_states, torch.Tensor) and call.hidden_states.dim() == 3
        assert call.position_embeddings is not None, _broken("position_embeddings are no longer passed")
        training = i < len(layers)
        if training:
            assert call.cache is None and not call.use_cache, _broken(f"training call carries a cache: {sorted(kwargs)}")
        else:
            named = [k for k in kwargs if k in _compat.CACHE_KEYWORDS and kwargs[k] is not None]
            assert named and call.cache is not None, _broken(f"no KV cache under {_compat.CACHE_KEYWORDS}: {sorted(kwargs)}")


def test_long_context_runs_patched_on_every_layer_of_a_training_forward():
    model = _model()
    handle = apply_long_context(model, "all")
    assert len([e for e in handle.report if "tiled_layer" in e.patched]) == 2
    feature_counts.reset()
    ids = torch.randint(1, 60, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    counts = feature_counts.snapshot()["long_context"]
    assert counts.ran == 2 and counts.fallbacks == {}, _broken(f"long_context counts {counts.as_dict()}")
    assert counts.amounts["rms_norm_calls"] >= 2 * 2 + 1  # two per layer (again in the tiles' recompute), final norm
    handle.remove()


def test_the_loss_keywords_a_forward_passes_down_leave_every_layer_patched():
    """The SP forward calls the model with `shift_labels` (and the Trainer with `num_items_in_batch`); transformers
    hands a forward's `**kwargs` to every decoder layer. The patched layer reads them as the loss's, not its own:
    before, every layer ran stock under SP through the Trainer (`keyword arguments ['shift_labels']`)."""
    model = _model()
    ids = torch.randint(1, 60, (2, 9))
    shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    calls: list = []
    handles = _record(list(model.model.layers), calls)
    try:
        model(input_ids=ids, labels=shift, shift_labels=shift, num_items_in_batch=1, ignore_index=-100)
    finally:
        for h in handles:
            h.remove()
    assert all("shift_labels" in kw for _, _, kw in calls), _broken("shift_labels no longer reaches the layers")
    handle = apply_long_context(model, "all")
    feature_counts.reset()
    model(input_ids=ids, labels=shift, shift_labels=shift, num_items_in_batch=1, ignore_index=-100).loss.backward()
    counts = feature_counts.snapshot()["long_context"]
    assert counts.ran == 2 and counts.fallbacks == {}, counts.as_dict()
    handle.remove()


def test_norms_and_mlps_are_called_with_one_hidden_states_tensor():
    model = _model()
    layer = model.model.layers[0]
    calls: list = []
    handles = _record([layer.input_layernorm, layer.post_attention_layernorm, model.model.norm, layer.mlp], calls)
    ids = torch.randint(1, 60, (2, 9))
    try:
        model(input_ids=ids, labels=ids)
    finally:
        for h in handles:
            h.remove()
    assert len(calls) == 4
    for module, args, kwargs in calls:
        assert len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor), _broken(
            f"{type(module).__name__} called with {len(args)} positional and keywords {sorted(kwargs)}")


def test_tiled_mlp_runs_patched_in_every_layer_and_keeps_the_signature():
    model = _model()
    stock_sig = inspect.signature(model.model.layers[0].mlp.forward)
    handle = apply_tiled_mlp(model, shards=3)
    assert len(handle.patched) == 2
    assert inspect.signature(model.model.layers[0].mlp.forward) == stock_sig
    feature_counts.reset()
    ids = torch.randint(1, 60, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    counts = feature_counts.snapshot()["tiled_mlp"]
    assert counts.ran == 2 and counts.fallbacks == {} and counts.amounts["shards"] == 6, counts.as_dict()
    handle.remove()


def test_the_trainer_calls_the_model_with_keywords_the_tiled_loss_reads(tmp_path):
    """Trainer.compute_loss -> model(**inputs, [num_items_in_batch]) -> the tiled loss: every keyword is a
    parameter of the model's forward or one the patch knows, and the patched loss ran for every step."""
    model = _model()
    fwd_params = set(inspect.signature(type(model).forward).parameters)
    calls: list = []
    handles = _record([model], calls)
    handle = patch_model_loss(model)
    assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    data = [{"input_ids": ids} for ids in variable_length_ids(4)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, use_cpu=True,
                             report_to=[], disable_tqdm=True, save_strategy="no", remove_unused_columns=False)
    feature_counts.reset()
    try:
        Trainer(model=model, args=args, train_dataset=data, data_collator=padded_collate).train()
    finally:
        for h in handles:
            h.remove()
        handle.remove()
    assert len(calls) == 2
    for _, args_, kwargs in calls:
        unknown = sorted(k for k in kwargs if k not in fwd_params and k not in _known_extra_keywords())
        assert not args_ and not unknown, _broken(f"Trainer passes {len(args_)} positional, unknown keywords {unknown}")
    counts = feature_counts.snapshot()["tiled_loss"]
    assert counts.ran == 2 and counts.fallbacks == {}, _broken(f"tiled_loss counts {counts.as_dict()}")


def test_model_outputs_carry_the_cache_under_a_known_name():
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

    for cls in (CausalLMOutputWithPast, BaseModelOutputWithPast):
        assert _compat.cache_output_field(cls) in _compat.CACHE_KEYWORDS[:2], _broken(f"{cls.__name__} cache field")
