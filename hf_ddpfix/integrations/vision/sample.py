"""A valid batch for any image-text-to-text model, built from its config and structure (no processor, offline).

:func:`sample_batch` gives ``input_ids`` / ``attention_mask`` / ``labels`` and, with ``image=True``, the pixel
inputs the model's image path accepts plus as many image tokens as its features fill. How the image part is found,
in order (the first layout whose image features come out is kept, per model):

- the pixel keyword sets :func:`.layouts.candidates` builds from the config and the keywords of
  ``get_image_features`` (on the model or its ``.model``; grids, NaFlex rows, patch positions, native sizes and
  anyres tiles, tiles, a second tower's pixels, bare patch rows), tried in that order;
- the image-token count: the rows of the features ``get_image_features`` returns (total elements / the text
  width), written as that many ``image_token_id`` tokens into ``input_ids``. A model with no image token (BLIP,
  GIT, an encoder-decoder) gets ``pixel_values`` beside plain text;
- boundary tokens: a layout the whole model refuses is tried once more with the image tokens between the begin
  and end tokens the config names (:func:`image_bounds`: ``image_start_token_id`` / ``image_end_token_id``,
  ``boi_token_id`` / ``eoi_token_id``, ...), as a processor writes them; a model that wants them counts them
  (Ovis2.5: "Expected 1 visual boundary tokens"). Only then: a layout that runs without them is kept as it is.

Companion inputs, built beside the text from ``forward``'s keywords and the config (by naming convention):

- ``flattened_patches`` (Pix2Struct): ``[1, 16, 2 + D]`` patch rows of a 4 x 4 grid, the first two columns the
  1-based row / column ids, ``D`` the config's ``patch_embed_hidden_size`` (else ``C*P*P``), with the patches'
  ``attention_mask``; a forward with no ``input_ids`` but ``decoder_input_ids`` then takes the text as
  ``labels`` only (its ``attention_mask`` is the patches');
- ``*image*position_mask`` (Kosmos-2's ``image_embeds_position_mask``): a model with no ``get_image_features``
  and no image token gets as many placeholder text tokens as the config's image-token count
  (``latent_query_num``, ``num_query_tokens``, ...) and the ``[1, seq]`` mask marking them;
- ``image_attention_mask`` (Idefics): ``[1, seq, num_images]`` ones, every token attending every image;
- ``bbox`` (UDOP): one ``[x0, y0, x1, y1]`` box in ``[0, 1]`` per token, ``[1, seq, 4]`` floats;
- a robot-state / action vector (PI0): a keyword ``<name>`` (``state``, ``actions``) the config sizes by
  ``max_<stem>_dim`` / ``<stem>_dim`` (``<stem>`` the name without a plural ``s``): ``[1, dim]``, or
  ``[1, chunk_size, dim]`` for a plural name with a ``chunk_size`` in the config; beside ``actions``, a fixed
  ``noise`` of the same shape and ``timestep`` 0.5 where ``forward`` takes them (no random draw in the model);
- a nested vision-language config (PI0's ``vlm_config``, no get_image_features on the model): its image token,
  as many as the count it names (``num_image_tokens``);
- video: a model with ``get_video_features`` and no ``get_image_features`` (InstructBLIP-Video) is probed with
  it, its ``video_token_id`` / ``video_token_index`` standing in for the image token where the config names none.

Guarantees: deterministic for a given ``seed``; never mutates the model (the trial runs under ``no_grad`` with the
RNG forked); raises :class:`SampleError` naming every layout tried when none runs.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..._compat import image_features, unwrap_model
from .adapter import output_tensors
from .layouts import as_int, candidates, cfg_get, image_params, ramp, text_config, vision_config

__all__ = ["SampleError", "sample_batch", "image_bounds", "image_layout"]

_TOKEN_KEYS = ("image_token_id", "image_token_index", "image_token", "img_token_id", "image_pad_token_id",
               "media_placeholder_token_id", "image_context_token_id")
#: read only where no config names an image token (a video-only model: InstructBLIP-Video)
_VIDEO_TOKEN_KEYS = ("video_token_id", "video_token_index")
#: how many image embeddings a model with no get_image_features places (the placeholders of a position mask)
_COUNT_KEYS = ("latent_query_num", "num_query_tokens", "image_seq_length", "mm_tokens_per_image", "num_image_tokens")
#: a sequence length for a plural vector keyword (``actions``: a chunk of action steps)
_CHUNK_KEYS = ("chunk_size", "action_chunk_size", "n_action_steps")


class SampleError(ValueError):
    """No valid input could be built for the model; the message lists what was tried."""


@dataclass
class Layout:
    """How a model takes an image: the pixel keywords and how many image tokens their features fill."""

    pixels: dict[str, Any]
    n_tokens: int
    token_id: int | None
    notes: list[str] = field(default_factory=list)
    bounds: tuple[int, int] | None = None  # begin / end token ids written around the image tokens


def special_ids(cfg: Any) -> set[int]:
    """Every token id the config names (``*_token_id`` / ``*_token_index`` / ``*_id`` ints, in every sub-config)."""
    out: set[int] = set()
    seen: set[int] = set()

    def visit(c: Any) -> None:
        if id(c) in seen:
            return
        seen.add(id(c))
        for k, v in vars(c).items():
            if isinstance(v, int) and not isinstance(v, bool) and ("token" in k or k.endswith("_id")):
                out.add(v)
            elif isinstance(v, (list, tuple)) and "token" in k:
                out.update(x for x in v if isinstance(x, int) and not isinstance(x, bool))
            elif hasattr(v, "to_dict") and hasattr(v, "model_type"):
                visit(v)

    visit(cfg)
    return out


def image_token_id(cfg: Any) -> int | None:
    """The id written where image features go (``image_token_id`` / ``image_token_index`` ..., top config first;
    a ``video_token_id`` only where no config names an image token; last, the token of a nested
    vision-language config, :func:`_nested_vlms`)."""
    for keys in (_TOKEN_KEYS, _VIDEO_TOKEN_KEYS):
        for c in (cfg, text_config(cfg), vision_config(cfg)):
            if c is None:
                continue
            v = cfg_get(c, keys)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    for vlm in _nested_vlms(cfg):
        v = image_token_id(vlm)
        if v is not None:
            return v
    return None


_BOUND_KEYS = (("image_start_token_id", "image_end_token_id"), ("image_begin_token_id", "image_end_token_id"),
               ("boi_token_id", "eoi_token_id"), ("boi_token_index", "eoi_token_index"),
               ("image_start_token", "image_end_token"), ("img_start_token_id", "img_end_token_id"))


def image_bounds(cfg: Any) -> tuple[int, int] | None:
    """The begin / end token ids a processor writes around an image's tokens, where the config (or its text config)
    names both (:data:`_BOUND_KEYS`, first pair found), else None."""
    for c in (cfg, text_config(cfg)):
        if c is None:
            continue
        for start_key, end_key in _BOUND_KEYS:
            start, end = getattr(c, start_key, None), getattr(c, end_key, None)
            if all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
                return start, end
    return None


def _nested_vlms(cfg: Any) -> list[Any]:
    """Sub-configs that are whole vision-language configs (they hold a ``vision_config``), in a config that has
    none of its own: PI0's ``vlm_config`` (a PaliGemma) beside its action expert's ``dit_config``."""
    if vision_config(cfg) is not None:
        return []
    return [v for v in vars(cfg).values()
            if hasattr(v, "to_dict") and hasattr(v, "model_type") and vision_config(v) is not None]


def _nested_count(cfg: Any) -> int:
    """The image-token count a nested vision-language config names (its own or its text config's
    ``num_image_tokens`` ...), 0 where none does."""
    for vlm in _nested_vlms(cfg):
        for c in (vlm, text_config(vlm)):
            n = as_int(cfg_get(c, _COUNT_KEYS), 0)
            if n:
                return n
    return 0


def _image_fn(model: nn.Module) -> Any:
    for name in ("get_image_features", "get_video_features"):  # a video-only model: its video features
        for m in (model, getattr(model, "model", None)):
            fn = getattr(m, name, None) if m is not None else None
            if callable(fn):
                return fn
    return None


def _feature_rows(out: Any, width: int) -> int:
    """The image-token count ``get_image_features``' output fills: its features' elements / the text ``width``;
    where no output tensor has that width (a tower whose projector runs in ``forward``: Llama 4), the rows of its
    first tensor."""
    feats = image_features(out)
    tensors = output_tensors(feats) if feats is not None else []
    if not tensors:
        tensors = [t for t in output_tensors(out) if t.shape[-1] == width][:1]
    if not tensors and (first := output_tensors(out)[:1]) and first[0].numel():
        return first[0].numel() // first[0].shape[-1]
    total = sum(t.numel() for t in tensors)
    if not tensors or total == 0 or total % width:
        raise SampleError(f"image features of {[tuple(t.shape) for t in tensors]} do not fill rows of width {width}")
    return total // width


def image_layout(model: nn.Module) -> Layout:
    """The pixel keywords and image-token count for ``model`` (kept per model; see the module docstring).

    Raises:
        SampleError: no layout runs through ``get_image_features``; the message names each try and its error.
    """
    cached = _LAYOUTS.get(model)
    if cached is not None:
        return cached
    cfg = model.config
    token = image_token_id(cfg)
    fn = _image_fn(model)
    width = as_int(getattr(text_config(cfg), "hidden_size", None), 0)
    if fn is not None and vision_config(cfg) is None and getattr(cfg, "vision_config", 0) is None:
        raise SampleError(f"{type(model).__name__}: its config has no vision_config (a text-only default config)")
    params = image_params(model, fn) if fn is not None else set(inspect.signature(model.forward).parameters)
    errors: list[str] = []
    bounds = image_bounds(cfg)  # tried only where a layout without them is refused
    for name, kw in candidates(model, params):
        if fn is None or token is None:  # the first layout the whole model takes beside plain text
            n = _placeholders(model, cfg)
            nested = _nested_count(cfg) if token is not None and not n else 0  # PI0: its VLM's image tokens
            layout = Layout(kw, n or nested, token if nested else None,
                            [f"{name}; no get_image_features/image token: pixels beside the text"
                             + (f", {n} placeholder tokens in its position mask" if n else "")
                             + (f", {nested} image tokens its nested VLM config names" if nested else "")])
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    model(**_assemble(model, layout, seq=4, seed=0))
            except Exception as e:  # noqa: BLE001 - a trial: any failure means "not this layout"
                errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
                continue
            _LAYOUTS[model] = layout
            return layout
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                n = _feature_rows(fn(**kw), width)
        except Exception as e:  # noqa: BLE001 - a trial: any failure means "not this layout"
            errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            continue
        for layout in (Layout(kw, n, token, [name]),
                       *([Layout(kw, n, token, [f"{name}; between boundary tokens {bounds}"], bounds)] if bounds else [])):
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    model(**_assemble(model, layout, seq=4, seed=0))  # the whole model takes it too
            except Exception as e:  # noqa: BLE001 - a trial: any failure means "not this layout"
                errors.append(f"{layout.notes[0]}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else ''}")
                continue
            _LAYOUTS[model] = layout
            return layout
    raise SampleError(f"{type(model).__name__}: no image layout built from the config runs "
                      f"({'; '.join(errors) or 'no candidate'})")


def _position_mask_key(names: set[str]) -> str | None:
    """The ``forward`` keyword marking where image embeddings go (``image_embeds_position_mask``), if any."""
    return next((k for k in sorted(names) if "image" in k and k.endswith("position_mask")), None)


def _placeholders(model: nn.Module, cfg: Any) -> int:
    """Image placeholders a model with a position mask and no image token takes: the config's count, else 0."""
    if _position_mask_key(set(inspect.signature(model.forward).parameters)) is None:
        return 0
    return as_int(cfg_get(cfg, _COUNT_KEYS), 0)


