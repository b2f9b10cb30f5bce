"""VLM families: which towers hf_ddpfix can drive with a dummy image, found by config and structure.

A :class:`VisionFamily` is data: the ``vision_config.model_type`` values it covers, where the tower
lives, which config attributes and child modules it must have. :func:`find_vision_adapter` matches a
model against the registry (:data:`VISION_FAMILIES`, extended with :func:`register_vision_family`) and
checks the structure, so a renamed or restructured tower is reported unsupported rather than driven
blindly. A :class:`VisionAdapter` knows how to build the smallest image the tower accepts, run it, and
where the tower's outputs enter the language model (the tie points for
:class:`~hf_ddpfix.integrations.stabilizer.VisionStabilizer`).

Supported families: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE. For other VLMs,
:func:`vision_param_names` / :func:`vision_groups` find vision parts by module name (planning and the
hang guard only) and :func:`describe_unsupported` says why there is no adapter.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._compat import unwrap_model

__all__ = [
    "VISION_FAMILIES",
    "VisionAdapter",
    "VisionFamily",
    "describe_unsupported",
    "find_vision_adapter",
    "get_submodule",
    "has_trainable_vision_params",
    "is_vision_language_model",
    "output_tensors",
    "register_vision_family",
    "vision_groups",
    "vision_param_names",
]

# Input names that make Qwen-style VLMs run their vision tower (modeling_qwen2_5_vl.py, 5.23:
# `if pixel_values is not None` / `if pixel_values_videos is not None`).
_VISUAL_INPUT_NAMES = ("pixel_values", "pixel_values_videos")

# Module names that hold vision parameters in VLMs we have no adapter for (planning / guard only).
_GENERIC_VISION_NAMES = frozenset(
    {
        "visual",
        "vision_tower",
        "vision_model",
        "vision_encoder",
        "image_encoder",
        "vision_embed_tokens",
        "multi_modal_projector",
        "mm_projector",
        "vision_projection",
        "visual_projection",
        "connector",
    }
)



# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VisionFamily:
    """How to find and drive the vision tower of one VLM family.

    Args:
        name: family name used in logs (e.g. ``"qwen2_5_vl"``).
        vision_model_types: ``config.vision_config.model_type`` values of this family.
        tower_paths: dotted attribute paths of the tower, relative to the HF model, tried in order.
        required_config: ``vision_config`` attributes the dummy input is built from.
        required_children: child modules the tower must have (a structural check: a renamed or
            restructured tower is reported unsupported rather than driven blindly).
        deepstack_layer_paths: where the decoder layers live when the tower also returns
            ``deepstack_features`` (Qwen3-VL adds feature ``i`` to the output of decoder layer ``i``).
    """

    name: str
    vision_model_types: tuple[str, ...]
    tower_paths: tuple[str, ...] = ("model.visual", "visual")
    required_config: tuple[str, ...] = (
        "patch_size",
        "temporal_patch_size",
        "spatial_merge_size",
        "in_channels",
    )
    required_children: tuple[str, ...] = ("patch_embed", "blocks", "merger")
    deepstack_layer_paths: tuple[str, ...] = ()


_QWEN3_LAYERS = ("model.language_model.layers", "language_model.layers")
VISION_FAMILIES: list[VisionFamily] = [
    VisionFamily("qwen2_vl", ("qwen2_vl_vision", "qwen2_vl")),
    VisionFamily("qwen2_5_vl", ("qwen2_5_vl_vision", "qwen2_5_vl")),
    VisionFamily("qwen3_vl", ("qwen3_vl_vision", "qwen3_vl"), deepstack_layer_paths=_QWEN3_LAYERS),
    VisionFamily(
        "qwen3_vl_moe", ("qwen3_vl_moe_vision", "qwen3_vl_moe"), deepstack_layer_paths=_QWEN3_LAYERS
    ),
]


def register_vision_family(family: VisionFamily) -> None:
    """Add (or replace, by ``name``) a family in :data:`VISION_FAMILIES`.

    Guarantees: a registered family is matched by :func:`find_vision_adapter` (test_vlm: registry test).
    """
    VISION_FAMILIES[:] = [f for f in VISION_FAMILIES if f.name != family.name] + [family]


def get_submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _vision_config(hf: nn.Module) -> Any | None:
    cfg = getattr(hf, "config", None)
    return getattr(cfg, "vision_config", None) if cfg is not None else None


def is_vision_language_model(model: nn.Module) -> bool:
    """True when the (unwrapped) model's config has a ``vision_config``."""
    return _vision_config(unwrap_model(model)) is not None


