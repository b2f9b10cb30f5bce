"""The pixel keyword sets to try for a model's image path, built from its config and the signature of the call
that runs its tower (no processor, offline); :mod:`.sample` keeps the first whose features come out.

:func:`candidates` yields, most specific first, from the keywords :func:`image_params` finds:

- a grid keyword (``image_grid_thw`` / ``grid_thw`` / ``image_grid_hw`` ...): Qwen2-VL-style flattened patches
  ``[t*h*w, C*T*P*P]`` for a ``[1, 2m, 2m]`` grid (``m`` the merge size), then the same patches as
  ``[t*h*w, C*T, P, P]`` for a conv patch embedding (Kimi-K2.5's MoonViT), then one channels-last crop
  ``[tokens, P*m, P*m, C]`` per image token with the grid counted in tokens (Inkling 2); a ``*merge_sizes``
  keyword gets ``[m]`` per grid (VideoLLaMA3);
- ``flattened_patches`` (Pix2Struct): ``[1, 16, 2 + D]`` patch rows led by their 1-based row / column ids;
- a ``*_token_pooling`` keyword: one crop's patch rows with the patch indices each image token pools (Molmo2);
- ``spatial_shapes`` + ``pixel_attention_mask``: NaFlex patch rows;
- a ``*image*position_ids`` / ``*pixel*position_ids`` keyword: ``[1, n, C*P*P]`` patch rows with their ``(x, y)``
  grid positions ``[1, n, 2]``, on a ``2k x 2k`` grid (``k`` the tower's pooling kernel), then rows of ``k x k``
  patches merged (``model_patch_size``) on a 2 x 2 grid (Gemma 4, Gemma 4 Unified);
- ``pixel_values`` as ``[1, C, H, W]``, ``[1, 1, C, H, W]`` or ``[1, 2, C, H, W]`` at the vision config's image
  size (``image_sizes``: a small image first, then the native size and its anyres tiles; ``pixel_attention_mask``;
  Mllama's ``aspect_ratio_ids`` / ``aspect_ratio_mask`` tiles), each with the pixels of a second tower where
  ``get_image_features`` takes ``<prefix>_pixel_values`` and the config has ``<prefix>_vision_config``
  (DeepSeek-VL-Hybrid's high-resolution SAM tower), at that config's size;
- last, ``pixel_values`` as bare patch rows ``[1, N, C*P*P]`` then ``[N, C*P*P]`` (a linear patch embedding fed by
  the processor's patches, Fuyu).

Every tensor is a deterministic ramp (no random draw).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .adapter import anyres_tiles, image_size_hw
from .parts import tower_config as vision_config

__all__ = ["as_int", "candidates", "cfg_get", "image_params", "ramp", "text_config", "vision_config"]

_GRID_KEYS = ("image_grid_thw", "grid_thw", "image_grid_hws", "grid_hws", "image_grid_hw", "grid_hw")
_CHANNEL_KEYS = ("in_channels", "num_channels", "in_chans", "channels")
#: a per-side pooling of the patch grid a tower with patch positions applies (Gemma 4's 3 x 3 average pool)
_POOL_KEYS = ("pooling_kernel_size", "spatial_merge_size", "merge_size")


def cfg_get(cfg: Any, names: tuple[str, ...]) -> Any:
    """The first of ``names`` set (not None) on ``cfg``, else None."""
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return None


def text_config(cfg: Any) -> Any:
    """The decoder's text config (the config itself where it has none apart)."""
    try:
        return cfg.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        return cfg


