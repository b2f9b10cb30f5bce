"""What the ranks agree on about parameter usage: the guard's table and the step's "used" mask.

Two collectives of one byte per trainable parameter, used by ``ParameterUsage``
(``integrations/usage/tracker.py``):

- :func:`gather_missing` + :func:`raise_if_missing` (the guard, before a synchronising backward):
  all-gather "gets no gradient here" per parameter; if any rank has one, every rank raises the same
  :class:`UnusedParametersError` naming the parameters, their modules, the ranks, what stock DDP would
  do (hang, or fail a step later) and the fix, never a hang.
- :class:`UsageAgreement` (finalize, once per optimizer step): all-reduce(MAX) of "used in some
  micro-batch of this step", so every rank resets the same ``.grad`` to ``None``. Issued asynchronously;
  a rank that used every parameter itself knows the answer (all used) and never reads it: it is waited
  for (a stream wait on NCCL, no host read) at the next step. Only a rank with parameters it did not use
  waits and reads the mask (one device->host read). Every rank issues the same collective at the same
  point whatever it used, so no rank can wait alone; the answer is the same OR either way. A per-rank flag
  can ride along (the trainable-set watch's); a rank that did not read it reads it later from host memory
  (:meth:`UsageAgreement.late_flags`, before its next collective; no device->host read).
  :func:`agree_used` is the blocking form (the mask as a tensor).

Contract: without an initialised process group (or in a one-process group) each function answers
from the local data alone and runs no collective; with one, every rank must call it in the same
order (``ParameterUsage`` calls them at points every rank reaches).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...ops.dist import collective_device, dist_ready, gather_flags
from .hang_guard import UnusedParametersError
from .scopes import ParamSlot

__all__ = ["UNUSED_FIX", "UsageAgreement", "agree_used", "gather_missing", "raise_if_missing"]

UNUSED_FIX = (
    "Fix: let hf_ddpfix tie unused parameters in (HF_DDPFIX_PARAMETER_USAGE=1, the default under DDP/FSDP), "
    "or set ddp_find_unused_parameters=True in TrainingArguments, or make the module's output reach the loss."
)


def gather_missing(missing: list[int], n_slots: int, group: Any) -> list[list[int]]:
    """Every rank's list of slot indices that get no gradient (one row per rank; ``[missing]`` alone
    without a process group)."""
    if not dist_ready(group):
        return [missing]
    marked = set(missing)
    rows = gather_flags([i in marked for i in range(n_slots)], group)
    return [[i for i, flag in enumerate(row) if flag] for row in rows]


def raise_if_missing(table: list[list[int]], slots: Sequence[ParamSlot]) -> None:
    """Raise :class:`UnusedParametersError` when any rank's row of ``table`` is non-empty.

    Raises:
        UnusedParametersError: naming up to five parameters with their modules and ranks, the
            consequence under stock DDP and the fix.
    """
    if not any(table):
        return
    bad = sorted(set().union(*map(set, table)))
    lines = []
    for i in bad[:5]:
        ranks = [r for r, row in enumerate(table) if i in row]
        lines.append(f"{slots[i].name} (module {slots[i].module_name or '<root>'}) on rank(s) {ranks}")
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    world = len(table)
    consequence = (
        "stock DDP would hang in backward (the ranks that use it wait for the others)"
        if any(len([r for r, row in enumerate(table) if i in row]) < world for i in bad)
        else "stock DDP would fail at the next step ('Expected to have finished reduction')"
    )
    raise UnusedParametersError(
        "hf_ddpfix: DistributedDataParallel(find_unused_parameters=False) cannot train this step: "
        f"{len(bad)} trainable parameters get no gradient: " + "; ".join(lines) + more
        + f". {consequence}. {UNUSED_FIX}"
    )


def agree_used(used: torch.Tensor, group: Any) -> torch.Tensor:
    """``used`` (bool, one per slot) OR-ed over the ranks of ``group`` (unchanged without one)."""
    if not dist_ready(group):
        return used
    flags = used.to(torch.uint8).to(collective_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags.cpu().bool()


class UsageAgreement:
    """The step's "some rank used it" agreement, issued asynchronously and read only where it matters.

    Counters: ``issued`` collectives, ``reads`` (device->host reads of the agreed mask).

    Guarantees: :meth:`unused_everywhere` returns exactly the slots no rank of ``group`` used (the OR over
    ranks, as :func:`agree_used`), with one all-reduce per call on every rank; a rank whose own
    ``unused_here`` is empty does no host read (tests/test_step_overhead.py counts them).
    """

    def __init__(self) -> None:
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._late: _LateFlags | None = None
        self._side: Any = None  # the CUDA stream that copies late flags to host memory
        self.issued = 0
        self.reads = 0
        self.late_reads = self.late_waits = 0  # late_flags: host-memory reads / event waits (GPU, host ran ahead)
        self.seen_anywhere: bool | None = None  # the last agree()'s "some rank saw it" (``seen``), until take_seen

    def unused_everywhere(self, unused_here: set[int], n_slots: int, group: Any) -> set[int]:
        """The slot indices no rank used: ``unused_here`` minus those some other rank used. Call on every
        rank at the same point; without a process group of more than one rank, ``unused_here``."""
        return self.agree(unused_here, n_slots, group)[0]

    def agree(self, unused_here: set[int], n_slots: int, group: Any, flag: bool | None = None,
              seen: bool | None = None) -> tuple[set[int], tuple[bool, bool] | None]:
        """:meth:`unused_everywhere`, with a per-rank ``flag`` carried in the same all-reduce (two more bytes:
        "some rank set it", "some rank did not"; ``None``: no flag, every rank must agree on that), and a per-rank
        ``seen`` (one more byte, MAX: "some rank saw it", e.g. the FSDP2 dummy's "this rank passed an image";
        ``None``: none carried). The agreed ``seen`` is kept in :attr:`seen_anywhere` until :meth:`take_seen`.

        Returns:
            ``(unused, flags)``: ``flags`` is ``(some rank set it, every rank set it)`` on a rank that read the
            agreement (one whose ``unused_here`` is non-empty, whose ``flag`` is set or whose ``seen`` is false);
            ``(False, False)`` on a rank that neither set it nor had anything to reset (it does not read: a rank
            that did set it reads "some rank did not" and acts on it); ``None`` without a flag. A rank whose
            ``seen`` is true knows "some rank saw it" without reading.
        """
        extra = (0 if flag is None else 2) + (0 if seen is None else 1)
        at_seen = n_slots + extra - 1  # the "seen" byte, last
        if not dist_ready(group):
            self.seen_anywhere = seen
            return set(unused_here), (None if flag is None else (bool(flag), bool(flag)))
        self.wait()
        self._late = None  # a previous step's unread flags: that step's on_step_end did not run (nothing to act on)
        device = collective_device(group)
        read = bool(unused_here) or bool(flag) or seen is False
        if read:
            host = torch.ones(n_slots + extra, dtype=torch.uint8)
            if unused_here:
                host[sorted(unused_here)] = 0
            if flag is not None:
                host[n_slots], host[n_slots + 1] = int(bool(flag)), int(not flag)
            if seen is not None:
                host[at_seen] = int(seen)
            flags = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        else:
            flags = torch.ones(n_slots + extra, dtype=torch.uint8, device=device)
            if flag is not None:  # this rank: flag not set ("some rank did not" = 1)
                flags[n_slots] = 0
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self.issued += 1
        if not read:  # the OR of "used" (and of "seen") is all ones whatever the others sent, no flag of ours to check
            self.seen_anywhere = None if seen is None else True
            self._pending = (work, flags)
            if flag is not None:  # but another rank's flag: read late, once the result is in host memory (late_flags)
                if device.type == "cuda" and self._side is None:
                    self._side = torch.cuda.Stream(device=device)
                self._late = _LateFlags(work, flags, n_slots, self._side)
            return set(), (None if flag is None else (False, False))
        work.wait()
        self.reads += 1
        row = flags.tolist()  # the one device->host read, on a rank that has something to reset or report
        agreed = None if flag is None else (bool(row[n_slots]), not row[n_slots + 1])
        self.seen_anywhere = None if seen is None else bool(row[at_seen])
        return {i for i in unused_here if not row[i]}, agreed

    def take_seen(self) -> bool | None:
        """The last :meth:`agree`'s agreed ``seen`` ("some rank saw it"), once; ``None`` when none was carried."""
        seen, self.seen_anywhere = self.seen_anywhere, None
        return seen

    def late_flags(self) -> tuple[bool, bool] | None:
        """The flags of the last :meth:`agree` on a rank that did not read them (it set no flag and had nothing to
        reset): ``(some rank set it, every rank set it)``, once; ``None`` when there is nothing unread.

        Call it before this rank issues its next collective (the Trainer's ``on_step_end``). Cost: no device->host
        read. On a CPU group (gloo) the result is already in host memory once the (small, already issued by every
        rank) all-reduce completes: a host-side wait then a read of a CPU tensor. On a GPU the two bytes were copied
        into pinned host memory behind the all-reduce (``non_blocking``, on a side stream) with an event; an event
        that has completed makes the read free; one that has not (the host ran ahead of the all-reduce) is waited
        for alone (``event.synchronize``: the all-reduce and the 2-byte copy, not the queued compute), counted in
        ``late_waits``."""
        late, self._late = self._late, None
        if late is None:
            return None
        row = late.read(self)
        self.late_reads += 1
        return bool(row[0]), not row[1]

    def wait(self) -> None:
        """Complete the collective left in flight by the previous call (no host read on NCCL: a stream wait)."""
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            work.wait()


class _LateFlags:
    """The two flag bytes of an in-flight agreement, on their way to host memory (see ``late_flags``)."""

    def __init__(self, work: Any, flags: torch.Tensor, n_slots: int, side: Any) -> None:
        self.work, self.event = work, None
        if flags.device.type == "cuda":  # behind the all-reduce, off the compute stream; no host wait here
            self.host = torch.empty(2, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(side):
                work.wait()  # a stream wait on the collective
                self.host.copy_(flags[n_slots:n_slots + 2], non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(side)
            flags.record_stream(side)
        else:
            self.host = flags[n_slots:n_slots + 2]

    def read(self, counts: UsageAgreement) -> list[int]:
        if self.event is None:
            self.work.wait()  # gloo: the result is written in host memory by the collective itself
        elif not self.event.query():
            counts.late_waits += 1
            self.event.synchronize()
        return self.host.tolist()  # host memory, complete: not a device read
