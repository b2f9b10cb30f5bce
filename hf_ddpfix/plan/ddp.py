"""The plan's DDP decisions: checkpointing variant, parameter usage, VLM stabiliser, `find_unused_parameters`,
`static_graph` and the hang guard.

Pure rules (facts + options -> `Decision` with its reason), called in this order by
:func:`hf_ddpfix.plan.resolve.resolve_plan`; the failure table they avoid is in that module's docstring.
"""

from __future__ import annotations

from ..config import DDPFixConfig
from . import deepspeed as ds_rules
from .fsdp import fsdp_usage_reason
from .types import Correct, Decision, PlanError, RunFacts


def decide_checkpointing(facts: RunFacts, c: DDPFixConfig, distributed: bool, correct: Correct) -> Decision:
    asked = facts.checkpointing
    if facts.parallel == "deepspeed" and facts.deepspeed is not None:
        return ds_rules.checkpointing(facts, c, correct)
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


# The long form (how the usage is observed, what it costs, stock fu=True semantics) is docs/plan.md#parameter_usage:
# a plan line fits a terminal (Plan.report).
_USAGE_HOW = "unused trainable parameters tied into the loss with exact-zero gradients at run time"
_USAGE_COST = "docs/plan.md#parameter_usage"


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


def decide_stabilizer(facts: RunFacts, c: DDPFixConfig, distributed: bool, usage: bool = False) -> Decision:
    if not facts.is_vlm:
        return Decision(None, "")
    if facts.parallel == "deepspeed":
        return ds_rules.stabilizer(facts, c)
    needs = distributed and (facts.trainable_vision_params or facts.parallel == "fsdp")
    if not needs:
        why = "no trainable vision parameters" if distributed else "single process"
        return Decision(False, f"not needed: {why}")
    if usage and facts.parallel == "ddp":
        return Decision(False, "not needed under DDP: parameter_usage ties the unused vision parameters in "
                        "(no dummy image forward)")
    if c.vlm_stabilizer is False:
        return Decision(False, f"disabled ({c.source('vlm_stabilizer')})")
    if facts.vlm_adapter is None:
        return Decision(False, "no adapter for this VLM family: safe fallback (non-reentrant + find_unused)")
    return Decision(
        True,
        f"{facts.vlm_adapter}: text-only steps run a dummy image (exactly-zero contribution) so every rank "
        "uses every vision parameter",
        changed=True,
    )


def unused_reason(facts: RunFacts, stabilized: bool, usage: Decision | None = None) -> str | None:
    """Why some trainable parameters may go unused in a step (None: every one is used every step).

    With the parameter-usage mechanism on, none can (it ties them in). With it explicitly off, hf_ddpfix
    cannot prove that no layer is skipped (a text-only step in Mllama, LayerDrop, a branch), so stock's
    choice stays: that reason is returned whenever stock would pick find_unused_parameters=True.
    """
    if usage is not None and usage.value:
        return None
    if facts.trainable_vision_params and not stabilized:
        return "trainable vision parameters go unused on steps without images"
    if facts.conditional_params:
        return "conditionally used parameters (e.g. MoE experts)"
    if usage is not None and usage.value is False and facts.stock_find_unused():
        return "parameter_usage is off, so nothing proves every trainable parameter is used every step"
    return None


