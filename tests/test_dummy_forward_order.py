"""The forward order the dummy image relies on is checked at attach time (issue 49 item 1).

The dummy runs at the language model's forward pre-hook, where an image rank has already run its tower (embed ->
tower -> language model). ``forward_order_problem`` reads the forward of the module that owns the language model and
refuses where it calls the language model before its tower; the FSDP2 / ZeRO dummy then raises ``ValueError`` (the
plan folds the tower under FSDP2 and keeps stock under ZeRO).

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


def test_a_forward_without_source_concludes_nothing():
    assert first_calls(len, "language_model", set(TOWER_CALLS)) == (None, None)
