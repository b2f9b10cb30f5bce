"""Vision-language models under DDP / FSDP2: every rank uses every vision parameter every step.

Problem (REFERENCES.md §1, §2): with LoRA (or full fine-tuning) on the vision tower, a micro-batch
without images leaves the tower's parameters unused. Stock DDP with ``find_unused_parameters=False``
then hangs (ranks differ) or fails with "Expected to have finished reduction" (no rank saw an image);
``static_graph`` fails when the image/text mix changes; under FSDP a rank that skips the tower skips
its all-gathers and the job hangs (transformers #37186).

Fix, in three parts:

1. :class:`VisionStabilizer` — a forward pre/post hook pair on the HF model (the module whose
   ``forward`` takes ``pixel_values``; it runs inside DDP's forward). In training mode with grad
   enabled, a batch without visual input runs a minimal dummy image through the tower *before* the
   language model and ties its outputs where real image features enter the language model (the input
   embeddings; Qwen3-VL's deepstack features: decoder layer ``i``) through an identity whose backward
   sends exact zeros to the tower. The loss and every language-model gradient are bit-identical, vision
   grads are exact zeros, and the autograd graph has the same shape on image and text ranks, so FSDP2
   issues its all-gathers / reduce-scatters in the same order everywhere (tying to the loss instead
   hangs FSDP2: a text rank's ``inputs_embeds`` then needs no grad, which moves the first decoder
   layer's reduce-scatter; measured). Fallback (``inputs_embeds`` passed in, reentrant checkpointing):
   tie to ``outputs.loss``, else ``logits``; fine for DDP.
2. :meth:`VisionStabilizer.finalize_vision_grads` — a zero gradient is not "no gradient" (AdamW with
   weight decay moves a parameter whose grad is zero). Once per optimizer step, before gradient
   clipping, one all-reduce(MAX) asks "did any rank see visual input in any micro-batch of this
   step?"; if not, every trainable vision ``.grad`` is set to ``None`` — exactly what stock DDP with
   ``find_unused_parameters=True`` leaves (measured on torch 2.13: a parameter unused on all ranks keeps
   ``grad=None``; one used on some rank, or in any ``no_sync`` micro-batch, gets the average with zeros).
3. :class:`HangGuard` — when the stabiliser is off and DDP runs with ``find_unused_parameters=False``:
   one tiny all-gather per forward detects ranks disagreeing on whether the tower ran (or no rank
   running it) and raises :class:`UnusedParametersError` on every rank instead of hanging.

Trainer wiring (transformers 5.23, ``Trainer._inner_training_loop``): attach the stabiliser to the model
before ``Trainer.train`` (before or after wrapping). Call ``finalize_vision_grads()`` on every rank after
the last backward of an optimizer step and **before** ``Trainer._clip_grad_norm`` /
``Trainer._get_grad_norm`` (clip_grad_norm_'s total norm sees zero grads vs ``None`` grads differently
in the last bit: measured, 57 of 200 random cases), e.g. by wrapping both methods.
``TrainerCallback.on_pre_optimizer_step`` exists but fires *after* clipping, so use it only as a
backstop: a second call in the same step is a no-op (no forward ran since the previous call).

Supported families (registry keyed by ``vision_config.model_type`` and checked against the tower's
structure): Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE. Other VLMs: :func:`find_vision_adapter`
returns ``None`` and :func:`describe_unsupported` says why.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "UnusedParametersError",
    "VisionFamily",
    "VisionAdapter",
    "VISION_FAMILIES",
    "register_vision_family",
    "unwrap_model",
    "find_vision_adapter",
    "describe_unsupported",
    "is_vision_language_model",
    "vision_param_names",
    "has_trainable_vision_params",
    "VisionStabilizer",
    "HangGuard",
    "check_used_groups",
    "fsdp_wrap_plan",
]

STABILIZER_ENV = "HF_DDPFIX_VLM_STABILIZER"

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


class UnusedParametersError(RuntimeError):
    """Raised on every rank when DDP(find_unused_parameters=False) would hang or crash on unused params."""


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


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / DataParallel / ``torch.compile`` / PEFT wrappers and return the HF model.

    Guarantees: ``unwrap_model(DataParallel(get_peft_model(m, cfg))) is m`` (test_vlm).
    """
    seen: set[int] = set()
    cur = model
    while id(cur) not in seen:
        seen.add(id(cur))
        inner = getattr(cur, "_orig_mod", None)  # torch.compile
        if isinstance(inner, nn.Module):
            cur = inner
            continue
        inner = getattr(cur, "module", None)  # DDP, DataParallel, FSDP1, accelerate wrappers
        if isinstance(inner, nn.Module):
            cur = inner
            continue
        get_base = getattr(cur, "get_base_model", None)  # peft.PeftModel
        if callable(get_base):
            inner = get_base()
            if isinstance(inner, nn.Module) and inner is not cur:
                cur = inner
                continue
        break
    return cur


