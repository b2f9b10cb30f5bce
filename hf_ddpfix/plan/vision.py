"""The plan's vision decisions, under every engine: ``vlm_stabilizer`` (a dummy image so every rank runs the
tower in training) and ``vlm_eval_sync`` (evaluation, prediction and generation forwards agree on images).

One decision, one module (docs/design.md "The plan"): DDP, FSDP2 (whose units decide whether a dummy is needed)
and DeepSpeed ZeRO are all here. Pure functions of :class:`~hf_ddpfix.plan.types.RunFacts` (no
torch.distributed); :func:`decide_vision` is what :func:`hf_ddpfix.plan.resolve.resolve_plan` calls.

Why evaluation needs its own rule (issue: ZeRO-3 evaluation hangs in the README's example): under DeepSpeed ZeRO-3
and FSDP every forward all-gathers parameters, evaluation forwards included. A rank whose evaluation batch has no
image skips the vision tower while a rank with an image runs it, so the ranks issue different collectives: a hang
on NCCL, a size mismatch on gloo, at the first evaluation batch. Under DDP (and ZeRO-0/1/2) an evaluation forward
issues no collective: nothing to do there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..integrations.deepspeed.zero import DeepSpeedFacts
from .fsdp import fsdp_unit_classes, fsdp_units_ours
from .types import Decision, RunFacts

if TYPE_CHECKING:
    from ..config.options import DDPFixConfig
    from ..integrations.fsdp import FsdpFacts

__all__ = ["decide_eval_sync", "decide_stabilizer", "decide_vision", "fsdp_eval_sync", "fsdp_vision_decisions",
           "vision_decision"]

_HOW = ("evaluation / prediction / generation forwards agree across ranks whether any rank has an image (one "
        "all-gather of 1 byte per forward); ranks without one then run the dummy image where the real one runs "
        "(nothing tied under no_grad: outputs exactly stock's), so every rank issues the same {what}")


def decide_eval_sync(facts: RunFacts, c: DDPFixConfig) -> Decision:
    """The plan's ``vlm_eval_sync`` decision.

    Returns:
        ``Decision(None)`` for a text model, one process, or DDP / single (no collective in an evaluation
        forward); ``False`` with the reason where it is not needed or cannot be done (the run keeps stock
        behaviour: mixed image/text evaluation batches then fail as in stock); ``True`` where hf_ddpfix
        makes the forwards agree.

    Guarantees: on only under ZeRO-3 or FSDP with more than one rank, a VLM adapter in that view and the
    stabiliser not disabled (tests/test_vlm.py).
    """
    if not facts.is_vlm or facts.world_size <= 1 or facts.parallel in ("single", "ddp"):
        return Decision(None, "")
    if facts.parallel == "deepspeed":
        stage = facts.deepspeed.stage if facts.deepspeed is not None else facts.zero_stage
        if stage is None:
            return Decision(False, "ZeRO stage unknown: stock evaluation kept")
        if stage < 3:
            return Decision(False, f"not needed: ZeRO-{stage} keeps parameters whole, an evaluation forward "
                            "issues no collective")
        what = "ZeRO-3 all-gathers"
    else:
        what = "FSDP all-gathers"
    if c.vlm_stabilizer is False:
        return Decision(False, f"disabled ({c.source('vlm_stabilizer')}); evaluation batches mixing images and "
                        f"text hang under {facts.parallel} as in stock")
    if facts.vlm_adapter is None:
        return Decision(False, "no dummy image for this VLM family: evaluation batches mixing images and text "
                        f"hang under {facts.parallel} as in stock (give every evaluation batch an image)")
    return Decision(True, f"{facts.vlm_adapter}: " + _HOW.format(what=what), changed=True)


#: how ``vlm_stabilizer``'s reason starts under ZeRO-2/3 when the family has no dummy image: the runtime then
#: attaches :class:`~hf_ddpfix.integrations.vision.mixed_guard.MixedImageGuard`
NO_ZERO_DUMMY = "no adapter for this VLM family"


def vision_decision(
    *, ds: DeepSpeedFacts, is_vlm: bool, adapter: str | None, trainable_vision: bool, disabled: str | None
) -> tuple[bool | None, str, bool]:
    """Whether to run :class:`~hf_ddpfix.integrations.vision.zero.ZeroVisionStabilizer`.

    Needed under ZeRO-2 when tower parameters are trainable (gradient all-reduce sizes) and under ZeRO-3
    for any VLM (a frozen tower is sharded and all-gathered too). ZeRO-0/1 reduce the whole gradient
    buffer (stage 1 zero-fills missing grads): not needed.

    Returns:
        ``(value or None when not a VLM, reason, changed_from_stock)``.
    """
    if not is_vlm:
        return None, "", False
    stage = ds.stage
    if stage is None:
        return False, "ZeRO stage unknown: stock behaviour kept", False
    if stage < 2:
        return False, f"not needed under ZeRO-{stage} (gradients reduced as one flat buffer)", False
    if stage == 2 and not trainable_vision:
        return False, "not needed: no trainable vision parameters (ZeRO-2 keeps parameters whole)", False
    if disabled:
        return False, f"disabled ({disabled}); mixed image/text batches fail in stock ZeRO-{stage}", False
    if adapter is None:
        return False, (f"{NO_ZERO_DUMMY}: batches mixing images and text fail under ZeRO-{stage} as in stock; "
                       "the first such forward stops with a named error, not a mismatch or a hang (1 byte "
                       "all-gathered per forward; give every micro-batch an image, or use DDP / FSDP2)"), False
    what = "all-gathers" if stage == 3 else "gradient all-reduces"
    built = (" (no hand-written family: the dummy is built from vision_config and checked by a trial run "
             "before training; a failed trial keeps stock behaviour and says so)") if adapter.endswith(
        "(from config)") else ""
    return True, (f"{adapter}: text-only micro-batches run a dummy image between the embedding and the "
                  f"language model (exactly-zero contribution), so every rank issues the same ZeRO-{stage} "
                  f"{what}{built}"), True



def _zero_stabilizer(facts: RunFacts, c: DDPFixConfig) -> Decision:
    """The ``vlm_stabilizer`` decision under DeepSpeed (:func:`vision_decision`)."""
    ds = facts.deepspeed or DeepSpeedFacts(stage=facts.zero_stage)
    disabled = c.source("vlm_stabilizer") if c.vlm_stabilizer is False else None
    value, reason, changed = vision_decision(ds=ds, is_vlm=facts.is_vlm, adapter=facts.vlm_adapter,
                                             trainable_vision=facts.trainable_vision_params, disabled=disabled)
    return Decision(value, reason, changed=changed)



def decide_stabilizer(facts: RunFacts, c: DDPFixConfig, distributed: bool, usage: bool = False) -> Decision:
    """The general ``vlm_stabilizer`` rule (DDP, FSDP, ZeRO in :func:`_zero_stabilizer`); FSDP2's own cases:
    :func:`fsdp_vision_decisions`, applied over it by :func:`decide_vision`."""
    if not facts.is_vlm:
        return Decision(None, "")
    if facts.parallel == "deepspeed":
        return _zero_stabilizer(facts, c)
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



def _no_unit_in_skippable(facts: RunFacts, units: Decision) -> bool:
    f = facts.fsdp
    if f is None:
        return False
    if f.wrapped:
        return not f.skipped_units
    if fsdp_units_ours(units):  # the plan's classes (an explicit list less what it folded, or accelerate's less
        return not set(fsdp_unit_classes(units)) & set(f.skippable)  # absent names: see _accelerates_units)
    return (f.policy == "transformer_based_wrap" and f.user_classes is not None
            and not any(n in f.skippable for n in f.user_classes))


_EVAL_NOT_NEEDED = ("not needed under FSDP2: no unit inside the vision tower, so evaluation, prediction and "
                    "generation forwards all-gather the same units in the same order on every rank, images or not")


_DUMMY = ("{family}: units inside the tower (fsdp_skippable = shard): a rank without an image runs the dummy "
          "image at the language model's start, where an image rank runs its tower, tied with an exact-zero "
          "gradient; tower gradients reset to None in a step no rank saw an image (stock DDP find_unused=True)")


_DUMMY_EVAL = ("{family}: evaluation, prediction and generation forwards agree on images across ranks (one "
               "1-byte all-gather each); ranks without one run the dummy image (no grad) where the others run "
               "their tower, so every rank all-gathers the tower's units in the same order")


_DUMMY_CROSS = ("{family}: tower and cross-attention layers are units (fsdp_skippable = shard): a rank without an "
                "image runs a zero image through the tower where an image rank runs it and every cross-attention "
                "layer in its place on zero states (an exact-zero contribution); their gradients reset to None in "
                "a step no rank saw an image (stock DDP find_unused=True)")


_DUMMY_CROSS_EVAL = ("{family}: evaluation, prediction and generation forwards on a rank without an image run the "
                     "tower and the cross-attention layers on zero states (outputs unchanged), so every rank "
                     "all-gathers the same units in the same order")


def _dummy_texts(f: FsdpFacts) -> tuple[str, str]:
    """The (training, evaluation) reasons of the dummy that runs ``f``'s skippable units."""
    if any("CrossAttention" in n for n in f.skippable):  # Mllama: integrations/fsdp/cross_attention.py
        return _DUMMY_CROSS.format(family=f.dummy), _DUMMY_CROSS_EVAL.format(family=f.dummy)
    return _DUMMY.format(family=f.dummy), _DUMMY_EVAL.format(family=f.dummy)


