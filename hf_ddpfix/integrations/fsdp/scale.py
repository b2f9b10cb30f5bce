"""THE model of FSDP2 units and per-rank bytes: the one place the plan, ``hf-ddpfix plan``, ``hf-ddpfix rehearse``
and the GPU suite read them from (issue 46 item 2 / issue 49 item 1; ``hf_ddpfix.facts.offline.plan_offline`` is the
entry point that resolves the plan's units and its fold/shard choice first, then calls :func:`shard_layout`).

The model is built on the meta device (no memory), accelerate's own ``fsdp2_prepare_model`` shards it with the
plugin the launch would build and the unit classes the plan hands it, inside a fake process group of the run's
world size (``_compat.fake_process_group``: collectives do nothing), and every FSDP2 parameter group is read back:
its full bytes (what an all-gather materialises), the bytes this rank stores (its padded shard), and whether it
stays gathered from its forward to its backward (accelerate 1.15: the root and ``[final norm, head]``), and which of
its bytes are trainable (gradients and Adam's two moments, sharded alike).

Guarantees (tests/test_fsdp_scale.py): the stored bytes are each rank's real shard (``fully_shard``'s ``to_local()``
padded to the chunk: ``ceil(rows / N)`` rows of every parameter; the ``to_local()`` sizes of all ranks add up to the
model); the model passed in is left unchanged (a fresh meta copy is sharded); nothing outlives the call (the fake
group is destroyed).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..._compat import fake_process_group, fsdp_groups, join_shared_holders, prepare_like_accelerate

__all__ = ["UNSHARDED", "ShardLayout", "UnitBytes", "shard_layout"]

GiB = 2**30
#: The pseudo-unit of the parameters FSDP does not shard (stored whole on every rank).
UNSHARDED = "(not sharded)"


@dataclass(frozen=True)
class UnitBytes:
    """One FSDP2 parameter group: ``name`` (its modules' names, ``""`` for the root), ``full_bytes`` (gathered),
    ``local_bytes`` (this rank's padded shard) and ``held`` (stays gathered from its forward to its backward)."""

    name: str
    full_bytes: int
    local_bytes: int
    held: bool
    trainable_local_bytes: int = 0


@dataclass(frozen=True)
class ShardLayout:
    """The units of one sharded model as rank ``rank`` of ``world_size`` stores them.

    ``shard_bytes``: what the rank stores between steps (every unit's shard, and the parameters FSDP leaves whole:
    the pseudo-unit :data:`UNSHARDED`). ``peak_bytes``: during a forward, the
    shard plus every held unit gathered (root, ``[norm, head]``) plus the largest other unit gathered (one at a time;
    prefetching gathers the next one early, which the bound below leaves out). ``total_bytes``: the whole model.
    ``state_bytes``: the trainable parameters' sharded gradients plus AdamW's two moments (each the parameter's
    dtype, as torch's AdamW keeps them). ``rank_bytes``: ``peak_bytes + state_bytes``, a rank's bytes before
    activations (not included: activations, the CUDA context, allocator fragmentation)."""

    world_size: int
    rank: int
    units: tuple[UnitBytes, ...]
    total_bytes: int

    @property
    def root(self) -> UnitBytes | None:
        return next((u for u in self.units if u.name == ""), None)

    @property
    def shard_bytes(self) -> int:
        return sum(u.local_bytes for u in self.units)

    @property
    def held_bytes(self) -> int:
        return sum(u.full_bytes - u.local_bytes for u in self.units if u.held)

    @property
    def largest_unit(self) -> UnitBytes:
        return max(self.units, key=lambda u: u.full_bytes)

    @property
    def largest_transient_bytes(self) -> int:
        return max((u.full_bytes - u.local_bytes for u in self.units if not u.held), default=0)

    @property
    def peak_bytes(self) -> int:
        return self.shard_bytes + self.held_bytes + self.largest_transient_bytes

    @property
    def trainable_local_bytes(self) -> int:
        return sum(u.trainable_local_bytes for u in self.units)

    @property
    def state_bytes(self) -> int:
        return 3 * self.trainable_local_bytes  # gradient + exp_avg + exp_avg_sq, sharded like the parameter

    @property
    def rank_bytes(self) -> int:
        return self.peak_bytes + self.state_bytes

    def lines(self) -> list[str]:
        """What ``hf-ddpfix plan`` prints: the units and this rank's bytes."""
        root = self.root
        held = [u for u in self.units if u.held and u is not root]
        big = self.largest_unit
        out = [f"fsdp2 units at world size {self.world_size} (rank {self.rank}, parameters as FSDP stores them; "
               f"accelerate's fsdp2_prepare_model on the meta device): {len(self.units)} units, model "
               f"{_size(self.total_bytes)}",
               f"  per rank: shard {_size(self.shard_bytes)}; peak in a forward {_size(self.peak_bytes)} (the shard "
               f"+ the units held gathered from forward to backward + the largest other unit)",
               f"  root unit (gathered for the whole forward): {_size(root.full_bytes) if root else '0 B'}"]
        if held:
            out.append("  also held gathered: " + ", ".join(f"[{u.name}] {_size(u.full_bytes)}" for u in held))
        whole = next((u for u in self.units if u.name == UNSHARDED), None)
        if whole is not None:
            out.append(f"  not sharded by FSDP (whole on every rank): {_size(whole.full_bytes)}")
        out.append(f"  largest unit: [{big.name or 'root'}] {_size(big.full_bytes)}")
        out.append(f"  + gradients and AdamW moments of the trainable parameters (sharded) {_size(self.state_bytes)} "
                   f"= {_size(self.rank_bytes)} per rank before activations")
        return out


def _size(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def shard_layout(model: nn.Module, plugin: Any, world_size: int, rank: int = 0, *, join_shared: bool = False,
                 mixed_precision: str = "no", before: Callable[[nn.Module], None] | None = None) -> ShardLayout:
    """Shard a meta-device copy of ``model`` as accelerate would under ``plugin`` at ``world_size`` ranks and read
    rank ``rank``'s units (:class:`ShardLayout`). ``join_shared``: the plan's ``fsdp_shared`` (every module holding
    a tied tensor joins one group, as the run's applier does). ``mixed_precision``: the launch's (``"bf16"``:
    accelerate stores the trainable parameters in float32). ``before(copy)``: called on the copy first.

    Raises:
        ValueError: ``model`` has a parameter that is not on the meta device (a real model would be copied).
    """
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("shard_layout needs a meta-device model (build it under `with torch.device('meta')`)")
    work = copy.deepcopy(model)
    if before is not None:
        before(work)
    names = {id(m): n for n, m in work.named_modules()}
    with fake_process_group(world_size, rank):
        if join_shared:
            with join_shared_holders(work):
                prepare_like_accelerate(work, plugin, mixed_precision)
        else:
            prepare_like_accelerate(work, plugin, mixed_precision)
        every = {id(p): p for p in work.parameters()}
        total = sum(p.numel() * p.element_size() for p in every.values())  # a DTensor's numel is the full one
        whole = sum(p.numel() * p.element_size() for p in every.values() if not hasattr(p, "to_local"))
        units = tuple(
            UnitBytes(name=", ".join(names.get(id(m), type(m).__name__) for m in mods),
                      full_bytes=sum(full * size for full, _, size, _ in params),
                      local_bytes=sum(local * size for _, local, size, _ in params), held=not reshards,
                      trainable_local_bytes=sum(local * size for _, local, size, grad in params if grad))
            for mods, params, reshards in fsdp_groups(work))
    if whole:  # parameters FSDP leaves out (accelerate's ignored modules, 4-bit weights in uint8): whole on every rank
        trainable = sum(p.numel() * p.element_size() for p in every.values()
                        if not hasattr(p, "to_local") and p.requires_grad)
        units += (UnitBytes(UNSHARDED, whole, whole, False, trainable),)
    return ShardLayout(world_size=world_size, rank=rank, units=units, total_bytes=total)
