"""VLM families: which towers hf_ddpfix can drive with a dummy image, found by config and structure.

A :class:`~hf_ddpfix.integrations.vision.family.VisionFamily` is data: the ``model_type`` values it covers, where the tower (and projector)
lives, which config attributes and child modules it must have. :func:`find_vision_adapter` matches a
model against the registry (:data:`VISION_FAMILIES`, extended with :func:`register_vision_family`) and
checks the structure, so a renamed or restructured tower is reported unsupported rather than driven
blindly. The :class:`~hf_ddpfix.integrations.vision.adapter.VisionAdapter` it returns builds the smallest
image the tower accepts, runs it, and says where the outputs enter the language model.

Supported families:

- ``"grid"`` — Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE (``tower(pixel_values, grid_thw=...)``):
  driven under DDP / FSDP2 (:class:`~hf_ddpfix.integrations.vision.stabilizer.VisionStabilizer`) and DeepSpeed
  ZeRO-2/3 (:class:`~hf_ddpfix.integrations.vision.zero.ZeroVisionStabilizer`).
- ``"image"`` — LLaVA, Gemma 3 (``root.get_image_features(pixel_values=...)`` on one native-size image:
  tower and projector): driven under DeepSpeed ZeRO-2/3 only (``zero_only``). Under DDP / FSDP the plan
  keeps the generic mechanism measured on them (``parameter_usage``; FSDP2 ``fold_skippable``): the DDP
  stabiliser's "every vision parameter is used every step" does not hold for them (Gemma 3's SigLIP
  pooling head runs but never reaches the loss), so it would let the plan drop ``find_unused_parameters``
  wrongly. Under ZeRO that does not matter: a parameter no rank gives a gradient is zero-filled on
  every rank alike. ``find_vision_adapter(model)`` is the DDP / FSDP view and skips these families;
  ``find_vision_adapter(model, zero=True)`` returns them.

- found by structure, grid (every view: DDP, FSDP2, ZeRO) — any other VLM whose ``get_image_features`` takes a
  Qwen-style grid (``image_grid_thw``: GLM-4V, GLM-4.6V, GLM-OCR, Exaone 4.5, LFM3-VL, PaddleOCR-VL, Qwen3.5, Cosmos 3,
  HyperCLOVAX-Vision-V2 on transformers 5.23): one merged token's patches (``vision_config``: ``patch_size``,
  ``temporal_patch_size``, ``spatial_merge_size``, ``in_channels``, where it has them) and its grid ``[[1, m, m]]``,
  run through ``get_image_features`` where the model runs it; its pixel layout fixed by a trial and its gradients
  proven exactly zero (:meth:`~hf_ddpfix.integrations.vision.adapter.VisionAdapter.verify`) when the model is
  materialized (here, before the plan; on the meta device or ZeRO-3 partitioned: when the stabiliser attaches). A
  family that fails says why (``describe_unsupported``) and keeps the generic mechanism (issue 45).
- discovered (ZeRO view only) — any other VLM whose model has ``get_image_features(pixel_values=...)``:
  the family is built from the model's own config and structure (tower and projector found by module
  name, ``vision_config.image_size`` / ``num_channels``, the extra inputs ``get_image_features`` requires,
  such as Pixtral's ``image_sizes``) and driven like the ``"image"`` kind; a trial run at attach time
  (:meth:`~hf_ddpfix.integrations.vision.adapter.VisionAdapter.verify`) fixes the pixel layout and proves
  the dummy runs (Idefics3 / SmolVLM, PaliGemma, Mistral 3, InternVL on transformers 5.23). Not
  discovered, with the reason: models without ``get_image_features`` or whose image features do not
  enter through ``inputs_embeds`` (Mllama's cross-attention layers run only with an image, so a dummy
  image cannot make them run with an exactly-zero contribution), required inputs hf_ddpfix cannot
  build from the config, and optional pixel inputs that run the tower again when a batch has them
  (:func:`optional_pixel_inputs`: Step3p7's local crops).
- discovered by layout (ZeRO view only) — a VLM whose ``get_image_features`` needs inputs no fixed dummy image
  gives (NaFlex ``spatial_shapes`` + ``pixel_attention_mask``: LFM2-VL; patch rows with ``image_position_ids``:
  Gemma 4; pooled crops: Molmo2), whose config lacks a native image size, or whose grid dummy did not run
  (Kimi-K2.5's unflattened patches, VideoLLaMA3's merge sizes): the dummy is the first of the sample builder's pixel
  keyword sets (:func:`~hf_ddpfix.integrations.vision.layouts.candidates`, a few patches each) that runs through
  ``get_image_features``, its gradients proven exactly zero like the others' (``"layout"`` kind). Under DDP /
  FSDP2 these keep the generic mechanism (``parameter_usage``, FSDP2 folding), which trains them like stock.

For other VLMs, :func:`vision_param_names` / :func:`vision_groups` find vision parts by module name
(planning and the hang guard only) and :func:`describe_unsupported` says why there is no adapter.

Where a model's tower, projector and language model are (by name, by path, ``get_decoder()``) is not decided
here: :func:`~hf_ddpfix.integrations.vision.parts.vlm_parts` is the one source; this module adds the registry's
hand-written tower paths and what the dummy image needs.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ..._compat import unwrap_model
from .adapter import (
    BUILT_INPUTS,
    GRID_INPUT_NAMES,
    VisionAdapter,
    grid_geometry,
    image_size_hw,
    materialized,
    output_tensors,
)
from .family import VisionFamily
from .layouts import candidates, image_params
from .parts import (
    DEEPSTACK_LAYER_PATHS,
    TOWER_NAMES,
    get_submodule,
    is_vision_language_model,
    vision_modules,
    vlm_parts,
)
from .parts import vision_config as _vision_config

__all__ = [
    "TOWER_NAMES",
    "VISION_FAMILIES",
    "VisionAdapter",
    "VisionFamily",
    "describe_unsupported",
    "find_vision_adapter",
    "get_submodule",
    "has_trainable_vision_params",
    "is_vision_language_model",
    "optional_pixel_inputs",
    "output_tensors",
    "register_vision_family",
    "vision_groups",
    "vision_param_names",
]

# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------


def _image_family(name: str, model_types: tuple[str, ...]) -> VisionFamily:
    """A ``get_image_features`` family (transformers 5.23 ``LlavaModel`` / ``Gemma3Model`` layout)."""
    return VisionFamily(
        name, (), tower_paths=("model.vision_tower", "vision_tower"), required_config=("image_size", "num_channels"),
        required_children=(), kind="image", model_types=model_types,
        projector_paths=("model.multi_modal_projector", "multi_modal_projector"), zero_only=True,
    )


VISION_FAMILIES: list[VisionFamily] = [
    VisionFamily("qwen2_vl", ("qwen2_vl_vision", "qwen2_vl")),
    VisionFamily("qwen2_5_vl", ("qwen2_5_vl_vision", "qwen2_5_vl")),
    VisionFamily("qwen3_vl", ("qwen3_vl_vision", "qwen3_vl"), deepstack_layer_paths=DEEPSTACK_LAYER_PATHS),
    VisionFamily(
        "qwen3_vl_moe", ("qwen3_vl_moe_vision", "qwen3_vl_moe"), deepstack_layer_paths=DEEPSTACK_LAYER_PATHS
    ),
    _image_family("llava", ("llava",)),
    _image_family("gemma3", ("gemma3",)),
]


def register_vision_family(family: VisionFamily) -> None:
    """Add (or replace, by ``name``) a family in :data:`VISION_FAMILIES`.

    Guarantees: a registered family is matched by :func:`find_vision_adapter` (test_vlm: registry test).
    """
    VISION_FAMILIES[:] = [f for f in VISION_FAMILIES if f.name != family.name] + [family]


def _structure_gaps(hf: nn.Module, fam: VisionFamily, tower: nn.Module, vc: Any) -> list[str]:
    """What the located tower / model lacks for ``fam``'s dummy (empty: it can be driven)."""
    missing = [c for c in fam.required_children if not hasattr(tower, c)]
    missing += [f"vision_config.{a}" for a in fam.required_config if not hasattr(vc, a)]
    if fam.kind == "grid":
        if "grid_thw" not in inspect.signature(tower.forward).parameters:
            missing.append("forward(grid_thw=...)")
        return missing
    if hasattr(vc, "image_size") and image_size_hw(vc) is None:
        missing.append("vision_config.image_size as an int or (height, width)")
    get_features = getattr(hf, "get_image_features", None)
    if not callable(get_features) or "pixel_values" not in inspect.signature(get_features).parameters:
        missing.append("get_image_features(pixel_values=...)")
    if not any(get_submodule(hf, p) is not None for p in fam.projector_paths):
        missing.append(f"a projector at {list(fam.projector_paths)}")
    return missing