def fsdp_vision_decisions(facts: RunFacts, units: Decision, usage: Decision,
                          skippable: Decision | None = None) -> tuple[Decision, Decision] | None:
    """``(vlm_stabilizer, vlm_eval_sync)`` for a VLM under FSDP2 whose units hold nothing a rank may skip and
    whose unused parameters ``parameter_usage`` ties per unit, or whose tower units the dummy runs
    (``skippable`` is ``"shard"``); ``None``: the general rules decide."""
    if facts.parallel != "fsdp" or facts.fsdp_version != 2 or not facts.is_vlm:
        return None
    if skippable is not None and skippable.value == "shard" and facts.fsdp is not None:
        train, evaluate = _dummy_texts(facts.fsdp)
        return Decision(True, train, changed=True), Decision(True, evaluate, changed=True)
    if not usage.value:
        return None
    if not _no_unit_in_skippable(facts, units):
        return None
    return (
        Decision(False, "not needed under FSDP2: the vision tower and projector have no unit of their own "
                 "(fsdp_units), so every rank all-gathers them with the enclosing unit whether or not it has an "
                 "image; parameter_usage ties what a text-only rank leaves unused (no dummy image runs)"),
        Decision(False, _EVAL_NOT_NEEDED),
    )


def fsdp_eval_sync(facts: RunFacts, units: Decision, eval_sync: Decision,
                   skippable: Decision | None = None) -> Decision:
    """``vlm_eval_sync`` for an evaluation outside ``train()``: not needed where no unit lies inside a subtree
    a rank may skip (the units hf_ddpfix chooses), else ``eval_sync`` (the general rule)."""
    if facts.parallel == "fsdp" and facts.fsdp_version == 2 and facts.is_vlm and facts.fsdp is not None:
        f = facts.fsdp
        if (f.wrapped and f.skipped_units and f.dummy) or (not f.wrapped and skippable is not None
                                                          and skippable.value == "shard"):
            return Decision(True, _dummy_texts(f)[1], changed=True)
    if facts.parallel == "fsdp" and facts.fsdp_version == 2 and facts.is_vlm and _no_unit_in_skippable(facts, units):
        return Decision(False, _EVAL_NOT_NEEDED)
    return eval_sync



def decide_vision(facts: RunFacts, c: DDPFixConfig, distributed: bool, units: Decision, usage: Decision,
                  skippable: Decision | None = None) -> tuple[Decision, Decision]:
    """``(vlm_stabilizer, vlm_eval_sync)``: the general rules, and FSDP2's own cases over them
    (:func:`fsdp_vision_decisions`: the plan's units decide whether a dummy image is needed)."""
    stabilizer = decide_stabilizer(facts, c, distributed, bool(usage.value))
    eval_sync = decide_eval_sync(facts, c)
    fsdp_vision = fsdp_vision_decisions(facts, units, usage, skippable)
    if fsdp_vision is not None:
        stabilizer, eval_sync = fsdp_vision
    return stabilizer, eval_sync
