"""The plan's decisions that exist only under DDP: `find_unused_parameters`, `static_graph` and the hang guard.

Pure rules (facts + options -> `Decision` with its reason); :func:`decide_ddp` is what
:func:`hf_ddpfix.plan.resolve.resolve_plan` calls (once); the failure table they avoid is in that module's
docstring. The decisions every engine makes (checkpointing, parameter usage, the VLM stabiliser) have their own
modules (docs/design.md "The plan").
"""

from __future__ import annotations

from ..config.options import DDPFixConfig
from .types import Correct, Decision, PlanError, RunFacts

__all__ = ["decide_ddp", "decide_find_unused", "decide_hang_guard", "decide_static_graph", "unused_reason"]


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


def decide_ddp(facts: RunFacts, c: DDPFixConfig, mode: str, checkpointed: bool, stabilizer: Decision,
               usage: Decision, correct: Correct) -> tuple[Decision, Decision, Decision]:
    """``(find_unused_parameters, static_graph, hang_guard)``; each ``Decision(None)`` where the run is not DDP
    (the hang guard aside: see :func:`decide_hang_guard`).

    Raises:
        PlanError: reentrant checkpointing with parameters that go unused (:func:`decide_find_unused`), or an
            explicit setting known to fail, with ``strict`` (through ``correct``).
    """
    ddp = facts.parallel == "ddp"
    unused = unused_reason(facts, bool(stabilizer.value), usage)
    fu = decide_find_unused(facts, c, ddp, mode, unused, bool(stabilizer.value), correct, usage)
    static = decide_static_graph(facts, c, ddp, checkpointed, unused, correct)
    guard = decide_hang_guard(facts, c, ddp, bool(fu.value), bool(stabilizer.value), bool(usage.value))
    return fu, static, guard
