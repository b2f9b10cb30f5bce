"""The plan's ``checkpointing`` decision, under every engine: DDP, FSDP2, DeepSpeed ZeRO, one process.

One decision, one module (docs/design.md "The plan"): the variant (off, reentrant, non-reentrant) and its reason
for each engine are here, so "what does hf_ddpfix do with checkpointing under ZeRO-3" is read in this file.
Pure: facts and options in, a ``Decision`` out; called once by :func:`hf_ddpfix.plan.resolve.resolve_plan`.
"""

from __future__ import annotations

from ..config.options import DDPFixConfig
from ..integrations.deepspeed.zero import NON_REENTRANT_FIXED_IN, DeepSpeedFacts
from .deepspeed import _older
from .types import Correct, Decision, RunFacts

__all__ = ["checkpointing_decision", "decide_checkpointing"]


def checkpointing_decision(
    asked: str, *, ds: DeepSpeedFacts, is_peft: bool, user_reentrant: bool | None, forced: str | None = None
) -> tuple[str, str, bool, str | None]:
    """The checkpoint variant under DeepSpeed.

    Args:
        asked: what the run asked for ("off", "reentrant", "non_reentrant").
        ds: the run's DeepSpeed facts (stage, version).
        is_peft: the model is a peft ``PeftModel``.
        user_reentrant: the explicit ``use_reentrant`` of the run, ``None`` if unset.
        forced: ``HF_DDPFIX_CHECKPOINTING`` (honoured, with the known failure in the reason).

    Returns:
        ``(mode, reason, changed_from_stock, correction or None)``; a correction is set when an explicit
        user setting is overridden.
    """
    if asked == "off":
        return "off", "not requested", False, None
    broken = ds.stage == 3 and is_peft and _older(ds.version_tuple, NON_REENTRANT_FIXED_IN)
    known = (f"PEFT + ZeRO-3 + non-reentrant checkpointing fails on deepspeed {ds.version or '(unknown)'} "
             "<= 0.19.2 ('CheckpointError ... recomputed metadata shape [0]'; fixed in 0.19.3, DeepSpeed "
             "PR #8148)")
    if forced in ("reentrant", "non_reentrant"):
        note = f"; warning: {known}" if forced == "non_reentrant" and broken else ""
        return forced, f"forced (HF_DDPFIX_CHECKPOINTING){note}", forced != asked, None
    if asked == "reentrant":
        return "reentrant", "as requested (reentrant works under DeepSpeed: no DDP reducer)", False, None
    if broken:
        correction = None
        if user_reentrant is False:
            correction = f"use_reentrant=False -> True: {known}"
        return "reentrant", f"{known}: reentrant works there", True, correction
    why = "as requested"
    if ds.stage == 3 and is_peft:
        why += f" (deepspeed {ds.version} >= 0.19.3 handles PEFT + ZeRO-3 non-reentrant)"
    return "non_reentrant", why, False, None



def _zero_checkpointing(facts: RunFacts, c: DDPFixConfig, correct: Correct) -> Decision:
    """The checkpointing decision under DeepSpeed (:func:`checkpointing_decision`)."""
    assert facts.deepspeed is not None
    forced = c.checkpointing if c.checkpointing in ("reentrant", "non_reentrant") else None
    mode, reason, changed, correction = checkpointing_decision(
        facts.checkpointing, ds=facts.deepspeed, is_peft=facts.is_peft, user_reentrant=facts.user_reentrant,
        forced=forced)
    if correction:
        correct(correction)
    if forced:
        reason = reason.replace("HF_DDPFIX_CHECKPOINTING", c.source("checkpointing"))
    return Decision(False if mode == "off" else mode, reason, changed=changed)



def decide_checkpointing(facts: RunFacts, c: DDPFixConfig, distributed: bool, correct: Correct) -> Decision:
    """The plan's ``checkpointing`` decision: the variant each engine runs (DDP and FSDP2 here, ZeRO in
    :func:`_zero_checkpointing`); an explicit setting that is known to fail goes through ``correct``."""
    asked = facts.checkpointing
    if facts.parallel == "deepspeed" and facts.deepspeed is not None:
        return _zero_checkpointing(facts, c, correct)
    if asked == "off":
        if c.assume_checkpointing:
            return Decision(False, "not detected; assumed on (custom checkpointing) for the DDP decisions")
        return Decision(False, "not requested")
    if c.checkpointing == "reentrant":
        return Decision("reentrant", f"forced ({c.source('checkpointing')})", changed=asked != "reentrant")
    if c.checkpointing == "non_reentrant":
        return Decision("non_reentrant", f"forced ({c.source('checkpointing')})", changed=asked != "non_reentrant")
    if asked == "reentrant" and distributed:
        if facts.user_reentrant and c.strict:
            # strict: keep the explicit choice; the find_unused decision raises if it cannot work
            return Decision("reentrant", "explicit use_reentrant=True kept (strict mode)")
        fsdp = facts.parallel == "fsdp"
        if facts.user_reentrant:
            correct(
                "use_reentrant=True -> False: reentrant checkpointing re-runs the forward inside backward, "
                + ("under no_grad, where the per-unit FSDP2 ties cannot read what the layer used (verified with "
                   "non-reentrant only)" if fsdp else "which DDP with find_unused_parameters=True sees as a second use ('ready only once')")
            )
        tool = (f"; replaces the model's own checkpoint function {facts.checkpoint_function} (its own "
                "recompute / offloading is not used: HF_DDPFIX_OFFLOAD_ACTIVATIONS=1 offloads instead)"
                if facts.checkpoint_function else "")
        why = ("under FSDP2 the per-unit ties read each unit's autograd graph, which reentrant checkpointing hides "
               "(it runs the layer under no_grad); the ties are verified with non-reentrant, which recomputes the same"
               if fsdp else "reentrant breaks DDP with find_unused/unused params; non-reentrant works in every DDP mode")
        return Decision("non_reentrant", why + tool, changed=True)
    if facts.checkpoint_function:
        return Decision(asked, f"as requested; the model's own checkpoint function is kept: {facts.checkpoint_function}")
    return Decision(asked, "as requested")
