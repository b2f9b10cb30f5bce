"""No graph walk once a batch signature's usage pattern is established: the check at backward that replaces it.

``ParameterUsage.tie_loss`` walks the autograd graph from the loss each micro-batch (``tracker.py``). Once the
last :data:`ESTABLISH` walks of one batch signature (the forward's positional count and its non-``None``
keyword arguments) found every trainable parameter used, with no exact-zero tie anywhere in the graph
(``ZeroTie.applied`` did not move since the last loss) and no reentrant checkpointed region, that signature's
micro-batches are not walked: :meth:`NoWalkCheck.install` puts a pre-hook on the loss's node that asks the
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
from collections.abc import Callable
from typing import Any

import torch

from ..._compat import engine_will_run_all
from ...ops import feature_counts
from ...ops.zero_tie import ZeroTie

__all__ = ["ESTABLISH", "NoWalkCheck", "UsageChanged"]

#: Consecutive walks from the loss of one batch signature that found every trainable parameter used (nothing
#: tied, no reentrant region, no tie anywhere in the graph) before that signature's micro-batches are checked
#: at backward instead of walked.
ESTABLISH = 2


class UsageChanged(RuntimeError):
    """Raised from the first node of a backward whose no-walk check found a parameter that will get no gradient
    (before any other node ran): the caller runs the backward again on ``tie_loss(loss)``, which walks and ties
    (``_compat.around_backward(..., retry=UsageChanged)``)."""





class NoWalkCheck:
    """One tracker's no-walk state: the signatures' established counts, the tie mark, the check at backward.

    ``ParameterUsage`` calls :meth:`new_forward` from its root pre-hook, :meth:`may_skip` in ``tie_loss``,
    :meth:`install` when it may, :meth:`walked` after each walk from the loss it decides by.

    Attributes: ``checks`` (micro-batches decided by the check), ``check_seconds`` (its thread CPU time: it
    runs inside backward), ``failed`` (checks that found a parameter left out: the backward was retried).
    """

    def __init__(self) -> None:
        self.sig: Any = None  # the current training forward's batch signature
        self.established: dict[Any, int] = {}  # signature -> consecutive all-used clean walks from the loss
        self.tie_mark = -1  # ZeroTie.applied after the last loss handled (a tie made since: walk)
        self.retrying = False  # the last check failed: the retry's tie_loss walks
        self.grad_nodes: list[Any] | None = None  # every slot's AccumulateGrad node (held; DDP holds them too)
        self.checks, self.check_seconds, self.failed = 0, 0.0, 0

    def new_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training forward starts: its signature (positional count, the names of non-``None`` keywords)."""
        self.sig = (len(args), tuple(sorted(k for k, v in kwargs.items() if v is not None)))

    def may_skip(self, loss: torch.Tensor, ready: bool, pending_regions: bool) -> bool:
        """True when this loss need not be walked: ``ready`` (the tracker's own conditions: the wiring retries,
        the route is set, ties on, one scope, one forward for this loss), no reentrant region pending, no tie
        made since the last loss, not a retry, and the signature's last ``ESTABLISH`` walks were all-used."""
        return (ready and not self.retrying and not pending_regions and loss.grad_fn is not None
                and ZeroTie.applied == self.tie_mark and self.established.get(self.sig, 0) >= ESTABLISH)

    def walked(self, all_used: bool, pending_regions: bool) -> None:
        """A walk from the loss decided (call before any tie it makes): count the signature's pattern when the
        walk found every parameter used in a clean graph (no region, no tie since the last loss)."""
        clean = all_used and not pending_regions and ZeroTie.applied == self.tie_mark
        self.established[self.sig] = self.established.get(self.sig, 0) + 1 if clean else 0
        self.retrying = False

    def loss_done(self) -> None:
        """The loss was handled (walked and tied, or checked): ties made so far are accounted for."""
        self.tie_mark = ZeroTie.applied

    def take_nodes(self, tensors: Callable[[], list[torch.Tensor]]) -> bool:
        """Take (once, until forgotten) the ``AccumulateGrad`` node of every tensor of ``tensors()``; False, and
        nothing taken, when one does not require grad (frozen since the nodes were last taken: the caller walks)."""
        if self.grad_nodes is None:
            ts = tensors()
            if not all(t.requires_grad for t in ts):
                return False
            self.grad_nodes = [torch.autograd.graph.get_gradient_edge(t).node for t in ts]
        return True

    def install(self, loss: torch.Tensor, tensors: Callable[[], list[torch.Tensor]],
                all_used: Callable[[], None]) -> torch.Tensor:
        """Put the check on ``loss``'s node (returned unchanged): when backward starts, every ``AccumulateGrad``
        of ``tensors()`` must be about to run; then ``all_used()`` records the micro-batch as all used, else
        :class:`UsageChanged` is raised there (the signature's pattern dropped, counted as ``parameter_usage``
        / ``no_walk_check_failed``)."""
        if self.grad_nodes is None:
            self.grad_nodes = [torch.autograd.graph.get_gradient_edge(t).node for t in tensors()]
        nodes, sig, fired = self.grad_nodes, self.sig, [False]

        def check(grad_outputs: Any) -> None:
            if fired[0]:
                return
            fired[0] = True
            t0 = time.thread_time()
            ok = engine_will_run_all(nodes)
            if ok:
                all_used()
                self.checks += 1
            self.check_seconds += time.thread_time() - t0
            if not ok:
                self.established[sig] = 0
                self.grad_nodes = None  # taken afresh (a parameter may have been replaced)
                self.retrying = True
                self.failed += 1
                feature_counts.record_amount("parameter_usage", "no_walk_check_failed", 1)
                raise UsageChanged("hf_ddpfix: a parameter will get no gradient in this backward (usage changed); "
                                   "accelerator.backward runs it again with the parameter tied in")

        loss.grad_fn.register_prehook(check)
        self.loss_done()
        return loss
