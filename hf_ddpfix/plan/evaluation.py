"""The plan's ``eval_outputs`` decision: do the ranks agree on the prediction fields the Trainer gathers in
evaluation and prediction? A pure function of :class:`~hf_ddpfix.plan.types.RunFacts`.

Why (issues 36/37, REFERENCES.md §14): ``Trainer.evaluation_loop`` pads and gathers every tensor of each step's
prediction tuple. A field present on some ranks only (transformers 5.24's ``image_outputs``; 5.23's
``image_hidden_states`` of LLaVA-style families) makes the ranks issue different collectives: gloo "448 vs 8"
bytes, NCCL a hang — under DDP, FSDP2 and ZeRO alike (the gather is the Trainer's, not the wrapper's). The
mechanism: :mod:`hf_ddpfix.integrations.eval_outputs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .types import Decision, RunFacts

if TYPE_CHECKING:
    from ..config.options import DDPFixConfig

__all__ = ["EVAL_OUTPUTS_HOW", "decide_eval_outputs"]

#: The plan line's reason: the whole line fits the report's 160 characters uncut (docs/plan.md#eval_outputs).
EVAL_OUTPUTS_HOW = ("predictions keep the fields all ranks have at eval step 1 (1 small all_gather_object a loop); "
                    "the rest dropped")


def decide_eval_outputs(facts: RunFacts, c: DDPFixConfig) -> Decision:
    """The plan's ``eval_outputs`` decision.

    Returns:
        ``Decision(None)`` with one process (nothing is gathered across ranks); ``False`` when disabled (stock
        gathers: fields that differ by rank fail them as in stock); ``True`` otherwise, any model: whether its
        outputs differ by rank is observed at run time, never predicted from the model's kind.

    Guarantees: on for every parallel mode with more than one process unless ``eval_outputs`` is off
    (tests/test_eval_outputs.py).
    """
    if facts.world_size <= 1 or facts.parallel == "single":
        return Decision(None, "")
    if c.eval_outputs is False:
        return Decision(False, f"disabled ({c.source('eval_outputs')}): an output field some ranks lack fails the "
                        "Trainer's prediction gathers as in stock")
    return Decision(True, EVAL_OUTPUTS_HOW, changed=True)