def _match_family(hf: nn.Module) -> tuple[VisionFamily | None, nn.Module | None, str, str]:
    """Return (family, tower, tower_name, reason); family is None with a reason when unsupported."""
    vc = _vision_config(hf)
    if vc is None:
        reason = f"{type(hf).__name__} is not a vision-language model (its config has no vision_config)"
        return None, None, "", reason
    mtype = str(getattr(vc, "model_type", ""))
    fam = next((f for f in VISION_FAMILIES if mtype in f.vision_model_types), None)
    if fam is None:
        names = ", ".join(f.name for f in VISION_FAMILIES)
        return (
            None,
            None,
            "",
            (
                f"{type(hf).__name__} (vision_config.model_type={mtype!r}) has no hf_ddpfix vision adapter "
                f"(supported families: {names})"
            ),
        )
    for path in fam.tower_paths:
        tower = get_submodule(hf, path)
        if tower is None:
            continue
        missing = [c for c in fam.required_children if not hasattr(tower, c)]
        missing += [f"vision_config.{a}" for a in fam.required_config if not hasattr(vc, a)]
        params = inspect.signature(tower.forward).parameters
        if "grid_thw" not in params:
            missing.append("forward(grid_thw=...)")
        if missing:
            return (
                None,
                None,
                "",
                (
                    f"{type(hf).__name__}: tower {path!r} of family {fam.name} lacks {missing}; "
                    "the installed transformers changed this model's structure"
                ),
            )
        return fam, tower, path, ""
    reason = f"{type(hf).__name__}: no vision tower at {list(fam.tower_paths)} (family {fam.name})"
    return None, None, "", reason


# ---------------------------------------------------------------------------------------------------
# Adapter
# ---------------------------------------------------------------------------------------------------


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


