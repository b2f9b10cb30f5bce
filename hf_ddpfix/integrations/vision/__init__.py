"""Vision-language models under DDP, FSDP2 and DeepSpeed ZeRO: one folder per concept of the feature.

- :mod:`.parts` — :func:`~.parts.vlm_parts`, where a VLM's tower, projector and language model are and how its image
  features enter the language model: the one source every feature reads them from.
- :mod:`.family` — :class:`VisionFamily`, what a VLM family is, as data.
- :mod:`.adapter` — :class:`VisionAdapter`, a located tower and the smallest dummy image it accepts.
- :mod:`.proof` — the attach-time proof that a dummy contributes exactly zero (families found by structure).
- :mod:`.families` — the registry of hand-written families, discovery from a model's own config and structure,
  ``find_vision_adapter`` / ``describe_unsupported``, vision parts found by module name.
- :mod:`.stabilizer` — :class:`VisionStabilizer`: the dummy image on text-only steps (DDP / FSDP2),
  stock optimizer semantics, and the evaluation sync for FSDP2.
- :mod:`.zero` — :class:`ZeroVisionStabilizer`: the dummy image where the real one runs (ZeRO-2/3),
  the evaluation / generation sync for ZeRO-3 (:class:`GenerateSync`).
(Which modules to ``fully_shard`` so ranks with and without images issue the same collectives:
:mod:`hf_ddpfix.integrations.fsdp.wrap`.)
"""

from .adapter import VisionAdapter
from .families import describe_unsupported, find_vision_adapter, register_vision_family, vision_param_names
from .family import VisionFamily
from .stabilizer import VisionStabilizer
from .zero import GenerateSync, ZeroVisionStabilizer

__all__ = [
    "GenerateSync",
    "VisionAdapter",
    "VisionFamily",
    "VisionStabilizer",
    "ZeroVisionStabilizer",
    "describe_unsupported",
    "find_vision_adapter",
    "register_vision_family",
    "vision_param_names",
]
