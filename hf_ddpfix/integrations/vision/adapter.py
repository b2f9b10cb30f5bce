"""A located vision tower and how to drive it with the smallest dummy image it accepts.

:class:`VisionAdapter` is built by :func:`hf_ddpfix.integrations.vision.families.find_vision_adapter` once a
model matched a :class:`~hf_ddpfix.integrations.vision.family.VisionFamily` and passed its structural check.
Two kinds of tower are driven:

- ``"grid"`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE)): ``tower(pixel_values, grid_thw=...)`` on flattened
  patches. The dummy is one merged token (``spatial_merge_size**2`` patches): negligible next to a step.
- ``"image"`` (LLaVA, Gemma 3): ``root.get_image_features(pixel_values=...)`` on a ``[1, C, H, W]`` image —
  the tower *and* the projector, as on an image rank (LoRA on the projector gets its zero gradient too).
  These towers take exactly ``vision_config.image_size`` (CLIP / SigLIP position embeddings are fixed
  unless ``interpolate_pos_encoding``, which reads the position table outside its module's forward, so
  ZeRO-3 would not gather it; Gemma 3's projector pools a fixed patch grid), so the dummy is one image at
  the native size, batch 1. Cost per text-only micro-batch: one image through tower and projector,
  forward plus a backward that carries zeros (about 3x the forward): the cost of one real image, e.g.
  about 1 TFLOP for LLaVA-1.5's CLIP ViT-L/14-336 (577 tokens, 0.3B parameters) and about 15 TFLOP for
  Gemma 3's SigLIP-So400m at 896 px (4096 tokens, 0.4B parameters) — estimates from parameter and token
  counts, not measured on a GPU here.

- ``"layout"`` (discovered, ZeRO view): ``root.get_image_features(**keywords)`` with the sample builder's first
  layout that runs (:meth:`VisionAdapter.layout_inputs`).

The dummy is a fixed ramp in [-1, 1] (not zeros: a norm of an all-zero patch could divide by zero and
turn the zero gradients into NaN), built once per (dtype, device) and run under a forked RNG.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..._compat import image_features, output_field, zero3_gathered, zero3_partitioned
from .family import VisionFamily
from .parts import get_submodule
from .proof import eval_mode, prove_zero

__all__ = ["EXTRA_INPUT_BUILDERS", "GRID_INPUT_NAMES", "VISUAL_INPUT_NAMES", "VisionAdapter", "anyres_tiles", "get_submodule",
           "BUILT_INPUTS", "grid_geometry", "image_size_hw", "materialized", "output_tensors"]

# Input names that make a VLM run its vision tower (modeling_qwen2_5_vl.py / modeling_llava.py /
# modeling_gemma3.py, 5.23: `if pixel_values is not None` / `if pixel_values_videos is not None`).
VISUAL_INPUT_NAMES = ("pixel_values", "pixel_values_videos")


#: A discovered family's verdict per model: ``root -> (family name/kind, layout, error, unreached)``; ``layout`` is
#: ``(pixel ndim, tiles)`` ("image" kind) or ``(grid layout,)`` ("grid" kind); ``error`` is ``""`` when the trial and
#: the zero proof passed, else why not; ``unreached`` as :attr:`VisionAdapter.unreached`, then the names of
#: :attr:`VisionAdapter.reached` (kept either way: one trial per model; no reference to a model in the values).
_VERDICTS: weakref.WeakKeyDictionary[nn.Module, tuple[str, tuple[Any, ...], str, tuple[str, ...], tuple[str, ...]]] = (
    weakref.WeakKeyDictionary())

#: ``get_image_features`` / tower keywords that take a Qwen-style ``(t, h, w)`` grid per image (in patches).
GRID_INPUT_NAMES = ("image_grid_thw", "grid_thw")
#: The grid dummy's pixel layouts tried in order by :meth:`VisionAdapter.verify` (a discovered grid family):
#: ``flat`` ``[patches, C * tp * p * p]`` (Qwen2-VL, GLM-4V), ``patch5`` ``[patches, C, tp, p, p]``, ``patch4``
#: ``[patches, C, p, p]`` (towers without a temporal patch).
GRID_LAYOUTS = ("flat", "patch5", "patch4")


def image_size_hw(vision_config: Any) -> tuple[int, int] | None:
    """``vision_config.image_size`` as ``(height, width)`` (an int or a pair of ints), else ``None``."""
    size = getattr(vision_config, "image_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size):
        return int(size[0]), int(size[1])
    return None


def _first_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and v > 0 for v in value):
        return int(value[0])
    return None


def anyres_tiles(cfg: Any, hw: tuple[int, int]) -> int | None:
    """Tiles an "anyres" model (a config with ``image_grid_pinpoints``: LLaVA-NeXT, -OneVision, Granite Vision)
    cuts an image of its tower's native size ``hw`` into: the base tile plus the tiles of the pinpoint its
    processor picks (transformers' own ``select_best_resolution``); ``None`` without pinpoints."""
    points = getattr(cfg, "image_grid_pinpoints", None)
    if not (isinstance(points, list | tuple) and points and all(isinstance(x, list | tuple) for x in points)):
        return None
    try:
        from transformers.image_processing_utils import select_best_resolution
    except ImportError:  # pragma: no cover - every supported release has it
        return None
    h, w = select_best_resolution(tuple(hw), [list(x) for x in points])
    return (h // hw[0]) * (w // hw[1]) + 1


def grid_geometry(vision_config: Any) -> tuple[int, int, int, int] | None:
    """``(merge, channels, temporal patch, patch)`` of a Qwen-style grid tower, read from its ``vision_config``:
    ``spatial_merge_size`` (or ``merge_size``; 1 when absent), ``in_channels`` (or ``num_channels``; 3 when
    absent), ``temporal_patch_size`` (1 when absent or ``None``) and ``patch_size`` (required: ``None`` without it).
    An int or a list of equal ints each (the first is used)."""
    patch = _first_int(getattr(vision_config, "patch_size", None))
    if patch is None:
        return None
    merge = _first_int(getattr(vision_config, "spatial_merge_size", None) or getattr(vision_config, "merge_size", None))
    chans = _first_int(getattr(vision_config, "in_channels", None) or getattr(vision_config, "num_channels", None))
    tp = _first_int(getattr(vision_config, "temporal_patch_size", None))
    return merge or 1, chans or 3, tp or 1, patch


def materialized(params: list[torch.Tensor]) -> bool:
    """True when every tensor holds its values here: none on the meta device (``hf-ddpfix plan``'s model), none
    ZeRO-3 partitioned (empty until gathered), none an FSDP2 shard (a ``DTensor``: running it all-gathers)."""
    def sharded(p: torch.Tensor) -> bool:
        return any(cls.__name__ == "DTensor" for cls in type(p).__mro__)

    return not any(p.device.type == "meta" or zero3_partitioned(p) or sharded(p) for p in params)


def output_tensors(out: Any) -> list[torch.Tensor]:
    """Every floating tensor inside a model output (ModelOutput / tuple / list / dict / tensor)."""
    found: list[torch.Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                found.append(x)
        elif isinstance(x, dict):  # transformers.ModelOutput is an OrderedDict
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(out)
    return found


def _image_sizes(hw: tuple[int, int], device: torch.device) -> torch.Tensor:
    return torch.tensor([list(hw)], dtype=torch.long, device=device)


#: ``get_image_features`` keyword inputs a dummy can be given, built from ``(height, width)`` of the
#: dummy image (Pixtral / LLaVA-NeXT style ``image_sizes``). A required input not listed here makes a
#: family undiscoverable (reported, stock behaviour).
EXTRA_INPUT_BUILDERS = {"image_sizes": _image_sizes}
#: keyword inputs a discovered family's ``get_image_features`` may require, besides ``EXTRA_INPUT_BUILDERS``: the
#: grid of a grid-kind dummy (built by :meth:`VisionAdapter.dummy_inputs`)
BUILT_INPUTS = (*EXTRA_INPUT_BUILDERS, *GRID_INPUT_NAMES)


def _ramp(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.linspace(-1.0, 1.0, n, device=device, dtype=torch.float32).reshape(shape).to(dtype)


@dataclass
class VisionAdapter:
    """A located vision tower plus how to feed it a minimal dummy image.

    Attributes:
        family: the matched :class:`~hf_ddpfix.integrations.vision.family.VisionFamily`.
        root: the HF model whose ``forward`` takes ``pixel_values`` (hooks go here).
        tower: the vision tower module (``root.model.visual`` for Qwen, ``root.model.vision_tower`` for
            LLaVA / Gemma 3).
        tower_name: dotted name of ``tower`` inside ``root`` (e.g. ``"model.visual"``).
        vision_config: ``root.config.vision_config``.
        projector: the module ``get_image_features`` runs after the tower (``"image"`` kind), else ``None``.
        projector_name: its dotted name inside ``root`` (``""`` when none).
    """

    family: VisionFamily
    root: nn.Module
    tower: nn.Module
    tower_name: str
    vision_config: Any
    projector: nn.Module | None = None
    projector_name: str = ""
    _dummy_cache: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)
    _forward_params: tuple[str, ...] = field(default=(), repr=False)
    pixel_ndim: int = 4  # "image" kind: 4 ([1, C, H, W]) or 5 ([1, 1, C, H, W]: Idefics3 / SmolVLM); see verify
    pixel_tiles: int = 1  # 5-D only: images per sample (2: an any-resolution base image + one tile, LLaVA-OneVision)
    grid_layout: str = "flat"  # "grid" kind: the dummy's pixel layout (GRID_LAYOUTS; fixed by verify when discovered)
    #: ``"layout"`` kind: ``() -> [(name, get_image_features keywords)]``, the sample builder's layouts for this model
    #: (:func:`~hf_ddpfix.integrations.vision.layouts.candidates`), and the name of the one verify kept
    layout_trials: Any = field(default=None, repr=False)
    pixel_layout: str = ""
    verified: bool = False
    unreached: tuple[str, ...] = ()  # trainable parameters of parts() the dummy's features do not reach (verify)
    reached: list[tuple[str, nn.Module]] = field(default_factory=list, repr=False)  # modules beyond tower and
    # projector whose trainable parameters the dummy reaches (verify: a projector under another name); in parts()

    def __post_init__(self) -> None:
        self._forward_params = tuple(inspect.signature(self.root.forward).parameters)

    @property
    def kind(self) -> str:
        """``"grid"`` (Qwen towers), ``"image"`` (``get_image_features`` on a square image) or ``"layout"`` (the
        keywords of the sample builder's first layout that runs, through ``get_image_features``)."""
        return self.family.kind

    def parts(self) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of what the dummy runs: the tower, then the projector if any."""
        out = [(self.tower_name, self.tower)]
        if self.projector is not None:
            out.append((self.projector_name, self.projector))
        return out + self.reached

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Tower (and projector) parameters with ``requires_grad`` (LoRA adapters, merger, full fine-tune)."""
        return [p for _, m in self.parts() for p in m.parameters() if p.requires_grad]

    def _tower_dtype_device(self) -> tuple[torch.dtype, torch.device]:
        dtype = getattr(self.tower, "dtype", None)
        p = next(self.tower.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        if not isinstance(dtype, torch.dtype):
            dtype = p.dtype if p is not None else torch.float32
        return dtype, device

    def dummy_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The smallest image the tower accepts: ``(pixel_values, grid_thw or None)``.

        ``"grid"``: ``grid_thw = [[1, m, m]]`` with ``m = spatial_merge_size`` (one merged token;
        Qwen2.5-VL's window attention pads it to one window) and ``pixel_values`` of shape
        ``[m*m, C*tp*p*p]`` (a discovered family: the layout its trial run fixed, ``GRID_LAYOUTS``). ``"image"``: ``pixel_values`` of shape ``[1, num_channels, H, W]`` with
        ``(H, W)`` = ``vision_config.image_size``, no grid. Tower dtype and device, a fixed ramp in [-1, 1].

        Guarantees: the tower runs on it for every registered family (test_vlm: adapter tests).
        """
        vc = self.vision_config
        dtype, device = self._tower_dtype_device()
        key = (dtype, device)
        if key not in self._dummy_cache:
            if self.kind == "image":
                hw = image_size_hw(vc)
                assert hw is not None  # checked by the family's structural check
                lead = (1,) + ((self.pixel_tiles,) if self.pixel_ndim == 5 else ())
                pv = _ramp((*lead, int(vc.num_channels), *hw), dtype, device)
                self._dummy_cache[key] = (pv, None)
            else:
                geometry = grid_geometry(vc)
                assert geometry is not None  # checked by the family's structural check
                m, chans, tp, patch = geometry
                shape = {"flat": (m * m, chans * tp * patch * patch), "patch5": (m * m, chans, tp, patch, patch),
                         "patch4": (m * m, chans, patch, patch)}[self.grid_layout]
                grid = torch.tensor([[1, m, m]], dtype=torch.long, device=device)
                self._dummy_cache[key] = (_ramp(shape, dtype, device), grid)
        return self._dummy_cache[key]

    def layout_inputs(self) -> dict[str, Any]:
        """``"layout"`` kind: the keywords of the layout :meth:`verify` kept (NaFlex rows + ``spatial_shapes``, patch
        rows + positions, pooled crops, ...: a few patches each, :mod:`.layouts`), floats in the tower's dtype, all on
        its device."""
        dtype, device = self._tower_dtype_device()
        key = ("layout", self.pixel_layout, dtype, device)
        if key not in self._dummy_cache:
            kw = dict(self.layout_trials())[self.pixel_layout]
            self._dummy_cache[key] = {k: v.to(device, dtype if v.is_floating_point() else v.dtype)
                                      if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        return self._dummy_cache[key]

    def run_tower(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None) -> Any:
        """Run the vision path as the model does; returns its raw output.

        ``"grid"``: ``tower(pixel_values, grid_thw=grid_thw)`` (``BaseModelOutputWithPooling`` or, for
        Qwen3-VL, one with ``deepstack_features``); a grid family found by structure: ``root.get_image_features(
        pixel_values=..., image_grid_thw=..., return_dict=True)``. ``"image"``: ``root.get_image_features(
        pixel_values=..., return_dict=True)`` — tower and projector; ``pooler_output`` holds the projected
        image features (a tensor, or one tensor per image for LLaVA).
        """
        if self.kind == "image":
            hw = (int(pixel_values.shape[-2]), int(pixel_values.shape[-1]))
            extra = {n: EXTRA_INPUT_BUILDERS[n](hw, pixel_values.device) for n in self.family.extra_inputs}
            return self.root.get_image_features(pixel_values=pixel_values, return_dict=True, **extra)
        if self.family.discovered:  # found by structure: where the model runs its tower (get_image_features)
            grids = {n: grid_thw for n in self.family.extra_inputs if n in GRID_INPUT_NAMES}
            return self.root.get_image_features(pixel_values=pixel_values, return_dict=True, **grids)
        return self.tower(pixel_values, grid_thw=grid_thw)

    def verify(self) -> None:
        """Run-time check of a discovered family's dummy, before training (no-op for hand-written ones).

        1. **The layout**: runs the dummy once under ``no_grad``: ``"image"`` kind as ``[1, C, H, W]``, else
           ``[1, 1, C, H, W]`` (Idefics3 / SmolVLM take a list of images per sample), else ``[1, 2, C, H, W]``
           (LLaVA-OneVision's any-resolution base image and one tile for ``image_sizes`` = the tower's size), else
           ``[1, 1 + k, C, H, W]`` (LLaVA-NeXT: the base tile and the ``k`` tiles its ``image_grid_pinpoints`` give an
           image of the tower's size, :func:`anyres_tiles`);
           ``"grid"`` kind (found by structure: ``get_image_features(pixel_values, image_grid_thw)``, GLM-4V) in the
           layouts of :data:`GRID_LAYOUTS`; then, with :attr:`layout_trials` (the ``"layout"`` kind; a grid family in
           the ZeRO view, which becomes that kind), the sample builder's; keeps the first whose ``pooler_output`` gives
           image features to tie where real ones enter.
        2. **The zero proof** (where the parameters are materialized: not on the meta device, not ZeRO-3
           partitioned): runs the dummy with grad, ties its features into a probe with
           :class:`~hf_ddpfix.ops.zero_tie.ZeroTie` exactly as the stabilisers do, and back-propagates: the probe is
           a bitwise copy and every trainable tower / projector gradient is exactly zero (no NaN from a norm of the
           ramp); :attr:`unreached` lists the trainable parameters the features do not reach (a pooling head whose
           output the model drops: the DDP stabiliser's "every vision parameter is used" does not hold then). The
           gradients go to ``torch.autograd.grad``, never into ``.grad``; the parts run in eval mode (no batch-norm
           statistic moves) under a forked RNG.

        A model built partitioned (``from_pretrained`` under a ZeRO-3 config: ``zero.Init``) has empty tower weights
        on every rank, so step 1 runs with the tower's and projector's parameters gathered
        (:func:`hf_ddpfix._compat.zero3_gathered`: one all-gather per parameter, read-only, released after the
        trial): every rank must call ``verify`` together, as
        :class:`~hf_ddpfix.integrations.vision.zero.ZeroVisionStabilizer` does at attach time (before the ZeRO engine
        exists, so no ZeRO hook runs). Every rank runs the same trial on the same weights, so all reach the same
        verdict. The verdict is kept per model (a later call for the same model reuses it without a trial or a
        collective).

        Raises:
            ValueError: no layout runs, or the zero proof fails; the message says why, and the caller keeps stock
                behaviour.
        """
        if not self.family.discovered or self.verified:
            return
        key = f"{self.family.name}/{self.kind}{'+layouts' if self.layout_trials is not None else ''}"
        known = _VERDICTS.get(self.root)
        if known is not None and known[0] == key:
            self._set_layout(known[1])
            self.unreached, self.reached = known[3], [(n, m) for n in known[4] if (m := get_submodule(self.root, n))]
            if known[2]:
                raise ValueError(known[2])
            self.verified = True
            return
        params = [p for _, m in self.parts() for p in m.parameters()]
        if any(p.numel() == 0 and not zero3_partitioned(p) for p in params):
            raise ValueError(f"{self.family.name}: the vision tower has empty parameters that are not ZeRO-3 "
                             "partitioned: a dummy image cannot be checked before training")
        if any(p.device.type == "meta" for p in params):
            raise ValueError(f"{self.family.name}: the model is on the meta device: the dummy is checked in the run")
        errors: list[str] = []
        layout = self._trial(params, errors)
        if layout is None:
            self._dummy_cache.clear()
            self._set_layout((4, 1) if self.kind == "image" else ("flat",))
            why = f"{self.family.name}: no dummy built from vision_config runs through the tower ({'; '.join(errors)})"
            _VERDICTS[self.root] = (key, (), why, (), ())
            raise ValueError(why)
        why = self._prove_zero() if materialized(params) else ""
        _VERDICTS[self.root] = (key, layout, why, self.unreached, tuple(n for n, _ in self.reached))
        if why:
            raise ValueError(why)
        self.verified = True

    def _set_layout(self, layout: tuple[Any, ...]) -> None:
        if layout[:1] == ("layout",):  # a sample-builder layout: a grid family's too, in the ZeRO view (layout_trials)
            if self.kind != "layout":
                self.family = replace(self.family, kind="layout", zero_only=True, extra_inputs=())
            self.pixel_layout = layout[1]
        elif self.kind == "image" and len(layout) == 2:
            self.pixel_ndim, self.pixel_tiles = layout
        elif self.kind == "grid" and len(layout) == 1:
            self.grid_layout = layout[0]
        self._dummy_cache.clear()

    def _trial(self, params: list[nn.Parameter], errors: list[str]) -> tuple[Any, ...] | None:
        """The first layout whose no-grad dummy gives image features (see :meth:`verify`), else ``None``."""
        layouts: tuple[tuple[Any, ...], ...] = ((4, 1), (5, 1), (5, 2)) if self.kind == "image" else tuple(
            (g,) for g in GRID_LAYOUTS) if self.kind == "grid" else ()
        hw = image_size_hw(self.vision_config)
        tiles = anyres_tiles(getattr(self.root, "config", None), hw) if self.kind == "image" and hw else None
        if tiles is not None and tiles > 2:  # LLaVA-NeXT: the base tile + the tiles its pinpoints give a native image
            layouts = (*layouts, (5, tiles))
        if self.layout_trials is not None:  # then the sample builder's layouts (the "layout" kind's only ones)
            layouts += tuple(("layout", n) for n, _ in self.layout_trials())
        with zero3_gathered(params), eval_mode([m for _, m in self.parts()]):
            for layout in layouts:
                self._set_layout(layout)
                name = layout[1] if layout[0] == "layout" else "x".join(str(x) for x in layout)
                try:
                    with torch.no_grad():
                        out = self.run_dummy()
                except Exception as err:  # noqa: BLE001 - a trial: any failure means "not this layout"
                    errors.append(f"{name}: {type(err).__name__}: {str(err)[:120]}")
                    continue
                pooled = image_features(out)
                tensors = output_tensors(pooled) if pooled is not None else []
                if tensors and all(t.numel() > 0 for t in tensors):
                    return layout
                errors.append(f"{name}: get_image_features returned no pooler_output features")
        return None

    def _prove_zero(self) -> str:
        """The zero proof of :meth:`verify` (:func:`~hf_ddpfix.integrations.vision.proof.prove_zero`)."""
        return prove_zero(self)

    def run_dummy(self) -> Any:
        """Run the dummy image without disturbing the RNG stream (LoRA dropout in the tower draws from a
        forked generator, so later random draws match a stock run)."""
        _, device = self._tower_dtype_device()
        devices = [device.index] if device.type != "cpu" and device.index is not None else []
        with torch.random.fork_rng(devices=devices, device_type=device.type if device.type != "cpu" else "cuda"):
            if self.kind == "layout":
                return self.root.get_image_features(**self.layout_inputs(), return_dict=True)
            return self.run_tower(*self.dummy_inputs())

    def tie_points(self, out: Any) -> list[tuple[nn.Module | None, list[torch.Tensor]]]:
        """Where each dummy output enters the language model on a real image batch.

        ``pooler_output`` (the merged / projected image tokens; a tensor or a list of tensors) goes to
        the input-embedding module's output (real image features are scattered into ``inputs_embeds``);
        Qwen3-VL's deepstack feature ``i`` goes to decoder layer ``i``'s output. ``None`` means "tie to
        the loss" (no such module found). Only what reaches the language model is tied: a tower output
        the model drops (SigLIP's pooling head in Gemma 3, unused hidden states) gets no gradient here,
        as on an image rank. Tying where real features enter keeps the autograd graph's shape the same
        on image and text ranks, so FSDP2 / ZeRO issue their backward collectives in the same order.
        """
        pooled = image_features(out) if self.kind == "image" or self.family.discovered else output_field(
            out, "pooler_output")
        if isinstance(pooled, torch.Tensor):
            pooled_list = [pooled]
        elif isinstance(pooled, (list, tuple)) and pooled and all(isinstance(t, torch.Tensor) for t in pooled):
            pooled_list = list(pooled)
        else:
            return [(None, output_tensors(out))]
        get_emb = getattr(self.root, "get_input_embeddings", None)
        try:
            emb = get_emb() if callable(get_emb) else None
        except (AttributeError, NotImplementedError):
            emb = None
        ties: list[tuple[nn.Module | None, list[torch.Tensor]]] = [(emb, pooled_list)]
        deep = output_field(out, "deepstack_features") or []
        layers: nn.Module | None = None
        for path in self.family.deepstack_layer_paths:
            layers = get_submodule(self.root, path)
            if layers is not None:
                break
        for i, feat in enumerate(output_tensors(deep)):
            layer = layers[i] if isinstance(layers, nn.ModuleList) and i < len(layers) else None
            ties.append((layer, [feat]))
        return ties

    def has_visual_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """True when a call ``root(*args, **kwargs)`` passes ``pixel_values`` or ``pixel_values_videos``."""
        for name in VISUAL_INPUT_NAMES:
            if kwargs.get(name) is not None:
                return True
            if name in self._forward_params:
                i = self._forward_params.index(name)
                if i < len(args) and args[i] is not None:
                    return True
        return False