_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, Layout] = weakref.WeakKeyDictionary()


def sample_batch(model: nn.Module, *, image: bool, seq: int = 12, seed: int = 0) -> dict[str, Any]:
    """A batch of one sequence for ``model`` (the HF model, or a PEFT / DDP wrapper around it): ``seq`` text tokens (ids that are no special token), plus, with
    ``image``, the image tokens and pixel keywords of :func:`image_layout`. ``labels`` = ``input_ids``.

    Raises:
        SampleError: ``image=True`` and no image layout runs (see :func:`image_layout`).
    """
    hf = unwrap_model(model)  # a PeftModel / DDP wrapper: the HF model's config, signature and image path
    return _assemble(hf, image_layout(hf) if image else None, seq=seq, seed=seed)


def _assemble(model: nn.Module, layout: Layout | None, *, seq: int, seed: int) -> dict[str, Any]:
    cfg = model.config
    vocab = as_int(getattr(text_config(cfg), "vocab_size", None), 0) or as_int(getattr(cfg, "vocab_size", None), 1000)
    avoid = special_ids(cfg)
    g = torch.Generator().manual_seed(seed)
    pool = [i for i in range(3, min(vocab, 400)) if i not in avoid] or [1]
    ids = [pool[int(j)] for j in torch.randint(0, len(pool), (seq,), generator=g)]
    batch: dict[str, Any] = {}
    placed = 0  # placeholder tokens of a position mask (no image token id)
    if layout is not None:
        if layout.token_id is not None and layout.n_tokens:
            begin, end = ([layout.bounds[0]], [layout.bounds[1]]) if layout.bounds else ([], [])
            ids = ids[:2] + begin + [layout.token_id] * layout.n_tokens + end + ids[2:]
        elif layout.n_tokens:
            placed = layout.n_tokens
            ids = ids[:2] + [pool[0]] * placed + ids[2:]
        batch.update({k: v.clone() for k, v in layout.pixels.items()})
    input_ids = torch.tensor([ids], dtype=torch.long)
    names = set(inspect.signature(model.forward).parameters)
    if "input_ids" not in names and "decoder_input_ids" in names:  # an image encoder, a text decoder (Pix2Struct):
        batch["labels"] = input_ids.clone()  # the text is the decoder's; attention_mask is the patches'
    else:
        labels = input_ids.clone()
        try:
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        except (AttributeError, NotImplementedError):  # a model without one raises in transformers 5
            head = None
        rows = getattr(head, "out_features", None) or getattr(head, "num_embeddings", None)
        if isinstance(rows, int) and rows > 0:  # an id the head cannot predict is no target (Molmo2's image token,
            labels[labels >= rows] = -100  # in an embedding table apart from the vocabulary its head predicts)
        batch.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)
    _companions(model, batch, names, input_ids, placed, layout is not None)
    token = image_token_id(cfg)
    if "mm_token_type_ids" in names:  # M-RoPE families: 1 where an image token sits (the processor's output)
        batch["mm_token_type_ids"] = (input_ids == token).long() if token is not None else torch.zeros_like(input_ids)
    if "qformer_input_ids" in names:  # InstructBLIP: the instruction for the Q-Former, in its own small vocabulary
        q = torch.tensor([pool[:4]], dtype=torch.long)
        batch.update(qformer_input_ids=q, qformer_attention_mask=torch.ones_like(q))
    return batch


