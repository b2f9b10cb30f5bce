"""The mixed-image guard under ZeRO-2/3 for a VLM with no dummy image (hf_ddpfix/integrations/vision/mixed_guard.py).

Fast tier: the rule that reads a forward's visual inputs, the guard's verdict from every rank's flags (the gather
replaced by the flags a run would gather), and the plan -> runtime wiring. The 2-process ZeRO-3 run (a family with
no dummy stops at its first mixed step with the named error on both ranks, the launch goes on):
tests/test_vlm_families.py's batched cells."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_ddpfix.integrations.vision import mixed_guard
from hf_ddpfix.integrations.vision.mixed_guard import MixedImageGuard, has_visual_input
from hf_ddpfix.plan.types import Decision
from hf_ddpfix.plan.vision import NO_ZERO_DUMMY, vision_decision
from hf_ddpfix.runtime.errors import DDPFixError


def test_visual_inputs_are_read_by_name_and_emptiness():
    ids = torch.ones(1, 4, dtype=torch.long)
    assert not has_visual_input({"input_ids": ids, "pixel_values": None, "image_sizes": torch.ones(1, 2)})
    assert has_visual_input({"input_ids": ids, "pixel_values": torch.zeros(1, 3, 4, 4)})
    assert has_visual_input({"pixel_values_videos": torch.zeros(2, 8)})
    assert has_visual_input({"flattened_patches": torch.zeros(1, 4, 6)})
    assert has_visual_input({"images": [torch.zeros(3, 4, 4)]})
    assert not has_visual_input({"pixel_values": torch.zeros(0, 3, 4, 4)})  # an empty batch of images
    assert not has_visual_input({"images": []})


class _Toy(nn.Module):
    def forward(self, input_ids=None, pixel_values=None):  # noqa: ANN001, ANN201
        return input_ids


def _guard(monkeypatch, rows):  # noqa: ANN001, ANN202
    monkeypatch.setattr(mixed_guard, "dist_ready", lambda group=None: True)
    monkeypatch.setattr(mixed_guard, "gather_flags", lambda flags, group=None: rows)
    model = _Toy()
    return model, MixedImageGuard(model, why="no dummy (toy)", stage=3, error=DDPFixError).attach()


@pytest.mark.parametrize("rows", [[[True], [True]], [[False], [False]]])
def test_ranks_that_agree_run_untouched(monkeypatch, rows):
    model, guard = _guard(monkeypatch, rows)
    ids = torch.ones(1, 3, dtype=torch.long)
    assert model(input_ids=ids) is ids and guard.forwards == 1


def test_ranks_that_mix_images_and_text_stop_with_the_named_error_and_remove_restores(monkeypatch):
    """Shown failing (2026-12-02): with ``_check`` returning early on mixed rows the run goes on (here: no raise;
    on 2 ranks under ZeRO-3: gloo's "Received data size doesn't match" abort, the cells' zero3 crash)."""
    model, guard = _guard(monkeypatch, [[True], [False]])
    with pytest.raises(DDPFixError, match=r"rank\(s\) \[0\] pass an image and rank\(s\) \[1\] pass text only") as e:
        model(input_ids=torch.ones(1, 3, dtype=torch.long), pixel_values=torch.zeros(1, 3, 2, 2))
    assert "ZeRO-3" in str(e.value) and "no dummy (toy)" in str(e.value) and "DDP or FSDP2" in str(e.value)
    guard.remove()
    guard.remove()  # idempotent
    assert not model._forward_pre_hooks


def test_the_plan_names_the_guard_and_the_runtime_attaches_it_only_for_a_family_without_a_dummy():
    from types import SimpleNamespace

    from hf_ddpfix.integrations.deepspeed.zero import DeepSpeedFacts
    from hf_ddpfix.runtime.attach import _mixed_image_guard_stage

    value, reason, _ = vision_decision(ds=DeepSpeedFacts(stage=3), is_vlm=True, adapter=None, trainable_vision=True,
                                       disabled=None)
    assert value is False and reason.startswith(NO_ZERO_DUMMY) and "named error" in reason
    trainer = SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(
        deepspeed_plugin=SimpleNamespace(zero_stage=3))))

    def plan(decision, world=2):  # noqa: ANN001, ANN202
        return SimpleNamespace(vlm_stabilizer=decision, world_size=world)

    assert _mixed_image_guard_stage(trainer, plan(Decision(False, reason))) == 3
    assert _mixed_image_guard_stage(trainer, plan(Decision(False, reason), world=1)) is None
    assert _mixed_image_guard_stage(trainer, plan(Decision(True, "llava: dummy"))) == 3  # used if its trial fails
    disabled = vision_decision(ds=DeepSpeedFacts(stage=3), is_vlm=True, adapter=None, trainable_vision=True,
                               disabled="HF_DDPFIX_VLM_STABILIZER=0")
    assert _mixed_image_guard_stage(trainer, plan(Decision(False, disabled[1]))) is None  # the user asked for stock
    assert _mixed_image_guard_stage(trainer, plan(Decision(None, ""))) is None  # not a VLM


