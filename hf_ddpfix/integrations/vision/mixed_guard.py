"""A named error, not a collective mismatch or a hang, where ranks mix images and text under ZeRO with no dummy image.

Problem (measured 2026-12-02 on CPU, 2 gloo ranks, deepspeed 0.19.8, the VLM family sweep's ZeRO-3 cells,
tests/scripts/vlm_family_cells.py): for a VLM family hf_ddpfix has no ZeRO dummy image for (Aria, DeepSeek-VL,
Mllama, ...: :func:`~hf_ddpfix.integrations.vision.families.describe_unsupported` says why per family), a micro-batch
with an image on one rank and text only on another makes the image rank all-gather its tower's partitions under
ZeRO-3 (reduce its gradients under ZeRO-2) while the other rank has moved on: gloo aborts the process ("Received data
size doesn't match expected size", ``terminate called``), NCCL waits until its timeout. Stock DeepSpeed does the same;
the plan says so (``vlm_stabilizer = off  no adapter for this VLM family``), but the run still dies mid-training
with an error that names none of it.

Fix (:class:`MixedImageGuard`): before every forward of the model (training, evaluation, prediction, generation),
the ranks agree whether each passes visual input (one all-gather of one byte: :func:`~hf_ddpfix.ops.dist.
gather_flags`); when some do and some do not, every rank raises the same error (the runtime's
:class:`~hf_ddpfix.runtime.errors.DDPFixError`) naming the ranks, the family's reason and the fixes, before any rank enters the tower. Forwards where
every rank has an image, or none has, run untouched (stock's math: nothing is tied or changed).

A family whose image call runs the tower again on optional local crops (:func:`~hf_ddpfix.integrations.vision.
families.optional_pixel_inputs`: Step3p7's ``pixel_values_local``) has no dummy for that reason; the same all-gather
carries one more byte per such input under ZeRO-3, and a forward where every rank has an image but they disagree on the
crops stops by name too (stock: the same mismatch; ZeRO-2 reduces the same gradients either way: not checked).

Cost: one all-gather of a byte (a byte per watched crop input) and its host read per forward, only in this case (ZeRO-2 with a trainable tower, or
ZeRO-3, a VLM, no dummy image; under ZeRO-3 also a model whose ``forward`` takes pixels though its config names no
``vision_config``: UDOP, measured aborting in gloo at step 1 on the sweep's mixed ranks); ``HF_DDPFIX_VLM_STABILIZER=0``
keeps stock (no check).

Guarantees: raises on every rank at the same forward (the same gathered flags), so no rank is left waiting; never
raises where ranks agree; :meth:`remove` leaves the model as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..._compat.models import unwrap_model
from ...ops.dist import dist_ready, gather_flags
from .families import optional_pixel_inputs

__all__ = ["MixedImageGuard", "has_visual_input", "takes_visual_input"]

#: keyword inputs that carry an image or a video, beside any whose name contains ``pixel_values``
#: (``pixel_values``, ``pixel_values_videos``, ``pixel_values_images``): Pix2Struct's patches, Fuyu's, Molmo's
#: ``images``, precomputed ``image_embeds``
VISUAL_NAMES = frozenset({"flattened_patches", "image_patches", "images", "image_embeds"})


def takes_visual_input(model: nn.Module) -> bool:
    """True when the (unwrapped) model's ``forward`` has a keyword :func:`has_visual_input` reads: a model that
    takes pixels though its config names no ``vision_config`` (UDOP) is a vision-language model to the guard."""
    import inspect

    try:
        names = inspect.signature(unwrap_model(model).forward).parameters
    except (TypeError, ValueError):
        return False
    return any("pixel_values" in n or n in VISUAL_NAMES for n in names)


def _carries(value: Any) -> bool:
    """True for a non-empty tensor, a list holding one, or any other value but ``None``."""
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return bool(value.numel())
    if isinstance(value, list | tuple):
        return any(isinstance(v, torch.Tensor) and v.numel() for v in value)
    return True


def has_visual_input(kwargs: dict[str, Any]) -> bool:
    """True when a forward's keyword inputs carry an image or a video (a non-empty tensor, or a non-empty list of
    them, under a :data:`VISUAL_NAMES` name or one containing ``pixel_values``)."""
    return any(_carries(value) for name, value in kwargs.items()
               if "pixel_values" in name or name in VISUAL_NAMES)


class MixedImageGuard:
    """Stop a forward where some ranks pass visual input and others do not (module docstring).

    Args:
        model: the HF VLM, a ``PeftModel`` or a wrapper (the hook goes on the unwrapped HF model).
        why: why there is no dummy image (in the error).
        stage: the ZeRO stage (in the error).
        process_group: the group to agree over (default: the world).
        error: the exception class raised (the runtime passes :class:`~hf_ddpfix.runtime.errors.DDPFixError`).
    """

    def __init__(self, model: nn.Module, *, why: str, stage: int, process_group: Any = None,
                 error: type[Exception] = RuntimeError) -> None:
        self.root = unwrap_model(model)
        self.why, self.stage, self.process_group, self.error = why, stage, process_group, error
        features = getattr(self.root, "get_image_features", None)
        #: optional pixel inputs that run the tower again when present (local crops): under ZeRO-3 the image ranks
        #: must agree (the second pass gathers the tower again); ZeRO-2 reduces the same gradients either way
        self.watched = optional_pixel_inputs(features) if callable(features) and stage == 3 else []
        self.forwards = 0
        self._handle: Any = None

    def attach(self) -> MixedImageGuard:
        """Register the forward pre-hook, first in line (idempotent). Returns ``self``."""
        if self._handle is None:
            self._handle = self.root.register_forward_pre_hook(self._check, with_kwargs=True, prepend=True)
        return self

    def remove(self) -> None:
        """Remove the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not dist_ready(self.process_group):
            return
        self.forwards += 1
        flags = [has_visual_input(kwargs), *(_carries(kwargs.get(n)) for n in self.watched)]
        rows = gather_flags(flags, self.process_group)
        with_image = [r for r, row in enumerate(rows) if row[0]]
        if not with_image:
            return
        if len(with_image) == len(rows):
            self._check_watched(rows)
            return
        without = [r for r, row in enumerate(rows) if not row[0]]
        what = "all-gather the vision tower's parameters" if self.stage == 3 else "reduce the tower's gradients"
        raise self.error(
            f"hf_ddpfix (deepspeed ZeRO-{self.stage}): in this forward rank(s) {with_image} pass an image and "
            f"rank(s) {without} pass text only. Under ZeRO-{self.stage} only the image ranks would {what}: a "
            f"collective mismatch (NCCL: a hang), as in stock DeepSpeed. hf_ddpfix has no dummy image for this "
            f"family ({self.why}). Fix: give every micro-batch an image on every rank (or none on any), or train "
            "under DDP or FSDP2, which handle mixed ranks for this family (docs/vlm-families.md). Stopped before any "
            "rank entered the tower; HF_DDPFIX_VLM_STABILIZER=0 removes this check.")

    def _check_watched(self, rows: list[list[bool]]) -> None:
        """Every rank passes an image: raise when they disagree on an optional pixel input (:attr:`watched`), with
        which the image runs modules of its own (stock DeepSpeed: the same mismatch)."""
        for i, name in enumerate(self.watched, start=1):
            have = [r for r, row in enumerate(rows) if row[i]]
            if have and len(have) < len(rows):
                lack = [r for r, row in enumerate(rows) if not row[i]]
                raise self.error(
                    f"hf_ddpfix (deepspeed ZeRO-{self.stage}): in this forward rank(s) {have} pass `{name}` and "
                    f"rank(s) {lack} do not. This model runs its vision tower again on `{name}` (local crops), so "
                    f"under ZeRO-{self.stage} the ranks would run different modules: a collective mismatch (NCCL: "
                    "a hang), as in stock DeepSpeed. Fix: give every rank's micro-batch the same kind of image "
                    "(with or without local crops on every rank), or train under DDP or FSDP2. Stopped before any "
                    "rank entered the tower; HF_DDPFIX_VLM_STABILIZER=0 removes this check.")
