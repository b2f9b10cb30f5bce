"""The forward order the dummy image relies on is checked at attach time (issue 49 item 1).

The dummy runs at the language model's forward pre-hook, where an image rank has already run its tower (embed ->
tower -> language model). ``forward_order_problem`` reads the forward of the module that owns the language model and
refuses where it calls the language model before its tower, or runs its tower before it embeds the tokens (Ovis2.5,
transformers 5.25: its image rank all-gathered the tower's units while a text rank, its dummy not yet run, gathered
the embedding's: "9723904 vs 35264" mid-step); the FSDP2 / ZeRO dummy then raises ``ValueError`` (the plan folds the
tower under FSDP2 and keeps stock under ZeRO).

Shown failing once (2026-12-02): with ``forward_order_problem`` returning ``None`` always, the reordered model below
builds a stabiliser and ``test_a_forward_that_enters_the_language_model_first_is_refused`` fails ("DID NOT RAISE").
On transformers 5.23 every family with a dummy (50 of 97) shows both calls in that forward, tower first.
"""

from __future__ import annotations

import pytest
from fixtures import build_qwen2_5_vl

from hf_ddpfix.integrations.vision.zero import (
    TOWER_CALLS,
    ZeroVisionStabilizer,
    first_calls,
    first_embedding_call,
    forward_order_problem,
    language_model_path,
)


def _reordered_forward(self, input_ids=None, pixel_values=None, image_grid_thw=None, **kwargs):
    out = self.language_model(input_ids=input_ids, **kwargs)  # the language model first ...
    self.get_image_features(pixel_values, image_grid_thw)  # ... then the tower
    return out


def test_the_stock_forward_runs_its_tower_before_the_language_model():
    model = build_qwen2_5_vl()
    stab = ZeroVisionStabilizer(model)
    path = language_model_path(stab.adapter)
    assert path == "model.language_model"
    lm_at, tower_at = first_calls(type(model.model).forward, "language_model", set(TOWER_CALLS))
    assert lm_at is not None and tower_at is not None and tower_at < lm_at  # both read, tower first
    assert forward_order_problem(stab.adapter, path) is None


def test_a_forward_that_enters_the_language_model_first_is_refused():
    model = build_qwen2_5_vl()
    inner = model.model
    inner.__class__ = type("ReorderedModel", (type(inner),), {"forward": _reordered_forward})
    with pytest.raises(ValueError, match=r"ReorderedModel\.forward calls self\.language_model \(line 2 .*before it "
                                         r"runs the tower \(line 3\)"):
        ZeroVisionStabilizer(model)


def _tower_first_forward(self, input_ids=None, pixel_values=None, image_grid_thw=None, **kwargs):
    features = self.get_image_features(pixel_values, image_grid_thw)  # the tower first ...
    inputs_embeds = self.get_input_embeddings()(input_ids)  # ... then the embedding
    return self.language_model(inputs_embeds=inputs_embeds + 0 * features.pooler_output[0].sum(), **kwargs)


def test_a_forward_that_runs_its_tower_before_it_embeds_the_tokens_is_refused_and_the_plan_folds():
    """Shown failing (2026-12-03, the embedding check left out): "DID NOT RAISE", and the plan's facts named a
    dummy (``fsdp_skippable`` would shard the tower)."""
    from hf_ddpfix.integrations.fsdp import fsdp_facts

    model = build_qwen2_5_vl()
    assert first_embedding_call(type(model.model).forward) is not None  # the stock forward: embed, then tower
    inner = model.model
    inner.__class__ = type("TowerFirstModel", (type(inner),), {"forward": _tower_first_forward})
    assert first_embedding_call(_tower_first_forward) == (3, 20)
    with pytest.raises(ValueError, match=r"TowerFirstModel\.forward runs the tower \(line 2 .*before it embeds the "
                                         r"tokens \(line 3\)"):
        ZeroVisionStabilizer(model)
    facts = fsdp_facts(None, model)
    assert facts.dummy == "" and facts.no_dummy.startswith("the forward order: TowerFirstModel"), facts.no_dummy


def test_a_forward_without_source_concludes_nothing():
    assert first_calls(len, "language_model", set(TOWER_CALLS)) == (None, None)
    assert first_embedding_call(len) is None
