"""Where a vision-language model keeps its parts: the one source of a VLM's family facts (issue 49).

Every place that needs to know where a VLM's tower, projector and text decoder are, how its tower is called and
where its image features enter the decoder reads it here: the dummy-image registry and discovery
(:mod:`.families`), the ZeRO dummy's placement (:mod:`.zero`), the FSDP2 cross-attention dummy and unit facts
(:mod:`hf_ddpfix.integrations.fsdp.cross_attention`, :mod:`hf_ddpfix.integrations.fsdp.units`) and sequence
parallelism (:mod:`hf_ddpfix.integrations.sequence_parallel.vision`); the plan, ``hf-ddpfix plan``, the rehearsal,
the family sweep and the benchmarks reach it through them. Pure: it reads the module tree, configs and attributes
only (no forward, no parameter data: a meta-device or ZeRO-3 partitioned model is read the same way).

The rules (read from transformers 5.23 / 5.24 modeling files; every image-text-to-text family the sweep builds
gives the same modules as the lookups they replace: tests/test_vlm_parts.py):

- **tower**: the outermost module named one of :data:`TOWER_NAMES` (``model.visual``, ``model.vision_tower``,
  ``model.vision_model``, ...); a caller that already located the tower it drives (a registered family's
  ``tower_paths``) passes it.
- **projector**: the outermost module named one of :data:`PROJECTOR_NAMES`.
- **language model**: the first of :data:`LANGUAGE_MODEL_PATHS` that is a module other than the tower
  (``language_model_by == "path"``); else the module ``get_decoder()`` returns, when it is neither the model nor the
  tower (``"get_decoder"``: GIT, Idefics, BLIP's ``text_decoder``). Only a path-found language model is one a
  dummy image may be placed before (the ZeRO / FSDP dummies): ``get_decoder()`` may name a module that also embeds
  the tokens.
- **entry**: ``"cross_attention"`` when the language model lists ``cross_attention_layers`` (Mllama: the image
  features reach the decoder as ``cross_attention_states``, and the cross-attention layers run only with an
  image), else ``"inputs_embeds"`` (features merged into the embeddings); ``""`` without a language model.
- **cross-attention modules**: the class names containing ``CrossAttention`` anywhere in the model (wider than
  ``entry``: Aria's projector attends across image tokens); the dummy-image discovery and the FSDP2 dummy facts
  refuse such a model unless it is the cross-attention kind they drive.
- **vision parts**: the outermost modules named as a vision part (:data:`VISION_PART_NAMES`) or built from the
  model's ``vision_config`` (their own ``config.model_type`` is the vision config's: VideoLLaVA's ``image_tower``
  and ``video_tower``), for the plan and the hang guard where no dummy image is driven.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..._compat import unwrap_model

__all__ = ["DEEPSTACK_LAYER_PATHS", "ENTRIES", "LANGUAGE_MODEL_PATHS", "PROJECTOR_NAMES", "TOWER_CALLS",
           "TOWER_CONFIG_KEYS", "TOWER_NAMES", "VISION_PART_NAMES", "VlmParts", "cross_attention_modules", "get_submodule", "is_vision_language_model",
           "outermost", "tower_config", "vision_config", "vision_modules", "vlm_parts"]

#: Module names of a vision tower, outermost first found (transformers 5.23 / 5.24 VLMs).
TOWER_NAMES = ("vision_tower", "vision_model", "visual", "vision_encoder", "image_encoder")
#: Module names of the projector ``get_image_features`` runs after the tower.
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "mm_projector", "vision_projection", "visual_projection")
#: Module names that hold vision parameters (towers, projectors, Fuyu-style patch embeddings).
VISION_PART_NAMES = frozenset(TOWER_NAMES + PROJECTOR_NAMES + ("vision_embed_tokens",))
#: Where the text decoder (the module called with the merged ``inputs_embeds``) lives, tried in order:
#: ``model.language_model`` (LLaVA, Gemma 3, Qwen-VL, ... on 5.x), ``language_model`` (Llama 4, BLIP-2),
#: ``model.text_model`` (Idefics2/3, SmolVLM), ``text_model`` (Kosmos-2).
LANGUAGE_MODEL_PATHS = ("model.language_model", "language_model", "model.text_model", "text_model")
#: Where the decoder layers are that Qwen3-VL-style deepstack features are added to (feature ``i`` to layer ``i``).
DEEPSTACK_LAYER_PATHS = ("model.language_model.layers", "language_model.layers")
#: How a VLM's forward calls its tower, as its source spells it (``self.<name>(...)``; transformers 5.23 / 5.24).
TOWER_CALLS = ("get_image_features", "get_video_features", "get_vision_features", "visual", "vision_tower",
               "vision_model", "vision_encoder", "vision")
#: Where image features enter the language model (:attr:`VlmParts.entry`).
ENTRIES = ("inputs_embeds", "cross_attention")


@dataclass(frozen=True)
class VlmParts:
    """Where one VLM's parts are: dotted paths inside the (unwrapped) HF model, ``None`` where not found.

    Attributes:
        tower: the vision tower.
        projector: the projector after the tower.
        language_model: the text decoder the image features enter.
        language_model_by: ``"path"`` (one of :data:`LANGUAGE_MODEL_PATHS`), ``"get_decoder"``, or ``""`` (none).
        entry: ``"inputs_embeds"`` or ``"cross_attention"`` (:data:`ENTRIES`), ``""`` without a language model.
        cross_attention: class names containing ``CrossAttention`` anywhere in the model, sorted.
        vision: the outermost vision parts (by name or by the vision config's model type), in module order.
    """

    tower: str | None = None
    projector: str | None = None
    language_model: str | None = None
    language_model_by: str = ""
    entry: str = ""
    cross_attention: tuple[str, ...] = ()
    vision: tuple[str, ...] = ()


def get_submodule(root: nn.Module, path: str) -> nn.Module | None:
    """``root.get_submodule(path)``, or ``None`` when there is no such module."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


#: the keys of a model config a vision tower's config sits under (transformers 5.23 / 5.24)
TOWER_CONFIG_KEYS = ("vision_config", "vision_encoder_config", "visual_config")


def _is_config(v: Any) -> bool:
    return v is not None and not isinstance(v, (dict, int, str, bool, float, list, tuple))


def tower_config(cfg: Any) -> Any | None:
    """The image tower's config inside the model config ``cfg``, or ``None``: its ``vision_config`` /
    ``vision_encoder_config`` / ``visual_config``; else, in an ``encoder`` config, the tower config that encoder
    holds (T5Gemma 2: ``encoder.vision_config``) or the encoder's own config where it is an image encoder's (it
    names an ``image_size``: VisionEncoderDecoder's ViT). A text encoder's config (a text encoder-decoder) is none."""
    for key in TOWER_CONFIG_KEYS:
        v = getattr(cfg, key, None)
        if _is_config(v):
            return v
    enc = getattr(cfg, "encoder", None)
    if not _is_config(enc):
        return None
    inner = next((v for key in TOWER_CONFIG_KEYS if _is_config(v := getattr(enc, key, None))), None)
    return inner if inner is not None else enc if getattr(enc, "image_size", None) is not None else None


def vision_config(hf: nn.Module) -> Any | None:
    """The tower config of ``hf.config`` (:func:`tower_config`), or ``None``."""
    cfg = getattr(hf, "config", None)
    return tower_config(cfg) if cfg is not None else None


def is_vision_language_model(model: nn.Module) -> bool:
    """True when the (unwrapped) model's config holds a vision tower's config (:func:`tower_config`)."""
    return vision_config(unwrap_model(model)) is not None


def outermost(hf: nn.Module, names: tuple[str, ...] | frozenset[str]) -> str | None:
    """Dotted path of the first (outermost, in module order) submodule whose own name is in ``names``."""
    for path, _ in hf.named_modules():
        if path and path.rsplit(".", 1)[-1] in names:
            return path
    return None


def cross_attention_modules(hf: nn.Module) -> tuple[str, ...]:
    """Sorted class names containing ``CrossAttention`` among ``hf``'s modules."""
    return tuple(sorted({type(m).__name__ for m in hf.modules() if "CrossAttention" in type(m).__name__}))


def _built_from_vision_config(mod: nn.Module, vision_type: str | None) -> bool:
    cfg = getattr(mod, "config", None)
    return vision_type is not None and getattr(cfg, "model_type", None) == vision_type


def vision_modules(hf: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of the outermost vision parts of ``hf``: named as one (:data:`VISION_PART_NAMES`), or a
    sub-model built from the model's vision config (its own ``config.model_type`` is the vision config's)."""
    vision_type = getattr(vision_config(hf), "model_type", None) or None
    out: list[tuple[str, nn.Module]] = []
    for name, mod in hf.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix, _ in out):
            continue
        if name.rsplit(".", 1)[-1] in VISION_PART_NAMES or _built_from_vision_config(mod, vision_type):
            out.append((name, mod))
    return out


def _path_of(hf: nn.Module, module: nn.Module) -> str | None:
    return next((path for path, m in hf.named_modules() if m is module), None)


def _language_model(hf: nn.Module, tower: nn.Module | None) -> tuple[str | None, str]:
    for path in LANGUAGE_MODEL_PATHS:
        mod = get_submodule(hf, path)
        if isinstance(mod, nn.Module) and mod is not tower:
            return path, "path"
    get_decoder = getattr(hf, "get_decoder", None)
    if not callable(get_decoder):
        return None, ""
    try:
        decoder = get_decoder()
    except (AttributeError, NotImplementedError, TypeError):
        return None, ""
    if not isinstance(decoder, nn.Module) or decoder is hf or decoder is tower:
        return None, ""
    path = _path_of(hf, decoder)
    return (path, "get_decoder") if path else (None, "")


def vlm_parts(model: nn.Module, *, tower: str | None = None) -> VlmParts:
    """Where ``model``'s tower, projector and language model are, and how image features enter it (module
    docstring).

    Args:
        model: an HF model, a ``peft.PeftModel`` around it, or a DDP / compiled wrapper (paths are inside the
            unwrapped HF model).
        tower: the tower's path when the caller already located it (a registered family's ``tower_paths``);
            default: found by name (:data:`TOWER_NAMES`).

    Returns:
        A :class:`VlmParts`; a model without any of the parts gets ``None`` / ``""`` fields (a text model too).

    Guarantees: pure (no forward, no parameter data read); for every image-text-to-text family the sweep builds,
    the tower, projector and language model are the modules the lookups it replaced found
    (tests/test_vlm_parts.py).

    Example::

        >>> parts = vlm_parts(qwen2_5_vl)   # doctest: +SKIP
        >>> parts.tower, parts.language_model, parts.entry
        ('model.visual', 'model.language_model', 'inputs_embeds')
    """
    hf = unwrap_model(model)
    tower_path = tower if tower is not None else outermost(hf, TOWER_NAMES)
    tower_mod = get_submodule(hf, tower_path) if tower_path else None
    lm_path, by = _language_model(hf, tower_mod)
    lm = get_submodule(hf, lm_path) if lm_path else None
    entry = "" if lm is None else "cross_attention" if getattr(lm, "cross_attention_layers", None) else "inputs_embeds"
    return VlmParts(
        tower=tower_path if tower_mod is not None else None,
        projector=outermost(hf, PROJECTOR_NAMES),
        language_model=lm_path,
        language_model_by=by,
        entry=entry,
        cross_attention=cross_attention_modules(hf),
        vision=tuple(path for path, _ in vision_modules(hf)),
    )
