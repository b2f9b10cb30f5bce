"""Tiled compute for token-wise modules (TiledMLP), DDP/FSDP safe.

A token-wise module (the gated MLP of Llama/Qwen/Mistral/Gemma, the Qwen2-VL / Qwen2.5-VL vision MLPs)
maps every token independently, so it can run in chunks along the flattened token axis. The forward
runs chunk by chunk under ``no_grad`` and keeps only its input; the backward recomputes each chunk with
grad enabled. Peak intermediate memory falls from ``tokens x intermediate`` to
``tokens/shards x intermediate``.

DDP safety: the module's trainable parameters are explicit inputs of one ``autograd.Function``. The
backward calls ``torch.autograd.grad`` per chunk on detached stand-ins of the parameters, sums the
parameter gradients locally and returns them, so each parameter's ``AccumulateGrad`` (and the DDP /
FSDP hook on it) fires exactly once per step. (A per-chunk ``.backward()`` fires the hooks once per
chunk: "Expected to mark a variable ready only once", REFERENCES.md section 4.)

Checkpointing: inside a non-reentrant checkpoint the layer forward runs again in backward only to
regenerate saved tensors, and the tiled MLP would then run 3 times per step (forward, checkpoint
recompute, tiled backward recompute). We skip the compute in the checkpoint recompute when it is
provably unused: the checkpoint's early stop fires on this Function's own saved tensors (they are the
last ones the recompute needs, true for Llama/Qwen/Mistral decoder layers and the Qwen-VL vision
blocks where only a residual add follows the MLP), so the output is never read and a placeholder is
returned. Otherwise (an op after the MLP saves its output, early stop disabled, torch internals changed)
the recompute computes as usual. Result: 2 MLP forwards + 1 backward per step, like the untiled
checkpointed layer. Reentrant checkpointing needs the recomputed output, so it keeps 3.

Usage::

    handle = apply_tiled_mlp(model, shards="auto")   # before DDP/FSDP wrapping
    print(handle.report)                              # what was tiled, what was skipped and why
    handle.remove()                                   # or remove_tiled_mlp(model)
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DEFAULT_MIN_TOKENS",
    "DEFAULT_TARGET_GB",
    "DEFAULT_TOKENS_PER_SHARD",
    "INTERMEDIATE_BYTES_PER_TOKEN_FACTOR",
    "TiledMLPEntry",
    "TiledMLPHandle",
    "TiledMLPSetting",
    "apply_tiled_mlp",
    "choose_shards",
    "is_token_wise",
    "parse_tiled_mlp_setting",
    "register_token_wise",
    "remove_tiled_mlp",
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

_STATE_ATTR = "_hf_ddpfix_tiled_mlp"
_ALLOWED_SETTINGS = "off|0|false, on|1|true|auto, arctic, target, target:<GB>, <N shards >= 2>"


# --------------------------------------------------------------------------------------------------
# Shard policy
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TiledMLPSetting:
    """A parsed tiled-MLP setting (``HF_DDPFIX_TILED_MLP`` / ``UNSLOTH_TILED_MLP`` spellings).

    Attributes:
        mode: ``"off"``, ``"auto"`` (min-tokens + tokens-per-shard rule), ``"arctic"``
            (``ceil(tokens / hidden)`` shards, ALST/Unsloth rule), ``"target"`` (shards so that one chunk's
            MLP intermediate fits ``target_gb`` GiB) or ``"fixed"`` (exactly ``shards``).
        shards: the shard count for ``"fixed"``.
        target_gb: GiB budget for ``"target"`` (``None`` = ``DEFAULT_TARGET_GB``).
    """

    mode: Literal["off", "auto", "arctic", "target", "fixed"]
    shards: int | None = None
    target_gb: float | None = None


def parse_tiled_mlp_setting(value: str, name: str = "UNSLOTH_TILED_MLP") -> TiledMLPSetting:
    """Parse a tiled-MLP setting string.

    Args:
        value: ``off|0|false|no``, ``on|1|true|yes|auto``, ``arctic``, ``target``, ``target:<GB>``
            (GB a positive number) or an integer ``N >= 2`` (fixed shard count). Case-insensitive.
        name: the variable name used in error messages.

    Raises:
        ValueError: naming ``name``, the bad value and the allowed values.

    Guarantees: every allowed spelling parses; anything else raises (never silently "off").
    """
    raw = value
    v = str(value).strip().lower()
    if v in ("", "0", "false", "off", "no", "none"):
        return TiledMLPSetting("off")
    if v in ("1", "true", "on", "yes", "auto"):
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
                f"Allowed: {_ALLOWED_SETTINGS}"
            )
        return TiledMLPSetting("target", target_gb=gb)
    if v.isdigit() and int(v) >= 2:
        return TiledMLPSetting("fixed", shards=int(v))
    raise ValueError(f"{name}={raw!r} is not a tiled-MLP setting. Allowed: {_ALLOWED_SETTINGS}")


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
        raise ValueError("shards must be an int >= 1, 'auto', 'arctic', 'target', 'target:<GB>' or 'off'")
    if isinstance(shards, int):
        if shards < 1:
            raise ValueError(f"shards={shards}: must be >= 1")
        return min(shards, upper)
    mode = shards.mode
    if mode == "off":
        n = 1
    elif mode == "fixed":
        n = int(shards.shards or 1)
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
                saved.append((owner, leaf, owner._parameters[leaf]))
                owner._parameters[leaf] = value  # a plain tensor: autograd tracks it, no hooks
        yield
    finally:
        for owner, leaf, old in reversed(saved):
            owner._parameters[leaf] = old


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


def _checkpoint_recompute_is_last(n_saved: int) -> bool:
    """True when called inside a non-reentrant checkpoint recompute (early stop on) and the next
    ``n_saved`` saved tensors are the last the recompute needs: the recompute stops right after them,
    so the value of this op's output is never read.

    Reads torch.utils.checkpoint internals (torch 2.4-2.13); any surprise returns False (= compute).
    """
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if not hooks:
            return False
        fn = hooks[0]
        fn = getattr(fn, "__wrapped__", fn)
        if "_recomputation_hook" not in getattr(fn, "__qualname__", ""):
            return False
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))
        frame = cells["target_frame_ref"]()
        gid = cells["gid"]
        if frame is None or not frame.early_stop:
            return False
        return int(frame.recomp_counter[gid]) + n_saved == len(frame.weak_holders)
    except Exception:  # noqa: BLE001 - private internals changed: fall back to the always-correct path
        return False


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

        if call.skip_in_recompute and _checkpoint_recompute_is_last(1 + len(params)):
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


# --------------------------------------------------------------------------------------------------
# Token-wise detection
# --------------------------------------------------------------------------------------------------

# Canonical forms of forwards known to be token-wise, over child modules called on the single input.
_TEMPLATES: dict[frozenset[str], set[str]] = {
    frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"}): {
        "down_proj((act_fn(gate_proj(X))*up_proj(X)))",
        "down_proj((up_proj(X)*act_fn(gate_proj(X))))",
    },
    frozenset({"fc1", "fc2", "act"}): {"fc2(act(fc1(X)))"},
}
_TEMPLATE_KEYS = {  # child name -> role (Linear-like or parameter-free activation)
    "gate_proj": "linear", "up_proj": "linear", "down_proj": "linear", "fc1": "linear", "fc2": "linear",
    "act_fn": "act", "act": "act",
}
_REGISTERED: dict[type, str] = {}
_FORWARD_CACHE: dict[type, str | None] = {}


def register_token_wise(cls: type[nn.Module], intermediate_attr: str = "") -> None:
    """Declare ``cls`` token-wise (its forward maps each token independently) so ``apply_tiled_mlp``
    tiles it even though its forward does not match a built-in template.

    Args:
        cls: the module class.
        intermediate_attr: optional dotted path of a Linear whose ``out_features`` is the intermediate
            size (used by the ``"target"`` shard rule), e.g. ``"fc1"``.
    """
    _REGISTERED[cls] = intermediate_attr


class _NotTemplate(Exception):
    pass


def _canon(node: ast.AST, env: dict[str, str], arg: str) -> str:
    if isinstance(node, ast.Name):
        if node.id == arg:
            return "X"
        if node.id in env:
            return env[node.id]
        raise _NotTemplate(f"free name {node.id!r}")
    if isinstance(node, ast.Call) and not node.keywords and len(node.args) == 1:
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            return f"{f.attr}({_canon(node.args[0], env, arg)})"
        raise _NotTemplate("call of something other than a child module")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return f"({_canon(node.left, env, arg)}*{_canon(node.right, env, arg)})"
    raise _NotTemplate(f"unsupported expression {type(node).__name__}")


def _forward_form(cls: type) -> str | None:
    """Canonical form of ``cls.forward`` (or None when it is not a simple child-call expression)."""
    if cls in _FORWARD_CACHE:
        return _FORWARD_CACHE[cls]
    form: str | None = None
    try:
        src = textwrap.dedent(inspect.getsource(cls.forward))
        fdef = ast.parse(src).body[0]
        assert isinstance(fdef, ast.FunctionDef)
        args = fdef.args
        if len(args.args) == 2 and not (args.vararg or args.kwarg or args.kwonlyargs):
            arg = args.args[1].arg
            env: dict[str, str] = {}
            for stmt in fdef.body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    continue  # docstring
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                    env[stmt.targets[0].id] = _canon(stmt.value, env, arg)
                    continue
                if isinstance(stmt, ast.Return) and stmt.value is not None:
                    form = _canon(stmt.value, env, arg)
                break
    except (OSError, TypeError, SyntaxError, AssertionError, _NotTemplate, IndexError):
        form = None
    _FORWARD_CACHE[cls] = form
    return form


def _is_linear_like(m: nn.Module) -> bool:
    if isinstance(m, nn.Linear):
        return True
    base = getattr(m, "get_base_layer", None)  # peft LoRA / DoRA wrapped Linear
    return callable(base) and isinstance(base(), nn.Linear)


_NOT_ELEMENTWISE = {"Softmax", "Softmin", "LogSoftmax", "Softmax2d", "MultiheadAttention"}


def _is_elementwise(m: nn.Module) -> bool:
    """Parameter-free activations from torch.nn / transformers.activations, Dropout, Identity."""
    if isinstance(m, (nn.Dropout, nn.Identity)):
        return True
    mod = type(m).__module__
    from_lib = mod == "torch.nn.modules.activation" or mod.startswith("transformers.activations")
    return from_lib and type(m).__name__ not in _NOT_ELEMENTWISE and not any(True for _ in m.parameters())


def is_token_wise(module: nn.Module) -> tuple[bool, str]:
    """Whether ``module`` can be shown token-wise, with the reason.

    Shown when the class was registered with ``register_token_wise``; for an ``nn.Sequential`` of
    Linear layers (peft-wrapped allowed) and element-wise activations; or when (a) its children are
    exactly one of the known sets (``gate_proj/up_proj/down_proj/act_fn`` or ``fc1/fc2/act``), the
    projections Linear (peft-wrapped allowed) and the activation element-wise, and (b) the source of
    its class ``forward`` parses to the matching template (``down(act(gate(x)) * up(x))`` or
    ``fc2(act(fc1(x)))``).

    Guarantees: never True for a module whose forward mixes tokens unless the user registered it.
    """
    cls = type(module)
    if cls in _REGISTERED:
        return True, f"{cls.__name__} registered with register_token_wise"
    children = dict(module.named_children())
    if type(module) is nn.Sequential:
        bad = [n for n, c in children.items() if not (_is_linear_like(c) or _is_elementwise(c))]
        if children and not bad:
            return True, "Sequential of Linear layers and element-wise activations"
        return False, f"Sequential: children {bad or '[]'} are not Linear layers or element-wise activations"
    key = frozenset(children)
    if key not in _TEMPLATES:
        return False, (
            f"{cls.__name__}: children {sorted(children)} are not a known token-wise MLP structure "
            "(gate_proj/up_proj/down_proj/act_fn or fc1/fc2/act); register_token_wise() it if it is token-wise"
        )
    for name, child in children.items():
        role = _TEMPLATE_KEYS[name]
        if role == "linear" and not _is_linear_like(child):
            return False, f"{cls.__name__}.{name} is {type(child).__name__}, not a Linear (or peft-wrapped Linear)"
        if role == "act" and not _is_elementwise(child):
            return False, f"{cls.__name__}.{name} is {type(child).__name__}, not a known element-wise activation"
    if any(True for _ in module._parameters.values()) or any(True for _ in module._buffers.values()):
        return False, f"{cls.__name__} owns parameters/buffers outside its projections"
    form = _forward_form(cls)
    if form is None or form not in _TEMPLATES[key]:
        return False, (
            f"{cls.__name__}.forward does not match a token-wise template (got {form!r}); "
            "register_token_wise() it if it is token-wise"
        )
    return True, f"{cls.__name__}: forward is {form}"


def _intermediate_size(module: nn.Module) -> int:
    attr = _REGISTERED.get(type(module), "")
    first = [n for n, c in module.named_children() if _is_linear_like(c)][:1] if isinstance(module, nn.Sequential) else []
    for name in ([attr] if attr else []) + first + ["gate_proj", "fc1", "up_proj"]:
        try:
            m = module.get_submodule(name)
        except AttributeError:
            continue
        base = m.get_base_layer() if hasattr(m, "get_base_layer") else m
        if isinstance(base, nn.Linear):
            return int(base.out_features)
    return 0


# --------------------------------------------------------------------------------------------------
# Patching
# --------------------------------------------------------------------------------------------------


@dataclass
class _TiledConfig:
    shards: int | TiledMLPSetting
    min_tokens: int
    tokens_per_shard: int
    target_gb: float | None
    sync: bool
    group: Any
    skip_in_recompute: bool
    intermediate: int


class _TiledForward:
    """Instance-level ``forward`` replacing a token-wise module's forward (deep-copy safe)."""

    def __init__(self, module: nn.Module, prev: Any, config: _TiledConfig) -> None:
        self.module = module
        self.prev = prev  # the instance-level forward we replaced (None: the class forward)
        self.config = config
        self.stats: dict[str, int] | None = None

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._base_forward())

    def _base_forward(self) -> Callable[..., torch.Tensor]:
        return self.prev if self.prev is not None else type(self.module).forward.__get__(self.module)

    def shards_for(self, x: torch.Tensor) -> int:
        c = self.config
        hidden = int(x.shape[-1]) if x.dim() else 1
        n = choose_shards(
            x.numel() // max(1, hidden), hidden, c.intermediate, c.shards,
            min_tokens=c.min_tokens, tokens_per_shard=c.tokens_per_shard, target_gb=c.target_gb,
            dtype_bytes=x.element_size(),
        )
        return sync_shards(n, c.group) if c.sync else n

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        base = self._base_forward()
        if len(args) + len(kwargs) != 1:
            return base(*args, **kwargs)
        x = args[0] if args else next(iter(kwargs.values()))
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.numel() == 0:
            return base(*args, **kwargs)
        shards = self.shards_for(x)
        if shards <= 1:
            return base(x)
        return tiled_call(
            self.module, x, shards, forward=base,
            skip_in_recompute=self.config.skip_in_recompute, stats=self.stats,
        )


