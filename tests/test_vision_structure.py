"""A dummy found by structure (issue 45, item 1): every grid-style VLM transformers ships (``get_image_features``
taking ``image_grid_thw``, enumerated from ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``, not a list kept here) gets
the smallest input its tower accepts, built from its own ``vision_config``, run where the model runs its tower and
proven at attach time to contribute exactly zero; or the reason why not. One process, tiny models (each family's
default config through the rehearsal's shrinker; GLM-4V also as the zoo builds it).

The 2-process proof (GLM-4V through the FSDP test device with the dummy under FSDP2, and under DDP, against stock DDP)
is tests/test_fsdp_skippable.py::test_tower_units_with_the_dummy_like_stock_ddp.
"""

from __future__ import annotations

import inspect
import time

import pytest
import torch
import transformers
from packaging.version import Version
from zoo import MORE_VLMS, ZOO

from hf_ddpfix.integrations.vision.families import describe_unsupported, find_vision_adapter
from hf_ddpfix.integrations.vision.stabilizer import VisionStabilizer
from hf_ddpfix.integrations.vision.zero import ZeroVisionStabilizer

#: grid families the structure must find on transformers 5.23 (the class, not the example: each lies outside the
#: registry, VISION_FAMILIES). A family leaving this set fails the test; one joining it is reported.
PROVEN_AT_LEAST = frozenset({"glm4v", "glm4v_moe", "glm46v", "glm_ocr", "exaone4_5", "lfm3_vl", "paddleocr_vl",
                             "qwen3_5", "qwen3_5_moe", "hyperclovax_vision_v2", "cosmos3_edge"})


REGISTERED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # the registry's grid families (by name)


