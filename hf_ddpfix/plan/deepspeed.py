"""The plan's decisions that exist only under DeepSpeed, and the doctor's advice: pure functions of
:class:`DeepSpeedFacts`.

``resolve_plan`` calls :func:`decide_deepspeed` once: the ``deepspeed`` line (:func:`engine`), the ZeRO-3 leaf
modules (:func:`leaf_modules`) and ``zero_skip_unused`` (:func:`skip_unused`). What ZeRO changes in the decisions
every engine makes sits with those decisions (docs/design.md "The plan"): checkpointing in ``plan/checkpointing.py``,
the VLM stabiliser in ``plan/vision.py``, tiling under ZeRO-3 in ``plan/memory.py``.

The facts, the measurements behind each rule and the appliers are in :mod:`hf_ddpfix.integrations.deepspeed.zero`.
Nothing here imports deepspeed or touches a process group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..integrations.deepspeed.zero import (
    LEAF_MODULES_SINCE,
    NON_REENTRANT_FIXED_IN,
    DeepSpeedFacts,
    parse_version,
)
from .types import Decision, RunFacts

if TYPE_CHECKING:
    from ..config.options import DDPFixConfig

__all__ = [
    "adapter_dtype_note",
    "decide_deepspeed",
    "deepspeed_advice",
    "engine",
    "leaf_modules",
    "leaf_modules_decision",
    "skip_unused",
    "skip_unused_decision",
]


# -------------------------------------------------------------------------------------------------




def _older(v: tuple[int, int, int] | None, than: tuple[int, int, int]) -> bool:
    """True when ``v`` is older than ``than``; an unknown version counts as old (the safe choice)."""
    return v is None or v < than




def leaf_modules_decision(ds: DeepSpeedFacts, disabled: str | None = None) -> tuple[tuple[str, ...] | None, str, bool]:
    """Which MoE block classes to mark as ZeRO-3 leaf modules.

    Returns:
        ``(class names, or None when not ZeRO-3, reason, changed_from_stock)``.
    """
    if ds.stage != 3:
        return None, "", False
    if not ds.moe_blocks:
        return (), "no MoE block with per-expert submodules (fused experts always run)", False
    names = ", ".join(n.rsplit(".", 1)[-1] for n in ds.moe_blocks)
    if disabled:
        return (), f"disabled ({disabled}); {names} left as in stock", False
    if ds.leaf_config:
        return (), f"the DeepSpeed config sets zero_optimization.leaf_module: left to it ({names} not added)", False
    if _older(ds.version_tuple, LEAF_MODULES_SINCE):
        return (), f"deepspeed {ds.version} < 0.14 has no set_z3_leaf_modules: {names} left as in stock", False
    return tuple(ds.moe_blocks), (f"{names}: ranks routing tokens to different experts would all-gather "
                                  "different experts (hang / ~10x slower); gathered as one leaf, unused "
                                  "experts get zero gradients"), True


def skip_unused_decision(stage: int | None, asked: bool | None, source: str) -> tuple[bool | None, str, bool]:
    """Whether parameters no rank used in an optimizer step get their weights and AdamW state back after it.

    Stock DDP (``find_unused_parameters=True``) leaves such a parameter's gradient ``None`` and AdamW
    skips it; ZeRO-1/2/3 zero-fill it and step it (weight decay, momentum, the partition's step count).
    Default: off, DeepSpeed's own semantics. A run stock DeepSpeed trains (every rank text-only in a step,
    or an image on every rank; a head whose output never reaches the loss) would otherwise end with other
    weights than stock DeepSpeed's, which the rule "never a silently different result" forbids; the
    difference from DDP is stated in the plan instead, and one setting matches DDP.

    Args:
        stage: the ZeRO stage (``None``: unknown).
        asked: the ``zero_skip_unused`` setting (``None``: unset).
        source: where the setting came from (``HF_DDPFIX_ZERO_SKIP_UNUSED``, "argument").

    Returns:
        ``(value or None when it does not arise, reason, changed_from_stock)``.
    """
    if stage is None or stage < 1:
        if asked:
            return False, (f"requested ({source}) but {'ZeRO stage unknown' if stage is None else 'ZeRO-0'}: no "
                           "flat partitions known to hf_ddpfix; stock behaviour kept"), False
        return None, "", False
    if not asked:
        why = f"off ({source})" if asked is False else "default: stock DeepSpeed"
        return False, (f"{why}: in an optimizer step where no rank used a parameter (vision tower without an image "
                       "on any rank, a head outside the loss) ZeRO steps it with a zero gradient, so AdamW's weight "
                       "decay and momentum move it where stock DDP leaves it (measured 1e-3 to 1e-2 after a few "
                       "steps, docs/deepspeed.md); kept as stock DeepSpeed so runs stock DeepSpeed trains keep their weights; "
                       "HF_DDPFIX_ZERO_SKIP_UNUSED=1 matches DDP"), False
    return True, (f"requested ({source}): after each optimizer step the "
                  "parameters no rank used get back their fp32 weights and AdamW moments, and a parameter used "
                  "again gets AdamW's bias correction with its own step count (stock DDP's semantics; torch "
                  "Adam/AdamW only, else stock with the reason); cost: one all-reduce of 1 byte per trainable "
                  "tensor per step, graph walks per forward and loss"), True


def skip_unused(facts: RunFacts, c: DDPFixConfig) -> Decision:
    """The plan's ``zero_skip_unused`` decision (:func:`skip_unused_decision`)."""
    if facts.parallel != "deepspeed":
        if c.zero_skip_unused:
            return Decision(False, f"requested ({c.source('zero_skip_unused')}) but the run is not DeepSpeed: "
                            "DDP/FSDP already skip parameters no rank used (nothing to do)")
        return Decision(None, "")
    stage = facts.deepspeed.stage if facts.deepspeed is not None else facts.zero_stage
    value, reason, changed = skip_unused_decision(stage, c.zero_skip_unused, c.source("zero_skip_unused"))
    return Decision(value, reason, changed=changed)


