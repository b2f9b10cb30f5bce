"""Who used what: every trainable parameter used on every rank every step (DDP / FSDP2), and the guard.

- ``tracker.py``: :class:`ParameterUsage`, the per-forward observation, the tie at the loss given to
  backward and the per-step finalize.
- ``scopes.py``: parameter slots and FSDP2 unit scopes; ``regions.py``: what reentrant checkpointed layers
  read; ``agreement.py``: the cross-rank guard table and the step's "used" mask (asynchronous);
  ``step.py``: what the current optimizer step has seen; ``outputs.py``: the log record, where a tie goes.
- ``hang_guard.py``: the VLM hang guard and :class:`UnusedParametersError`.

The names below are this folder's public face (``from hf_ddpfix.integrations.usage import ParameterUsage``).
"""

from .hang_guard import HangGuard, UnusedParametersError
from .tracker import UNSEEN_LOSS, ParameterUsage, UsageRecord, reachable_leaf_ids

__all__ = ["UNSEEN_LOSS", "HangGuard", "ParameterUsage", "UnusedParametersError", "UsageRecord", "reachable_leaf_ids"]
