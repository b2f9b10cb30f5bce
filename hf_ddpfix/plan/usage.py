"""The plan's ``parameter_usage`` decision, under every engine: the generic "every parameter used" mechanism
(:mod:`hf_ddpfix.integrations.usage`) under DDP and FSDP2; off (``None``) elsewhere.

One decision, one module (docs/design.md "The plan"). Pure; called once by
:func:`hf_ddpfix.plan.resolve.resolve_plan`.
"""

from __future__ import annotations

from ..config.options import DDPFixConfig
from .types import Decision, RunFacts

__all__ = ["decide_parameter_usage", "fsdp_usage_reason"]

# The long form (how the usage is observed, what it costs, stock fu=True semantics) is docs/plan.md#parameter_usage:
# a plan line fits a terminal (Plan.report).
_USAGE_HOW = "unused trainable parameters tied into the loss with exact-zero gradients at run time"

_USAGE_COST = "docs/plan.md#parameter_usage"



def fsdp_usage_reason() -> str:
    """The ``parameter_usage`` reason under FSDP2."""
    return ("per FSDP unit: every trainable parameter of a unit that this rank's forward (and the loss given to "
            "backward) does not reach is tied into the unit's output with an exact-zero gradient (moved into the "
            "loss at backward when the loss is built from another output, e.g. TRL's fused LM head), so every rank "
            "reduce-scatters the same gradients in the same order; grads no rank used in the step are reset to "
            "None before clipping (stock DDP find_unused=True semantics); cost: one graph walk per forward and one "
            "per loss, one all-reduce of 1 byte per trainable tensor per step")



def decide_parameter_usage(facts: RunFacts, c: DDPFixConfig, ckpt: str) -> Decision:
    """The generic "every parameter used" mechanism (hf_ddpfix.integrations.usage) under DDP and FSDP2."""
    if facts.parallel == "fsdp" and facts.fsdp_version == 2 and facts.fsdp is not None:
        if c.parameter_usage is False:
            return Decision(False, f"disabled ({c.source('parameter_usage')}): a rank that leaves a trainable "
                            "parameter of a unit unused reduce-scatters a different set (fails as in stock)")
        if facts.loss_unseen is not None:
            return Decision(False, f"cannot observe the loss that is back-propagated ({facts.loss_unseen}): stock "
                            "FSDP kept")
        return Decision(True, fsdp_usage_reason(), changed=True)
    if facts.parallel != "ddp":
        return Decision(None, "")
    if c.parameter_usage is False:
        return Decision(False, f"disabled ({c.source('parameter_usage')}): stock find_unused_parameters kept")
    explicit = facts.user_find_unused if c.find_unused_parameters is None else c.find_unused_parameters
    if explicit is True and ckpt != "reentrant":  # reentrant: fu=True fails, the mechanism makes fu=False work
        return Decision(False, "not needed: explicit find_unused_parameters=True lets DDP find unused parameters")
    if facts.loss_unseen is not None:
        return Decision(False, f"cannot observe the loss that is back-propagated ({facts.loss_unseen}): stock "
                        "find_unused_parameters kept")
    return Decision(True, f"{_USAGE_HOW} ({_USAGE_COST})", changed=True)