def adapter_dtype_note(ds: DeepSpeedFacts) -> str | None:
    """The plan log line for a frozen base and trainable adapters in different dtypes, or ``None``."""
    if not (ds.base_dtype and ds.adapter_dtype):
        return None
    if ds.cast_dtype:
        return (f"{ds.base_dtype} base + {ds.adapter_dtype} trainable parameters: DeepSpeed casts the whole "
                f"module to {ds.cast_dtype} and keeps fp32 master weights in the optimizer (trains on "
                "deepspeed 0.19.8; the TypeError reported with older versions: pass "
                "autocast_adapter_dtype=False to get_peft_model)")
    return (f"{ds.base_dtype} base + {ds.adapter_dtype} trainable parameters with DeepSpeed bf16/fp16 off: "
            "DeepSpeed keeps the dtypes as they are")


def deepspeed_advice(version: str | None) -> list[str]:
    """What ``hf-ddpfix doctor`` says about the installed deepspeed (pure).

    Args:
        version: ``deepspeed_version()``, ``None`` when not installed.
    """
    if version is None:
        return ["deepspeed: not installed (only needed for ZeRO runs: DS_BUILD_OPS=0 pip install deepspeed)"]
    v = parse_version(version)
    lines = [f"deepspeed {version}"]
    if v is None:
        return lines + ["  version not readable: hf_ddpfix assumes the oldest behaviour (reentrant "
                        "checkpointing for PEFT + ZeRO-3)"]
    if v < NON_REENTRANT_FIXED_IN:
        lines.append("  PEFT + ZeRO-3 + non-reentrant checkpointing fails on this version (fixed in 0.19.3): "
                     "hf_ddpfix switches such runs to reentrant; upgrade with `pip install -U deepspeed`")
    else:
        lines.append("  PEFT + ZeRO-3 works with non-reentrant checkpointing on this version")
    if v < LEAF_MODULES_SINCE:
        lines.append("  no ZeRO-3 leaf modules (< 0.14): MoE models with per-expert modules may hang under "
                     "ZeRO-3; upgrade")
    lines.append("  mixed image/text batches: hf_ddpfix runs a dummy image on text-only ranks under ZeRO-2/3 "
                 "(Qwen2/2.5/3-VL, LLaVA, Gemma 3 by hand; other VLMs with get_image_features built from their "
                 "config, e.g. Idefics3/SmolVLM, PaliGemma, Mistral 3, InternVL); Mllama-style cross-attention "
                 "VLMs: give every micro-batch an image under ZeRO")
    return lines


# ---- the plan's DeepSpeed decisions (called by hf_ddpfix.plan.resolve.resolve_plan) ----


def engine(facts: RunFacts) -> Decision:
    """The plan's ``deepspeed`` line: stage, version, offload, config source, dtype note."""
    if facts.parallel != "deepspeed":
        return Decision(None, "")
    ds = facts.deepspeed
    if ds is None:
        return Decision("unknown", "no DeepSpeed config readable: stock behaviour kept")
    note = adapter_dtype_note(ds)
    return Decision(f"ZeRO-{ds.stage}", ds.describe() + (f" (from {ds.source})" if ds.source else "")
                    + (f"; {note}" if note else ""))






def leaf_modules(facts: RunFacts) -> Decision:
    """The plan's ``zero3_leaf_modules`` decision: short class names joined by ",", or ``False``."""
    if facts.parallel != "deepspeed" or facts.deepspeed is None:
        return Decision(None, "")
    value, reason, changed = leaf_modules_decision(facts.deepspeed)
    if value is None:
        return Decision(None, "")
    return Decision(",".join(v.rsplit(".", 1)[-1] for v in value) or False, reason, changed=changed)


def decide_deepspeed(facts: RunFacts, c: DDPFixConfig) -> tuple[Decision, Decision, Decision]:
    """``(deepspeed, zero3_leaf_modules, zero_skip_unused)``: the plan's ZeRO-only decisions."""
    return engine(facts), leaf_modules(facts), skip_unused(facts, c)
