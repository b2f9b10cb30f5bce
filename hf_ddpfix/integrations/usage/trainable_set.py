"""Parameters whose ``requires_grad`` changes after the model is wrapped (a callback unfreezing a head at step 2).

Problem (issue 28): DDP registers the parameters that require grad when it wraps the model and all-reduces
only those. A parameter unfrozen later gets a gradient on every rank from that rank's micro-batches only:
stock DDP never reduces it, so the replicas silently drift apart (its weights if the optimizer holds it, and
through the clip coefficient, computed from each rank's own gradient norm, every other weight too). FSDP2
and DeepSpeed ZeRO flatten / shard the trainable set when they wrap: a parameter unfrozen afterwards is
outside their buckets and partitions altogether.

:class:`TrainableSetWatch` takes the trainable set when hf_ddpfix attaches (before the model is wrapped) and
checks it after the last backward of every optimizer step, before the gradients are clipped, measured or
stepped (:func:`hf_ddpfix._compat.before_gradient_clipping`): the step where the change takes effect. The check
compares every known parameter's ``requires_grad`` with the set the ranks last agreed on (a C-level scan, no
Python loop); its "changed here" flag rides in the usage agreement's all-reduce where that runs (DDP, FSDP2), so
a step where nothing changed costs no collective of its own. In a step where some rank changed its set, every
rank must have made the same change (one ``all_gather_object`` of the names, that step only); otherwise every
rank raises :class:`TrainableSetChangedError` at that step (a rank that did not change learns it from the same
agreement before its next collective: ``finalize_late``).

Unfreezing (a parameter that did not require grad at wrapping and does now):

- DDP: the gradients of the parameters unfrozen since wrapping are averaged over the ranks (one
  ``all_reduce`` per parameter, a rank without a gradient adding zeros; none when no rank has one), what
  DDP does for every registered parameter: the optimizer and the clip see what a one-process run with the
  same global batch sees. Logged once per new set, counted as feature ``trainable_set`` (``ran``, amount
  ``reduced_params``).
- FSDP: :class:`TrainableSetChangedError` at that step, naming the parameters, the step and the
  fix (unfreeze before ``trainer.train()``, with a zero learning rate until the step you want, or restart
  from a checkpoint with the new trainable set), before the optimizer steps: no replica has drifted.
- DeepSpeed ZeRO (1/2/3): the engine reduces, clips and steps inside ``accelerator.backward`` (``engine.step``),
  where the clipping hook point above is never reached, and its partitions hold only the parameters trainable
  at ``deepspeed.initialize``: :class:`TrainableSetChangedError` on every rank, naming the parameters, the step
  and the fix.

Freezing (a parameter trainable at wrapping that no longer requires grad; issue 38) trains as stock does under
the same parallelism: from the micro-batch where it is frozen the parameter gets no gradient. What "as stock"
means, exactly (each backed by a bit-equal comparison with the stock Trainer, tests/test_trainable_set.py):

- DDP (stock: ``find_unused_parameters=True``): DDP leaves a parameter no rank used without a gradient and
  AdamW skips it (no update, no weight decay, its moments frozen). A gradient it got in an earlier micro-batch
  of the same step (frozen between the micro-batches of an accumulation) is averaged over the ranks and stepped
  once more. hf_ddpfix keeps the plan's ``find_unused_parameters=False`` / static graph: the reducer still waits
  for the frozen parameter's hook, so ``ParameterUsage`` keeps tying it into every backward
  (:meth:`hf_ddpfix.ops.zero_tie.ZeroTie.tie`: its ``AccumulateGrad`` runs and accumulates nothing), and its
  finalize leaves ``.grad`` ``None`` where no micro-batch of the step gave it one: the same gradients, the same
  weights. No collective changes, so a rank that froze alone cannot hang DDP; the agreement raises at that step.
- FSDP2 (stock FSDP2 reduce-scatters only the gradients of parameters that require grad): nothing to change,
  but a rank that froze alone would reduce-scatter other tensors than its peers inside backward (a hang). So
  before every micro-batch's forward a cheap local test (:meth:`TrainableSetWatch.hold`: the same C-level scan of
  ``requires_grad``, no collective, no device read) compares this rank's set with the one the ranks last agreed
  on; only where it differs does the rank hold the agreed set for that micro-batch (a parameter unfrozen since is
  switched off, one frozen at the first micro-batch of the step switched back on; restored when the micro-batch
  ends), so every rank's backward reduce-scatters the same tensors, and the change rides in the step's usage
  agreement (no collective of its own). Every rank changed the same way: the held parameters' gradients are set to
  ``None`` right after the agreement (before clipping: what stock FSDP2 gives a parameter frozen for the whole
  step), so the run equals stock FSDP2's; a parameter frozen after an earlier micro-batch of the step already
  holds a gradient (hf_ddpfix ties every trainable parameter into each micro-batch), so its reduce-scatter is
  unchanged and it is not held. A rank that changed alone: every rank raises
  :class:`TrainableSetChangedError` at that step's ``on_step_end`` (the changed rank after reading the
  agreement, the others from the agreement's late flags: after the step's clipping and optimizer step, whose
  collectives match on every rank thanks to the hold, and before any further collective).
- DeepSpeed ZeRO (stock ZeRO keeps stepping the flat partition: a frozen parameter's zero-filled gradient
  slice, with AdamW's weight decay, as DeepSpeed does; with ``zero_skip_unused`` it is skipped, as stock DDP):
  nothing to change. The engine reduces inside backward, so the check runs before the first micro-batch's forward
  of every optimizer step (:meth:`TrainableSetWatch.agree_at_step_start`): the local test's flag in one
  asynchronous all-reduce of two bytes (``UsageAgreement``), read at once only by a rank that changed its set,
  by the others late, from host memory, at ``on_step_end`` (no device read). A rank whose set differs from the
  agreed one holds it for the micro-batch (:meth:`TrainableSetWatch.hold` with ``zero_frozen``: a parameter frozen
  since is switched back on with a hook that hands the engine a zero gradient, the zero slice stock ZeRO steps;
  one unfrozen is switched off), so every rank's engine reduces the same tensors; every rank changed the same way:
  agreed at that step's start (a change made between micro-batches: at the next step's start, the hold keeping the
  step as stock's meanwhile); a rank that changed alone: every rank raises at that step's ``on_step_end``.

Logged once per new frozen set, counted as feature ``trainable_set`` (``ran``, amount ``frozen_params``).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...ops.dist import dist_ready, gather_flags
from ...ops.feature_counts import record_amount, record_ran

__all__ = ["FEATURE", "TrainableSetChangedError", "TrainableSetWatch"]

logger = logging.getLogger("hf_ddpfix")

#: ``hf_ddpfix.ops.feature_counts`` name of this check.
FEATURE = "trainable_set"


_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _plain(name: str) -> str:
    """A parameter name without the segments FSDP1 / checkpoint / compile wrappers insert."""
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class TrainableSetChangedError(RuntimeError):
    """Parameters became trainable after wrapping where hf_ddpfix cannot reduce their gradients."""


def _differently(parallel: str, step: Any, names: list[str]) -> TrainableSetChangedError:
    """The error every rank raises when some ranks changed the trainable set and others did not."""
    return TrainableSetChangedError(
        f"hf_ddpfix ({parallel}): at optimizer step {step} the ranks changed the trainable set differently after "
        f"wrapping (this rank: {', '.join(names[:5]) or 'none'}; some rank changed "
        + ("nothing" if names else "its set") + "); their gradients cannot be averaged. Fix: change requires_grad "
        "the same way on every rank (e.g. in a TrainerCallback, which runs on every rank).")


class TrainableSetWatch:
    """Watch the trainable set of ``model`` from now on (see the module docstring).

    Args:
        model: the unwrapped model (what the optimizer and the wrapper see).
        parallel: the plan's mode (``"ddp"`` reduces; any other multi-rank mode raises).
        step: returns the optimizer step being taken (1-based), for messages.
        process_group: the data-parallel group (default: the world).
    """

    def __init__(self, model: nn.Module, parallel: str, step: Any = lambda: 0, process_group: Any = None) -> None:
        self.model, self.parallel, self.step, self.process_group = model, parallel, step, process_group
        # by name: FSDP2's fully_shard replaces every parameter object (DTensors) under the same name; wrapper
        # segments are dropped, and a parameter whose name did not exist here (FSDP1's flat parameters) is
        # never "new"
        self.known = {_plain(n) for n, _ in model.named_parameters()}
        self.baseline = {_plain(n) for n, p in model.named_parameters() if p.requires_grad}
        self._checked_step: Any = None
        self._frozen: list[tuple[str, nn.Parameter]] | None = None  # the candidates, taken at the first check
        self._frozen_params: list[nn.Parameter] = []
        self._trained: list[tuple[str, nn.Parameter]] = []  # trainable when the watch started (taken with _frozen)
        self._trained_params: list[nn.Parameter] = []
        self._new: list[tuple[str, nn.Parameter]] | None = None
        self._new_step: Any = None
        self._froze: tuple[str, ...] = ()  # frozen since the watch started, as of this step's check
        self._froze_agreed: tuple[str, ...] = ()  # ... as last agreed by every rank
        self._hold_step: Any = None  # the optimizer step of the last hold()
        self._held_frozen: dict[str, nn.Parameter] = {}  # frozen, held trainable from the step's first micro-batch
        self.defer_mismatch = False  # FSDP2: a rank that changed alone raises at finalize_late, not at finalize
        self._pending: TrainableSetChangedError | None = None
        self.holds = 0  # micro-batches in which this rank held the agreed set (tests, logs)
        self._agree_step: Any = None  # DeepSpeed: the optimizer step whose flag agree_at_step_start issued
        self._announced: set[tuple[str, ...]] = set()
        self.reduced = 0  # parameter reductions done so far (tests, logs)
        self.frozen_changes = 0  # steps in which the set of parameters frozen since wrapping changed (agreed)

    def new_trainable(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` that require grad now and did not when the watch started, in module order."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad and _plain(n) in self.known and _plain(n) not in self.baseline]

    def changed(self, fresh: bool = False) -> bool:
        """True when, on this rank, some parameter requires grad now that did not when the watch started, or the
        set of parameters frozen since then differs from the one the ranks last agreed on (a parameter frozen in
        this step). Taken once per optimizer step and kept for :meth:`finalize`: what ``ParameterUsage``
        carries in its agreement (``step_flag``). Cost: a C-level scan of every known parameter's
        ``requires_grad`` (no Python loop) while nothing changed."""
        step = self.step()
        if fresh or self._new_step != step or self._new is None:
            if self._frozen is None:  # after wrapping (FSDP2 swaps the parameter objects when it wraps)
                named = [(n, p) for n, p in self.model.named_parameters() if _plain(n) in self.known]
                self._frozen = [(n, p) for n, p in named if _plain(n) not in self.baseline]
                self._trained = [(n, p) for n, p in named if _plain(n) in self.baseline]
                self._frozen_params = [p for _, p in self._frozen]
                self._trained_params = [p for _, p in self._trained]
            self._new_step = step
            self._new = ([(n, p) for n, p in self._frozen if p.requires_grad]
                         if any(map(_REQUIRES_GRAD, self._frozen_params)) else [])
            self._froze = (tuple(n for n, p in self._trained if not p.requires_grad)
                           if not all(map(_REQUIRES_GRAD, self._trained_params)) else ())
        return bool(self._new) or self._froze != self._froze_agreed

    def hold(self, zero_frozen: bool = False) -> list[tuple[nn.Parameter, bool, Any]]:
        """Before a micro-batch's forward (FSDP2, DeepSpeed): the local test, and the hold where it fails (module
        docstring). ``zero_frozen`` (DeepSpeed): every parameter frozen since the agreed set is held, with a hook
        that hands the engine a zero gradient; else (FSDP2) only one frozen at the step's first micro-batch, whose
        gradient :meth:`finalize` sets to ``None`` once agreed.

        Returns the ``(parameter, requires_grad to restore, hook handle)`` switched to the agreed set, for
        :meth:`release`; ``[]`` (nothing switched, no collective, no device read: a C-level scan of
        ``requires_grad``) while this rank's set is the agreed one."""
        step = self.step()
        first = step != self._hold_step
        if first:
            self._hold_step, self._held_frozen = step, {}
        if not self.changed(fresh=True):
            return []
        switched: list[tuple[nn.Parameter, bool, Any]] = [(p, True, None) for _, p in self._new or []]
        agreed = set(self._froze_agreed)
        for n, p in self._trained:
            if n in self._froze and n not in agreed and (zero_frozen or first or n in self._held_frozen):
                if not zero_frozen:
                    self._held_frozen[n] = p
                switched.append((p, False, None))
        for i, (p, was, _) in enumerate(switched):
            p.requires_grad_(not was)
            if zero_frozen and not was:
                switched[i] = (p, was, p.register_hook(torch.zeros_like))
        self.holds += bool(switched)
        return switched

    @staticmethod
    def release(switched: list[tuple[nn.Parameter, bool, Any]]) -> None:
        """Give back the ``requires_grad`` values :meth:`hold` switched (the micro-batch ended)."""
        for p, was, handle in switched:
            if handle is not None:
                handle.remove()
            p.requires_grad_(was)

    @contextmanager
    def held_step(self, agreement: Any = None) -> Iterator[None]:
        """A step context around one micro-batch's ``training_step``: the local test and the hold (:meth:`hold`,
        restored by :meth:`release` when it ends). FSDP2: no ``agreement`` (the flag rides in the usage agreement at
        finalize). DeepSpeed: ``agreement`` (a ``UsageAgreement``) carries the flag at the step's first micro-batch
        (:meth:`agree_at_step_start`), and a frozen parameter is held with a zero gradient (the slice stock ZeRO
        steps)."""
        if agreement is not None:
            self.agree_at_step_start(agreement)
        switched = self.hold(zero_frozen=agreement is not None)
        try:
            yield
        finally:
            self.release(switched)

    def agree_at_step_start(self, agreement: Any) -> None:
        """DeepSpeed, before each micro-batch's forward: at the first of an optimizer step, this rank's "my set
        changed" flag (the local test) in ``agreement``'s asynchronous all-reduce (``UsageAgreement.agree`` with no
        slot: two bytes), acted on by :meth:`finalize` where this rank changed its set (it reads at once), else late
        (:meth:`finalize_late` at ``on_step_end``, from host memory). Later micro-batches of the step: nothing."""
        step = self.step()
        if step == self._agree_step:
            return
        self._agree_step = step
        mine = self.changed(fresh=True)
        _, flags = agreement.agree(set(), 0, self.process_group, mine)
        self.finalize(agreed=flags)

    def finalize(self, once_per_step: bool = True, agreed: tuple[bool, bool] | None = None) -> None:
        """Check (and under DDP reduce) once per optimizer step; a second call in the same step does nothing
        unless ``once_per_step`` is False (DeepSpeed: every micro-batch is checked).

        ``agreed``: ``(some rank changed, every rank changed)`` as the usage agreement's all-reduce carried
        :meth:`changed` this step (``ParameterUsage.take_step_flags``): no collective and no host read of its
        own then. A rank that changed nothing and had nothing to read gets ``(False, False)`` and does nothing;
        a rank that changed reads "every rank" and, where another did not, raises; a rank that did not read learns it
        at :meth:`finalize_late` (before its next collective) and raises the same error. ``None``: one all-gather of
        a byte per rank."""
        step = self.step()
        if once_per_step and step == self._checked_step:
            return
        self._checked_step = step
        if agreed is not None:
            if not agreed[0]:
                return
            self.changed()
            new = list(self._new or [])
            if not agreed[1]:
                err = _differently(self.parallel, step, [n for n, _ in new] + list(self._froze))
                if self.defer_mismatch:  # FSDP2: the others learn it at on_step_end; clipping comes first
                    self._pending = err
                    return
                raise err
        else:
            mine = self.changed(fresh=not once_per_step)
            new = list(self._new or [])
            if not dist_ready(self.process_group):
                self._froze_agreed = self._froze
                self._drop_held()
                return
            rows = gather_flags([mine], self.process_group)  # one byte per rank and step
            if not any(r[0] for r in rows):
                return
            if not all(r[0] for r in rows):
                raise _differently(self.parallel, step, [n for n, _ in new] + list(self._froze))
        self._agree_changes(step, new)
        self._drop_held()
        if new:
            self._ddp_or_refuse(step, new)

    def _drop_held(self) -> None:
        """Every rank agreed on the change: a parameter held trainable since the step's first micro-batch gets the
        gradient stock FSDP2 gives a parameter frozen for the whole step, none."""
        for p in self._held_frozen.values():
            p.grad = None
        self._held_frozen = {}

    def _agree_changes(self, step: Any, new: list[tuple[str, nn.Parameter]]) -> None:
        """Every rank changed its set in this step: check that they unfroze and froze the same parameters since
        wrapping (one ``all_gather_object`` of the names, only in a step where some set changed), else raise the
        same :class:`TrainableSetChangedError` on every rank; a new frozen set is logged once and counted
        (``trainable_set`` / ``frozen_params``). Nothing else to do for a frozen parameter: under DDP it is still
        tied into every backward (``ZeroTie.tie``), so the reducer gets its hook and no collective changes; it
        gets no gradient, and the usage finalize leaves its ``.grad`` ``None`` unless a micro-batch of this step
        gave it one before it was frozen (then that gradient is averaged and stepped, as stock DDP does). FSDP2 /
        ZeRO: see the module docstring."""
        names = list(self._froze)
        if dist_ready(self.process_group):
            mine = ([n for n, _ in new], names)
            everyone: list[Any] = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(everyone, mine, group=self.process_group)
            if any(other != mine for other in everyone):
                shown = ", ".join(names[:5]) or "none"
                raise TrainableSetChangedError(
                    f"hf_ddpfix ({self.parallel}): at optimizer step {step} the ranks changed the trainable set "
                    f"differently after wrapping (this rank froze: {shown}; unfroze: "
                    f"{', '.join(mine[0][:5]) or 'none'}); every rank must train the same set. Fix: change "
                    "requires_grad the same way on every rank (e.g. in a TrainerCallback, which runs on every rank).")
        if self._froze == self._froze_agreed:
            return
        added = [n for n in names if n not in self._froze_agreed]
        self._froze_agreed = self._froze
        self.frozen_changes += 1
        record_ran(FEATURE)
        record_amount(FEATURE, "frozen_params", len(added))
        key = ("frozen", *names)
        if added and key not in self._announced:
            self._announced.add(key)
            shown = ", ".join(added[:5]) + (f" and {len(added) - 5} more" if len(added) > 5 else "")
            logger.warning("hf_ddpfix (%s): at optimizer step %s, %d parameter(s) stopped requiring grad after the "
                           "model was wrapped (%s) on every rank: from now on they get no gradient, as in stock %s "
                           "(counted: trainable_set / frozen_params)", self.parallel, step, len(added), shown,
                           self.parallel.upper())

    def finalize_late(self, agreed: tuple[bool, bool] | None) -> None:
        """The check on a rank that did not read the agreement at :meth:`finalize` (it changed nothing and had
        nothing to reset): ``agreed`` is ``UsageAgreement.late_flags`` (read before this rank's next collective).
        Where some rank changed its set, this one changed nothing: the ranks differ, and this rank raises the
        :class:`TrainableSetChangedError` the ranks that changed raised at :meth:`finalize`, before any further
        collective, so no rank waits alone in one."""
        pending, self._pending = self._pending, None
        if pending is not None:  # this rank changed its set alone (defer_mismatch): raised with the others now
            raise pending
        if agreed is not None and agreed[0]:
            raise _differently(self.parallel, self._checked_step, [])

    def _ddp_or_refuse(self, step: Any, new: list[tuple[str, nn.Parameter]]) -> None:
        """Reduce the new parameters' gradients (DDP, the same set on every rank) or raise."""
        names = [n for n, _ in new]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        if self.parallel != "ddp":
            ds = self.parallel == "deepspeed"
            raise TrainableSetChangedError(
                f"hf_ddpfix ({self.parallel}): at optimizer step {step}, {len(names)} parameter(s) require grad that "
                f"did not when the model was wrapped ({shown or 'on another rank'}). "
                + ("DeepSpeed ZeRO partitions only the parameters trainable at deepspeed.initialize, so their "
                   "gradients would never be reduced nor stepped (a silently different run). "
                   if ds else f"{self.parallel.upper()} shards / buckets only the parameters trainable at wrap "
                   "time, so their gradients would not be reduced and the replicas would drift apart. ")
                + "Raised before the optimizer step: nothing has drifted. Fix: set requires_grad before "
                "trainer.train()" + (" (before deepspeed.initialize)" if ds else "") + " and keep such a "
                "parameter's learning rate at 0 until the step you want, or save a checkpoint and start a new "
                "train() with the new trainable set.")
        has = gather_flags([p.grad is not None for _, p in new], self.process_group)
        world = dist.get_world_size(self.process_group)
        for i, (_, p) in enumerate(new):
            if not any(row[i] for row in has):
                continue  # no rank has a gradient: stays None, as under DDP for a parameter no rank used
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.process_group)
            p.grad.div_(world)
            self.reduced += 1
        record_ran(FEATURE)
        record_amount(FEATURE, "reduced_params", len(new))
        key = tuple(names)
        if key not in self._announced:
            self._announced.add(key)
            logger.warning("hf_ddpfix: at optimizer step %s, %d parameter(s) require grad that did not when DDP "
                           "wrapped the model (%s): DDP does not reduce them; hf_ddpfix averages their gradients "
                           "over the ranks every step from now on (one all_reduce each), as DDP does for the others",
                           step, len(names), shown)