def decide_find_unused(
    facts: RunFacts,
    c: DDPFixConfig,
    ddp: bool,
    ckpt: str,
    unused: str | None,
    stabilized: bool,
    correct: Correct,
    usage: Decision | None = None,
) -> Decision:
    if not ddp:
        return Decision(None, "")
    stock = facts.stock_find_unused()
    explicit = facts.user_find_unused if c.find_unused_parameters is None else c.find_unused_parameters
    source = "ddp_find_unused_parameters" if c.find_unused_parameters is None else c.source("find_unused_parameters")
    if ckpt == "reentrant":
        # reentrant checkpointing fires a parameter's hook in the recompute too: only fu=False works
        if unused is not None:
            raise PlanError(
                f"reentrant checkpointing cannot work under DDP here: {unused}. Use non-reentrant "
                "checkpointing (HF_DDPFIX_CHECKPOINTING=non_reentrant) or enable the VLM stabiliser"
            )
        if explicit:
            correct(f"find_unused_parameters=True ({source}) -> False: with reentrant checkpointing it fails "
                    "with 'Expected to mark a variable ready only once'")
        return Decision(False, "reentrant checkpointing: only find_unused=False works", changed=stock is not False)
    if (explicit is True and stabilized and not facts.conditional_params and unused is None
            and c.find_unused_parameters is None and not c.strict):
        correct(  # not strict here, so this only lists the correction
            "find_unused_parameters=True (ddp_find_unused_parameters) -> False: the VLM stabiliser uses every "
            "vision parameter every step, so the extra graph traversal buys nothing "
            "(HF_DDPFIX_FIND_UNUSED_PARAMETERS=1 forces it)"
        )
        return Decision(False, "stabiliser: every parameter is used every step", changed=stock is not False)
    if explicit is True:
        return Decision(True, f"explicit ({source})", changed=stock is not True)
    if c.find_unused_parameters is False and unused is not None:
        # a forced setting is a power-user choice (e.g. every batch has images): honoured, guarded
        return Decision(False, f"forced ({source}) although {unused}; the hang guard raises if ranks disagree",
                        changed=stock is not False)
    if explicit is False:
        if unused is not None:
            correct(f"find_unused_parameters=False ({source}) -> True: {unused}, which crashes or hangs DDP")
            return Decision(True, unused, changed=stock is not True)
        return Decision(False, f"explicit ({source})", changed=stock is not False)
    if unused is not None:
        return Decision(True, unused, changed=stock is not True)
    why = ("every trainable parameter reaches the loss (tied in where not)"
           if usage is not None and usage.value else "every trainable parameter is used every step")
    if facts.is_peft and stock:
        why += "; stock: True for a PeftModel (a graph walk a step)"
    return Decision(False, why, changed=stock is not False)


def decide_static_graph(
    facts: RunFacts, c: DDPFixConfig, ddp: bool, checkpointed: bool, unused: str | None, correct: Correct
) -> Decision:
    if not ddp:
        return Decision(None, "")
    stock = bool(facts.user_static_graph)
    # a failure known from the stock table forbids it; an env override disables it
    forbidden = None
    if facts.grad_accum_steps > 1:
        forbidden = (f"gradient_accumulation_steps={facts.grad_accum_steps} uses no_sync, which static graph "
                     "breaks (expect_autograd_hooks_ INTERNAL ASSERT)")
    elif unused is not None:
        forbidden = f"the graph changes between steps ({unused})"
    disabled = None
    if c.static_graph is False:
        disabled = f"disabled ({c.source('static_graph')})"
    elif checkpointed and c.static_graph_with_checkpointing is False:
        disabled = f"disabled with checkpointing ({c.source('static_graph_with_checkpointing')})"
    wanted = c.static_graph if c.static_graph is not None else facts.user_static_graph
    if forbidden:
        if wanted:
            src = "ddp_static_graph" if c.static_graph is None else c.source("static_graph")
            correct(f"static_graph=True ({src}) -> False: {forbidden}")
        return Decision(False, f"off: {forbidden}", changed=stock)
    if disabled:
        return Decision(False, disabled, changed=stock)
    if wanted is False:
        return Decision(False, "explicitly off", changed=stock)
    reason = "graph is fixed (every trainable parameter used every step, no accumulation)"
    return Decision(True, reason + ("" if wanted else ": DDP skips per-step graph search"), changed=not stock)


def decide_hang_guard(
    facts: RunFacts, c: DDPFixConfig, ddp: bool, fu: bool, stabilized: bool, usage: bool = False
) -> Decision:
    if ddp and not fu and not usage and not facts.is_vlm and c.parameter_usage is False:
        if c.hang_guard is False:
            return Decision(False, f"disabled ({c.source('hang_guard')})")
        return Decision(True, "find_unused=False without parameter_usage: before each backward ranks check that "
                        "every trainable parameter gets a gradient (one all-gather of 1 byte per tensor)", True)
    if not (ddp and facts.is_vlm):
        return Decision(None, "")
    if not facts.trainable_vision_params:
        return Decision(False, "not needed: no trainable vision parameters")
    if fu or stabilized or usage:
        why = "find_unused=True" if fu else "stabiliser uses every parameter" if stabilized else (
            "parameter_usage ties every parameter in")
        return Decision(False, "not needed: " + why)
    if c.hang_guard is False:
        return Decision(False, f"disabled ({c.source('hang_guard')})")
    return Decision(True, "VLM without stabiliser under find_unused=False: ranks must agree on image use", True)
