"""Who used what: every trainable parameter used on every rank every step (DDP / FSDP2), and the guard.

- ``tracker.py``: :class:`ParameterUsage`, the per-forward observation and the tie at the loss given to
  backward; ``finalize.py``: its per-step finalize (the cross-rank "unused" agreement, ``.grad = None``);
  ``real_grads.py``: a real gradient outside the loss seen counts as used in the step.
- ``scopes.py``: parameter slots and FSDP2 unit scopes; ``regions.py``: what reentrant checkpointed layers
  read; ``agreement.py``: the cross-rank guard table and the step's "used" mask (asynchronous);
  ``step.py``: what the current optimizer step has seen; ``outputs.py``: the log record, where a tie goes;
  ``no_walk.py``: no graph walk once a batch signature's usage is established (a check at backward instead).
- ``hang_guard.py``: the VLM hang guard and :class:`UnusedParametersError`.

Why: DDP with ``find_unused_parameters=False`` (fu=False) or ``static_graph=True`` needs every trainable
parameter's gradient hook to fire exactly once per synchronising backward on every rank, and FSDP2 needs
every rank to reduce-scatter the same set of gradients. Real models skip parameters: a text-only step
skips a vision tower (Qwen-VL, LLaVA, Gemma 3, ...) or Mllama's cross-attention layers, LayerDrop skips
random layers per rank, a router sends no token to an expert. Stock avoids the failure with fu=True (an
extra graph traversal per step); hf_ddpfix gets fu=False and static graph *by construction* instead:

1. **Observe.** After each training forward, :class:`ParameterUsage` walks the autograd graph from the
   output (the loss, else the logits) and collects the trainable parameters whose ``AccumulateGrad``
   node it reaches: exactly those that will receive a gradient. A module that ran but whose output
   never reached the loss is therefore *not* counted as used (forward hooks alone would count it).
   Reentrant checkpointing runs a layer's forward under ``no_grad``; the graph then holds only the
   checkpoint node, so each reentrant checkpoint call runs under a ``TorchFunctionMode`` that records
   which trainable parameters its ops read (recompute in backward is not observed: it is the same
   layer). A region whose output does not require grad gives its parameters no gradient and counts
   as "not used".
2. **Tie.** Every trainable parameter not observed is tied into the output with
   :class:`hf_ddpfix.ops.zero_tie.ZeroTie`: identity forward (the loss is a bitwise copy), exact-zero
   gradient to the parameter. Its hook fires once, its gradient is ``0`` (``g + 0 == g`` bit for bit).
   Under FSDP2 the tie is made per FSDP unit, in a forward hook that runs before FSDP reshards (the
   unsharded parameter gets the zero; every rank reduce-scatters the same set).
3. **Finalize** (:meth:`ParameterUsage.finalize`, once per optimizer step, after the last backward and
   *before* gradient clipping): one all-reduce(MAX) of a one-byte-per-parameter "really used in some
   micro-batch of this step" mask; where no rank used a parameter its ``.grad`` is set back to ``None``
   — what stock DDP(fu=True) leaves (AdamW then skips it: no moment update, no weight decay). Where
   some rank used it, the others contributed exact zeros, which is what stock's reducer averages too.
   The all-reduce is issued asynchronously and read on the host only by a rank that itself left some
   parameter unused or changed its trainable set (:class:`~.agreement.UsageAgreement`; the trainable-set
   watch's flag rides in it): a text LoRA step reads nothing from the device (the others read the flag's two
   bytes late, from host memory: ``UsageAgreement.late_flags``).

The names below are this folder's public face (``from hf_ddpfix.integrations.usage import ParameterUsage``).
"""

from .hang_guard import HangGuard, UnusedParametersError
from .tracker import UNSEEN_LOSS, ParameterUsage, UsageChanged, UsageRecord, reachable_leaf_ids

__all__ = ["UNSEEN_LOSS", "HangGuard", "ParameterUsage", "UnusedParametersError", "UsageChanged", "UsageRecord",
           "reachable_leaf_ids"]