@dataclass(frozen=True)
class TiledMLPEntry:
    """One candidate module: qualified name, class, whether it is tiled and why."""

    name: str
    cls: str
    tiled: bool
    reason: str


@dataclass
class TiledMLPHandle:
    """Result of ``apply_tiled_mlp``: the report and a ``remove()`` that undoes the patch."""

    model: nn.Module
    report: list[TiledMLPEntry] = field(default_factory=list)

    @property
    def patched(self) -> list[str]:
        return [e.name for e in self.report if e.tiled]

    @property
    def skipped(self) -> list[TiledMLPEntry]:
        return [e for e in self.report if not e.tiled]

    def remove(self) -> int:
        """Restore every patched module's forward; returns how many were restored."""
        return remove_tiled_mlp(self.model)


def _looks_like_mlp(name: str, module: nn.Module) -> bool:
    leaf = name.rsplit(".", 1)[-1].lower()
    return leaf in ("mlp", "feed_forward", "ffn") or "mlp" in type(module).__name__.lower()


def apply_tiled_mlp(
    model: nn.Module,
    shards: int | str | TiledMLPSetting = "auto",
    *,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD,
    target_gb: float | None = None,
    modules: Sequence[str | nn.Module] | None = None,
    sync: bool | Any = False,
    skip_in_recompute: bool = True,
) -> TiledMLPHandle:
    """Tile the token-wise MLPs of ``model`` (instance-level forward replacement).

    Args:
        model: any ``nn.Module`` (HF model, ``PeftModel``); patch it before DDP/FSDP wrapping (works
            after too: the parameters are unchanged).
        shards: ``"auto"`` (default: 1 below ``min_tokens`` tokens, else ``ceil(tokens /
            tokens_per_shard)``), ``"arctic"``, ``"target"``, ``"target:<GB>"``, an int, or a
            ``TiledMLPSetting``. Decided per call from the flattened token count.
        min_tokens: ``"auto"`` does not tile below this many tokens (default 8192).
        tokens_per_shard: ``"auto"`` chunk length target (default 2048).
        target_gb: GiB budget of one chunk's intermediate for ``"target"`` (default 1.0).
        modules: restrict to these modules (qualified names or module objects); each must be shown
            token-wise, else ``ValueError`` naming it. Default: every module of the model that is.
        sync: ``True`` (default group) or a process group: all-reduce MAX of the shard count per call
            so every rank uses the same count (ZeRO-3 / FSDP wrapping the MLP's Linears).
        skip_in_recompute: see ``tiled_call`` (default True: 2 MLP forwards per step under
            non-reentrant checkpointing instead of 3; falls back to computing when not provably safe).

    Returns:
        ``TiledMLPHandle`` with ``report`` (every MLP-like module: tiled or skipped with the reason),
        ``patched`` names and ``remove()``.

    Raises:
        ValueError: a module named in ``modules`` is missing or not shown token-wise; bad ``shards``.

    Guarantees: idempotent (a second call updates the settings, never stacks wrappers); reversible
    (``remove()`` restores the exact previous forward); parameters, state dict and module hooks are
    untouched; with ``shards`` resolving to 1 the original forward runs (bit-identical).
    """
    if isinstance(shards, str):
        shards = parse_tiled_mlp_setting(shards, name="shards")
    elif not isinstance(shards, (int, TiledMLPSetting)) or isinstance(shards, bool) or (
        isinstance(shards, int) and shards < 1
    ):
        raise ValueError(f"shards={shards!r}: expected an int >= 1 or a setting string ({_ALLOWED_SETTINGS})")
    group = None if isinstance(sync, bool) else sync
    do_sync = bool(sync) if isinstance(sync, bool) else True

    named = dict(model.named_modules())
    candidates: list[tuple[str, nn.Module, bool]] = []  # (name, module, explicitly requested)
    if modules is not None:
        by_id = {id(m): n for n, m in named.items()}
        for item in modules:
            if isinstance(item, str):
                if item not in named:
                    raise ValueError(f"apply_tiled_mlp(modules=...): no module named {item!r} in the model")
                candidates.append((item, named[item], True))
            else:
                if id(item) not in by_id:
                    raise ValueError(f"apply_tiled_mlp(modules=...): {type(item).__name__} is not part of the model")
                candidates.append((by_id[id(item)], item, True))
    else:
        candidates = [(n, m, False) for n, m in named.items() if (n and _looks_like_mlp(n, m)) or is_token_wise(m)[0]]

    handle = TiledMLPHandle(model)
    for name, module, explicit in candidates:
        ok, reason = is_token_wise(module)
        if not ok:
            if explicit:
                raise ValueError(f"apply_tiled_mlp: cannot tile {name!r}: {reason}")
            handle.report.append(TiledMLPEntry(name, type(module).__name__, False, reason))
            continue
        config = _TiledConfig(
            shards, min_tokens, tokens_per_shard, target_gb, do_sync, group, skip_in_recompute,
            _intermediate_size(module),
        )
        existing = module.__dict__.get("forward")
        if isinstance(existing, _TiledForward):
            existing.config = config
            reason += " (already tiled: settings updated)"
        else:
            module.__dict__[_STATE_ATTR] = True
            module.forward = _TiledForward(module, existing, config)  # type: ignore[method-assign]
        handle.report.append(TiledMLPEntry(name, type(module).__name__, True, reason))
    return handle


def remove_tiled_mlp(model: nn.Module) -> int:
    """Undo ``apply_tiled_mlp`` on every module of ``model``; returns how many were restored.

    Guarantees: afterwards no module of ``model`` runs tiled and each has its previous forward.
    """
    count = 0
    for module in model.modules():
        fwd = module.__dict__.get("forward")
        if isinstance(fwd, _TiledForward):
            if fwd.prev is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = fwd.prev
            module.__dict__.pop(_STATE_ATTR, None)
            count += 1
    return count