def _float_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


#: words of keywords that are no config-sized vector (ids, masks, embeddings, pixels, caches, outputs)
_NOT_VECTORS = ("ids", "mask", "embeds", "values", "labels", "cache", "key", "output", "return", "use_")


def _vector_shape(cfg: Any, name: str) -> tuple[int, ...] | None:
    """``[1, dim]`` / ``[1, chunk, dim]`` for a vector keyword the config sizes (module docstring), else None."""
    stem = name[:-1] if name.endswith("s") else name
    dim = as_int(cfg_get(cfg, (f"max_{stem}_dim", f"{stem}_dim")), 0)
    if not dim:
        return None
    chunk = as_int(cfg_get(cfg, _CHUNK_KEYS), 0) if name.endswith("s") else 0
    return (1, chunk, dim) if chunk else (1, dim)


def _companions(model: nn.Module, batch: dict[str, Any], names: set[str], input_ids: torch.Tensor, placed: int,
                image: bool) -> None:
    """Add, in place, the companion inputs ``forward`` takes beside the text and pixels (module docstring)."""
    cfg = model.config
    dtype = _float_dtype(model)
    seq = input_ids.shape[1]
    if placed and (key := _position_mask_key(names)) is not None:  # where the image embeddings go (Kosmos-2)
        mask = torch.zeros_like(input_ids, dtype=torch.bool)
        mask[:, 2:2 + placed] = True
        batch[key] = mask
    if image and "image_attention_mask" in names:  # per-image cross-attention (Idefics): every token, every image
        pv = batch.get("pixel_values")
        n_images = pv.shape[1] if isinstance(pv, torch.Tensor) and pv.dim() == 5 else 1
        batch["image_attention_mask"] = torch.ones(1, seq, n_images, dtype=torch.long)
    if "bbox" in names:  # a box per token (UDOP): a row of boxes left to right in [0, 1]
        x0 = torch.arange(seq, dtype=torch.float32) / seq
        boxes = torch.stack([x0, torch.zeros(seq), x0 + 1.0 / seq, torch.full((seq,), 0.1)], -1)
        batch["bbox"] = boxes[None].to(dtype)
    for name in sorted(names):  # robot state / actions sized by the config (PI0)
        if name in batch or name in ("noise", "timestep") or any(w in name for w in _NOT_VECTORS):
            continue
        shape = _vector_shape(cfg, name)
        if shape is None:
            continue
        batch[name] = ramp(shape, dtype)
        if name == "actions":  # the flow-matching draws, fixed: a deterministic loss
            if "noise" in names:
                batch["noise"] = ramp(shape, dtype).flip(-1)
            if "timestep" in names:
                batch["timestep"] = torch.full((shape[0],), 0.5, dtype=torch.float32)
