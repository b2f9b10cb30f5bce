"""Every trainable parameter used on every rank every step, for any model, with stock semantics.

How (observe, tie, finalize) and why: the package docstring (``integrations/usage/__init__.py``). At most one
walk per micro-batch, none once established: with the Trainer wiring (``at_loss``) and no FSDP2 units the forward's
own walk (a prediction) runs only until the loss route is set (a step whose every loss was seen at backward; a loss
then unseen brings it back, counted, logged once); then the walk from the loss, until a batch signature's pattern is
established, then a check at backward instead (``no_walk.py``). Tests: tests/scripts/usage_zoo.py.

Guard (``guard=True``: nothing tied): before backward, ranks all-gather "gets no gradient here" per parameter;
any entry raises :class:`UnusedParametersError` on every rank (parameters, modules, ranks, fix), never a hang.

Cost (benchmarks/usage_python_cost.py): a walk is ~2-4 µs per autograd node (8-18 ms for a 32-layer LoRA Llama's
4.7k nodes); the check at backward ~50 µs; one zero tensor per tied parameter; one asynchronous all-reduce of
``n_trainable`` (+2) bytes per optimizer step; with ``guard`` one all-gather per synchronising forward.

Trainer wiring: attach before or after ``Trainer.train`` wraps the model; :meth:`~ParameterUsage.finalize` runs before
the Trainer clips or measures gradients (``_compat.before_gradient_clipping``).

Guarantees: with fu=False (static graph at accumulation 1) every zoo family trains to stock DDP(fu=True)'s weights
(1e-6; bit-equal where the math is unchanged), replicas in sync, reentrant or non-reentrant checkpointing, GA 1 and 2.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..._compat import ddp_syncs_grads, is_ddp_sink_node, unwrap_parallel
from ...ops import feature_counts
from ...ops.autograd_reach import output_tensors, reachable_leaf_ids, reachable_leaf_ids_split
from ...ops.zero_tie import ZeroTie, is_zero_tie_node
from .agreement import UNUSED_FIX, UsageAgreement, gather_missing, raise_if_missing
from .finalize import UNSEEN_LOSS, StepFinalize
from .hang_guard import UnusedParametersError
from .loss_observer import observe_loss
from .no_walk import ESTABLISH, NoWalkCheck, UsageChanged
from .outputs import UsageRecord, anchor_of, replace_in
from .real_grads import watch_real
from .regions import ReentrantRegions
from .scopes import Scope, build_scopes, collect_slots, unit_pre_hook
from .step import StepRecord

__all__ = ["ESTABLISH", "UNSEEN_LOSS", "ParameterUsage", "UsageChanged", "UsageRecord", "UnusedParametersError",
           "reachable_leaf_ids"]


class ParameterUsage(StepFinalize):
    """Observe, tie and finalize: every trainable parameter takes part in every backward.

    Usage (plain PyTorch; the Trainer wiring is in the module docstring)::

        usage = ParameterUsage(model).attach()        # before or after DDP wrapping
        ddp = DDP(model, find_unused_parameters=False, static_graph=(ga == 1))
        for step in ...:
            for micro_batch in ...:                   # no_sync for all but the last
                ddp(**micro_batch).loss.backward()
            usage.finalize()                          # before clip_grad_norm_ and optimizer.step()

    Args:
        model: any ``nn.Module`` (HF model, PeftModel, DDP/compiled wrapper): hooks go on the module
            without DDP / compile wrappers, whose forward output carries the loss (or the logits).
        tie: tie unobserved parameters in (the mechanism). ``False``: observe only (with ``guard``).
        guard: before each synchronising backward, all-gather "gets no gradient here" per parameter and
            raise :class:`UnusedParametersError` on every rank when any rank has one. Default: on
            exactly when ``tie`` is off.
        units: FSDP2 units (modules passed to ``fully_shard``), any order; each unit ties the
            parameters it owns in its own forward (before FSDP reshards). Default: one scope, the root.
        ddp_module: the DDP wrapper; the guard skips its ``no_sync`` micro-batches.
        process_group: group for finalize and guard collectives (default WORLD).
        allow_region_reuse: a parameter read in two reentrant checkpointed layers fires its DDP hook
            twice, which DDP accepts only with ``static_graph``; ``False`` raises a named error.

    Guarantees: the loss and every gradient of a used parameter are bit-identical to the untouched
    model's; tied parameters get exact zeros; after :meth:`finalize`, ``.grad is None`` exactly for the
    parameters no rank used in any micro-batch of the step (tests/test_usage.py,
    tests/scripts/usage_zoo.py).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tie: bool = True,
        guard: bool | None = None,
        units: Iterable[nn.Module] | None = None,
        ddp_module: nn.Module | None = None,
        process_group: Any = None,
        allow_region_reuse: bool = True,
    ) -> None:
        self.model = model
        self.root = unwrap_parallel(model)
        self.tie = tie
        self.guard = (not tie) if guard is None else guard
        self.ddp_module, self.process_group, self.allow_region_reuse = ddp_module, process_group, allow_region_reuse
        self.slots = collect_slots(self.root)
        self._sharded = units is not None  # FSDP2 swaps the tensor objects: no cached id index
        self.scopes = build_scopes(self.root, self.slots, list(units) if units is not None else [self.root])
        self._all = frozenset(range(len(self.slots)))
        self._index_cache: dict[int, int] | None = None
        self._handles: list[Any] = []
        self._regions = ReentrantRegions(active=lambda: self._active, watched=lambda: self._index().keys())
        self.agreement = UsageAgreement()
        #: a per-rank, per-step flag carried in the agreement's all-reduce (the trainable-set watch's "my set
        #: changed"); its agreed value is kept in ``step_flags`` until :meth:`take_step_flags`
        self.step_flag: Callable[[], bool] | None = None
        self.step_flags: tuple[bool, bool] | None = None
        #: a per-rank "saw it this step" carried in the same all-reduce (the FSDP2 dummy's "passed an image"); the
        #: agreed "some rank saw it" is ``agreement.take_seen()``
        self.step_seen: Callable[[], bool | None] | None = None
        self._active, self._depth = False, 0
        self._forward_used: set[int] = set()
        self._step = StepRecord()
        self._warned_unseen = False
        self._route_set = False  # every training forward's loss so far was seen at `tie_loss` for a whole step
        self._route_lost = False  # ... and then one was not: the forward's own walk runs for the rest of the run
        self._predicting = True
        self.at_loss = self.backward_retries = False  # set by whoever routes every loss through `tie_loss` / retries
        self.no_walk = NoWalkCheck()  # no walk once a batch signature's usage is established (no_walk.py)
        self._frozen: frozenset[int] = frozenset()  # slots frozen after wrapping, as the last walk found them
        self._frozen_tensors: list[torch.Tensor] = []
        self.last: UsageRecord | None = None
        self.forwards = self.walks = self.ties = self.losses = self.loss_ties = self.resets = 0
        self.seconds = 0.0

    # -- set-up -------------------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        """True while the hooks are registered."""
        return bool(self._handles)

    def attach(self) -> ParameterUsage:
        """Register the hooks (idempotent). Returns ``self``."""
        if self._handles or not self.slots:
            return self
        root_scope = self._root_scope()
        self._handles.append(self.root.register_forward_pre_hook(self._root_pre_hook, prepend=True, with_kwargs=True))
        for scope in self.scopes:
            if scope is not root_scope:  # prepend: before FSDP2's pre-forward registers its backward hooks
                hook = unit_pre_hook(scope, lambda: self._active, several_units=len(self.scopes) > 1)
                self._handles.append(scope.module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True))
            # prepend: run before FSDP2's post-forward reshards the unit (the tie needs unsharded params)
            self._handles.append(
                scope.module.register_forward_hook(self._scope_post_hook(scope, scope is root_scope), prepend=True)
            )
        self._handles += self._regions.attach(self.root)
        return self

    def remove(self) -> None:
        """Remove the hooks and restore wrapped checkpoint functions (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._regions.remove()
        self._active = False
        self.agreement.wait()
        self.reset_step()

    def set_units(self, units: Iterable[nn.Module]) -> None:
        """Re-scope onto FSDP2 units made after :meth:`attach` (accelerate shards inside ``train()``), as if given
        to the constructor: slots read again, each unit ties what it owns; forgets the step (call between steps)."""
        attached = self.attached
        self.remove()  # hooks off; re-attached below onto the new scopes
        self.slots = collect_slots(self.root)
        self.scopes = build_scopes(self.root, self.slots, list(units))
        self._sharded = True  # FSDP2 swapped the tensor objects: no cached id index
        self._all = frozenset(range(len(self.slots)))
        self._forward_used = set()
        self.reset_step()
        if attached:
            self.attach()

    def _root_scope(self) -> Scope:
        return next(s for s in self.scopes if s.module is self.root)

    def _index(self) -> dict[int, int]:
        """``id`` of each watched tensor -> its slot index (cached within an optimizer step without FSDP2)."""
        if self._index_cache is not None:
            return self._index_cache
        index = {id(t): i for i, t in enumerate(s.tensor() for s in self.slots) if t is not None}
        if not self._sharded:
            self._index_cache = index
        return index

    # -- forward hooks ------------------------------------------------------------------------------
    def _root_pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._active:  # a nested call of the root (rare): observe the outer call only
            self._depth += 1
            return
        self._active = module.training and torch.is_grad_enabled()
        if not self._active:
            return
        self._depth = 0
        self.no_walk.new_forward(args, kwargs)
        if self._step.pending_forwards and not self._predicting:
            self._lose_route()  # the previous forward's loss was not seen before this forward
        self._predicting = not (self.at_loss and self._route_set and not self._route_lost and len(self.scopes) == 1)
        self._regions.new_forward()
        self._twice: set[int] = set()
        self._forward_used = set()
        self._record = UsageRecord(self.slots)
        self._root_scope().stop = set()

    def _scope_post_hook(self, scope: Scope, is_root: bool) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not self._active:
                return None
            if is_root and self._depth:
                self._depth -= 1
                return None
            t0 = time.perf_counter()
            new_output = self._observe_and_tie(scope, output, is_root) if self._predicting else None
            if is_root:
                self._finish_forward(t0)
            else:
                self._record.seconds += time.perf_counter() - t0
            return new_output

        return hook

    def _observe_and_tie(self, scope: Scope, output: Any, is_root: bool) -> Any:
        anchor = anchor_of(output)
        roots = [anchor] if (is_root and anchor is not None) else [t for t in output_tensors(output) if t.requires_grad]
        reached = reachable_leaf_ids(roots, scope.stop)
        self.walks += 1
        region = self._regions.read_ids()
        index = self._index()
        mine = set(scope.slots)
        hit = {index[i] for i in reached if i in index} & mine
        in_region = {index[i] for i in region if i in index} & mine
        self._forward_used |= hit | in_region
        self._twice |= hit & in_region  # read in a reentrant layer and outside: its hook fires twice
        only_region = in_region - hit
        if only_region:
            self._record.region_used += [self.slots[i].name for i in sorted(only_region)]
        live = mine & set(index.values()) if self._sharded else mine
        missing = sorted(live - hit - in_region)
        if not self.tie or not missing:
            return None
        if anchor is None:
            raise UnusedParametersError(
                f"hf_ddpfix: cannot tie {len(missing)} unused parameters (e.g. {self.slots[missing[0]].name}) "
                f"into the output of {type(scope.module).__name__}: no output tensor requires grad. {UNUSED_FIX}"
            )
        extras = [t for t in (self.slots[i].tensor() for i in missing) if t is not None]
        self._watch_real(missing)
        tied = ZeroTie.tie(anchor, extras)
        if self._sharded:  # FSDP2: the loss must reach the tie, else it moves there (loss_observer.py)
            self._step.unit_ties.add(tied, extras, {t.grad_fn for t in output_tensors(output) if t.grad_fn is not None})
        self._record.tied, self.ties = self._record.tied + [self.slots[i].name for i in missing], self.ties + len(extras)
        return replace_in(output, anchor, tied)

    def _finish_forward(self, t0: float) -> None:
        self._active = False
        used = self._forward_used  # a prediction until the loss given to backward confirms it (`tie_loss`)
        self._step.forward_done(used if self._predicting else None, self._regions.reads_with_outputs())
        self.forwards += 1
        feature_counts.record_amount("parameter_usage", "forwards", 1)
        rec = self._record
        if rec.tied:
            feature_counts.record_amount("parameter_usage", "ties_at_output", len(rec.tied))
        rec.used_slots = used
        if self._predicting:
            if self.guard and not self.at_loss:
                self._check(sorted(self._all - used) if not self.tie else [])
            if not self.allow_region_reuse:
                self._regions.check_reuse(self.slots, self._twice)
        rec.seconds += time.perf_counter() - t0
        self.seconds += rec.seconds
        self.last = rec

    # -- the loss given to backward ------------------------------------------------------------------
    def tie_loss(self, loss: Any) -> Any:
        """Observe the loss that is really back-propagated and tie every trainable parameter it does not
        reach into it (exact-zero gradient); returns the loss to back-propagate (a bitwise copy).

        Call on every rank with the tensor about to be passed to ``backward`` (the Trainer wiring does it
        inside ``accelerator.backward``: ``_compat.around_backward``), once per micro-batch. The forward's
        own observation (from the model output), where it ran, is a prediction; this one decides: the
        parameters the loss reaches through real computation (or that a reentrant checkpointed layer of
        the pending forwards read) count as used for :meth:`finalize`; those reached only through an
        earlier exact-zero tie count as unused; the rest are tied in here. With ``guard`` (no ties) the
        ranks check here, before backward, that every parameter gets a gradient.

        A loss that is not a tensor requiring grad, or that follows no observed training forward, is
        returned unchanged.

        Guarantees: the returned loss equals ``loss`` bit for bit, every watched parameter's
        ``AccumulateGrad`` (and so its DDP hook) runs exactly once in its backward, and the gradients of
        the parameters the loss reaches are unchanged (tests/test_usage_at_loss.py,
        tests/scripts/trainer_heads.py).
        """
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad or self._step.pending_forwards == 0:
            return loss
        regions, single = bool(self._step.region_outputs), self._step.pending_forwards == 1
        ready = self.backward_retries and not self._predicting and self.tie and not self.guard and not self._sharded
        frozen = self._frozen
        watched = lambda: [s.tensor() for i, s in enumerate(self.slots) if i not in frozen]  # noqa: E731
        if (self.no_walk.may_skip(loss, ready and single, regions) and self._frozen_still()
                and self.no_walk.take_nodes(watched)):  # the signature's usage is established: no walk
            if frozen:  # frozen since wrapping: tied in as before (DDP waits for their hooks), never checked
                loss = ZeroTie.tie(loss, self._frozen_tensors)
            return self.no_walk.install(loss, watched, self._all_used)
        t0 = time.perf_counter()
        real_nodes, side_nodes = set[Any](), set[Any]()
        real, tied_only = reachable_leaf_ids_split([loss], is_zero_tie_node, is_ddp_sink_node,
                                                   real_nodes=real_nodes, side_nodes=side_nodes)
        self.walks += 1
        # a reentrant region's reads count as used unless its output reaches the loss only through an exact-zero
        # tie (e.g. the ZeRO dummy image's tower layers): then, like a tied leaf, reached but not used
        region: set[int] = set()
        for nodes, ids in self._step.region_outputs:
            if nodes and not (nodes & real_nodes) and nodes & side_nodes:
                tied_only |= ids - real
            else:
                region |= ids
        index = self._index()
        unused_ids = index.keys() - real - region  # set algebra in C: no per-parameter Python loop
        tied_before = len(unused_ids & tied_only)  # reached only through a tie the loss already holds
        missing = sorted(index[i] for i in unused_ids - tied_only)
        used = self._all - {index[i] for i in unused_ids} if unused_ids else set(self._all)
        if self._sharded:
            used &= set(index.values())
        if not self.allow_region_reuse and not self._predicting:
            twice = {index[i] for i in real & self._regions.read_ids() if i in index}
            self._regions.check_reuse(self.slots, twice)
        self._step.loss_seen(used)
        if self.last is not None and not self._predicting:
            self.last.used_slots = used
        self.losses += 1
        feature_counts.record_ran("parameter_usage")
        if tied_before:
            feature_counts.record_amount("parameter_usage", "output_ties_in_loss", tied_before)
        if self.guard and not self.tie:
            self._check(missing)
        frozen = self._note_frozen(missing)
        if not self._predicting:  # the signature's pattern: every parameter used (but the frozen), no other tie
            self.no_walk.walked(len(unused_ids) == len(frozen) and single, regions)
        self._watch_real(missing)
        if self.tie and missing:
            extras = [t for t in (self.slots[i].tensor() for i in missing) if t is not None]
            loss = ZeroTie.tie(loss, extras)
            self.loss_ties += len(extras)
            feature_counts.record_amount("parameter_usage", "ties_at_loss", len(extras))
            if self.last is not None:
                self.last.tied_at_loss = [self.slots[i].name for i in missing]
        self.no_walk.loss_done()
        self.seconds += time.perf_counter() - t0
        return loss

    def _watch_real(self, slots: list[int]) -> None:
        """Count a slot of ``slots`` (left out of the loss seen) as used in this step if its leaf receives a real
        gradient in any backward (``real_grads.py``)."""
        watch_real(self._step, self.slots, slots)

    def _all_used(self) -> None:
        """The check at backward found every watched parameter about to get its gradient: all used (but those frozen
        since wrapping, tied in)."""
        used = self._all - self._frozen if self._frozen else self._all
        self._step.loss_seen(used)
        self.losses += 1
        feature_counts.record_ran("parameter_usage")
        if self.last is not None:
            self.last.used_slots = used

    def _note_frozen(self, missing: list[int]) -> frozenset[int]:
        """The slots of ``missing`` whose tensor does not require grad (frozen after wrapping: a loop over the
        slots left out only), kept for the no-walk path; a change forgets the check's cached nodes."""
        frozen = frozenset(i for i in missing if (t := self.slots[i].tensor()) is not None and not t.requires_grad)
        if frozen != self._frozen:
            self._frozen = frozen
            self._frozen_tensors = [t for t in (self.slots[i].tensor() for i in sorted(frozen)) if t is not None]
            self.no_walk.grad_nodes = None
        return frozen

    def _frozen_still(self) -> bool:
        """No slot known frozen requires grad again (else the walk decides: it may be used now)."""
        return not self._frozen or not any(t.requires_grad for t in self._frozen_tensors)

    def observe_loss(self, loss: Any) -> Any:
        """FSDP2's loss observer (``loss_observer.py``: adds what it reaches, moves unreached unit ties into it)."""
        spent, loss = observe_loss(loss, self._step, self._index)
        if spent is not None:
            self.walks, self.losses, self.seconds = self.walks + 1, self.losses + 1, self.seconds + spent
        return loss

    def _lose_route(self) -> None:
        """A forward's loss unseen at backward (two forwards for one loss, or by finalize): the forward's own walk
        and tie run for the rest of the run (``parameter_usage / forward_walks_resumed``; also ``UNSEEN_LOSS``)."""
        if not self._route_lost:
            self._route_lost = True
            feature_counts.record_amount("parameter_usage", "forward_walks_resumed", 1)

    def _check(self, missing: list[int]) -> None:
        """All-gather "gets no gradient here" per parameter; raise on every rank if any rank has one."""
        if self.ddp_module is not None and not ddp_syncs_grads(self.ddp_module):
            return
        raise_if_missing(gather_missing(missing, len(self.slots), self.process_group), self.slots)

    def describe(self) -> str:
        """One line: how many parameters are watched, how many were tied so far, the time spent."""
        per = self.seconds / self.forwards * 1e3 if self.forwards else 0.0
        return (
            f"{len(self.slots)} trainable tensors watched in {len(self.scopes)} scope(s); {self.ties} ties over "
            f"{self.forwards} forwards, {self.loss_ties} at the loss over {self.losses} losses seen at backward; "
            f"{self.walks} graph walks; {self.resets} grads reset to None; {per:.2f} ms per forward"
        )
