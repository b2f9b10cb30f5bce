"""What a `Trainer` evaluation attaches outside `train()` (`hf_ddpfix.trainer.run_evaluation_with_plan`), and the
bitsandbytes CPU-repack switch that training and evaluation under FSDP2 both turn off.

Guarantees: every attach puts its undo on the caller's `ExitStack`; nothing is attached when the plan's decision
is off (tests/test_quantized.py, tests/test_vlm_trainer.py).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any

from torch import nn

from .._compat import disable_cpu_repack
from ..integrations.vision.stabilizer import VisionStabilizer
from ..ops import feature_counts

logger = logging.getLogger("hf_ddpfix")

__all__ = ["attach_eval_sync", "cpu_repack_off"]


def cpu_repack_off(model: nn.Module, stack: ExitStack) -> int:
    """Turn bitsandbytes' in-place CPU repack of 4-bit weights off on `model` (FSDP2 rebuilds each weight from its
    shards every forward: `_compat.disable_cpu_repack`) until `stack` closes, which restores each module's own
    value. Counted as the amount `quantization/cpu_repack_off`. Returns how many modules were switched off."""
    n, undo = disable_cpu_repack(model)
    stack.callback(undo)
    if n:
        feature_counts.record_amount("quantization", "cpu_repack_off", n)
    return n


def attach_eval_sync(model: nn.Module, decision: Any, parallel: str, stack: ExitStack) -> Any:
    """For an evaluation outside `train()`: attach the eval-only stabiliser the plan's `vlm_eval_sync`
    decision asks for (ZeRO-3: `ZeroVisionStabilizer`, FSDP: `VisionStabilizer`, both `train=False,
    sync_eval=True`); its undo goes on `stack`. Returns it, or `None` when the decision is off."""
    if not decision.value:
        return None
    if parallel == "deepspeed":
        from ..integrations.vision.zero import ZeroVisionStabilizer

        try:
            sync: Any = ZeroVisionStabilizer(model, train=False, sync_eval=True).attach()
        except ValueError as err:  # a failed trial run of a discovered family: stock evaluation, said why
            feature_counts.record_fallback("stabilizer", str(err))
            logger.warning("hf_ddpfix: vlm_eval_sync not applied (stock evaluation): %s", err)
            return None
    elif parallel == "fsdp":  # tower units: the dummy at the language model's start, where the tower runs
        from ..integrations.fsdp.cross_attention import CrossAttentionDummy, kept_cross_attention_dummy
        from ..integrations.fsdp.dummy import kept_eval_sync
        from ..integrations.vision.zero import ZeroVisionStabilizer

        if kept_eval_sync(model) is not None or kept_cross_attention_dummy(model) is not None:
            return None  # train() left one attached: it serves this loop
        try:  # Mllama: the tower, the projector and the cross-attention layers on a text-only rank
            sync = CrossAttentionDummy(model).attach()
            stack.callback(sync.remove)
            return sync
        except ValueError:
            pass
        try:
            sync = ZeroVisionStabilizer(model, train=False, sync_eval=True).attach()
        except ValueError:
            sync = VisionStabilizer(model, run_when_frozen=True, train=False, sync_eval=True).attach()
    else:
        sync = VisionStabilizer(model, run_when_frozen=True, train=False, sync_eval=True).attach()
    stack.callback(sync.remove)
    return sync
