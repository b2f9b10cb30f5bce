"""``fsdp_skippable``: fold a subtree a rank may skip into the enclosing FSDP2 unit, or shard it and run a dummy.

A subtree a rank may skip (a VLM's vision tower and projector on a text-only step) cannot hold an FSDP2 unit of
its own unless every rank runs it: otherwise ranks all-gather different units (gloo size mismatch, NCCL hang).
Two ways keep the collectives equal (docs/plan.md#fsdp_skippable):

- **fold**: no unit inside the subtree; its parameters belong to the enclosing unit (the root for a tower), which
  every rank all-gathers whole for that unit's forward and backward. Cost: ``folded_bytes`` unsharded on every
  rank, every step (Llama-3.2-90B-Vision: 37.5 GiB in bf16, issue 36).
- **shard**: the subtree's blocks are units; a rank without an image runs the stabiliser's dummy image through
  the tower where an image rank runs it (the language model's start), tied with an exact-zero gradient. Cost:
  one dummy tower forward and backward on a rank without an image (``dummy_tokens`` patches; ~6 FLOPs per
  tower parameter and token).

The budget: fold only while ``folded_bytes <= max(FOLD_FLOOR_BYTES, FOLD_FRACTION * total_bytes / world_size)``.
``total_bytes / world_size`` is each rank's parameter shard; a fold within 10 % of it keeps a rank's parameter
memory within 1.1x its shard plus the largest unit (the bound the scale test asserts), and below 64 MiB the
dummy's forward costs more than the gather it saves (a 64 MiB all-gather is ~1 ms on NVLink, a tower forward
on one image several ms). LayerDrop stacks always stay folded (random per-layer skipping has no dummy), as does
any family without a dummy (no stabiliser adapter, nothing discovered). Mllama's cross-attention layers have one
(:mod:`hf_ddpfix.integrations.fsdp.cross_attention`: zero cross-attention states, an exact-zero contribution).

Guarantees (tests/test_fsdp_skippable.py): the decision is a pure function of :class:`SkippableFacts` and the
mode; ``fold`` whenever no dummy exists; ``shard`` when forced and a dummy exists; under ``auto`` the folded bytes
never exceed :func:`fold_budget`; the reason is at most :data:`MAX_REASON` characters.
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import Decision

__all__ = ["FOLD_FLOOR_BYTES", "FOLD_FRACTION", "MAX_REASON", "SKIPPABLE_MODES", "SkippableFacts",
           "decide_skippable", "fold_budget"]

#: below this a fold is always cheap enough (see the module docstring)
FOLD_FLOOR_BYTES = 64 * 2**20
#: the fraction of a rank's parameter shard a fold may add (the scale test's 1.1x bound)
FOLD_FRACTION = 0.1
#: the longest reason: the plan line stays near 160 characters
MAX_REASON = 130
SKIPPABLE_MODES = ("auto", "fold", "shard")
_ANCHOR = "docs/plan.md#fsdp_skippable"


@dataclass(frozen=True)
class SkippableFacts:
    """What the choice reads (a meta-device model gives them as well as a real one).

    Attributes:
        folded_bytes: parameter bytes in subtrees a rank may skip that a dummy could run (LayerDrop excluded).
        total_bytes: parameter bytes of the whole model.
        world_size: ranks sharing the FSDP2 mesh.
        dummy: the dummy's name (the stabiliser family, e.g. ``"llava"``), ``""`` when none can be built.
        no_dummy: why no dummy can be built (read when ``dummy`` is empty).
        dummy_tokens: tokens (patches) the dummy image runs through the tower.
        tower_params: parameters the dummy's forward reads (tower and projector).
        user_shards: an explicit ``fsdp_transformer_layer_cls_to_wrap`` names classes inside those subtrees.
    """

    folded_bytes: int
    total_bytes: int
    world_size: int
    dummy: str = ""
    no_dummy: str = ""
    dummy_tokens: int = 0
    tower_params: int = 0
    user_shards: bool = False


def fold_budget(total_bytes: int, world_size: int) -> int:
    """The most bytes the plan folds under ``auto``: ``max(64 MiB, 10 % of a rank's parameter shard)``."""
    return max(FOLD_FLOOR_BYTES, int(FOLD_FRACTION * total_bytes / max(1, world_size)))


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _flops(n: float) -> str:
    for unit, scale in (("PF", 1e15), ("TF", 1e12), ("GF", 1e9), ("MF", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} F"


def decide_skippable(f: SkippableFacts, mode: str | None = "auto") -> Decision:
    """``"fold"`` or ``"shard"`` for the subtrees a rank may skip, with both costs in the reason.

    Args:
        f: the facts.
        mode: ``auto`` (by cost), ``fold`` or ``shard`` (forced; ``shard`` without a dummy folds and says why);
            ``None`` is ``auto``.

    Returns:
        ``Decision("fold" | "shard", reason)``; ``Decision(None)`` when nothing is skippable.
    """
    mode = mode or "auto"
    if mode not in SKIPPABLE_MODES:
        raise ValueError(f"fsdp_skippable={mode!r} is not a recognised value; allowed: {', '.join(SKIPPABLE_MODES)}")
    if f.folded_bytes <= 0:
        return Decision(None, "")
    budget = fold_budget(f.total_bytes, f.world_size)
    fold = f"fold {_size(f.folded_bytes)} whole"
    if not f.dummy:
        return Decision("fold", f"{fold}: no dummy ({f.no_dummy or 'no stabiliser adapter'})"[:MAX_REASON])
    flops = 6.0 * f.tower_params * f.dummy_tokens
    dummy = f"dummy {f.dummy_tokens} tok ~{_flops(flops)}"
    costs = f"{fold} vs {dummy}"
    if f.user_shards:
        choice, why = "shard", "explicit wrap list"
    elif mode != "auto":
        choice, why = mode, "forced"
    elif f.folded_bytes <= budget:
        choice, why = "fold", f"<= budget {_size(budget)}"
    else:
        choice, why = "shard", f"> budget {_size(budget)}"
    return Decision(choice, f"{costs}; {why} [{_ANCHOR}]"[:MAX_REASON], changed=choice == "shard")
