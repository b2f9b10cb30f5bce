"""Default configs that lack a value their model reads, given one (the shrinker's repairs; issue 45).

A stock default config (``AutoConfig.for_model``) can leave unset what its own model needs; a released checkpoint
sets it. Each repair fills one such gap on the shrunk config, records a line saying what it set, and returns
whether it changed anything:

- :func:`give_image_token`: an image / video token id the model compares ``input_ids`` with, unset (BLIP-2,
  InstructBLIP, InstructBLIP-Video's ``video_token_index``): one past the vocabulary, as released checkpoints have;
- :func:`give_missing_token`: a ``*_token_id`` the model reads and the config lacks (the Qwen-Omni thinkers'
  ``vision_start_token_id``; UDOP's ``decoder_start_token_id``), from the error the model raised;
- :func:`give_unset_field`: a ``sliding_window`` left ``None`` beside sliding-attention layers or a model that builds a
  sliding mask (Step3p7): :data:`SLIDING_WINDOW`, capped at ``max_position_embeddings``;
- :func:`give_vision_config`: a vision sub-config the config class declares and a text-only default config leaves
  ``None`` (Gemma 4, Gemma 4 Unified), built from its declared defaults (the sweep only);
- :func:`give_linear_width`: a tower width the built model's image path shows wrong (a linear whose input width is
  a config field the tensor reaching it does not have: Llama 4's pixel-shuffle MLP and projector, whose default
  config breaks both relations its checkpoints hold), set to the width that reaches it.

Guarantees: a repair never changes a value the config sets, except :func:`give_linear_width` (a width no model of
the class can run with, changed in the tower's config only and said on its line);
:func:`~hf_ddpfix.rehearse.shrink_check.shrink_checked` keeps a repair only where the model then runs
(tests/test_vlm_families.py, tests/test_sample_layouts.py).
"""

from __future__ import annotations

import re
from typing import Any

from ..integrations.vision.parts import TOWER_CONFIG_KEYS
from .shrink import _subconfigs

__all__ = ["SLIDING_WINDOW", "give_image_token", "give_linear_width", "give_missing_token", "give_unset_field",
           "give_vision_config"]

_IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index", "video_token_index", "video_token_id")


def give_image_token(config: Any, model: Any, lines: list[str]) -> bool:
    """Give a default config whose image-token field is ``None`` a token of its own, as every released checkpoint
    has (BLIP-2 OPT: 50265, one past its text vocabulary): the id one past the embedding's rows (the repair then
    grows the vocabulary to embed it). Used only where the shrunk model takes no image as it is and its code
    compares ``input_ids`` with the field (BLIP-2, InstructBLIP: ``input_ids == None`` is ``False``, the image path
    fails; InstructBLIP-Video's ``video_token_index``, read as ``config.video_token_id``, its ``attribute_map``
    alias); MiniCPM-V, whose code reads the field but works without it, keeps it unset. Returns whether it did."""
    import inspect
    import sys

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    if not isinstance(rows, int):
        return False
    for key in _IMAGE_TOKEN_FIELDS:
        if key not in vars(config) or getattr(config, key) is not None:
            continue
        try:
            source = inspect.getsource(sys.modules[type(model).__module__])
        except (OSError, TypeError, KeyError):
            return False
        aliases = [k for k, v in (getattr(config, "attribute_map", None) or {}).items() if v == key]
        if not any(f"config.{k}" in source for k in [key, *aliases]):  # read by its name or an alias of it
            continue
        setattr(config, key, rows)
        lines.append(f"{key}: None -> {rows} (the default config sets no image token; the model compares "
                     "input_ids with it)")
        return True
    return False


_MISSING_TOKEN = re.compile(r"'(\w+)' object has no attribute '(\w+_token_id)'")


def give_missing_token(config: Any, errors: str, lines: list[str]) -> bool:
    """Set a token id a default config lacks while its model reads it (``errors``: the checks' messages,
    ``'<Config>' object has no attribute '<name>_token_id'``): UDOP's ``decoder_start_token_id`` is its
    ``pad_token_id`` (the T5 convention its checkpoints follow), any other id (Qwen2.5-Omni's thinker:
    ``vision_start_token_id``) one no other token of the config uses, past the highest (the repair then embeds
    it). Returns whether it set one."""
    m = _MISSING_TOKEN.search(errors)
    if m is None:
        return False
    owner_cls, key = m.groups()
    nodes = [config] + [n for _, n in _subconfigs(config)]
    owner = next((n for n in nodes if type(n).__name__ == owner_cls), None)
    if owner is None or key in vars(owner):
        return False
    if key == "decoder_start_token_id" and isinstance(getattr(owner, "pad_token_id", None), int):
        value = owner.pad_token_id
    else:
        used = [v for n in nodes for k, v in vars(n).items()
                if (k.endswith("_token_id") or k.endswith("_token_index")) and isinstance(v, int)]
        value = max(used, default=-1) + 1
    setattr(owner, key, value)
    lines.append(f"{owner_cls}.{key}: missing -> {value} (the default config lacks it; the model reads it)")
    return True