def test_a_model_that_takes_pixels_without_a_vision_config_is_guarded_under_zero3_only(monkeypatch):
    """UDOP: no ``vision_config`` (``vlm_stabilizer`` does not arise), yet its ``forward`` takes ``pixel_values``;
    under ZeRO-3 mixed ranks aborted in gloo at step 1 (the family cells, 2026-12-02). ZeRO-2 trains mixed ranks
    with a frozen tower, so no check there; a text model gets none; ``HF_DDPFIX_VLM_STABILIZER=0`` keeps stock.
    Shown failing (2026-12-02) with the ``decision.value is None`` branch returning ``None``."""
    from types import SimpleNamespace

    from hf_ddpfix.integrations.vision.mixed_guard import takes_visual_input
    from hf_ddpfix.runtime.attach import _mixed_image_guard_stage

    class Text(nn.Module):
        def forward(self, input_ids=None, labels=None):  # noqa: ANN001, ANN201
            return input_ids

    assert takes_visual_input(_Toy()) and not takes_visual_input(Text())

    def trainer(model, stage):  # noqa: ANN001, ANN202
        return SimpleNamespace(model=model, accelerator=SimpleNamespace(state=SimpleNamespace(
            deepspeed_plugin=SimpleNamespace(zero_stage=stage))))

    plan = SimpleNamespace(vlm_stabilizer=Decision(None, ""), world_size=2)
    monkeypatch.delenv("HF_DDPFIX_VLM_STABILIZER", raising=False)
    assert _mixed_image_guard_stage(trainer(_Toy(), 3), plan) == 3
    assert _mixed_image_guard_stage(trainer(_Toy(), 2), plan) is None
    assert _mixed_image_guard_stage(trainer(Text(), 3), plan) is None
    monkeypatch.setenv("HF_DDPFIX_VLM_STABILIZER", "0")
    assert _mixed_image_guard_stage(trainer(_Toy(), 3), plan) is None


class _Crops(nn.Module):
    """A VLM whose image call runs the tower again on optional local crops (Step3p7, DeepSeek-OCR-2)."""

    def get_image_features(self, pixel_values, pixel_values_local=None, num_local_patches=None):  # noqa: ANN001, ANN201
        return pixel_values

    def forward(self, input_ids=None, pixel_values=None, pixel_values_local=None):  # noqa: ANN001, ANN201
        return input_ids


def test_an_image_call_with_optional_crops_has_no_dummy_and_the_guard_stops_ranks_that_disagree_on_them(monkeypatch):
    """Step3p7 under ZeRO-3 (the family cells, 2026-12-02): its discovered dummy ran one image through
    ``get_image_features``, a real image also its local crops (717 vs 635 modules in step 0): a collective timeout.
    Such a family now gets no dummy (the guard stops mixed ranks by name); image ranks that disagree on the crops
    (stock: the same mismatch) stop by name too. Shown failing (2026-12-02): with ``watched`` empty the crop
    disagreement ran on (no raise here; on 2 ranks a timeout)."""
    from hf_ddpfix.integrations.vision.families import optional_pixel_inputs

    assert optional_pixel_inputs(_Crops().get_image_features) == ["pixel_values_local"]
    assert optional_pixel_inputs(_Toy().forward) == []  # pixel_values itself is the image, not an extra pass
    monkeypatch.setattr(mixed_guard, "dist_ready", lambda group=None: True)
    ids, pv = torch.ones(1, 3, dtype=torch.long), torch.zeros(1, 3, 2, 2)
    for rows, raises in (([[True, True], [True, True]], False), ([[True, False], [True, False]], False),
                         ([[True, True], [True, False]], True)):
        monkeypatch.setattr(mixed_guard, "gather_flags", lambda flags, group=None, rows=rows: (
            rows if len(flags) == 2 else pytest.fail(f"flags {flags}")))
        model = _Crops()
        guard = MixedImageGuard(model, why="crops", stage=3, error=DDPFixError).attach()
        assert guard.watched == ["pixel_values_local"]
        assert MixedImageGuard(model, why="crops", stage=2).watched == []  # ZeRO-2: the same gradients either way
        if raises:
            with pytest.raises(DDPFixError, match=r"rank\(s\) \[0\] pass `pixel_values_local` and rank\(s\) \[1\]"):
                model(input_ids=ids, pixel_values=pv, pixel_values_local=pv)
        else:
            assert model(input_ids=ids, pixel_values=pv) is ids
        guard.remove()


def test_a_discovered_image_family_with_optional_crops_is_refused_with_the_reason():
    """The ZeRO view of a family found by structure whose image call takes optional crops: no adapter, the reason
    names the input (so the plan's ``vlm_stabilizer`` reason starts with NO_ZERO_DUMMY and the guard attaches) and
    gives no DDP advice (shown failing 2026-12-02: "... need ddp_find_unused_parameters=True" in the ZeRO view)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from hf_ddpfix.integrations.vision.families import describe_unsupported, find_vision_adapter

    try:
        config = AutoConfig.for_model("step3p7")
    except (KeyError, ValueError):
        pytest.skip("transformers ships no step3p7 here")
    with torch.device("meta"):  # the default (full-size) config: structure only, no bytes
        model = AutoModelForImageTextToText.from_config(config)
    assert find_vision_adapter(model, zero=True) is None
    why = describe_unsupported(model, zero=True)
    assert "pixel_values_local" in why
    assert "ddp_find_unused_parameters" not in why  # DeepSpeed has none: the guard's stop is the answer there
