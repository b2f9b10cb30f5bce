"""The shrunk model, checked: :func:`~hf_ddpfix.rehearse.shrink.shrink_config`, then the relations only a built
model shows repaired, then the model built and run with and without an image.

What a built model shows that the config alone does not (both read on the meta device, no memory):

- **M-RoPE sections**: a rotary module holding ``mrope_section`` splits its ``inv_freq`` by it, so the sections
  must sum to ``inv_freq``'s length. Many configs carry no ``mrope_section`` and the module takes a default
  (Qwen2.5-VL ``[16, 24, 24]``, GLM-4V ``[8, 12, 12]``, transformers 5.23) that only fits the real head width:
  the shrunk config gets sections rescaled to its own rotary width.
- **token ids**: an image / video token id the batch carries must be a row of the input embedding (a stock
  default config may name ``image_token_index`` = ``vocab_size``: LLaVA's 32000); the vocabulary grows to hold it
  (also far past it: Idefics3 / SmolVLM name 128257 beside a vocabulary of 32000).

- **unset fields** the model needs (:mod:`~hf_ddpfix.rehearse.config_gaps`): a ``sliding_window`` left ``None``
  beside sliding-attention layers, an unset image / video token id the model compares ``input_ids`` with, a token
  id the config lacks, a tower width its image path shows wrong; for the sweep (``small_images``), a vision
  sub-config a text-only default config leaves ``None``.

:func:`shrink_checked` then builds the model (seeded) and runs it on :func:`~hf_ddpfix.integrations.vision.sample.
sample_batch` without and with an image; where the fully cut model fails and a copy with the vision sub-configs'
widths kept (layers still cut) runs, that copy is used and the lines say why.

Guarantees: the returned config builds; ``Checked.text`` / ``Checked.image`` say whether the forward ran
(``"ok"``) or the error (tests/test_vlm_families.py, every family transformers ships).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from .config_gaps import (
    give_image_token,
    give_linear_width,
    give_missing_token,
    give_unset_field,
    give_vision_config,
)
from .shrink import Shrunk, _rescale_sections, _subconfigs, shrink_config

__all__ = ["Checked", "align_outputs", "give_unset_field", "repair_shrunk", "repaired_meta", "run_checks", "shrink_checked"]

#: above this many parameters (meta count) a fallback candidate is not built: a rehearsal model stays small
MAX_PARAMS = 150_000_000


@dataclass
class Checked:
    """A checked shrink: the config and its lines, the built model, and what ran (``"ok"`` or the error)."""

    shrunk: Shrunk
    model: Any = None
    text: str = ""
    image: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def runs(self) -> bool:
        """The text-only forward ran and the image forward ran or has no layout the config describes."""
        return self.text == "ok" and (self.image == "ok" or self.image.startswith("no image layout"))


def _meta(model_cls: Any, config: Any) -> Any:
    import torch

    with torch.device("meta"):
        return model_cls(config)


def _rope_owner(module: Any, config: Any) -> Any:
    own = getattr(module, "config", None)
    nodes = [n for _, n in _subconfigs(config)]
    if own is not None and any(own is n for n in nodes):
        return own
    try:
        text = config.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        text = config
    return text


def _repair_once(config: Any, model: Any, lines: list[str]) -> bool:
    import torch

    changed = False
    for _, mod in model.named_modules():
        sec, inv = getattr(mod, "mrope_section", None), getattr(mod, "inv_freq", None)
        if not (isinstance(sec, list | tuple) and sec and isinstance(inv, torch.Tensor)):
            continue
        want = int(inv.shape[-1])
        if sum(sec) == want:
            continue
        owner = _rope_owner(mod, config)
        rope = getattr(owner, "rope_parameters", None)
        if not isinstance(rope, dict):
            continue
        try:
            new = _rescale_sections(list(sec), want)
        except ValueError:  # fewer rotary pairs than sections: left to the run to show
            continue
        owner.rope_parameters = {**rope, "mrope_section": new}
        lines.append(f"rope_parameters.mrope_section: {list(sec)} -> {new} (the rotary width of the cut model)")
        changed = True
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    if isinstance(rows, int):
        from ..integrations.vision.sample import image_token_id

        tok = image_token_id(config)
        if tok is not None and rows <= tok < 1 << 20:
            text = _rope_owner(None, config)
            if isinstance(getattr(text, "vocab_size", None), int):
                old = text.vocab_size
                text.vocab_size = old + tok + 1 - rows
                lines.append(f"vocab_size: {old} -> {text.vocab_size} (image token id {tok} must be embedded)")
                changed = True
    return changed


def repair_shrunk(shrunk: Shrunk, model_cls: Any) -> Shrunk:
    """Repair, in place, the relations of :attr:`shrunk.config` only the built model shows (module docstring);
    returns ``shrunk``. A config the class cannot build on the meta device is returned as is (the caller's real
    build names the error)."""
    repaired_meta(shrunk, model_cls)
    return shrunk


def repaired_meta(shrunk: Shrunk, model_cls: Any) -> Any:
    """:func:`repair_shrunk`, returning the meta-device model of the repaired config (``None`` where the class
    cannot build it)."""
    model = None
    for _ in range(3):
        try:
            model = _meta(model_cls, shrunk.config)
        except Exception:  # noqa: BLE001 - the real build reports it
            return None
        if not _repair_once(shrunk.config, model, shrunk.lines):
            return model
    return _meta(model_cls, shrunk.config)


def run_checks(model: Any, *, backward: bool = True) -> tuple[str, str]:
    """``(text, image)``: ``"ok"`` where a forward (and backward) on a text-only / an image batch ran, else the
    error (an image batch the config describes no layout for: ``"no image layout: ..."``)."""
    import torch

    from ..integrations.vision.sample import SampleError, sample_batch

    out = []
    for image in (False, True):
        try:
            batch = sample_batch(model, image=image)
        except SampleError as e:
            out.append(f"no image layout: {str(e)[:300]}")
            continue
        try:
            with torch.set_grad_enabled(backward):
                res = model(**batch)
            loss = getattr(res, "loss", None)
            if backward:
                if loss is None:
                    raise ValueError("the forward returned no loss for labels=input_ids")
                loss.backward()
            out.append("ok")
        except Exception as e:  # noqa: BLE001 - reported as the family's outcome
            out.append(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    model.zero_grad(set_to_none=True)
    return out[0], out[1]


_TOKEN_COUNTS = ("mm_tokens_per_image", "image_seq_length", "num_image_tokens", "image_token_count", "num_query_tokens")
#: integer pooling factors per side applied to the patch grid (Idefics3 / SmolVLM pixel shuffle, Aya's downsample)
_POOL_INTS = ("scale_factor", "downsample_factor", "pixel_shuffle_factor", "merge_kernel_size")
#: the same as a ratio in (0, 1): the grid side is divided by 1 / ratio (Llama 4's pixel shuffle 0.5)
_POOL_RATIOS = ("pixel_shuffle_ratio", "downsample_ratio")


def _pool_factor(config: Any) -> int:
    """The least common multiple of every per-side pooling factor any sub-config names (1 when none)."""
    import math

    out = 1
    for _, node in _subconfigs(config):
        for key in _POOL_INTS:
            v = getattr(node, key, None)
            if isinstance(v, int) and not isinstance(v, bool) and 1 < v <= 16:
                out = math.lcm(out, v)
        for key in _POOL_RATIOS:
            v = getattr(node, key, None)
            if isinstance(v, float) and 0 < v < 1 and abs(1 / v - round(1 / v)) < 1e-6:
                out = math.lcm(out, round(1 / v))
    return out


def _token_side(config: Any) -> tuple[Any, int] | None:
    """``(node, side)`` for a fixed square image-token count a tower pools its grid to (``mm_tokens_per_image``:
    Gemma 3's 256 = 16 x 16), ``None`` without one."""
    import math

    for _, node in _subconfigs(config):
        v = getattr(node, "mm_tokens_per_image", None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0 and math.isqrt(v) ** 2 == v:
            return node, math.isqrt(v)
    return None


def _allowed_sides(config: Any) -> list[int]:
    """Grid sides a projector accepts, read from a dict keyed by patch count (Aria's
    ``projector_patch_to_query_dict`` ``{1225: 128, 4900: 256}``: 35 x 35 or 70 x 70 patches); ``[]`` when none."""
    import math

    for _, node in _subconfigs(config):
        for key, v in vars(node).items():
            if "patch" in key and isinstance(v, dict) and v:
                try:
                    counts = [int(k) for k in v]
                except (TypeError, ValueError):
                    continue
                if all(c > 0 and math.isqrt(c) ** 2 == c for c in counts):
                    return sorted(math.isqrt(c) for c in counts)
    return []


def shrink_images(config: Any, lines: list[str], *, cut: bool = True) -> bool:
    """Keep, in place, the geometry relations of every tower with an ``image_size`` and a ``patch_size``, and with
    ``cut`` make its patch grid ``g`` times smaller per side (``g`` in 8, 4, 2: the largest that divides the grid,
    leaves at least 4 patches per side and keeps the relations). Relations kept (a default config that breaks
    one, e.g. Gemma 3's 224 px / 16 px = 14 patches beside 256 = 16 x 16 tokens, is moved to the nearest grid
    that holds them, said in the lines):

    - the grid side is a whole number of patches and a multiple of every pooling factor (``scale_factor``,
      ``downsample_factor``, ``1 / pixel_shuffle_ratio`` ...: a pixel shuffle reshapes the grid by it);
    - a fixed square token count (``mm_tokens_per_image``) pools the grid evenly: its side divides the grid side
      (the count is cut by ``g**2`` with the grid where that still holds);
    - a projector keyed by patch count (``projector_patch_to_query_dict``) gets one of its grids;
    - "anyres" resolutions (``image_grid_pinpoints``, multiples of the tile size) scale with the tile;
    - other image-token counts the grid fills (``image_seq_length``, ``num_image_tokens`` ...) are cut by
      ``g**2`` where it divides.

    For the sweep (``cut``) and for a config whose relations are broken: a rehearsal of a real checkpoint keeps
    its (consistent) geometry. Returns whether anything changed; the caller runs the model to check the cut."""
    import math

    changed, factor = False, 0
    pool = _pool_factor(config)
    tokens = _token_side(config)
    for path, node in _subconfigs(config):
        size, patch = getattr(node, "image_size", None), getattr(node, "patch_size", None)
        if isinstance(patch, list | tuple) and patch:
            patch = patch[0]
        as_pair = type(size) if isinstance(size, list | tuple) else None  # InternVL's (448, 448): kept a pair
        if as_pair and len(size) == 2 and size[0] == size[1]:
            size = size[0]
        if not (isinstance(size, int) and isinstance(patch, int) and 0 < patch <= size):
            continue
        side = size // patch
        t = tokens[1] if tokens else 0
        g = 0
        if cut:
            g = next((g for g in (8, 4, 2) if side % g == 0 and side // g >= 4 and (side // g) % pool == 0
                      and (not t or t % g == 0)), 0)
        new_side, new_t = (side // g, t // g if t else 0) if g else (side, t)
        need = math.lcm(pool, new_t or 1)
        if new_side % need:
            new_side = -(-new_side // need) * need
        sides = _allowed_sides(config)
        if sides and new_side not in sides:  # a projector keyed by patch count: its smallest grid
            new_side = next((x for x in sides if x % need == 0), sides[0])
        if new_side * patch == size and new_t == t:
            continue
        p = f"{path}." if path else ""
        why = f"sweep: {g}x fewer patches per side" if g else "the grid did not hold"
        rel = [f"pooling {pool}"] if pool > 1 else []
        rel += [f"{new_t} x {new_t} tokens"] if new_t else []
        node.image_size = as_pair((new_side * patch,) * 2) if as_pair else new_side * patch
        lines.append(f"{p}image_size: {size} -> {new_side * patch} ({why}; {new_side} patches per side"
                     f"{', ' + ', '.join(rel) if rel else ''})")
        if tokens and new_t != t:
            tokens[0].mm_tokens_per_image = new_t * new_t
            lines.append(f"mm_tokens_per_image: {t * t} -> {new_t * new_t}")
        for _, other in _subconfigs(config):
            points = getattr(other, "image_grid_pinpoints", None)
            if isinstance(points, list) and points and all(isinstance(x, list | tuple) and all(
                    isinstance(v, int) and v % size == 0 for v in x) for x in points):
                other.image_grid_pinpoints = [[v // size * new_side * patch for v in x] for x in points]
                lines.append(f"image_grid_pinpoints: tiles of {size} -> {new_side * patch}")
        factor, changed = max(factor, g), True
    if factor:
        for path, node in _subconfigs(config):
            for key in _TOKEN_COUNTS:
                v = getattr(node, key, None)
                if isinstance(v, int) and not isinstance(v, bool) and v % (factor * factor) == 0 and \
                        v // (factor * factor) >= 1 and key not in ("num_query_tokens", "mm_tokens_per_image"):
                    setattr(node, key, v // (factor * factor))
                    lines.append(f"{path + '.' if path else ''}{key}: {v} -> {v // (factor * factor)}")
    return changed


#: a tower's output width fields (the width its features leave it with)
_OUT_WIDTHS = ("out_hidden_size", "out_hidden_dim", "output_hidden_size", "out_dim", "output_dim")


def align_outputs(config: Any, lines: list[str]) -> bool:
    """Set, in place, every non-text sub-config's output width (``out_hidden_size`` ...) that differs from the
    language model's hidden to that hidden: a tower whose merger feeds ``inputs_embeds`` directly must leave at the
    text width, and a default config may not say so (Qwen3-VL's ``vision_config.out_hidden_size`` 3584 beside a
    text ``hidden_size`` 4096, transformers 5.23). Tried by :func:`shrink_checked` only where the image fails
    without it. Returns whether anything changed."""
    try:
        text = config.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        return False
    width = getattr(text, "hidden_size", None)
    if text is config or not isinstance(width, int):
        return False
    changed = False
    for path, node in _subconfigs(config):
        if node is text or node is config:
            continue
        for key in _OUT_WIDTHS:
            v = getattr(node, key, None)
            if isinstance(v, int) and not isinstance(v, bool) and v != width:
                setattr(node, key, width)
                lines.append(f"{path}.{key}: {v} -> {width} (the text width its features enter at)")
                changed = True
    return changed


def _kept_vision(config: Any) -> tuple[str, ...]:
    return tuple(p for p, _ in _subconfigs(config) if p and "text" not in p and "." not in p)


def shrink_checked(config: Any, model_cls: Any, *, seed: int = 0, backward: bool = False,
                   small_images: bool = False) -> Checked:
    """Shrink ``config`` for ``model_cls``, repair, build seeded and run (module docstring).

    Raises:
        Exception: the class cannot build the shrunk config (the caller names the step).
    """
    import torch

    plain: Checked | None = None  # the plain cut's result: what is returned when no candidate runs
    first: Checked | None = None  # the first candidate that runs text only (no image layout)
    filled: list[str] = []
    if small_images:  # the sweep: a text-only default config stands for the checkpoints that carry a tower
        config = copy.deepcopy(config)
        give_vision_config(config, filled)
    kept = _kept_vision(config)
    tries = ([((), True, False)] if small_images else []) + [((), False, False)] + \
        ([(kept, False, False)] if kept else []) + [((), small_images, True)]
    for keep, images, align in tries:
        if (keep or align) and (plain is None or plain.text != "ok"):  # these help an image path only
            break
        shrunk = shrink_config(config, keep_widths=keep)
        shrunk.lines[:0] = filled
        cut = shrink_images(shrunk.config, shrunk.lines, cut=images)  # without a cut: relations only (none move
        if images and not cut and not align:  # in a real config); a cut that changes nothing is the next try
            continue
        if align and not align_outputs(shrunk.config, shrunk.lines):
            continue
        shrunk = repair_shrunk(shrunk, model_cls)
        if keep:
            try:
                n = sum(p.numel() for p in _meta(model_cls, shrunk.config).parameters())
            except Exception:  # noqa: BLE001 - not this fallback then
                continue
            if n > MAX_PARAMS:
                continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(shrunk.config)
        text, image = run_checks(model, backward=backward)
        for _ in range(3):  # token ids the default config lacks (each kept only where it helps)
            trial = copy.deepcopy(shrunk)
            errs = f"{text} {image}"
            missing = give_missing_token(trial.config, errs, trial.lines) or \
                give_unset_field(trial.config, errs, trial.lines)
            widened = not missing and image != "ok" and give_linear_width(trial.config, image, trial.lines)
            if not (missing or widened) and not (image != "ok" and give_image_token(trial.config, model, trial.lines)):
                break
            trial = repair_shrunk(trial, model_cls)  # a new id embedded
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                again = model_cls(trial.config)
            text2, image2 = run_checks(again, backward=backward)
            # the image token: only where it gives the model its image path; a width: where the image error moves on
            if not (missing or image2 == "ok" or (widened and image2 != image and text2 == text)):
                break
            shrunk, model, text, image = trial, again, text2, image2
        got = Checked(shrunk, model, text, image)
        if got.text == got.image == "ok":  # the first candidate that takes an image too
            if (keep or align) and plain is not None:
                what = f"widths of {', '.join(keep)} kept" if keep else "tower outputs set to the text width"
                got.shrunk.lines.append(f"{what} (the fully cut model failed: "
                                        f"{plain.text if plain.text != 'ok' else plain.image})")
            return got
        if got.runs and first is None:  # text runs, no image layout: kept unless a later candidate does better
            first = got
        if not keep and not images and not align:
            plain = got
    if first is not None:
        return first
    assert plain is not None
    plain.shrunk.lines.append(f"check: the shrunk model does not run (text: {plain.text[:120]}; image: "
                              f"{plain.image[:120]})")
    return plain
