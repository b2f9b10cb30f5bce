"""No graph walk once a batch signature's usage pattern is established: the check at backward that replaces it.

``ParameterUsage.tie_loss`` walks the autograd graph from the loss each micro-batch (``tracker.py``). Once the
last :data:`ESTABLISH` walks of one batch signature (the forward's positional count and its non-``None``
keyword arguments) found every trainable parameter used, with no exact-zero tie anywhere in the graph
(``ZeroTie.applied`` did not move since the last loss) and no reentrant checkpointed region, that signature's
micro-batches are not walked: :func:`check_at_backward` puts a pre-hook on the loss's node that asks the
autograd engine, when the backward starts and before any other node of the model runs, whether every watched
parameter's ``AccumulateGrad`` will run (``_compat.engine_will_run_all``: C calls mapped in C, no Python loop
per parameter). Yes: all used, as the walk would have said (with no tie in the graph, reached means really
used). No (the usage changed: a text-only batch, LayerDrop, a detached head): :class:`UsageChanged` aborts the
backward before anything accumulated or any DDP hook fired; the wiring (``_compat.around_backward(...,
retry=UsageChanged)``) runs it again, and ``tie_loss`` walks and ties as before; the signature must be
established afresh. Only a wiring that retries (``ParameterUsage.backward_retries``) gets the check.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..._compat import engine_will_run_all
from ...ops import feature_counts
from ...ops.zero_tie import ZeroTie

__all__ = ["ESTABLISH", "UsageChanged", "check_at_backward", "may_skip_walk"]

#: Consecutive walks from the loss of one batch signature that found every trainable parameter used (nothing
#: tied, no reentrant region, no tie anywhere in the graph) before that signature's micro-batches are checked
#: at backward instead of walked.
ESTABLISH = 2


class UsageChanged(RuntimeError):
    """Raised from the first node of a backward whose no-walk check found a parameter that will get no gradient
    (before any other node ran): the caller runs the backward again on ``tie_loss(loss)``, which walks and ties
    (``_compat.around_backward(..., retry=UsageChanged)``)."""





def may_skip_walk(self: Any, loss: torch.Tensor) -> bool:
    """The walk can give way to the check at backward: the wiring retries (``backward_retries``), the route
    is set (``not _predicting``: one scope, every loss seen), ties are on, one forward for this loss, no
    reentrant region, no tie made since the last loss, and this signature's last ``ESTABLISH`` walks found
    every parameter used."""
    return (self.backward_retries and not self._predicting and not self._retrying and self.tie and not self.guard
            and not self._sharded and loss.grad_fn is not None and self._step.pending_forwards == 1
            and not self._step.region_outputs and ZeroTie.applied == self._tie_mark
            and self._established.get(self._sig, 0) >= ESTABLISH)


def check_at_backward(self: Any, loss: torch.Tensor) -> torch.Tensor:
    """No walk: a pre-hook on the loss's node asks the engine, when backward starts (before any other node of
    the model runs), whether every watched parameter's ``AccumulateGrad`` will run. Yes (the established
    pattern holds): every parameter counts as used, as the walk would say (no tie is in this graph, so
    reached means really used). No: the signature's pattern is dropped and :class:`UsageChanged` aborts this
    backward before anything accumulated; the caller's retry walks and ties (counted as ``parameter_usage``
    / ``no_walk_check_failed``). ``loss`` is returned unchanged."""
    if self._grad_nodes is None:
        self._grad_nodes = [torch.autograd.graph.get_gradient_edge(s.tensor()).node for s in self.slots]
    nodes, sig, fired = self._grad_nodes, self._sig, [False]

    def check(grad_outputs: Any) -> None:
        if fired[0]:
            return
        fired[0] = True
        t0 = time.thread_time()
        ok = engine_will_run_all(nodes)
        if ok:
            self._step.loss_seen(self._all)
            self.losses += 1
            self.checks += 1
            if self.last is not None:
                self.last.used_slots = self._all
        self.check_seconds += time.thread_time() - t0
        if not ok:
            self._established[sig] = 0
            self._grad_nodes = None  # taken afresh (a parameter may have been replaced)
            self._retrying = True
            feature_counts.record_amount("parameter_usage", "no_walk_check_failed", 1)
            raise UsageChanged("hf_ddpfix: a parameter will get no gradient in this backward (usage changed); "
                               "accelerator.backward runs it again with the parameter tied in")

    loss.grad_fn.register_prehook(check)
    feature_counts.record_ran("parameter_usage")
    return loss
