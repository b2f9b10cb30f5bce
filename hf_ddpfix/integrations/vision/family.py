"""What a VLM family is, as data: where its tower lives and how the dummy image is fed to it.

:class:`VisionFamily` holds no code that touches a model; the registry and discovery are in
:mod:`hf_ddpfix.integrations.vision.families`, the driver in :mod:`hf_ddpfix.integrations.vision.adapter`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KINDS", "VisionFamily"]

KINDS = ("grid", "image", "layout")


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
        kind: ``"grid"`` (``tower(pixel_values, grid_thw=...)``), ``"image"``
            (``root.get_image_features(pixel_values=...)`` on a ``[1, num_channels, *image_size]`` image) or
            ``"layout"`` (discovered only: ``root.get_image_features(**keywords)`` with the keywords of the sample
            builder's first layout that runs, :mod:`hf_ddpfix.integrations.vision.layouts`).
        model_types: ``config.model_type`` values of this family (for towers shared by several VLMs,
            e.g. SigLIP in Gemma 3 and PaliGemma, whose ``vision_model_types`` cannot tell them apart).
        projector_paths: where the module ``get_image_features`` runs after the tower lives (``"image"``
            kind; part of the vision group and of what the dummy runs).
        zero_only: the dummy is verified under DeepSpeed ZeRO-2/3 only (see the module docstring).
        extra_inputs: keyword inputs of ``get_image_features`` the dummy must pass besides
            ``pixel_values``, built from the config (``"image_sizes"``: ``[[height, width]]``).
        discovered: built by :func:`~hf_ddpfix.integrations.vision.families.find_vision_adapter` from the model's
            own config and structure (no hand-written entry); its dummy layout is fixed by a trial run
            when the ZeRO stabiliser attaches (:meth:`~hf_ddpfix.integrations.vision.adapter.VisionAdapter.
            verify`), and a failed trial keeps stock behaviour.
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
    kind: str = "grid"
    model_types: tuple[str, ...] = ()
    projector_paths: tuple[str, ...] = ()
    zero_only: bool = False
    extra_inputs: tuple[str, ...] = ()
    discovered: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"VisionFamily({self.name!r}).kind={self.kind!r}: allowed values are {KINDS}")