def _match_family(hf: nn.Module) -> tuple[VisionFamily | None, nn.Module | None, str, str]:
    """Return (family, tower, tower_name, reason); family is None with a reason when unsupported."""
    vc = _vision_config(hf)
    if vc is None:
        reason = f"{type(hf).__name__} is not a vision-language model (its config has no vision_config)"
        return None, None, "", reason
    mtype = str(getattr(vc, "model_type", ""))
    root_type = str(getattr(getattr(hf, "config", None), "model_type", ""))
    fam = next((f for f in VISION_FAMILIES if mtype in f.vision_model_types or root_type in f.model_types), None)
    if fam is None:
        names = ", ".join(f.name for f in VISION_FAMILIES)
        return None, None, "", (
            f"{type(hf).__name__} (model_type={root_type!r}, vision_config.model_type={mtype!r}) has no "
            f"hf_ddpfix vision adapter (supported families: {names})"
        )
    for path in fam.tower_paths:
        tower = get_submodule(hf, path)
        if tower is None:
            continue
        missing = _structure_gaps(hf, fam, tower, vc)
        if missing:
            return None, None, "", (
                f"{type(hf).__name__}: tower {path!r} of family {fam.name} lacks {missing}; "
                "the installed transformers changed this model's structure"
            )
        return fam, tower, path, ""
    reason = f"{type(hf).__name__}: no vision tower at {list(fam.tower_paths)} (family {fam.name})"
    return None, None, "", reason


