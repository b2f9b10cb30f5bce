"""Which subtrees a rank may skip (a VLM's tower on a text-only step, cross-attention layers, LayerDrop stacks): what
FSDP2 units must not split (the units themselves: :func:`hf_ddpfix.integrations.fsdp.units.fsdp_wrap_plan`)."""

from __future__ import annotations

from torch import nn

from ..vision.families import vision_groups

__all__ = ["layerdrop_stacks", "skippable_subtrees"]


_LAYERDROP_KEYS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def skippable_subtrees(hf: nn.Module) -> list[nn.Module]:
    """Submodules a training forward may skip on one rank and run on another.

    The vision groups of a VLM (a text-only step), decoder layers whose class is a cross-attention
    layer (Mllama runs them only with an image), and the stacks LayerDrop may skip (:func:`layerdrop_stacks`).
    """
    out = [m for _, m in vision_groups(hf)]
    for _, mod in hf.named_modules():
        if "CrossAttention" in type(mod).__name__ and "Layer" in type(mod).__name__:
            out.append(mod)
    return out + [m for m in layerdrop_stacks(hf) if not _inside(m, out)]


def _rate(obj: object, keys: tuple[str, ...]) -> float:
    rates = [getattr(obj, k, 0) for k in keys]
    return max((float(r) for r in rates if isinstance(r, (int, float)) and not isinstance(r, bool)), default=0.0)


def layerdrop_stacks(hf: nn.Module) -> list[nn.Module]:
    """The ``nn.ModuleList`` stacks (with parameters) whose layers a training forward may skip at random.

    Structural signals, any model: a module with a ``layerdrop`` attribute > 0 (transformers' BART, OPT,
    Whisper, wav2vec2... encoders and decoders keep their rate there and draw ``torch.rand`` per layer in
    training): its stacks; a config (or its ``text_config`` / ``encoder`` / ``decoder``) setting ``layerdrop``,
    ``encoder_layerdrop`` or ``decoder_layerdrop`` > 0: every stack of the model (where the rate is read is the
    model's business, so none is trusted to be safe).
    """
    cfg = getattr(hf, "config", None)
    cfgs = [cfg] + ([getattr(cfg, k, None) for k in ("text_config", "encoder", "decoder")] if cfg is not None else [])
    everywhere = any(_rate(c, _LAYERDROP_KEYS) > 0 for c in cfgs if c is not None)
    owners = [hf] if everywhere else [m for m in hf.modules() if _rate(m, ("layerdrop",)) > 0]
    out: list[nn.Module] = []
    for owner in owners:
        for mod in owner.modules():
            if (isinstance(mod, nn.ModuleList) and len(mod) and any(True for _ in mod.parameters())
                    and not any(mod is m for m in out)):
                out.append(mod)
    return out


def _inside(mod: nn.Module, subtrees: list[nn.Module]) -> bool:
    return any(mod is s or any(mod is m for m in s.modules()) for s in subtrees)
