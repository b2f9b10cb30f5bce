"""An exactly-zero contribution that makes tensors "used" for autograd, DDP and FSDP.

``ZeroTie.apply(x, *extras)`` returns a bitwise copy of ``x``; in backward ``x`` gets the incoming
gradient unchanged and every ``extra`` gets an exact-zero gradient. Tying a tensor computed from some
parameters into the loss this way makes those parameters take part in backward (their
``AccumulateGrad`` and DDP hooks fire, FSDP reduce-scatters them) without changing the loss or any
other gradient by a single bit, whatever the dtype or autocast state (no ``0 * inf`` NaN either).

Each zero gradient a tie hands out is a zero-strided view of one scalar zero, marked (:func:`is_tie_zero`): a
leaf's gradient hook that receives it knows nothing but the tie reached that leaf in this backward (the autograd
engine sums every contribution to a leaf before its hooks run, and never in place into a non-contiguous
tensor: any real contribution gives the hook another tensor). ``ParameterUsage`` decides "used" by it, from
what backward really ran (a regulariser added below the loss it saw, a hook, a second backward), without reading
a gradient's values: a real gradient that is exactly zero (LoRA A's first gradient while B is zero) is still a
real gradient, as for stock DDP's "its hook fired". So that ties alone always hand a leaf exactly one marked zero,
in one backward pass only the first tie that runs gives a leaf extra its zero; every later tie of the same leaf
in that pass gives it ``None`` (nothing to add: the leaf's ``AccumulateGrad`` runs anyway, the first zero is in
its buffer). Two ties used to reach a leaf summed into an unmarked zero, told apart by a host read of its values.
A tied output no loss reads gets ``None`` back (``set_materialize_grads(False)``, as DDP's sink leaves it), not a
zero sent through ``x``'s own graph, which would give the parameters behind it computed, unmarked zeros.

:meth:`ZeroTie.tie` also ties a parameter that stopped requiring grad after the model was wrapped: DDP's reducer
still waits for its hook, which fires when its ``AccumulateGrad`` runs; autograd accumulates nothing into a leaf
that does not require grad, so it gets no gradient, as frozen.
"""

from __future__ import annotations

from typing import Any

import torch

from .._compat import autograd_function_class, backward_id

__all__ = ["ZeroTie", "is_tie_zero", "is_zero_tie_node", "tie_zero"]

_MARK = "_hf_ddpfix_tie_zero"
_GIVEN = "_hf_ddpfix_tie_given"  # on a leaf extra: the backward pass (``backward_id``) a tie last gave it its zero in


def _marked_zero(shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    z = torch.zeros((), dtype=dtype, device=device).expand(shape)
    setattr(z, _MARK, True)  # kept with the tensor while autograd holds it (PyObject preservation)
    return z


def is_tie_zero(grad: Any) -> bool:
    """True for a gradient that is exactly a tie's zero (no other contribution was summed into it)."""
    return getattr(grad, _MARK, False) is True


class ZeroTie(torch.autograd.Function):
    """Identity on ``x``; the extra inputs get exact-zero gradients (so autograd, DDP and FSDP see
    them used). The forward value is a bitwise copy of ``x`` whatever the dtype or autocast state,
    and no ``0 * inf`` can turn the loss into NaN.

    ``ZeroTie.applied`` counts the ties made in this process (every use goes through ``apply``): a graph built
    while it did not move holds no tie (``ParameterUsage``'s no-walk check relies on it)."""

    applied = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *extras: torch.Tensor) -> torch.Tensor:
        ZeroTie.applied += 1
        # an output the loss does not use gets None, not a materialised zero: a zero sent back through ``x``'s own
        # graph would give its parameters computed zeros stock never gives them (tests/scripts/trainer_heads.py
        # head_in_forward: lm_head's LoRA behind tied logits the loss never reads; 5e-4 off stock by AdamW's decay)
        ctx.set_materialize_grads(False)
        ctx.extra_meta = [(e.shape, e.dtype, e.device) for e in extras]
        ctx.leaves = {i: e for i, e in enumerate(extras) if e.is_leaf}  # parameters: no graph held, no cycle
        return x.clone()  # a clone, not a view: Trainer scales the loss in place (`loss *= ...`)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        now = backward_id()
        zeros: list[torch.Tensor | None] = []
        for i, (s, d, dev) in enumerate(ctx.extra_meta):
            leaf = ctx.leaves.get(i)
            if leaf is not None:
                if getattr(leaf, _GIVEN, None) == now:
                    zeros.append(None)  # another tie gave this leaf its zero in this pass: one marked zero only
                    continue
                setattr(leaf, _GIVEN, now)
            zeros.append(_marked_zero(s, d, dev))
        return (grad, *zeros)

    @staticmethod
    def tie(x: torch.Tensor, extras: list[torch.Tensor]) -> torch.Tensor:
        """``ZeroTie.apply(x, *extras)``, with every extra that does not require grad now (a parameter frozen
        after the model was wrapped) tied too: its ``requires_grad`` is switched on only while the tie is built,
        so its ``AccumulateGrad`` node (and a DDP hook on it) runs in backward and accumulates nothing."""
        frozen = [e for e in extras if not e.requires_grad and e.is_leaf and e.is_floating_point()]
        for e in frozen:
            e.requires_grad_(True)
        try:
            return ZeroTie.apply(x, *extras)
        finally:
            for e in frozen:
                e.requires_grad_(False)


def is_zero_tie_node(node: Any) -> bool:
    """True for the autograd node of a :class:`ZeroTie` (its inputs after the first get exact zeros)."""
    return autograd_function_class(node) is ZeroTie


def tie_zero(output: Any, extras: list[torch.Tensor]) -> Any:
    """Attach ``extras`` to ``output.loss`` (else ``logits``, else the first tensor) via :class:`ZeroTie`."""
    extras = [e for e in extras if e.requires_grad]
    if not extras:
        return output
    if isinstance(output, dict):  # ModelOutput: setting a key updates the attribute too
        for key in ("loss", "logits", "last_hidden_state"):
            val = output.get(key)
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                output[key] = ZeroTie.apply(val, *extras)
                return output
        for key, val in output.items():
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                output[key] = ZeroTie.apply(val, *extras)
                return output
    elif isinstance(output, torch.Tensor) and output.is_floating_point():
        return ZeroTie.apply(output, *extras)
    elif isinstance(output, tuple):
        for i, val in enumerate(output):
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                return output[:i] + (ZeroTie.apply(val, *extras),) + output[i + 1 :]
    raise TypeError(f"hf_ddpfix: cannot attach the dummy vision output to a {type(output).__name__}")