def _get_submodule(root: nn.Module, path: str) -> nn.Module | None:
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
        tower = _get_submodule(hf, path)
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


def _output_tensors(out: Any) -> list[torch.Tensor]:
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
            return [(None, _output_tensors(out))]
        get_emb = getattr(self.root, "get_input_embeddings", None)
        try:
            emb = get_emb() if callable(get_emb) else None
        except (AttributeError, NotImplementedError):
            emb = None
        ties: list[tuple[nn.Module | None, list[torch.Tensor]]] = [(emb, [pooled])]
        deep = out.get("deepstack_features") or []
        layers: nn.Module | None = None
        for path in self.family.deepstack_layer_paths:
            layers = _get_submodule(self.root, path)
            if layers is not None:
                break
        for i, feat in enumerate(_output_tensors(deep)):
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


def _vision_groups(hf: nn.Module) -> list[tuple[str, nn.Module]]:
    fam, tower, name, _ = _match_family(hf)
    if fam is not None and tower is not None:
        return [(name, tower)]
    if _vision_config(hf) is None:
        return []
    return _generic_vision_modules(hf)


def _generic_vision_params(hf: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(f"{g}.{n}", p) for g, mod in _vision_groups(hf) for n, p in mod.named_parameters()]


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


# ---------------------------------------------------------------------------------------------------
# Stabiliser
# ---------------------------------------------------------------------------------------------------