@dataclass
class VisionAdapter:
    """A located vision tower plus how to feed it a minimal dummy image.

    Attributes:
        family: the matched :class:`VisionFamily`.
        root: the HF model whose ``forward`` takes ``pixel_values`` (hooks go here).
        tower: the vision tower module (``root.model.visual`` for Qwen ``*ForConditionalGeneration``).
        tower_name: dotted name of ``tower`` inside ``root`` (e.g. ``"model.visual"``).
        vision_config: ``root.config.vision_config``.
    """

    family: VisionFamily
    root: nn.Module
    tower: nn.Module
    tower_name: str
    vision_config: Any
    _dummy_cache: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )
    _forward_params: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        self._forward_params = tuple(inspect.signature(self.root.forward).parameters)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Tower parameters with ``requires_grad`` (LoRA adapters, merger, full fine-tune)."""
        return [p for p in self.tower.parameters() if p.requires_grad]

    def _tower_dtype_device(self) -> tuple[torch.dtype, torch.device]:
        dtype = getattr(self.tower, "dtype", None)
        p = next(self.tower.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        if not isinstance(dtype, torch.dtype):
            dtype = p.dtype if p is not None else torch.float32
        return dtype, device

    def dummy_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest image the tower accepts: ``(pixel_values, grid_thw)``.

        ``grid_thw = [[1, m, m]]`` with ``m = spatial_merge_size`` (one merged token; Qwen2.5-VL's window
        attention pads it to one window). ``pixel_values`` has shape ``[m*m, C*tp*p*p]`` in the tower's
        dtype and device, filled with a fixed ramp in [-1, 1] (not zeros: a norm of an all-zero patch
        could divide by zero and turn the zero gradients into NaN).

        Guarantees: the tower runs on it for every registered family (test_vlm: adapter tests).
        """
        vc = self.vision_config
        dtype, device = self._tower_dtype_device()
        key = (dtype, device)
        if key not in self._dummy_cache:
            m = int(vc.spatial_merge_size)
            cols = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
            pv = torch.linspace(-1.0, 1.0, m * m * cols, device=device, dtype=torch.float32)
            pv = pv.reshape(m * m, cols).to(dtype)
            grid = torch.tensor([[1, m, m]], dtype=torch.long, device=device)
            self._dummy_cache[key] = (pv, grid)
        return self._dummy_cache[key]

    def run_tower(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        """Call the tower as the model does (``tower(pixel_values, grid_thw=grid_thw)``); returns its
        raw output (``BaseModelOutputWithPooling`` or, for Qwen3-VL, one with ``deepstack_features``)."""
        return self.tower(pixel_values, grid_thw=grid_thw)

    def run_dummy(self) -> Any:
        """Run the dummy image through the tower without disturbing the RNG stream (LoRA dropout in
        the tower draws from a forked generator, so later random draws match a stock run)."""
        pv, grid = self.dummy_inputs()
        devices = [pv.device.index] if pv.device.type != "cpu" and pv.device.index is not None else []
        dev_type = pv.device.type if pv.device.type != "cpu" else "cuda"
        with torch.random.fork_rng(devices=devices, device_type=dev_type):
            return self.run_tower(pv, grid)

    def tie_points(self, out: Any) -> list[tuple[nn.Module | None, list[torch.Tensor]]]:
        """Where each dummy output enters the language model on a real image batch.

        ``pooler_output`` (the merged image tokens) goes to the input-embedding module's output (real
        image features are scattered into ``inputs_embeds``); Qwen3-VL's deepstack feature ``i`` goes
        to decoder layer ``i``'s output. ``None`` means "tie to the loss" (no such module found). Tying
        where real features enter keeps the autograd graph's shape the same on image and text ranks, so
        FSDP2 issues its backward all-gathers / reduce-scatters in the same order everywhere.
        """
        pooled = out.get("pooler_output") if isinstance(out, dict) else None
        if not isinstance(pooled, torch.Tensor):
            return [(None, output_tensors(out))]
        get_emb = getattr(self.root, "get_input_embeddings", None)
        try:
            emb = get_emb() if callable(get_emb) else None
        except (AttributeError, NotImplementedError):
            emb = None
        ties: list[tuple[nn.Module | None, list[torch.Tensor]]] = [(emb, [pooled])]
        deep = out.get("deepstack_features") or []
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
        for name in _VISUAL_INPUT_NAMES:
            if kwargs.get(name) is not None:
                return True
            if name in self._forward_params:
                i = self._forward_params.index(name)
                if i < len(args) and args[i] is not None:
                    return True
        return False


def find_vision_adapter(model: nn.Module) -> VisionAdapter | None:
    """Adapter for a supported VLM, else ``None`` (see :func:`describe_unsupported` for the reason).

    Accepts the HF model, a ``peft.PeftModel`` around it, or a DDP/DataParallel/compiled wrapper.

    Guarantees: Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE) tiny models get an adapter whose dummy runs; a
    Llava model and a text-only model get ``None`` (test_vlm).
    """
    hf = unwrap_model(model)
    fam, tower, name, _ = _match_family(hf)
    if fam is None or tower is None:
        return None
    return VisionAdapter(fam, hf, tower, name, _vision_config(hf))


def describe_unsupported(model: nn.Module) -> str:
    """One-line reason why ``model`` has no vision adapter, or ``""`` when it has one."""
    hf = unwrap_model(model)
    fam, _, _, reason = _match_family(hf)
    if fam is not None:
        return ""
    if _vision_config(hf) is None:
        return reason
    n = sum(p.numel() for _, p in _generic_vision_params(hf) if p.requires_grad)
    return f"{reason}; the dummy-image stabiliser is off for it" + (
        f" and its {n} trainable vision parameters need ddp_find_unused_parameters=True" if n else ""
    )


def _generic_vision_modules(hf: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost submodules whose name marks them as vision parts (for models without an adapter)."""
    out: list[tuple[str, nn.Module]] = []
    for name, mod in hf.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix, _ in out):
            continue
        if name.rsplit(".", 1)[-1] in _GENERIC_VISION_NAMES:
            out.append((name, mod))
    return out


def vision_groups(hf: nn.Module) -> list[tuple[str, nn.Module]]:
    fam, tower, name, _ = _match_family(hf)
    if fam is not None and tower is not None:
        return [(name, tower)]
    if _vision_config(hf) is None:
        return []
    return _generic_vision_modules(hf)


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