_UNSET_FIELD = re.compile(r"Could not find a `(\w+)` argument in the config, or it is not set")
#: the window a repaired ``sliding_window`` gets (capped at the config's ``max_position_embeddings``): wide
#: enough that a sample batch sits inside one window, so the repair changes no attention the batch sees
SLIDING_WINDOW = 4096


def give_unset_field(config: Any, errors: str, lines: list[str]) -> bool:
    """Set ``sliding_window`` where a default config leaves it ``None`` while its model needs one: its
    ``layer_types`` names a ``sliding_attention`` layer, or the checks' ``errors`` carry transformers' masking
    error (``Could not find a `sliding_window` argument in the config, or it is not set``: Step3p7 builds a
    sliding mask for every forward). The value is :data:`SLIDING_WINDOW` capped at the node's
    ``max_position_embeddings``. Every config node that has the field unset is set; returns whether any was."""
    m = _UNSET_FIELD.search(errors)
    asked = m.group(1) if m else None
    if asked is not None and asked != "sliding_window":
        return False
    changed = False
    for path, node in _subconfigs(config):
        if "sliding_window" not in vars(node) or node.sliding_window is not None:
            continue
        types = getattr(node, "layer_types", None) or ()
        if asked is None and "sliding_attention" not in types:
            continue
        cap = getattr(node, "max_position_embeddings", None)
        value = min(SLIDING_WINDOW, cap) if isinstance(cap, int) and cap > 0 else SLIDING_WINDOW
        node.sliding_window = value
        why = "its layer_types name sliding_attention" if asked is None else "the model builds a sliding mask"
        lines.append(f"{path + '.' if path else ''}sliding_window: None -> {value} (the default config sets none; {why})")
        changed = True
    return changed


def give_vision_config(config: Any, lines: list[str]) -> bool:
    """Build, in place, each vision sub-config the config class declares (``sub_configs_defaults``) and the default
    config leaves ``None`` (Gemma 4 / Gemma 4 Unified: a text-only default, while their image checkpoints carry a
    tower), from the declared spec's defaults. Only the vision keys: another optional tower (an audio encoder) takes
    no part in an image-text batch, and Nemotron-H Omni's ``audio_config`` does not build from its defaults. For the
    family sweep only (a rehearsal keeps a real checkpoint's towers as they are). Returns whether it built one."""
    changed = False
    for path, node in _subconfigs(config):
        specs = getattr(type(node), "sub_configs_defaults", None) or {}
        for key in TOWER_CONFIG_KEYS:
            spec = specs.get(key)
            if spec is None or key not in vars(node) or vars(node)[key] is not None:
                continue
            sub, _ = spec.create_subconfig(key, None)
            setattr(node, key, sub)
            lines.append(f"{path + '.' if path else ''}{key}: None -> {type(sub).__name__}() defaults (the default "
                         "config is text-only; its class declares the sub-config)")
            changed = True
    return changed


_MATMUL = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)")
#: words of the config fields that are widths
_WIDTH_WORDS = ("size", "dim", "hidden", "width")


def give_linear_width(config: Any, errors: str, lines: list[str]) -> bool:
    """Where the image path failed on a linear whose input width ``B`` is not the width ``A`` of the tensor reaching
    it (``errors``: torch's ``mat1 and mat2 shapes cannot be multiplied (NxA and BxC)``), set every width field
    (an int named ``*size*`` / ``*dim*`` / ``*hidden*`` / ``*width*``) equal to ``B`` in the configs apart from the
    text model's (a tower's, a projector's) to ``A``. Llama 4: its vision MLP width must be the pixel-shuffled width
    (``hidden_size / pixel_shuffle_ratio ** 2``) and ``vision_output_dim`` the projector's input; its default config
    holds neither. The caller keeps it only where the image error then changes (one relation at a time). Returns
    whether it changed a field."""
    m = _MATMUL.search(errors)
    if m is None or int(m.group(2)) == int(m.group(3)):
        return False
    got, want = int(m.group(2)), int(m.group(3))
    try:
        text = config.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        text = None
    changed = False
    for path, node in _subconfigs(config):
        if node is text or node is config:
            continue
        for key, v in list(vars(node).items()):
            if isinstance(v, int) and not isinstance(v, bool) and v == want and any(w in key for w in _WIDTH_WORDS):
                setattr(node, key, got)
                lines.append(f"{path}.{key}: {want} -> {got} (the width of the tensor its linear is fed: the image "
                             "path failed)")
                changed = True
    return changed
