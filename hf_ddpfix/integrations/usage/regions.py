"""Which trainable parameters a reentrant checkpointed layer reads (its forward builds no graph).

Reentrant checkpointing runs a layer's forward under ``no_grad``: the autograd graph then holds only
the checkpoint node, so ``ParameterUsage``'s graph walk (``integrations/usage/tracker.py``) cannot see the
parameters inside. :class:`ReentrantRegions` wraps each checkpointing layer's checkpoint function so
that, during an observed training forward, every reentrant checkpoint call runs under a
``ParamReadMode`` recording which watched tensors its ops read. The recompute in backward is not
observed (it is the same layer). A region whose output does not require grad gives its parameters no
gradient and is not recorded.

Contract:
    - :meth:`attach` wraps the layers that checkpoint now and re-checks at each layer's forward (a
      checkpoint function replaced later is wrapped then); :meth:`remove` restores each wrapped
      function unless someone replaced it since.
    - Outside an observed forward (``active()`` False) and for non-reentrant checkpoint functions the
      wrapper calls the original unchanged.
    - :meth:`check_reuse` raises :class:`UnusedParametersError` when reuse is not allowed and a
      parameter is read by two regions, or by one region and outside it (its DDP hook fires twice).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ..._compat import (
    checkpointable_layers,
    is_checkpointing,
    layer_checkpoint_func,
    set_layer_checkpoint_func,
)
from ...ops.autograd_reach import ParamReadMode, output_tensors
from ..checkpointing import INNER_ATTR, _use_reentrant_of
from .hang_guard import UnusedParametersError
from .scopes import ParamSlot

__all__ = ["ReentrantRegions"]


class ReentrantRegions:
    """The trainable-parameter reads of each reentrant checkpoint call in one forward.

    Args:
        active: True while a training forward is observed.
        watched: the ids of the trainable tensors to record (read afresh at each region: FSDP2 swaps them).

    Attributes:
        seen: one set of watched tensor ids per region of the current forward whose output requires grad.
    """

    def __init__(self, active: Callable[[], bool], watched: Callable[[], set[int]]) -> None:
        self._active = active
        self._watched = watched
        self.seen: list[set[int]] = []
        self.outputs: list[set[Any]] = []  # per region (parallel to ``seen``): the autograd nodes of its outputs
        self._wrapped: dict[int, tuple[nn.Module, Callable[..., Any]]] = {}

    def attach(self, root: nn.Module) -> list[Any]:
        """Hook every checkpointable layer under ``root``; returns the hook handles."""
        handles = []
        for layer in checkpointable_layers(root):
            handles.append(layer.register_forward_pre_hook(self._layer_pre_hook))
            if is_checkpointing(layer):  # now too: transformers < 5.23 runs the hooks inside the checkpoint call
                self._wrap_layer(layer)
        return handles

    def remove(self) -> None:
        """Restore the wrapped checkpoint functions (those not replaced since)."""
        for layer, inner in self._wrapped.values():
            if getattr(layer_checkpoint_func(layer), "_hf_ddpfix_usage", None) is self:  # not replaced since
                set_layer_checkpoint_func(layer, inner)
        self._wrapped = {}

    def new_forward(self) -> None:
        """Forget the regions of the previous forward."""
        self.seen = []
        self.outputs = []

    def reads_with_outputs(self) -> list[tuple[set[Any], set[int]]]:
        """Per region of the current forward: (the autograd nodes of its outputs, the watched ids it read)."""
        return list(zip(self.outputs, self.seen, strict=True))

    def read_ids(self) -> set[int]:
        """Every watched tensor id read by some region of the current forward."""
        return set().union(*self.seen) if self.seen else set()

    def check_reuse(self, slots: Sequence[ParamSlot], twice: set[int]) -> None:
        """Raise when a parameter is read by more than one region, or (``twice``: slot indices the graph
        walk also reached) by one region and outside it."""
        if not self.seen:
            return
        counts: dict[int, int] = {}
        for seen in self.seen:
            for pid in seen:
                counts[pid] = counts.get(pid, 0) + 1
        reused = [s.name for i, s in enumerate(slots)
                  if i in twice or ((t := s.tensor()) is not None and counts.get(id(t), 0) > 1)]
        if reused:
            raise UnusedParametersError(
                f"hf_ddpfix: {reused[:3]} are read by more than one reentrant checkpointed layer (or by one and "
                "outside it); their DDP hook "
                "fires once per layer, which DistributedDataParallel accepts only with static_graph=True. Fix: "
                "non-reentrant checkpointing (HF_DDPFIX_CHECKPOINTING=non_reentrant) or static_graph=True."
            )

    def _layer_pre_hook(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        if self._active() and is_checkpointing(layer):
            self._wrap_layer(layer)  # picks up a checkpoint function replaced since `attach`

    def _wrap_layer(self, layer: nn.Module) -> None:
        func = layer_checkpoint_func(layer)
        if func is None or getattr(func, "_hf_ddpfix_usage", None) is self:
            return
        set_layer_checkpoint_func(layer, self._observed_checkpoint(func))
        self._wrapped[id(layer)] = (layer, func)

    def _observed_checkpoint(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        reentrant = _use_reentrant_of(inner)

        def checkpoint_observed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if not (self._active() and reentrant):
                return inner(function, *args, **kwargs)
            mode = ParamReadMode(self._watched())
            with mode:
                out = inner(function, *args, **kwargs)
            if any(t.requires_grad for t in output_tensors(out)):
                self.seen.append(mode.seen)
                self.outputs.append({t.grad_fn for t in output_tensors(out) if t.grad_fn is not None})
            return out

        checkpoint_observed._hf_ddpfix_usage = self  # type: ignore[attr-defined]
        setattr(checkpoint_observed, INNER_ATTR, inner)  # what the layer runs (the plan's re-install check reads it)
        checkpoint_observed.use_reentrant = reentrant  # type: ignore[attr-defined]
        return checkpoint_observed