def _discover_family(hf: nn.Module) -> tuple[VisionFamily | None, str]:
    """A family built from ``hf``'s config and the signature of the call that runs its tower, or the reason why not.

    - ``"grid"`` kind, found by structure: ``get_image_features`` takes a Qwen-style grid (``image_grid_thw``:
      GLM-4V, GLM-4.6V, GLM-OCR, Exaone 4.5, LFM3-VL, Cosmos 3, ... on transformers 5.23) and ``vision_config``
      gives a ``patch_size`` (with ``spatial_merge_size`` / ``merge_size``, ``temporal_patch_size``,
      ``in_channels`` / ``num_channels`` where it has them): the dummy is one merged token's patches and its
      grid, run through ``get_image_features`` where the model runs it; under DDP, FSDP2 and ZeRO alike once
      :meth:`~hf_ddpfix.integrations.vision.adapter.VisionAdapter.verify` proved it (its layout, and exactly-zero
      gradients).
    - ``"image"`` kind (ZeRO view only): ``get_image_features(pixel_values=...)`` on one native-size image
      (``vision_config.image_size`` / ``num_channels``; extra inputs such as Pixtral's ``image_sizes``).
    - ``"layout"`` kind (ZeRO view only) where neither can be built from the config (required inputs no fixed image
      gives, no patch size or native image size): the sample builder's layouts, tried by ``verify``; the second
      value then says why the fixed dummies did not fit.
    """

    vc = _vision_config(hf)
    root_type = str(getattr(getattr(hf, "config", None), "model_type", ""))
    head = f"{type(hf).__name__} (model_type={root_type!r})"
    get_features = getattr(hf, "get_image_features", None)
    if not callable(get_features):
        return None, f"{head} has no get_image_features(pixel_values=...) to run a dummy image through"
    params = inspect.signature(get_features).parameters
    inner = getattr(getattr(hf, "model", None), "get_image_features", None)
    if "pixel_values" not in params and callable(inner) and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        get_features, params = inner, inspect.signature(inner).parameters  # passed on whole (MiniCPM-V 4.6)
    if "pixel_values" not in params:
        return None, f"{head}: get_image_features takes no pixel_values"
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    required = [n for n, p in params.items()
                if n != "pixel_values" and p.default is inspect.Parameter.empty and p.kind not in variadic]
    unknown = [n for n in required if n not in BUILT_INPUTS]
    optional = optional_pixel_inputs(get_features)
    if optional:
        return None, (f"{head}: get_image_features runs the tower again on {optional} when a batch carries them "
                      "(local crops): a dummy image cannot know whether another rank's image does, so the ranks "
                      "would run different modules")
    parts = vlm_parts(hf)
    if parts.cross_attention:
        return None, (f"{head}: image features enter through cross-attention layers ({', '.join(parts.cross_attention)}"
                      "), which run only with an image: a dummy image cannot run them with an exactly-zero contribution")
    tower, projector = parts.tower, parts.projector
    if tower is None:
        return None, f"{head}: no dummy image can be built: it has no vision tower named one of {list(TOWER_NAMES)}"

    def by_layout(why: str) -> tuple[VisionFamily, str]:  # the sample builder's layouts, verified (ZeRO view)
        return VisionFamily(
            f"{root_type} (from config)", (), tower_paths=(str(tower),), required_config=(), required_children=(),
            kind="layout", model_types=(root_type,), projector_paths=(projector,) if projector else (),
            zero_only=True, discovered=True), why

    if unknown:
        return by_layout(f"{head}: get_image_features needs {unknown}, which no fixed dummy image gives")
    grids = tuple(n for n in GRID_INPUT_NAMES if n in params)
    if grids:
        if grid_geometry(vc) is None:
            return by_layout(f"{head}: no grid dummy can be built from the config: it lacks vision_config.patch_size")
        return VisionFamily(
            f"{root_type} (from config)", (), tower_paths=(str(tower),), required_config=("patch_size",),
            required_children=(), kind="grid", model_types=(root_type,),
            projector_paths=(projector,) if projector else (), extra_inputs=grids[:1], discovered=True,
            deepstack_layer_paths=DEEPSTACK_LAYER_PATHS,
        ), ""
    if [n for n in required if n in GRID_INPUT_NAMES]:
        return by_layout(f"{head}: get_image_features needs {required}, which no fixed dummy image gives")
    missing = [f"vision_config.{a}" for a in ("num_channels",) if not hasattr(vc, a)]
    if image_size_hw(vc) is None:
        missing.append("vision_config.image_size as an int or (height, width)")
    if missing:
        return by_layout(f"{head}: no native-size dummy image can be built from the config: it lacks {missing}")
    return VisionFamily(
        f"{root_type} (from config)", (), tower_paths=(str(tower),), required_config=("image_size", "num_channels"),
        required_children=(), kind="image", model_types=(root_type,),
        projector_paths=(projector,) if projector else (), zero_only=True, extra_inputs=tuple(required),
        discovered=True,
    ), ""