def as_int(v: Any, default: int) -> int:
    """``v`` (or its first item) as a positive int, else ``default``."""
    if isinstance(v, (list, tuple)) and v:
        v = v[0]
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def ramp(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``shape`` filled with evenly spaced values in [-1, 1]: a deterministic input."""
    n = 1
    for s in shape:
        n *= s
    return torch.linspace(-1.0, 1.0, n, dtype=torch.float32).reshape(shape).to(dtype)


def image_params(model: nn.Module, fn: Any) -> set[str]:
    """The keywords ``fn`` (a ``get_image_features``) names, plus the required ones of the same method on the inner
    ``.model`` where ``fn`` passes ``**kwargs`` on (a wrapper naming fewer keywords than its base model requires:
    VideoLLaMA3's ``image_merge_sizes``). Optional inner keywords stay out: they would change the layout of models
    that run without them."""
    sig = inspect.signature(fn)
    names = {k for k, v in sig.parameters.items() if v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)}
    if any(v.kind is v.VAR_KEYWORD for v in sig.parameters.values()):
        inner = getattr(getattr(model, "model", None), getattr(fn, "__name__", ""), None)
        if callable(inner) and getattr(inner, "__func__", inner) is not getattr(fn, "__func__", fn):
            names |= {k for k, v in inspect.signature(inner).parameters.items()
                      if v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL) and v.default is v.empty}
    return names


def _second_towers(cfg: Any, params: set[str], channels: int) -> dict[str, tuple[int, ...]]:
    """``<prefix>_pixel_values`` keywords whose config has a ``<prefix>_vision_config`` with an image size: the
    per-image shape ``(C, H, W)`` of that tower's pixels."""
    out: dict[str, tuple[int, ...]] = {}
    for k in sorted(params):
        if k == "pixel_values" or not k.endswith("_pixel_values"):
            continue
        sub = getattr(cfg, k[: -len("pixel_values")] + "vision_config", None)
        hw = image_size_hw(sub) if sub is not None and not isinstance(sub, (dict, int, str)) else None
        if hw:
            out[k] = (as_int(cfg_get(sub, _CHANNEL_KEYS), channels), *hw)
    return out


def _position_key(params: set[str]) -> str | None:
    """The keyword giving each patch row its ``(x, y)`` grid position (``image_position_ids``), if any."""
    return next((k for k in sorted(params) if k.endswith("position_ids") and ("image" in k or "pixel" in k)), None)


def _pooled_rows(vc: Any, params: set[str], pool_key: str, c: int, p: int, hw: tuple[int, int],
                 dtype: torch.dtype) -> list[tuple[str, dict[str, Any]]]:
    """One crop's patch rows ``[1, gh*gw, C*P*P]`` (``gh*gw`` the tower's position table where it names one) with
    ``<x>_token_pooling`` ``[tokens, k*k]``: the patch indices each image token pools, ``k x k`` windows (``k`` 2,
    then 1), ``-1`` padding an edge window; an ``image_grids`` keyword gets ``[[rows, cols, 0, 0]]`` (the pooled
    low-resolution grid, no high-resolution crops). Molmo2's adapter."""
    gh, gw = hw[0] // p, hw[1] // p
    n = as_int(cfg_get(vc, ("num_position_embeddings", "num_patches")), 0)
    if n and n != gh * gw:  # a square position table the image size does not say
        gh = gw = int(n ** 0.5) if int(n ** 0.5) ** 2 == n else 0
    grids_key = next((k for k in ("image_grids", "grids") if k in params), None)
    out: list[tuple[str, dict[str, Any]]] = []
    for k in ((2, 1) if gh and gw else ()):
        ph, pw = -(-gh // k), -(-gw // k)
        idx = torch.full((ph * k, pw * k), -1, dtype=torch.long)
        idx[:gh, :gw] = torch.arange(gh * gw).reshape(gh, gw)
        kw = {"pixel_values": ramp((1, gh * gw, c * p * p), dtype),
              pool_key: idx.reshape(ph, k, pw, k).permute(0, 2, 1, 3).reshape(ph * pw, k * k)}
        if grids_key is not None:
            kw[grids_key] = torch.tensor([[ph, pw, 0, 0]], dtype=torch.long)
        out.append((f"{gh}x{gw} patch rows pooled {k}x{k} by {pool_key}", kw))
    return out


def candidates(model: nn.Module, params: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """Pixel keyword sets to try, most specific first (module docstring), each with a name for the record."""
    cfg = model.config
    vc = vision_config(cfg) or cfg
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    c = as_int(cfg_get(vc, _CHANNEL_KEYS), 3)
    p = as_int(cfg_get(vc, ("patch_size", "spatial_patch_size")), 14)
    hw = image_size_hw(vc) or image_size_hw(cfg) or (224, 224)
    out: list[tuple[str, dict[str, Any]]] = []
    grid_key = next((k for k in _GRID_KEYS if k in params), None)
    qformer: dict[str, Any] = {}
    if "qformer_input_ids" in params:  # InstructBLIP: the image features depend on the Q-Former's instruction
        qformer = {"qformer_input_ids": torch.tensor([[3, 4, 5, 6]], dtype=torch.long),
                   "qformer_attention_mask": torch.ones(1, 4, dtype=torch.long)}
    if grid_key is not None:
        m = as_int(cfg_get(vc, ("spatial_merge_size", "merge_size", "spatial_merge")), 2)
        t = as_int(cfg_get(vc, ("temporal_patch_size",)), 1)
        g = [1, 2 * m, 2 * m] if "thw" in grid_key else [2 * m, 2 * m]
        n = 4 * m * m
        merge_key = next((k for k in sorted(params) if k.endswith("merge_sizes")), None)
        # flattened patch rows first, then the same patches unflattened (a conv patch embedding: MoonViT)
        for unflat in (False, True):
            for tt in ((t, 1) if t != 1 else (1,)):
                shape = (n, c * tt, p, p) if unflat else (n, c * tt * p * p)
                name = f"grid {g} x ({c * tt}, {p}, {p}) patches" if unflat else f"grid {g} x {c}*{tt}*{p}^2"
                kw = {"pixel_values": ramp(shape, dtype), grid_key: torch.tensor([g], dtype=torch.long)}
                if merge_key is not None:  # a merge factor per grid (VideoLLaMA3's image_merge_sizes)
                    kw[merge_key] = torch.tensor([m], dtype=torch.long)
                    name += f", {merge_key} [{m}]"
                out.append((name, kw))
        # one channels-last crop of m x m patches per image token, the grid counted in tokens (Inkling 2's tower)
        gt = [1, 2, 2] if "thw" in grid_key else [2, 2]
        out.append((f"grid {gt} tokens x ({p * m}, {p * m}, {c}) crops", {
            "pixel_values": ramp((4, p * m, p * m, c), dtype), grid_key: torch.tensor([gt], dtype=torch.long)}))
    if "flattened_patches" in params:  # Pix2Struct: patch rows led by their 1-based row / column ids
        h, w = 4, 4
        d = as_int(cfg_get(vc, ("patch_embed_hidden_size",)), c * p * p)
        ids = torch.stack(torch.meshgrid(torch.arange(1, h + 1), torch.arange(1, w + 1), indexing="ij"), -1)
        rows = torch.cat([ids.reshape(h * w, 2).to(dtype), ramp((h * w, d), dtype)], -1)
        out.append((f"flattened {h}x{w} patches of {d}", {
            "flattened_patches": rows[None], "attention_mask": torch.ones(1, h * w, dtype=torch.long)}))
    if (pool_key := next((k for k in sorted(params) if k.endswith("_token_pooling")), None)) is not None:
        out += _pooled_rows(vc, params, pool_key, c, p, hw, dtype)
    if "spatial_shapes" in params:
        h, w = 4, 4
        out.append((f"naflex {h}x{w} patches", {
            "pixel_values": ramp((1, h * w, c * p * p), dtype),
            "spatial_shapes": torch.tensor([[h, w]], dtype=torch.long),
            "pixel_attention_mask": torch.ones(1, h * w, dtype=torch.bool)}))
    if (pos_key := _position_key(params)) is not None:  # patch rows with their (x, y) positions: the k x k pooled
        k = as_int(cfg_get(vc, _POOL_KEYS), 1)  # grid, then rows of k x k patches merged by the processor
        merged = as_int(cfg_get(vc, ("model_patch_size",)), p * k)
        for pp, side in ((p, 2 * k),) + (((merged, 2),) if merged != p else ()):
            ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
            out.append((f"{side}x{side} patch rows of {c}*{pp}^2 + {pos_key}", {
                "pixel_values": ramp((1, side * side, c * pp * pp), dtype),
                pos_key: torch.stack([xs, ys], -1).reshape(1, side * side, 2)}))
    towers = _second_towers(cfg, params, c)
    sizes = [hw]
    if "image_sizes" in params and 8 * p < min(hw):  # a tower that takes any size (Pixtral): a small image first,
        sizes = [(8 * p, 8 * p), hw]  # then the native size (a fixed position table: LLaVA-OneVision's 27 x 27)
    tiles = anyres_tiles(cfg, hw) if "image_sizes" in params else None
    for size in sizes:
        extra: dict[str, Any] = {}
        if "image_sizes" in params:
            extra["image_sizes"] = torch.tensor([list(size)], dtype=torch.long)
        leads: tuple[tuple[int, ...], ...] = ((1,), (1, 1), (1, 2))
        if tiles is not None and size == hw:  # LLaVA-NeXT anyres: the base tile + the grid the pinpoints pick
            leads = ((1, tiles),) + leads
        for lead in leads:
            kw = {"pixel_values": ramp((*lead, c, *size), dtype), **extra, **qformer,
                  **{k: ramp((*lead, *shape), dtype) for k, shape in towers.items()}}
            if "pixel_attention_mask" in params and len(lead) == 2:
                kw["pixel_attention_mask"] = torch.ones(*lead, *size, dtype=torch.bool)
            if "aspect_ratio_ids" in params:
                n_tiles = as_int(cfg_get(vc, ("max_num_tiles",)), 1)
                kw["pixel_values"] = ramp((1, 1, n_tiles, c, *size), dtype)
                kw["aspect_ratio_ids"] = torch.ones(1, 1, dtype=torch.long)
                kw["aspect_ratio_mask"] = torch.zeros(1, 1, n_tiles, dtype=torch.long)
                kw["aspect_ratio_mask"][..., 0] = 1
                out.append((f"tiles 1x{n_tiles} at {size}", kw))
                break
            out.append((f"pixels {tuple(kw['pixel_values'].shape)}", kw))
            if "pixel_attention_mask" in params and len(lead) == 2:  # a mask of real tiles (Granite Docling)
                out.append((f"pixels {tuple(kw['pixel_values'].shape)}, tile mask",
                            {**kw, "pixel_attention_mask": torch.ones(*lead, dtype=torch.bool)}))
    n_rows = (hw[0] // p) * (hw[1] // p)
    for lead in ((1,), ()):  # bare patch rows, no grid keyword (a linear patch embedding: Fuyu)
        out.append((f"patch rows {(*lead, n_rows, c * p * p)}", {"pixel_values": ramp((*lead, n_rows, c * p * p), dtype)}))
    return out
