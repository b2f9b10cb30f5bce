"""A token-wise block with several inputs and outputs, run in sequence tiles (``tiled_token_map``).

Generalises the TiledMLP Function (:mod:`.tiled`) to any function ``fn(*token_inputs) -> outputs``
whose output row ``i`` depends only on input row ``i`` of every input: the pre-attention part of a
decoder layer (norm, q/k/v projections with LoRA, rotary) or the post-attention part (o projection,
residual, norm, MLP, residual). The forward runs tile by tile under ``no_grad`` and saves only the
inputs; the backward recomputes one tile at a time with grad enabled, so the block's intermediates
exist for one tile at a time, never for the whole sequence.

DDP/FSDP safety (the TiledMLP design, REFERENCES.md section 4): the block's trainable parameters are
explicit inputs of one ``autograd.Function``; per tile the backward calls ``torch.autograd.grad`` on
detached stand-ins swapped into the module, sums parameter gradients locally (fp32 for low-precision
parameters) and returns them, so each parameter's ``AccumulateGrad`` and DDP/FSDP hook fires once.
RNG (CPU and CUDA) and the autocast state of the forward are replayed in the recompute, so dropout
masks are those of the forward.

Checkpointing: with ``skip_in_recompute`` the call skips its compute in a non-reentrant checkpoint
recompute whose early stop fires on its saved tensors (its output is then never read), as TiledMLP.

Guarantees: outputs equal ``fn`` on the whole input up to the matmul/reduction order inside a tile
(bit-identical with one tile); each input gradient row is computed from that tile only; every
trainable parameter of ``module`` that ``fn`` uses gets exactly one gradient per backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._compat import checkpoint_recompute_is_last
from .tiled import _split_sizes, _swapped_params, _trainable_params

__all__ = ["DEFAULT_TOKENS_PER_TILE", "tiled_token_map", "tiles_for"]

# 2048-token tiles keep the Llama-8B matmuls large (2048 x 4096 x 14336) and bound a tile's
# intermediates to ~0.3 GiB (the TiledMLP default, benchmarks/tiled.py).
DEFAULT_TOKENS_PER_TILE = 2048


def tiles_for(num_tokens: int, tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE) -> int:
    """``ceil(num_tokens / tokens_per_tile)``, at least 1. Raises ``ValueError`` for ``tokens_per_tile < 1``."""
    if int(tokens_per_tile) < 1:
        raise ValueError(f"tokens_per_tile={tokens_per_tile!r}: must be an integer >= 1")
    return max(1, math.ceil(int(num_tokens) / int(tokens_per_tile)))


@dataclass
class _MapCall:
    fn: Callable[..., tuple[torch.Tensor, ...]]
    module: nn.Module
    names: list[list[str]]
    n_inputs: int
    tiles: int
    skip_in_recompute: bool
    stats: dict[str, int] | None


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class _TokenMapFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _MapCall, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        inputs, params = tensors[: call.n_inputs], tensors[call.n_inputs :]
        n = inputs[0].shape[0]
        sizes = _split_sizes(n, call.tiles)
        dev = inputs[0].device
        ctx.call = call
        ctx.sizes = sizes
        ctx.autocast = (
            dev.type,
            torch.is_autocast_enabled(dev.type),
            torch.get_autocast_dtype(dev.type),
            torch.is_autocast_cache_enabled(),
        )
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
        ctx.save_for_backward(*inputs, *params)
        ctx.set_materialize_grads(False)

        if call.skip_in_recompute and checkpoint_recompute_is_last(len(inputs) + len(params)):
            probe = _as_tuple(call.fn(*(t[:1] for t in inputs)))
            if call.stats is not None:
                call.stats["skipped_recompute"] = call.stats.get("skipped_recompute", 0) + 1
            return tuple(p.new_empty((n, *p.shape[1:])) for p in probe)

        outs: list[torch.Tensor] = []
        start = 0
        for size in sizes:
            ys = _as_tuple(call.fn(*(t[start : start + size] for t in inputs)))
            if not outs:
                outs = [y.new_empty((n, *y.shape[1:])) for y in ys]
            for o, y in zip(outs, ys, strict=True):
                o[start : start + size] = y
            del ys
            start += size
        if call.stats is not None:
            call.stats["forward_tiles"] = call.stats.get("forward_tiles", 0) + len(sizes)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        call: _MapCall = ctx.call
        saved = ctx.saved_tensors
        inputs, params = saved[: call.n_inputs], saved[call.n_inputs :]
        needs = ctx.needs_input_grad[1:]
        need_in = [bool(b) for b in needs[: call.n_inputs]]
        need_p = [bool(b) for b in needs[call.n_inputs :]]
        leaves = [p.detach().requires_grad_(nd) for p, nd in zip(params, need_p, strict=True)]
        wanted = [leaf for leaf, nd in zip(leaves, need_p, strict=True) if nd]
        acc: list[torch.Tensor | None] = [None] * len(wanted)
        grad_in: list[torch.Tensor | None] = [torch.empty_like(t) if nd else None for t, nd in zip(inputs, need_in, strict=True)]

        device_type, ac_enabled, ac_dtype, ac_cache = ctx.autocast
        dev = inputs[0].device
        devices = [dev] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), _swapped_params(call.module, call.names, leaves):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, dev)
            start = 0
            for size in ctx.sizes:
                sl = slice(start, start + size)
                xs = [t[sl].detach().requires_grad_(nd) for t, nd in zip(inputs, need_in, strict=True)]
                with torch.enable_grad(), torch.autocast(device_type, dtype=ac_dtype, enabled=ac_enabled, cache_enabled=ac_cache):
                    ys = _as_tuple(call.fn(*xs))
                pairs = [(y, g[sl]) for y, g in zip(ys, grads, strict=True) if g is not None and y.requires_grad]
                wrt = [x for x, nd in zip(xs, need_in, strict=True) if nd] + wanted
                got: Sequence[torch.Tensor | None] = (
                    torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                    if pairs and wrt else [None] * len(wrt)
                )
                del ys, pairs
                k = 0
                for i, nd in enumerate(need_in):
                    if not nd:
                        continue
                    buf = grad_in[i]
                    assert buf is not None
                    if got[k] is None:
                        buf[sl].zero_()
                    else:
                        buf[sl] = got[k]
                    k += 1
                for j, g in enumerate(got[k:]):
                    if g is None:
                        continue
                    if acc[j] is None:
                        acc[j] = g.clone() if g.dtype in (torch.float32, torch.float64) else g.float()
                    else:
                        acc[j].add_(g)  # type: ignore[union-attr]
                del got, xs
                if call.stats is not None:
                    call.stats["backward_tiles"] = call.stats.get("backward_tiles", 0) + 1
                start += size

        out_params: list[torch.Tensor | None] = []
        it = iter(acc)
        for p, nd in zip(params, need_p, strict=True):
            g = next(it) if nd else None
            out_params.append(None if g is None else g.to(p.dtype))
        return (None, *grad_in, *out_params)


def tiled_token_map(
    fn: Callable[..., Any],
    inputs: Sequence[torch.Tensor],
    module: nn.Module,
    *,
    tiles: int,
    skip_in_recompute: bool = False,
    stats: dict[str, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Run ``fn(*inputs)`` in ``tiles`` tiles of the token axis (dim 0 of every input).

    Args:
        fn: token-wise function of the inputs (row ``i`` of each output depends only on row ``i`` of
            each input); returns a tensor or a tuple of tensors with the token axis first. It may call
            submodules of ``module``; their trainable parameters become explicit Function inputs.
        inputs: tensors ``[tokens, ...]`` with the same ``tokens``; those that require grad get one.
        module: the module owning every trainable parameter ``fn`` uses (found at call time).
        tiles: number of tiles (clamped to the token count; sizes differ by at most one).
        skip_in_recompute: skip the compute inside a non-reentrant checkpoint recompute whose early
            stop fires on this call's saved tensors (only for the last op of a checkpointed block).
        stats: optional dict receiving ``forward_tiles``, ``backward_tiles``, ``skipped_recompute``.

    Returns:
        The outputs as a tuple, each ``[tokens, ...]``.

    Raises:
        ValueError: no inputs, inputs with different token counts, or ``tiles < 1``.

    Guarantees: see the module docstring.
    """
    if not inputs:
        raise ValueError("tiled_token_map: needs at least one input tensor")
    n = inputs[0].shape[0]
    if any(t.shape[0] != n for t in inputs):
        raise ValueError(f"tiled_token_map: inputs have different token counts {[t.shape[0] for t in inputs]}")
    if int(tiles) < 1:
        raise ValueError(f"tiled_token_map(tiles={tiles!r}): must be an integer >= 1")
    names, params = _trainable_params(module)
    call = _MapCall(fn, module, names, len(inputs), int(tiles), skip_in_recompute, stats)
    return _TokenMapFunction.apply(call, *inputs, *params)