def optional_pixel_inputs(call: Any) -> list[str]:
    """The optional pixel inputs of ``call`` (a model's ``get_image_features``) beside ``pixel_values``: names that
    contain ``pixel_values`` and default to a value (Step3p7's and DeepSeek-OCR-2's ``pixel_values_local``: local
    crops run through the tower in a second call, only when a batch has them). Which modules an image runs then
    depends on the data, so no fixed dummy image matches every image rank."""
    try:
        params = inspect.signature(call).parameters
    except (TypeError, ValueError):
        return []
    return [n for n, p in params.items()
            if n != "pixel_values" and "pixel_values" in n and p.default is not inspect.Parameter.empty]


def _refusal(adapter: VisionAdapter, ddp: bool) -> str:
    """Why a family found by structure is not driven in this view, or ``""``. A grid family whose parameters are
    materialized is verified here, once per model (:meth:`VisionAdapter.verify`: a dummy of a few patches, its
    layout and the zero proof); on the meta device (``hf-ddpfix plan``) or ZeRO-3 partitioned it is verified when the
    stabiliser attaches. An ``"image"`` family (a native-size image: costly before training) is verified at attach
    only. The DDP view also needs every trainable tower / projector parameter reached by the dummy (the DDP
    stabiliser's "every vision parameter is used every step")."""
    if adapter.kind == "image":
        return ""
    params = [p for _, m in adapter.parts() for p in m.parameters()]
    if not materialized(params):
        return ""
    try:
        adapter.verify()
    except ValueError as err:
        return str(err)
    if ddp and adapter.unreached:
        return (f"{adapter.family.name}: the dummy reaches not every trainable vision parameter "
                f"({len(adapter.unreached)}, e.g. {adapter.unreached[0]}): under DDP / FSDP parameter_usage ties them")
    return ""


def _adapter(hf: nn.Module, discover: bool = True, ddp: bool = False) -> tuple[VisionAdapter | None, str]:
    """The adapter for ``hf`` (the registry's family, else one discovered by structure when ``discover``) and ``""``,
    or ``None`` and why not; ``ddp``: the DDP / FSDP view (see :func:`_refusal`)."""
    fam, tower, name, reason = _match_family(hf)
    # structure where the registry names no family, or names one whose tower is elsewhere (HyperCLOVAX-Vision-V2's
    # Qwen2.5-VL tower at model.vision_model); a registered family whose structure changed stays refused
    unnamed = "has no hf_ddpfix vision adapter" in reason or ": no vision tower at " in reason
    if fam is None and discover and unnamed and _vision_config(hf) is not None:
        found, why = _discover_family(hf)
        if found is None:
            return None, f"{reason}; {why}"
        if ddp and found.kind != "grid":  # an "image" family is driven under ZeRO only (module docstring)
            return None, reason
        fam, tower, name = found, get_submodule(hf, found.tower_paths[0]), found.tower_paths[0]
    if fam is None or tower is None:
        return None, reason
    projector, projector_name = None, ""
    for path in fam.projector_paths:
        projector = get_submodule(hf, path)
        if projector is not None:
            projector_name = path
            break
    adapter = VisionAdapter(fam, hf, tower, name, _vision_config(hf), projector, projector_name)
    if fam.kind == "layout" or (fam.discovered and fam.kind == "grid" and not ddp):  # the sample builder's pixel
        # keyword sets, tried by verify (after a grid family's own layouts in the ZeRO view: Kimi-K2.5's patches)
        adapter.layout_trials = lambda: candidates(hf, image_params(hf, hf.get_image_features))
    if fam.discovered:  # one trial per model and family (the verdict is kept per model: VisionAdapter.verify)
        refused = _refusal(adapter, ddp and not fam.zero_only)
        if refused:
            return None, f"{reason}; {refused}"
    return adapter, ""