def grid_families() -> dict[str, type]:
    """``model_type -> class`` of every image-text-to-text class of the installed transformers whose
    ``get_image_features`` takes ``image_grid_thw``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    out = {}
    for model_type, name in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()):
        cls = getattr(transformers, name, None)
        features = getattr(cls, "get_image_features", None)
        if features is not None and "image_grid_thw" in inspect.signature(features).parameters:
            out[model_type] = cls
    return out


def _tiny(model_type: str, cls: type, give_vision: bool = False) -> torch.nn.Module:
    """``model_type``'s default config through the rehearsal's shrinker; ``give_vision``: a vision config given first
    where the default has none (Gemma 4's default is text-only: the sweep's build, ``config_gaps``)."""
    from transformers import AutoConfig

    from hf_ddpfix.rehearse.config_gaps import give_vision_config
    from hf_ddpfix.rehearse.shrink import shrink_config

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type)
    if give_vision:
        give_vision_config(config, [])
    return cls(shrink_config(config).config)


def _text_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(1, min(vocab, 190), (1, 9), generator=torch.Generator().manual_seed(3))


def _zero_at_the_loss(model: torch.nn.Module, stabilizer: object, vocab: int, stock: tuple | None = None) -> int:
    """A text-only training forward and backward, stock (or ``stock``, that step's result) then with ``stabilizer``
    attached: the loss and every gradient stock had are bitwise equal, the extra gradients (the tower's, the dummy's)
    are all exactly zero and cover every trainable tower tensor but the adapter's ``unreached`` (none for a grid family:
    ``tower == extra``). Returns the number of extra gradients."""
    ids = _ids(vocab)
    loss, grads = stock if stock is not None else _text_step(model, ids)
    stabilizer.attach()
    try:
        loss2, grads2 = _text_step(model, ids)
    finally:
        stabilizer.remove()
    assert stabilizer.dummy_runs == 1 and torch.equal(loss, loss2)
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)
    extra = set(grads2) - set(grads)
    assert extra and all(not grads2[n].any() for n in extra), sorted(n for n in extra if grads2[n].any())[:3]
    parts = {id(p) for _, m in stabilizer.adapter.parts() for p in m.parameters()}
    tower = {n for n, p in model.named_parameters() if p.requires_grad and id(p) in parts}
    unreached = set(stabilizer.adapter.unreached)
    assert extra <= tower and tower - extra == unreached, sorted((tower - extra) ^ unreached)[:4]
    return len(extra)


#: a shrunk model above this many parameters is listed, not built (the shrinker keeps e.g. MuseSpark at 1.7 B)
MAX_PARAMS = 200_000_000


@pytest.mark.slow  # ~25-55 s on 2 cores (30 families built): the slow tier; GLM-4V's tests below are the fast tier's
def test_every_grid_family_gets_a_proven_dummy_or_says_why():
    """Per family: a tiny model (every parameter trainable), then the DDP / FSDP view's adapter, which verifies a
    family found by structure when the model is materialized: its pixel layout fixed by a trial, and the zero proof
    (:meth:`~hf_ddpfix.integrations.vision.adapter.VisionAdapter.verify`: the dummy's features tied with ``ZeroTie``
    give exactly-zero gradients to every trainable tensor they reach, and reach every one of the tower's). Found:
    found by structure unless the registry names it, verified, nothing unreached. Not found: the reason names the
    family and why no dummy runs. A family the shrinker cannot build small is listed, not hidden. (The loss-level
    check of the same dummy: :func:`test_glm4v_is_driven_under_ddp_fsdp2_and_zero_alike`.)

    Fails (by hand, 2026-12-02) when ``_discover_family`` builds no grid family (GLM-4V and the others of
    :data:`PROVEN_AT_LEAST` then have no adapter) and when the grid dummy is built as ``[m*m, C, p, p]`` only (the
    "flat" families fail their trial)."""
    proven, refused, unbuilt, t0 = {}, {}, {}, time.time()
    for model_type, cls in grid_families().items():
        try:
            with torch.device("meta"):
                size = sum(p.numel() for p in _tiny(model_type, cls).parameters())
            if size > MAX_PARAMS:
                unbuilt[model_type] = f"{size / 1e6:.0f} M parameters after shrinking"
                continue
            model = _tiny(model_type, cls).train()
        except Exception as err:  # noqa: BLE001 - the shrinker's limits are listed with their reason
            unbuilt[model_type] = f"{type(err).__name__}: {str(err)[:80]}"
            continue
        for p in model.parameters():
            p.requires_grad_(True)
        adapter = find_vision_adapter(model)
        if adapter is None:
            why = describe_unsupported(model)
            assert model_type in why and "dummy" in why, why
            refused[model_type] = why.rsplit("; ", 2)[-2][:160]
            continue
        assert adapter.family.discovered or adapter.family.name in REGISTERED, adapter.family
        if adapter.family.discovered:
            assert adapter.verified and adapter.unreached == (), (model_type, adapter.unreached)
        proven[model_type] = (adapter.family.name, adapter.grid_layout, [n for n, _ in adapter.parts()])
    print(f"\nproven {len(proven)}: {proven}\nno dummy {len(refused)}: {refused}\nnot built {len(unbuilt)}: {unbuilt}"
          f"\n{time.time() - t0:.0f} s")
    shipped = PROVEN_AT_LEAST & set(grid_families())  # the oldest stack's transformers 5.0 ships few of them
    if Version(transformers.__version__) < Version("5.23"):  # older releases: a family whose own tiny config does not
        shipped -= set(unbuilt)  # build there (5.0's Glm4vTextConfig has no pad_token_id) is listed above, not proven
    assert shipped <= set(proven), sorted(shipped - set(proven))


def test_glm4v_is_driven_under_ddp_fsdp2_and_zero_alike():
    """The zoo's GLM-4V (LoRA on the language model, the tower and the merger): one adapter in both views, found by
    structure (``glm4v (from config)``, the flat layout, one merged token: 4 patches of 3x2x14x14 and grid
    ``[[1, 2, 2]]``); the DDP stabiliser (dummy in the root pre-hook) and the FSDP2 / ZeRO one (before the language
    model) both give stock's text-only loss and gradients bit for bit and exact zeros to every LoRA tensor of the
    tower. Fails (by hand, 2026-12-02) with grid discovery off (``_discover_family``'s ``grids = ()``: no adapter)
    and with only the ``patch4`` layout tried (GLM-4V's trial fails: no adapter)."""
    entry = MORE_VLMS["glm4v"]
    model = entry.model(0)
    ddp, zero = find_vision_adapter(model), find_vision_adapter(model, zero=True)
    assert ddp is not None and zero is not None and ddp.family == zero.family, describe_unsupported(model)
    assert ddp.family.name == "glm4v (from config)" and ddp.kind == "grid" and ddp.grid_layout == "flat"
    pixels, grid = ddp.dummy_inputs()
    assert tuple(pixels.shape) == (4, 3 * 2 * 14 * 14) and grid.tolist() == [[1, 2, 2]]
    n_ddp = _zero_at_the_loss(model, VisionStabilizer(model, ddp), 256)
    n_zero = _zero_at_the_loss(model, ZeroVisionStabilizer(model, zero), 256)
    assert n_ddp == n_zero > 0


def test_a_grid_dummy_that_is_not_exactly_zero_is_refused_with_its_reason(monkeypatch):
    """The zero proof is real: a tower whose backward turns the tie's zeros into NaN (a norm of an all-zero input,
    simulated by a hook adding NaN to the merger's gradient) gets no adapter, and the reason says why."""
    model = MORE_VLMS["glm4v"].model(0)
    merger = model.base_model.model.model.visual.merger
    merger.register_full_backward_pre_hook(lambda mod, grad: tuple(g + float("nan") for g in grad))
    assert find_vision_adapter(model) is None
    assert "not exactly zero" in describe_unsupported(model), describe_unsupported(model)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "llava"])
def test_registered_families_keep_their_registry_entry(name):
    """The registry stays the exception: Qwen2.5-VL keeps its hand-written grid family (the tower called
    directly), LLaVA its ``zero_only`` image family (no adapter in the DDP view)."""
    model = ZOO[name].model(0)
    zero = find_vision_adapter(model, zero=True)
    assert zero is not None and not zero.family.discovered and zero.family.name == name
    assert (find_vision_adapter(model) is None) == (name == "llava")


#: families whose tower takes inputs no fixed dummy image gives (issue 45: the class, not the example): patch rows with
#: ``image_position_ids`` (Gemma 4), NaFlex rows + ``spatial_shapes`` / ``pixel_attention_mask`` with a pooling head
#: the model drops (LFM2-VL), a grid tower fed unflattened patches (Kimi-K2.5, whose grid dummy does not run)
BY_LAYOUT = ("gemma4", "lfm2_vl", "kimi_k25")


@pytest.mark.parametrize("model_type", BY_LAYOUT)
def test_a_tower_no_fixed_dummy_fits_is_driven_under_zero_by_the_sample_layout(model_type):
    """The ZeRO view's adapter is the ``"layout"`` kind: the sample builder's first pixel keyword set that runs
    through ``get_image_features``, verified (the zero proof) on the materialized model; the ZeRO stabiliser then gives
    stock's text-only loss and gradients bit for bit, exact zeros to every tower tensor the dummy reaches, and the
    ones it does not reach are the adapter's ``unreached`` (ZeRO zero-fills those on every rank alike). The DDP / FSDP
    view keeps the generic mechanism (no adapter). Fails (by hand, 2026-12-03) without the layout kind
    (``_discover_family`` refusing as before: no adapter) and with the grid family's refusal kept in the ZeRO view
    (Kimi-K2.5: no adapter)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as NAMES

    if model_type not in NAMES:
        pytest.skip(f"transformers {transformers.__version__} ships no {model_type}")
    model = _tiny(model_type, getattr(transformers, NAMES[model_type]), give_vision=True).train()
    for p in model.parameters():
        p.requires_grad_(True)
    zero = find_vision_adapter(model, zero=True)
    assert zero is not None, describe_unsupported(model, zero=True)
    assert zero.kind == "layout" and zero.verified and zero.family.discovered and zero.pixel_layout, zero
    assert find_vision_adapter(model) is None and "dummy" in describe_unsupported(model)
    assert _zero_at_the_loss(model, ZeroVisionStabilizer(model, zero), model.config.get_text_config().vocab_size) > 0
