"""Which modules to ``fully_shard`` (FSDP2) so that ranks with and without images issue the same collectives."""

from __future__ import annotations

from torch import nn

from ..._compat import unwrap_model
from ..vision.families import vision_groups

__all__ = ["fsdp_wrap_plan", "layerdrop_stacks", "skippable_subtrees"]


def fsdp_wrap_plan(model: nn.Module, *, fold_skippable: bool = False) -> list[tuple[str, nn.Module]]:
    """Modules to pass to ``torch.distributed.fsdp.fully_shard``, innermost first, root last: a view on the plan's
    unit choice for plain ``fully_shard`` loops, not a layout of its own. The classes are
    :func:`~hf_ddpfix.integrations.fsdp.units.unit_classes` of the model's :func:`~.units.fsdp_facts` (what the
    plan hands accelerate's transformer policy and ``shard_layout`` sizes: the one unit-layout model, issue 46);
    this lists their instances bottom-up, then ``model`` (the root). Accelerate's own embedding and ``[norm, head]``
    units are not made here: a plain loop keeps them in the root.

    ``fold_skippable=False`` is the plan's ``fsdp_skippable = shard``: units inside the vision tower too (its
    blocks and projector; the tower model's own parameters stay in the root), so :class:`VisionStabilizer` must be
    attached: every rank then runs the tower before the language model in every training forward and all ranks
    issue the same all-gathers / reduce-scatters in the same order (without it mixed image/text ranks hang).
    Subtrees no dummy runs (LayerDrop stacks, a family without a dummy) are folded either way.

    ``fold_skippable=True`` (any model, no dummy input needed) is the plan's ``fold``: no unit inside a subtree a
    rank may skip — the vision tower and projector (text-only step), cross-attention decoder layers (Mllama without
    an image), LayerDrop stacks: their parameters belong to the enclosing unit (the root for a tower), which every
    rank all-gathers, and :class:`~hf_ddpfix.integrations.usage.ParameterUsage` built with ``units=`` ties the ones
    a rank did not use, so every rank reduce-scatters the same set. Cost: a folded tower stays unsharded for the
    root's whole forward/backward.

    Guarantees: fully_shard over this plan + the stabiliser trains LoRA Qwen2.5-VL and Qwen3-VL with mixed
    image/text ranks (and an imageless step) to the same weights as DDP (1e-5; tests/scripts/vlm_fsdp.py); with
    ``fold_skippable`` + ParameterUsage every VLM of the zoo ends with stock DDP's (find_unused_parameters=True)
    weights within 2e-7 (tests/scripts/usage_fsdp.py, results in tests/results/fsdp2_parity.json); the classes
    are the plan's for the same model and mode (tests/test_vlm.py).
    """
    from .units import fsdp_facts, unit_classes

    classes = set(unit_classes(fsdp_facts(None, model), not fold_skippable)[0])
    ids = {id(m): n for n, m in model.named_modules()}
    plan: list[tuple[str, nn.Module]] = []

    def walk(mod: nn.Module) -> None:  # post-order: a unit's inner units are sharded before it
        for child in mod.children():
            walk(child)
        if type(mod).__name__ in classes and mod is not model and any(True for _ in mod.parameters()):
            plan.append((ids[id(mod)], mod))

    walk(unwrap_model(model))
    plan.append(("", model))
    return plan


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
