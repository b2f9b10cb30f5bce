"""Tiled compute for token-wise modules: one explicit-parameter autograd Function, DDP/FSDP safe.

A token-wise module (a gated MLP, a vision MLP) maps every token independently, so it can run in
chunks along the flattened token axis. The forward runs chunk by chunk under ``no_grad`` and keeps only
its input; the backward recomputes each chunk with grad enabled. Peak intermediate memory falls from
``tokens x intermediate`` to ``tokens/shards x intermediate``.

DDP safety: the module's trainable parameters are explicit inputs of one ``autograd.Function``. The
backward calls ``torch.autograd.grad`` per chunk on detached stand-ins of the parameters, sums the
parameter gradients locally and returns them, so each parameter's ``AccumulateGrad`` (and the DDP /
FSDP hook on it) fires exactly once per step. (A per-chunk ``.backward()`` fires the hooks once per
chunk: "Expected to mark a variable ready only once", REFERENCES.md section 4.)

Checkpointing: inside a non-reentrant checkpoint the layer forward runs again in backward only to
regenerate saved tensors. We skip the compute in that recompute when it is provably unused (the
checkpoint's early stop fires on this Function's own saved tensors; the probe is
:func:`hf_ddpfix._compat.checkpoint_recompute_is_last`), so a checkpointed layer runs 2 MLP forwards +
1 backward per step, like the untiled one. Reentrant checkpointing needs the recomputed output: 3.

Pure torch: the HF-facing detection and patching live in ``hf_ddpfix.integrations.long_context.token_wise`` and
``hf_ddpfix.integrations.long_context.tiled_mlp``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .._compat import checkpoint_recompute_is_last, module_parameter_slots

__all__ = [
    "ALLOWED_SETTINGS",
    "DEFAULT_MIN_TOKENS",
    "DEFAULT_TARGET_GB",
    "DEFAULT_TOKENS_PER_SHARD",
    "INTERMEDIATE_BYTES_PER_TOKEN_FACTOR",
    "TiledMLPSetting",
    "choose_shards",
    "holds_fsdp_unit",
    "parse_tiled_mlp_setting",
    "sync_shards",
    "tiled_call",
]

# Below this many tokens per MLP call "auto" does not tile: the intermediate is small, and tiling
# costs time at short sequences (+26% at 2K tokens, ms-swift #7090). benchmarks/tiled.py: below 8K
# tokens the untiled Llama-8B MLP fwd+bwd peak is < 0.75 GiB (bf16), not worth a recompute.
DEFAULT_MIN_TOKENS = 8192
# "auto" target chunk length. 2K-token chunks keep the matmuls large (2048 x 4096 x 14336 on Llama-8B)
# and give 4.5x lower MLP fwd+bwd peak at 16K tokens, 6.4x at 32K (benchmarks/tiled.py); ceil(seq/hidden)
# (ALST) gives only 4 shards and 2.8x at 16K.
DEFAULT_TOKENS_PER_SHARD = 2048
# "target" without a number: the MLP intermediate of one chunk should fit in this many GiB.
DEFAULT_TARGET_GB = 1.0
# Live intermediate bytes per token of an untiled gated MLP fwd+bwd, in units of
# intermediate_size x dtype bytes (gate, up, act(gate), product and their grads overlap in backward).
# benchmarks/tiled.py measures 5.43 (exact live-tensor bytes, Llama-8B MLP, bf16, every length).
INTERMEDIATE_BYTES_PER_TOKEN_FACTOR = 5.5

ALLOWED_SETTINGS = "off|0|false, on|1|true, auto, arctic, target, target:<GB>, <N shards >= 2>"


# --------------------------------------------------------------------------------------------------
# Shard policy
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TiledMLPSetting:
    """A parsed tiled-MLP setting (``HF_DDPFIX_TILED_MLP`` / ``UNSLOTH_TILED_MLP`` spellings).

    Attributes:
        mode: ``"off"``, ``"on"`` (forced: every call with 2 or more tokens tiled, ``ceil(tokens /
            tokens_per_shard)`` shards and at least 2), ``"auto"`` (min-tokens + tokens-per-shard rule), ``"arctic"``
            (``ceil(tokens / hidden)`` shards, ALST/Unsloth rule), ``"target"`` (shards so that one chunk's
            MLP intermediate fits ``target_gb`` GiB) or ``"fixed"`` (exactly ``shards``).
        shards: the shard count for ``"fixed"``.
        target_gb: GiB budget for ``"target"`` (``None`` = ``DEFAULT_TARGET_GB``).
    """

    mode: Literal["off", "on", "auto", "arctic", "target", "fixed"]
    shards: int | None = None
    target_gb: float | None = None


def parse_tiled_mlp_setting(value: str, name: str = "UNSLOTH_TILED_MLP") -> TiledMLPSetting:
    """Parse a tiled-MLP setting string.

    Args:
        value: ``off|0|false|no``, ``on|1|true|yes`` (forced), ``auto``, ``arctic``, ``target``, ``target:<GB>``
            (GB a positive number) or an integer ``N >= 2`` (fixed shard count). Case-insensitive. (An explicit
            ``on`` asks for tiling and gets it: it is not a spelling of ``auto``, which tiles only from
            ``min_tokens`` on and which the memory plan may leave off.)
        name: the variable name used in error messages.

    Raises:
        ValueError: naming ``name``, the bad value and the allowed values.

    Guarantees: every allowed spelling parses; anything else raises (never silently "off").
    """
    raw = value
    v = str(value).strip().lower()
    if v in ("", "0", "false", "off", "no", "none"):
        return TiledMLPSetting("off")
    if v in ("1", "true", "on", "yes"):
        return TiledMLPSetting("on")
    if v == "auto":
        return TiledMLPSetting("auto")
    if v == "arctic":
        return TiledMLPSetting("arctic")
    if v == "target":
        return TiledMLPSetting("target")
    if v.startswith("target:"):
        try:
            gb = float(v.split(":", 1)[1])
        except ValueError:
            gb = float("nan")
        if not (gb > 0 and math.isfinite(gb)):
            raise ValueError(
                f"{name}={raw!r}: 'target:<GB>' needs a positive number of GiB, e.g. 'target:2'. "
                f"Allowed: {ALLOWED_SETTINGS}"
            )
        return TiledMLPSetting("target", target_gb=gb)
    if v.isdigit() and int(v) >= 2:
        return TiledMLPSetting("fixed", shards=int(v))
    raise ValueError(f"{name}={raw!r} is not a tiled-MLP setting. Allowed: {ALLOWED_SETTINGS}")


def choose_shards(
    num_tokens: int,
    hidden: int,
    intermediate: int,
    shards: int | str | TiledMLPSetting = "auto",
    *,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD,
    target_gb: float | None = None,
    dtype_bytes: int = 2,
) -> int:
    """Number of chunks to split ``num_tokens`` tokens into.

    Rule:
        - int ``n``: ``n`` (clamped to ``[1, num_tokens]``).
        - ``"auto"``: 1 below ``min_tokens`` tokens (tiling does not pay there), else
          ``ceil(num_tokens / tokens_per_shard)``.
        - ``"on"`` (forced): ``max(2, ceil(num_tokens / tokens_per_shard))`` at every length (1 only for
          a single token).
        - ``"arctic"``: ``ceil(num_tokens / hidden)`` (ALST / Unsloth).
        - ``"target"``: ``ceil(num_tokens * F * intermediate * dtype_bytes / target)`` with
          ``F = INTERMEDIATE_BYTES_PER_TOKEN_FACTOR`` and target ``target_gb`` GiB (default 1 GiB).
        - ``"off"``: 1. A ``TiledMLPSetting`` or any of the strings ``parse_tiled_mlp_setting`` accepts.

    Guarantees: the result is in ``[1, max(1, num_tokens)]`` and deterministic in its arguments.
    """
    if isinstance(shards, str):
        shards = parse_tiled_mlp_setting(shards, name="shards")
    upper = max(1, int(num_tokens))
    if isinstance(shards, bool):
        raise ValueError("shards must be an int >= 1, 'on', 'auto', 'arctic', 'target', 'target:<GB>' or 'off'")
    if isinstance(shards, int):
        if shards < 1:
            raise ValueError(f"shards={shards}: must be >= 1")
        return min(shards, upper)
    mode = shards.mode
    if mode == "off":
        n = 1
    elif mode == "fixed":
        n = int(shards.shards or 1)
    elif mode == "on":
        n = max(2, math.ceil(num_tokens / max(1, tokens_per_shard)))
    elif mode == "arctic":
        n = math.ceil(num_tokens / max(1, hidden))
    elif mode == "target":
        gb = shards.target_gb or target_gb or DEFAULT_TARGET_GB
        per_token = INTERMEDIATE_BYTES_PER_TOKEN_FACTOR * intermediate * dtype_bytes
        n = math.ceil(num_tokens * per_token / (gb * 2**30))
    else:  # auto
        n = 1 if num_tokens < min_tokens else math.ceil(num_tokens / max(1, tokens_per_shard))
    return max(1, min(int(n), upper))


def sync_shards(n: int, group: Any = None) -> int:
    """All-reduce MAX of ``n`` over ``group`` so every rank uses the same shard count.

    Needed when a chunk triggers collectives (ZeRO-3 / FSDP wrapping the MLP's Linear layers: a
    different chunk count per rank means a different number of all-gathers and a hang). Costs one
    scalar all-reduce (and a host sync on GPU) per MLP call. Without an initialised process group
    (or world size 1) returns ``n`` unchanged.

    Guarantees: every rank of ``group`` gets the same value, ``>= n`` on each.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return int(n)
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    t = torch.tensor([int(n)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def holds_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``module`` is, or contains, an FSDP2 unit (``fully_shard``'s ``FSDPModule``): only then can a
    chunked call issue collectives of its own, so only then must the chunk count agree across ranks.

    A module inside a unit (an MLP in a decoder-layer unit, a vision tower folded into the root) issues none:
    its unit gathers once around the whole forward and backward, however often its ``forward`` runs, so a
    per-rank chunk count is safe there, and a count all-reduce would be a collective that only the ranks
    reaching the module issue (a vision MLP on the image ranks: the others wait in a different collective).

    Guarantees: read only; ``False`` without torch's FSDP2.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: nothing gathers per call
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


# --------------------------------------------------------------------------------------------------
# The autograd Function
# --------------------------------------------------------------------------------------------------


def _split_sizes(n: int, shards: int) -> list[int]:
    shards = max(1, min(shards, n))
    base, rem = divmod(n, shards)
    return [base + (1 if i < rem else 0) for i in range(shards)]


@contextmanager
def _swapped_params(module: nn.Module, names: Sequence[Sequence[str]], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """Temporarily make ``module``'s parameters (by qualified name) the given tensors."""
    saved: list[tuple[nn.Module, str, Any]] = []
    try:
        for group, value in zip(names, values, strict=True):
            for qual in group:
                owner_name, _, leaf = qual.rpartition(".")
                owner = module.get_submodule(owner_name) if owner_name else module
                saved.append((owner, leaf, module_parameter_slots(owner)[leaf]))
                module_parameter_slots(owner)[leaf] = value  # a plain tensor: autograd tracks it, no hooks
        yield
    finally:
        for owner, leaf, old in reversed(saved):
            module_parameter_slots(owner)[leaf] = old


def _trainable_params(module: nn.Module) -> tuple[list[list[str]], list[torch.Tensor]]:
    """Trainable parameters (found at call time) and every name each one is reachable under."""
    by_id: dict[int, int] = {}
    names: list[list[str]] = []
    params: list[torch.Tensor] = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        if id(p) in by_id:
            names[by_id[id(p)]].append(name)
            continue
        by_id[id(p)] = len(params)
        names.append([name])
        params.append(p)
    return names, params


@dataclass
class _Call:
    """Non-tensor state of one tiled call (travels through ``Function.apply``)."""

    module: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]
    names: list[list[str]]
    shards: int
    skip_in_recompute: bool = True
    stats: dict[str, int] | None = None


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x_flat = x.reshape(-1, x.shape[-1])
        n = x_flat.shape[0]
        sizes = _split_sizes(n, call.shards)
        device_type = x.device.type
        ctx.call = call
        ctx.sizes = sizes
        ctx.x_shape = x.shape
        ctx.autocast = (
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled(),
        )
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        ctx.save_for_backward(x, *params)

        if call.skip_in_recompute and checkpoint_recompute_is_last(1 + len(params)):
            # Checkpoint recompute whose early stop fires on our saved tensors: the output is never
            # read, so skip the MLP (avoids a third MLP forward). Probe one token for shape/dtype.
            probe = call.forward(x_flat[:1])
            if call.stats is not None:
                call.stats["skipped_recompute"] = call.stats.get("skipped_recompute", 0) + 1
            return probe.new_empty((*x.shape[:-1], probe.shape[-1]))

        out: torch.Tensor | None = None
        start = 0
        if call.stats is not None:
            call.stats["forward_chunks"] = call.stats.get("forward_chunks", 0) + len(sizes)
        for size in sizes:
            y = call.forward(x_flat[start : start + size])
            if out is None:
                out = y.new_empty((n, y.shape[-1]))
            out[start : start + size] = y
            start += size
            if call.stats is not None:
                call.stats["forward_tokens"] = call.stats.get("forward_tokens", 0) + size
        assert out is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        call: _Call = ctx.call
        x, *params = ctx.saved_tensors
        needs = ctx.needs_input_grad
        need_x = bool(needs[1])
        need_p = [bool(b) for b in needs[2:]]
        x_flat = x.reshape(-1, x.shape[-1]).detach()
        g_flat = grad_out.reshape(-1, grad_out.shape[-1])
        leaves = [p.detach().requires_grad_(need) for p, need in zip(params, need_p, strict=True)]
        wanted = [leaf for leaf, need in zip(leaves, need_p, strict=True) if need]
        acc: list[torch.Tensor | None] = [None] * len(wanted)
        grad_x = torch.empty_like(x_flat) if need_x else None

        device_type, ac_enabled, ac_dtype, ac_cache = ctx.autocast
        devices = [x.device] if x.is_cuda else []
        with torch.random.fork_rng(devices=devices), _swapped_params(call.module, call.names, leaves):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            start = 0
            for size in ctx.sizes:
                xc = x_flat[start : start + size].detach().requires_grad_(need_x)
                with torch.enable_grad(), torch.autocast(
                    device_type, dtype=ac_dtype, enabled=ac_enabled, cache_enabled=ac_cache
                ):
                    yc = call.forward(xc)
                inputs = ([xc] if need_x else []) + wanted
                if call.stats is not None:
                    call.stats["backward_tokens"] = call.stats.get("backward_tokens", 0) + size
                if inputs and yc.requires_grad:
                    grads = torch.autograd.grad(yc, inputs, g_flat[start : start + size], allow_unused=True)
                    if need_x:
                        gx, grads = grads[0], grads[1:]
                        assert grad_x is not None
                        if gx is None:
                            grad_x[start : start + size].zero_()
                        else:
                            grad_x[start : start + size] = gx
                    for i, g in enumerate(grads):
                        if g is None:
                            continue
                        if acc[i] is None:
                            hi = g.dtype in (torch.float32, torch.float64)
                            acc[i] = g.clone() if hi else g.float()
                        else:
                            acc[i].add_(g)  # type: ignore[union-attr]
                elif grad_x is not None:
                    grad_x[start : start + size].zero_()
                start += size

        out_params: list[torch.Tensor | None] = []
        it = iter(acc)
        for p, need in zip(params, need_p, strict=True):
            g = next(it) if need else None
            out_params.append(None if g is None else g.to(p.dtype))
        gx_out = grad_x.view(ctx.x_shape) if grad_x is not None else None
        return (None, gx_out, *out_params)


def tiled_call(
    module: nn.Module,
    x: torch.Tensor,
    shards: int,
    *,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    skip_in_recompute: bool = True,
    stats: dict[str, int] | None = None,
) -> torch.Tensor:
    """Run token-wise ``module`` on ``x`` in ``shards`` chunks of the flattened token axis.

    Args:
        module: a token-wise module (output row ``i`` depends only on input row ``i``).
        x: ``[..., hidden]``; all leading dims are flattened into one token axis.
        shards: number of chunks (clamped to the token count); sizes differ by at most one.
        forward: the function to run per chunk (default: the class ``forward`` bound to ``module``,
            so instance-level patches and module hooks are not re-entered per chunk).
        skip_in_recompute: inside a non-reentrant checkpoint recompute whose early stop fires on this
            call's saved tensors, skip the MLP compute (its output is never read). Turn off to always
            compute (3 MLP forwards per step under checkpointing instead of 2).
        stats: optional dict that receives counters (``forward_tokens``, ``forward_chunks``,
            ``backward_tokens``, ``skipped_recompute``) for tests and benchmarks.

    Returns:
        ``[..., out_features]``, same values as ``module(x)`` up to float summation order.

    Guarantees: gradients w.r.t. ``x`` and every trainable parameter equal the untiled ones; each
    trainable parameter receives exactly one gradient (one ``AccumulateGrad``/DDP hook) per backward;
    dropout masks in the recompute equal the forward's (CPU and CUDA RNG replayed); the autocast state
    of the forward is re-entered in the recompute; the global RNG state is left as the forward left it.
    """
    fwd = forward if forward is not None else type(module).forward.__get__(module)
    names, params = _trainable_params(module)
    call = _Call(module, fwd, names, int(shards), skip_in_recompute, stats)
    return _TiledFunction.apply(call, x, *params)
