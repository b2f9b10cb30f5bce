"""Vision decisions outside training steps: do evaluation, prediction and generation forwards need to agree
across ranks? A pure function of :class:`~hf_ddpfix.plan.types.RunFacts` (no torch.distributed).

Why (issue: ZeRO-3 evaluation hangs in the README's example): under DeepSpeed ZeRO-3 and FSDP every forward
all-gathers parameters, evaluation forwards included. A rank whose evaluation batch has no image skips the
vision tower while a rank with an image runs it, so the ranks issue different collectives: a hang on NCCL,
a size mismatch on gloo, at the first evaluation batch. Under DDP (and ZeRO-0/1/2) an evaluation forward
issues no collective: nothing to do there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .types import Decision, RunFacts

if TYPE_CHECKING:
    from ..config import DDPFixConfig

__all__ = ["decide_eval_sync"]

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