def find_vision_adapter(model: nn.Module, *, zero: bool = False) -> VisionAdapter | None:
    """Adapter for a supported VLM, else ``None`` (see :func:`describe_unsupported` for the reason).

    Accepts the HF model, a ``peft.PeftModel`` around it, or a DDP/DataParallel/compiled wrapper.

    Args:
        model: the model.
        zero: the DeepSpeed ZeRO view: also return ``zero_only`` families (LLaVA, Gemma 3) and families
            discovered from the config (any VLM with ``get_image_features``; see the module docstring). The
            default is the DDP / FSDP view (what :class:`~hf_ddpfix.integrations.vision.stabilizer.VisionStabilizer`
            and the plan's DDP / FSDP decisions use).

    Guarantees: Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE) tiny models get an adapter whose dummy runs; LLaVA
    and Gemma 3 get one with ``zero=True`` only; another ``image`` VLM (Mistral 3) and a text-only model get
    ``None`` (test_vlm); a grid VLM no entry names (GLM-4V) gets one found by structure in both views, verified
    (tests/test_vision_structure.py).
    """
    adapter, _ = _adapter(unwrap_model(model), ddp=not zero)
    if adapter is None or (adapter.family.zero_only and not zero):
        return None
    return adapter


def describe_unsupported(model: nn.Module, *, zero: bool = False) -> str:
    """One-line reason why ``model`` has no vision adapter in this view (``zero``: see
    :func:`find_vision_adapter`), or ``""`` when it has one."""
    hf = unwrap_model(model)
    adapter, reason = _adapter(hf, ddp=not zero)
    if adapter is not None and not (adapter.family.zero_only and not zero):
        return ""
    if _vision_config(hf) is None:
        return reason
    if adapter is not None:
        reason = (f"{type(hf).__name__}: family {adapter.family.name}'s dummy image is used under DeepSpeed "
                  "ZeRO-2/3 only (under DDP / FSDP hf_ddpfix uses parameter_usage instead)")
    n = sum(p.numel() for _, p in _generic_vision_params(hf) if p.requires_grad)
    if zero:  # DeepSpeed has no find_unused_parameters: the mixed-image guard stops mixed ranks by name instead
        return f"{reason}; the dummy-image stabiliser is off for it"
    return f"{reason}; the dummy-image stabiliser is off for it" + (
        f" and its {n} trainable vision parameters need ddp_find_unused_parameters=True" if n else ""
    )


def vision_groups(hf: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the vision parts of ``hf``: the adapter's tower (and projector) when some
    family matches (either view), else the outermost vision parts by name or vision config
    (:func:`~hf_ddpfix.integrations.vision.parts.vision_modules`)."""
    adapter, _ = _adapter(hf, discover=False)
    if adapter is not None:
        return adapter.parts()
    if _vision_config(hf) is None:
        return []
    return vision_modules(hf)


def _generic_vision_params(hf: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(f"{g}.{n}", p) for g, mod in vision_groups(hf) for n, p in mod.named_parameters()]


def vision_param_names(model: nn.Module, trainable_only: bool = True) -> list[str]:
    """Names (as ``model.named_parameters()`` spells them) of the vision tower's parameters.

    Pure: no collectives, no forward. Works for adapters and, by module names, for other VLMs.

    Guarantees: on a LoRA Qwen2.5-VL every returned name contains ``visual`` and ``lora_`` (test_vlm).
    """
    hf = unwrap_model(model)
    wanted = {id(p) for _, p in _generic_vision_params(hf) if p.requires_grad or not trainable_only}
    return [n for n, p in model.named_parameters() if id(p) in wanted]


def has_trainable_vision_params(model: nn.Module) -> bool:
    """True when some vision parameter has ``requires_grad`` (pure; for the planner)."""
    return bool(vision_param_names(model, trainable_only=True))