class _ZeroTie(torch.autograd.Function):
    """Identity on ``x``; the extra inputs get exact-zero gradients (so autograd, DDP and FSDP see
    them used). The forward value is a bitwise copy of ``x`` whatever the dtype or autocast state,
    and no ``0 * inf`` can turn the loss into NaN."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *extras: torch.Tensor) -> torch.Tensor:
        ctx.extra_meta = [(e.shape, e.dtype, e.device) for e in extras]
        return x.clone()  # a clone, not a view: Trainer scales the loss in place (`loss *= ...`)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        zeros = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.extra_meta]
        return (grad, *zeros)


def _tie(output: Any, extras: list[torch.Tensor]) -> Any:
    """Attach ``extras`` to ``output.loss`` (else ``logits``, else the first tensor) via :class:`_ZeroTie`."""
    extras = [e for e in extras if e.requires_grad]
    if not extras:
        return output
    if isinstance(output, dict):  # ModelOutput: setting a key updates the attribute too
        for key in ("loss", "logits", "last_hidden_state"):
            val = output.get(key)
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                output[key] = _ZeroTie.apply(val, *extras)
                return output
        for key, val in output.items():
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                output[key] = _ZeroTie.apply(val, *extras)
                return output
    elif isinstance(output, torch.Tensor) and output.is_floating_point():
        return _ZeroTie.apply(output, *extras)
    elif isinstance(output, tuple):
        for i, val in enumerate(output):
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                return output[:i] + (_ZeroTie.apply(val, *extras),) + output[i + 1 :]
    raise TypeError(f"hf_ddpfix: cannot attach the dummy vision output to a {type(output).__name__}")


def _is_fsdp_managed(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - very old torch
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def _dist_ready(group: Any = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _collective_device(group: Any = None) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class VisionStabilizer:
    """Makes every training forward use every vision parameter, with stock optimizer semantics.

    Usage (plain PyTorch; the Trainer wiring is in the module docstring)::

        stab = VisionStabilizer(model).attach()      # before or after DDP/FSDP wrapping
        for step in ...:
            for micro_batch in ...:                  # forward + backward (no_sync for all but last)
                model(**micro_batch).loss.backward()
            stab.finalize_vision_grads()             # before clipping and optimizer.step()
            clip_grad_norm_(...); optimizer.step(); optimizer.zero_grad()

    Args:
        model: HF VLM, PeftModel, or a wrapper (hooks go on the unwrapped HF model).
        adapter: the tower adapter; found with :func:`find_vision_adapter` when ``None``.
        run_when_frozen: run the dummy even when no tower parameter is trainable. ``None`` (default)
            means "only when the tower is FSDP-sharded" (FSDP all-gathers a frozen tower too).

    Raises:
        ValueError: the model has no adapter (message from :func:`describe_unsupported`).

    Guarantees: text-only batches give a bit-identical loss and LM gradients and exact-zero vision
    gradients; batches with images are untouched; after ``finalize_vision_grads`` the weights after
    AdamW are bit-identical to stock DDP(find_unused_parameters=True) (test_vlm, scripts/vlm_ddp.py).
    """

    def __init__(
        self, model: nn.Module, adapter: VisionAdapter | None = None, *, run_when_frozen: bool | None = None
    ) -> None:
        adapter = adapter or find_vision_adapter(model)
        if adapter is None:
            raise ValueError(f"hf_ddpfix: no vision stabiliser for this model: {describe_unsupported(model)}")
        self.adapter = adapter
        self.run_when_frozen = run_when_frozen
        self._handles: list[Any] = []
        self._in_forward = False
        self._in_dummy = False
        self._tower_ran = False
        self._dummy_ran = False
        self._pending: list[tuple[nn.Module | None, list[torch.Tensor]]] = []
        self._step_images = False
        self._step_micro_batches = 0
        self.dummy_runs = 0  # number of dummy tower forwards so far (for logs and tests)

    # -- hooks --------------------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        """True while the hooks are registered."""
        return bool(self._handles)

    def attach(self) -> VisionStabilizer:
        """Register the hooks (idempotent). Returns ``self``."""
        if not self._handles:
            root, tower = self.adapter.root, self.adapter.tower
            self._handles = [
                root.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
                root.register_forward_hook(self._post_hook, with_kwargs=True),
                tower.register_forward_pre_hook(self._tower_hook),
            ]
            self._handles += [m.register_forward_hook(self._tie_hook) for m in self._tie_modules()]
        return self

    def _tie_modules(self) -> list[nn.Module]:
        """Modules whose outputs can receive dummy features: the input embedding, deepstack layers."""
        mods: list[nn.Module] = []
        get_emb = getattr(self.adapter.root, "get_input_embeddings", None)
        try:
            emb = get_emb() if callable(get_emb) else None
        except (AttributeError, NotImplementedError):
            emb = None
        if isinstance(emb, nn.Module):
            mods.append(emb)
        n_deep = len(getattr(self.adapter.vision_config, "deepstack_visual_indexes", None) or [])
        for path in self.adapter.family.deepstack_layer_paths:
            layers = _get_submodule(self.adapter.root, path)
            if isinstance(layers, nn.ModuleList):
                mods += list(layers)[:n_deep]
                break
        return mods

    def remove(self) -> None:
        """Remove the hooks and forget per-step state (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._in_forward = False
        self._pending = []
        self.reset_step()

    def _needs_dummy(self) -> bool:
        if any(p.requires_grad for p in self.adapter.tower.parameters()):
            return True
        if self.run_when_frozen is None:
            return _is_fsdp_managed(self.adapter.tower)
        return self.run_when_frozen

    def _run_dummy(self) -> list[tuple[nn.Module | None, list[torch.Tensor]]]:
        self._in_dummy = True
        try:
            out = self.adapter.run_dummy()
        finally:
            self._in_dummy = False
        self.dummy_runs += 1
        ties = [(m, [t for t in ts if t.requires_grad]) for m, ts in self.adapter.tie_points(out)]
        return [(m, ts) for m, ts in ties if ts]

    def _tie_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        # Skipped under no_grad (reentrant checkpointing): the post-hook then ties to the loss instead.
        if not self._pending or not torch.is_grad_enabled():
            return None
        for i, (mod, extras) in enumerate(self._pending):
            if mod is module:
                del self._pending[i]
                return _tie(output, extras)
        return None

    def _tower_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._in_forward and not self._in_dummy:
            self._tower_ran = True

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._in_forward = module.training and torch.is_grad_enabled()
        self._tower_ran = False
        self._dummy_ran = False
        self._pending = []
        if self._in_forward and self._needs_dummy() and not self.adapter.has_visual_input(args, kwargs):
            # Before the language model: FSDP then all-gathers the tower at the same point on every rank.
            self._pending = self._run_dummy()
            self._dummy_ran = True

    def _post_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        if not self._in_forward:
            return None
        self._in_forward = False
        ran = self._tower_ran
        self.record_step_usage(ran)
        pending, self._pending = self._pending, []
        if not ran and not pending and not self._dummy_ran and self._needs_dummy():
            pending = self._run_dummy()  # visual input was passed but the tower did not run (e.g. cached)
        extras = [t for _, ts in pending for t in ts]  # not tied where real features enter: tie to the loss
        if not extras:
            return None
        return _tie(output, extras)

    # -- per-optimizer-step semantics ---------------------------------------------------------------
    def record_step_usage(self, has_images: bool) -> None:
        """Record one micro-batch of the current optimizer step (the hooks call this themselves)."""
        self._step_micro_batches += 1
        self._step_images = self._step_images or bool(has_images)

    def reset_step(self) -> None:
        """Forget the micro-batches recorded since the last finalize."""
        self._step_images = False
        self._step_micro_batches = 0

    def finalize_vision_grads(self, process_group: Any = None) -> bool | None:
        """Give the optimizer exactly what stock DDP(find_unused_parameters=True) would give it.

        Call on every rank after the last backward of an optimizer step and before gradient clipping
        and ``optimizer.step()``. One all-reduce(MAX) of "this rank ran the tower on real visual input
        in some micro-batch of this step" (skipped without ``torch.distributed``); if no rank did,
        every trainable vision parameter gets ``.grad = None`` (AdamW then skips it: no moment update,
        no weight decay); otherwise the (g + 0) sums are left as they are, which DDP averaged exactly
        as it averages stock's (g, unused→0). Resets the per-step state.

        Returns:
            ``True``/``False`` — whether any rank saw visual input; ``None`` (and no collective) when no
            training forward ran since the previous call, so a second call in one step is a no-op.

        Guarantees: after it, vision grads are ``None`` iff no rank saw an image this step (test_vlm,
        scripts/vlm_ddp.py: bit-equal to stock fu=True with AdamW(weight_decay>0), GA and no_sync).
        """
        if self._step_micro_batches == 0:
            return None
        local = self._step_images
        self.reset_step()
        if _dist_ready(process_group):
            flag = torch.tensor(
                [1 if local else 0], dtype=torch.int32, device=_collective_device(process_group)
            )
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
            any_images = bool(flag.item())
        else:
            any_images = local
        if not any_images:
            for p in self.adapter.trainable_parameters():
                p.grad = None
        return any_images


# ---------------------------------------------------------------------------------------------------
# Hang guard
# ---------------------------------------------------------------------------------------------------

_FIX_HINT = (
    f"Fix: enable the dummy-image stabiliser ({STABILIZER_ENV}=1; supported: "
    "Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or set ddp_find_unused_parameters=True in TrainingArguments."
)


def _usage_error(
    names: list[str], per_rank: list[list[bool]], unused_everywhere_is_error: bool
) -> str | None:
    """The error message for a usage table ``per_rank[rank][group]``, or ``None`` when consistent."""
    problems = []
    for g, name in enumerate(names):
        used_on = [r for r, row in enumerate(per_rank) if row[g]]
        unused_on = [r for r, row in enumerate(per_rank) if not row[g]]
        if used_on and unused_on:
            problems.append(
                f"{name!r} ran on rank(s) {used_on} but not on rank(s) {unused_on}: its parameters get no "
                "gradient there and stock DDP hangs in backward"
            )
        elif not used_on and unused_everywhere_is_error:
            problems.append(
                f"{name!r} ran on no rank (a step without images): its parameters get no gradient and "
                "stock DDP fails at the next step with 'Expected to have finished reduction'"
            )
    if not problems:
        return None
    return (
        "hf_ddpfix: DistributedDataParallel(find_unused_parameters=False) cannot train this step: "
        + "; ".join(problems)
        + ". "
        + _FIX_HINT
    )


def check_used_groups(
    used: dict[str, bool], group: Any = None, *, unused_everywhere_is_error: bool = True
) -> None:
    """Raise :class:`UnusedParametersError` on every rank when ranks disagree on which groups ran.

    One ``all_gather`` of ``len(used)`` int32 flags (every rank must call it with the same keys in
    the same order). No-op without an initialised process group of size > 1.

    Raises:
        UnusedParametersError: a group ran on some ranks only, or (``unused_everywhere_is_error``)
            on none; the message names the group, the ranks, and the fix.

    Guarantees: with mixed ranks every rank raises within seconds (scripts/vlm_hang_guard.py).
    """
    if not used or not _dist_ready(group):
        return
    names = list(used)
    dev = _collective_device(group)
    local = torch.tensor([1 if used[n] else 0 for n in names], dtype=torch.int32, device=dev)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    table = [[bool(v) for v in t.tolist()] for t in gathered]
    msg = _usage_error(names, table, unused_everywhere_is_error)
    if msg is not None:
        raise UnusedParametersError(msg)


class HangGuard:
    """Turns a DDP(find_unused_parameters=False) hang on vision parameters into a clear error.

    Use when the stabiliser is off (disabled, or a VLM without adapter) and DDP runs with
    ``find_unused_parameters=False``. Forward pre-hooks on each vision group record whether it ran;
    the HF model's forward post-hook (inside DDP's forward, before backward) calls
    :func:`check_used_groups`. Only groups with trainable parameters are checked; eval and
    ``no_grad`` forwards are skipped.

    Args:
        model: HF VLM, PeftModel or wrapper.
        groups: ``{name: module}`` to watch; default: the adapter's tower, else modules named like
            ``visual`` / ``vision_tower`` / ``multi_modal_projector``.
        ddp_module: the DDP wrapper; when given, ``no_sync`` micro-batches are not checked (only the
            synchronising backward must use every parameter).
        process_group: group for the check (default: WORLD).
        unused_everywhere_is_error: also raise when no rank ran a group (``static_graph=True`` users
            whose graph never uses the tower may set this to ``False``).

    Guarantees: mixed image/text ranks raise :class:`UnusedParametersError` on both ranks, and the
    processes exit non-zero in seconds (scripts/vlm_hang_guard.py).
    """

    def __init__(
        self,
        model: nn.Module,
        groups: dict[str, nn.Module] | None = None,
        *,
        ddp_module: nn.Module | None = None,
        process_group: Any = None,
        unused_everywhere_is_error: bool = True,
    ) -> None:
        self.root = unwrap_model(model)
        if groups is None:
            groups = dict(_vision_groups(self.root))
        self.groups = {n: m for n, m in groups.items() if any(p.requires_grad for p in m.parameters())}
        self.ddp_module = ddp_module
        self.process_group = process_group
        self.unused_everywhere_is_error = unused_everywhere_is_error
        self._handles: list[Any] = []
        self._used: dict[str, bool] = {}
        self._active = False

    @property
    def attached(self) -> bool:
        """True while the hooks are registered."""
        return bool(self._handles)

    def attach(self) -> HangGuard:
        """Register the hooks (idempotent; nothing to do when no group is trainable). Returns ``self``."""
        if self._handles or not self.groups:
            return self
        self._handles.append(self.root.register_forward_pre_hook(self._pre_hook))
        self._handles.append(self.root.register_forward_hook(self._post_hook))
        for name, mod in self.groups.items():
            self._handles.append(mod.register_forward_pre_hook(self._group_hook(name)))
        return self

    def remove(self) -> None:
        """Remove the hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._active = False

    def _group_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self._active:
                self._used[name] = True

        return hook

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._active = module.training and torch.is_grad_enabled()
        self._used = dict.fromkeys(self.groups, False)

    def _post_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._active:
            return
        self._active = False
        if self.ddp_module is not None and not getattr(self.ddp_module, "require_backward_grad_sync", True):
            return
        check_used_groups(
            self._used, self.process_group, unused_everywhere_is_error=self.unused_everywhere_is_error
        )


# ---------------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------------


def fsdp_wrap_plan(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules to pass to ``torch.distributed.fsdp.fully_shard``, innermost first, root last.

    The plan: every block named in the HF model's ``_no_split_modules`` (vision blocks and decoder
    layers), then the vision tower itself (patch embedding, mergers), then ``model`` (the root: the
    embeddings, LM head and any leftovers). With :class:`VisionStabilizer` attached every rank runs
    the tower before the language model in every training forward, so all ranks issue the same
    all-gathers / reduce-scatters in the same order. Without it, mixed image/text ranks hang.

    Guarantees: fully_shard over this plan + the stabiliser trains LoRA Qwen2.5-VL and Qwen3-VL with
    mixed image/text ranks (and an imageless step) to the same weights as DDP (1e-5; measured 7.6e-7
    and 1.1e-6; scripts/vlm_fsdp.py).
    """
    hf = unwrap_model(model)
    no_split = set(getattr(hf, "_no_split_modules", None) or [])
    ids = {id(m): n for n, m in model.named_modules()}
    plan: list[tuple[str, nn.Module]] = []
    for _, mod in hf.named_modules():
        if type(mod).__name__ in no_split:
            plan.append((ids[id(mod)], mod))
    for _, tower in _vision_groups(hf):
        if any(tower is m for _, m in plan) or not any(True for _ in tower.parameters()):
            continue
        plan.append((ids[id(tower)], tower))
    plan.append(("", model))
    return plan
