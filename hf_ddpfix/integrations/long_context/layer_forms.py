"""Decoder layers read by structure, not by source: what runs before and after the attention kernel.

The patched long-context layer (:mod:`.long_context`) splits a decoder layer at its attention kernel:
``pre`` (norm, q/k/v projections with LoRA, any q/k norm, rotary of any kind) and ``post`` (o projection,
residual, norms, MLP or MoE block, residual). Neither half is spelled per family:

- ``pre`` runs the model's own attention module, whose kernel call is intercepted through transformers'
  attention-function registry (:func:`hf_ddpfix._compat.attention_function_override`): the module hands
  ``q, k, v`` and its kernel keywords (``scaling``, ``dropout``, ``sliding_window``, ``softcap``, ...) to
  :func:`capture_attention_inputs`, which stops the module there. Qwen3/Gemma3/OLMo2 q/k norms, M-RoPE
  (Qwen2-VL/2.5-VL text decoders) or any other rotary run as the model wrote them.
- the residual wiring is one of four :data:`FORMS` (pre-norm: Llama, Qwen, Mistral, Phi-3, GLM, SmolLM3,
  MoE families; scaled pre-norm: Granite's ``residual_multiplier``; sandwich: Gemma 2/3; post-norm: OLMo 2). The names alone do not decide: each candidate form is checked
  once against the stock layer on the layer's first real call (:func:`probe_layer`, ``no_grad``, eval mode,
  a slice of the real input), and a layer no form reproduces runs stock with the probe's reason.

Kernel keywords: ``scaling`` is used; ``sliding_window`` and ``softcap`` reach transformers' sdpa function
only as ignored keywords (the window lives in the mask; sdpa never soft-caps), so with no mask they change
nothing and the patched kernel is stock's; any other keyword with a value makes the layer run stock.

Guarantees: the probe compares the decomposed layer against the stock forward on the same weights; a
mismatch (relative error above :data:`PROBE_RTOL`), an exception, or an attention module that does not call
the registry is a refusal with its reason, never a patched layer.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..._compat import (
    attention_function_override,
    attention_implementation,
    stock_attention_function,
    tensor_has_values,
    zero3_partitioned,
)
from ...ops.rms_norm import rms_norm

__all__ = ["FORMS", "GATE_OPS", "PROBE_RTOL", "LayerForm", "capture_attention_inputs", "candidate_forms", "probe_layer",
           "is_rms_norm", "rms_norm_form"]

#: Relative error (``|a-b| / |b|``, over the probe's output) below which a form counts as the layer's.
#: The decomposed layer runs the same ops as stock: a right form agrees to rounding, a wrong one by O(1).
PROBE_RTOL = 1e-3
PROBE_TOKENS = 8

#: Kernel keywords that do not change the math of an unmasked causal call through transformers' sdpa
#: function (``position_ids`` is passed for FlashAttention-2 by some families; sdpa ignores it and
#: ``sliding_window`` / ``softcap``).
_NEUTRAL_KERNEL_KEYWORDS = frozenset({"scaling", "dropout", "sliding_window", "softcap", "position_ids"})


def _pre_norm_in(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer.input_layernorm(x)


def _identity(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x


def _mlp(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    out = layer.mlp(h)
    if not isinstance(out, torch.Tensor):  # an MoE block returning (hidden, router_logits): not this form
        raise TypeError(f"{type(layer.mlp).__name__} returned {type(out).__name__}, not a tensor")
    return out


# Each post form drops its o-projection output as soon as the residual add has read it (as stock's
# rebinding of ``hidden_states`` does): it must not stay alive through the MLP.
def _post_pre_norm(layer: nn.Module, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    h = x + o
    del o
    return h + _mlp(layer, layer.post_attention_layernorm(h))


def _post_scaled_pre_norm(layer: nn.Module, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    m = layer.residual_multiplier  # Granite: each branch scaled before its residual add
    h = x + o * m
    del o
    return h + _mlp(layer, layer.post_attention_layernorm(h)) * m


def _post_sandwich(layer: nn.Module, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    h = x + layer.post_attention_layernorm(o)
    del o
    return h + layer.post_feedforward_layernorm(_mlp(layer, layer.pre_feedforward_layernorm(h)))


def _post_post_norm(layer: nn.Module, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    h = x + layer.post_attention_layernorm(o)
    del o
    return h + layer.post_feedforward_layernorm(_mlp(layer, h))


@dataclass(frozen=True)
class LayerForm:
    """A residual wiring: ``pre(layer, x)`` feeds the attention module; ``post(layer, x, o_proj_out)``;
    ``needs``: submodules it reads, ``lacks``: submodules it must not have, ``scalars``: float attributes."""

    name: str
    needs: tuple[str, ...]
    lacks: tuple[str, ...]
    pre: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    post: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    scalars: tuple[str, ...] = ()


FORMS = (
    LayerForm("sandwich", ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm", "mlp"), (), _pre_norm_in, _post_sandwich),
    LayerForm("post-norm", ("post_attention_layernorm", "post_feedforward_layernorm", "mlp"),
              ("input_layernorm", "pre_feedforward_layernorm"), _identity, _post_post_norm),
    LayerForm("scaled pre-norm", ("input_layernorm", "post_attention_layernorm", "mlp"),
              ("pre_feedforward_layernorm", "post_feedforward_layernorm"), _pre_norm_in, _post_scaled_pre_norm,
              ("residual_multiplier",)),
    LayerForm("pre-norm", ("input_layernorm", "post_attention_layernorm", "mlp"),
              ("pre_feedforward_layernorm", "post_feedforward_layernorm"), _pre_norm_in, _post_pre_norm),
)


def candidate_forms(layer: nn.Module) -> tuple[LayerForm, ...]:
    """The forms whose submodules ``layer`` has (and whose absent ones it lacks); the probe decides."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not isinstance(getattr(attn, "o_proj", None), nn.Module):
        return ()
    return tuple(f for f in FORMS if all(isinstance(getattr(layer, n, None), nn.Module) for n in f.needs)
                 and not any(hasattr(layer, n) for n in f.lacks)
                 and all(isinstance(getattr(layer, n, None), (int, float)) for n in f.scalars))


class _Captured(Exception):  # noqa: N818 - a control-flow signal, not an error
    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> None:
        super().__init__("attention inputs captured")
        self.qkv = (q, k, v)
        self.mask = mask
        self.kwargs = kwargs


class _GateMode(TorchFunctionMode):
    """Follows the kernel's (placeholder) output to ``o_proj``: the one tensor it is multiplied by is the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.derived: set[int] = set()
        self.keep: list[torch.Tensor] = []
        self.gate: torch.Tensor | None = None

    def mark(self, t: torch.Tensor) -> None:
        self.derived.add(id(t))
        self.keep.append(t)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        hits = [isinstance(a, torch.Tensor) and id(a) in self.derived for a in args]
        if any(hits):
            if getattr(func, "__name__", "") in GATE_OPS and len(args) == 2 and hits.count(True) == 1:
                self.gate = args[hits.index(False)]
            if isinstance(out, torch.Tensor):
                self.mark(out)
        return out


#: How a gated attention multiplies its kernel's output before ``o_proj`` (Qwen3.5 / Qwen3-Next:
#: ``attn_output * torch.sigmoid(gate)``), as the function a ``TorchFunctionMode`` sees.
GATE_OPS = frozenset({"mul", "__mul__", "__rmul__"})


def capture_attention_inputs(attn: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             gate: bool = False) -> tuple[Any, ...] | None:
    """Run ``attn`` on ``h [B, S, hidden]`` up to its kernel call: ``((q, k, v), kernel keywords)`` with
    ``q [B, Hq, S, D]``, ``k, v [B, Hk, S, D]``; ``None`` when the module returned without calling the
    registry function of its implementation (nothing after the kernel call runs).

    ``gate=True`` (a gated attention, ``layer_kinds``: its output is multiplied by a tensor before ``o_proj``):
    the module runs on to ``o_proj`` with a placeholder for the kernel's output, and the result is
    ``((q, k, v), kernel keywords, gate)``, ``gate [B, S, Hq * D]`` the tensor the output is multiplied by
    (``None`` when none was seen)."""
    impl = attention_implementation(attn)
    if impl is None:
        return None
    if gate:
        return _capture_gated(attn, impl, h, cos, sin)

    def capture(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            kwargs["positional extras"] = args
        raise _Captured(query, key, value, attention_mask, kwargs)

    try:
        with attention_function_override(impl, capture):
            attn(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
    except _Captured as got:
        if got.mask is not None:
            got.kwargs["attention_mask"] = got.mask
        return got.qkv, got.kwargs
    return None


def _capture_gated(attn: nn.Module, impl: str, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[Any, ...] | None:
    mode = _GateMode()
    seen: dict[str, Any] = {}

    def kernel(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            kwargs["positional extras"] = args
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        seen["qkv"], seen["kwargs"] = (query, key, value), kwargs
        b, hq, s, d = query.shape
        out = query.new_ones(b, s, hq, d)  # the kernel's layout; its values never reach anything kept
        mode.mark(out)
        return out, None

    def before_o_proj(module: nn.Module, inputs: tuple) -> None:
        raise _Captured(*seen["qkv"], None, seen["kwargs"])

    hook = attn.o_proj.register_forward_pre_hook(before_o_proj)
    try:
        with attention_function_override(impl, kernel), mode:
            attn(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
    except _Captured as got:
        g = mode.gate
        if g is not None and g.shape != (h.shape[0], h.shape[1], got.qkv[0].shape[1] * got.qkv[0].shape[3]):
            g = None
        return got.qkv, got.kwargs, g
    finally:
        hook.remove()
    return None


def kernel_refusal(kwargs: dict[str, Any]) -> str | None:
    """Why an attention call with these kernel keywords is not plain causal attention (``None``: it is)."""
    extra = sorted(k for k, v in kwargs.items() if v is not None and k not in _NEUTRAL_KERNEL_KEYWORDS)
    if extra:
        return f"attention kernel keywords {extra}"
    if kwargs.get("scaling") is None:
        return "attention kernel given no scaling"
    return None


def rms_norm_form(m: nn.Module, chunk_tokens: int = 4096, forward: Callable[..., Any] | None = None
                  ) -> tuple[str | None, str]:
    """An RMSNorm recognised by what it computes: a 1-D ``weight``, an epsilon (``variance_epsilon`` or
    ``eps``), no bias, and ``m(x)`` bit-identical to :func:`rms_norm` on a random input, in Llama's form
    (``"weight"``: ``w * x_hat.to(dtype)``) or Gemma's (``"unit_offset"``: ``(x_hat * (1 + w)).to(dtype)``).

    ``forward``: what the module computes now (default: its instance ``forward`` if one is set, e.g. by
    another library, else its class's).

    Returns:
        ``(form, reason)``; ``form`` ``None`` for anything else (LayerNorm, a norm of another formula, meta
        or fake weights with nothing to compare), which stays stock; ``"deferred"`` for a weight ZeRO-3 partitioned
        (checked at the norm's first call, :mod:`.norm_forward`).
    """
    w = getattr(m, "weight", None)
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    partitioned = isinstance(w, torch.Tensor) and zero3_partitioned(w) and w.numel() == 0
    if not isinstance(w, torch.Tensor) or not isinstance(eps, float) or not (
            partitioned or (w.dim() == 1 and w.numel() >= 2)):
        return None, ""
    if getattr(m, "bias", None) is not None or list(m.children()):
        return None, ""
    if partitioned:  # ZeRO-3: an empty placeholder until its forward gathers it (norm_forward.py)
        return "deferred", f"{type(m).__name__}: weight partitioned by ZeRO-3: checked against stock at its first call"
    if not tensor_has_values(w):  # meta / fake weights: nothing to compare
        return None, f"{type(m).__name__}: no values to check (meta or fake weight): stock"
    gen = torch.Generator(device=w.device).manual_seed(0)
    with torch.no_grad():
        x = torch.randn((5, w.shape[0]), generator=gen, device=w.device, dtype=torch.float32).to(w.dtype) * 3
        fn = forward or m.__dict__.get("forward") or type(m).forward.__get__(m)
        needs = _required_beyond_first(fn)
        if needs:  # Qwen3.5 / Qwen3-Next RMSNormGated: norm(x, gate), a gated norm the patch does not compute
            return None, f"{type(m).__name__}: its forward requires {', '.join(needs)} beside the hidden states " \
                         "(a gated norm): stock"
        try:
            ref = fn(x)
        except Exception as err:  # noqa: BLE001 - not a one-tensor norm: not ours
            return None, (f"{type(m).__name__}: the check against stock failed ({type(err).__name__}: "
                          f"{str(err)[:80]}), e.g. a weight already sharded (DTensor): stock")
        if isinstance(ref, torch.Tensor):
            for form, offset in (("weight", False), ("unit_offset", True)):
                if torch.equal(ref, rms_norm(x, w, eps, chunk_tokens=chunk_tokens, unit_offset=offset)):
                    what = "w * x_hat" if form == "weight" else "(1 + w) * x_hat"
                    return form, f"{type(m).__name__}: RMSNorm, {what} (checked against stock)"
    return None, f"{type(m).__name__}: a norm that computes neither w * rmsnorm(x) nor (1 + w) * rmsnorm(x): stock"


def is_rms_norm(m: nn.Module, chunk_tokens: int = 4096) -> tuple[bool, str]:
    """``(rms_norm_form(m) is not None, reason)``."""
    form, why = rms_norm_form(m, chunk_tokens)
    return form is not None, why


def _eval_mode(module: nn.Module) -> list[tuple[nn.Module, bool]]:
    flags = [(m, m.training) for m in module.modules()]
    for m, _ in flags:
        m.training = False
    return flags


def probe_layer(layer: nn.Module, stock: Callable[..., Any], hidden_states: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, gate: bool = False
                ) -> tuple[LayerForm | None, str, dict[str, Any]]:
    """Find the form of ``layer`` by running stock and each candidate on a slice of its real input.

    Args:
        layer: the decoder layer (``self_attn`` with ``o_proj``).
        stock: the layer's stock forward (bound).
        hidden_states: ``[B, S, hidden]``; the probe uses row 0, the first :data:`PROBE_TOKENS` tokens.
        cos, sin: the rotary tables of this call, ``[B or 1, S, rotary_dim]``.
        gate: the attention's output is multiplied by a gate before ``o_proj`` (``capture_attention_inputs``).

    Returns:
        ``(form, reason, kernel keywords)``; ``form`` is ``None`` with the reason when none matches.
    """
    forms = candidate_forms(layer)
    if not forms:
        return None, f"{type(layer).__name__}: no known residual wiring (norm/MLP submodule names)", {}
    if not tensor_has_values(hidden_states):  # shapes only (meta / fake tensors): nothing to compare
        return None, f"{type(layer).__name__}: no values to probe (meta / fake tensors): stock", {}
    t = min(PROBE_TOKENS, hidden_states.shape[1])
    x, c, s = hidden_states[:1, :t].detach(), cos[:1, :t].detach(), sin[:1, :t].detach()
    attn = layer.self_attn
    flags = _eval_mode(layer)
    why = "no candidate form matched"
    try:
        with torch.no_grad():
            # the probe is local math on a slice: a wrapped kernel (sequence parallelism) must not see it
            impl = attention_implementation(attn)
            plain = stock_attention_function(impl) if impl is not None else None
            with attention_function_override(impl, plain) if plain is not None else contextlib.nullcontext():
                ref = stock(x, attention_mask=None, position_embeddings=(c, s))
            if not isinstance(ref, torch.Tensor):  # e.g. transformers 5.0's Granite layer: callers index [0]
                return None, (f"{type(layer).__name__} returns {type(ref).__name__} on this release, not the hidden "
                              "states tensor the patched layer returns: stock"), {}
            for form in forms:
                got = capture_attention_inputs(attn, form.pre(layer, x), c, s, gate=gate)
                if got is None:
                    return None, f"{type(attn).__name__} does not call ALL_ATTENTION_FUNCTIONS", {}
                (q, k, v), kwargs = got[0], got[1]
                if gate and got[2] is None:
                    return None, f"{type(attn).__name__}: no gate found multiplying the attention output", kwargs
                refusal = kernel_refusal(kwargs)
                if refusal is not None:
                    return None, refusal, kwargs
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=kwargs["scaling"],
                                                   enable_gqa=True)
                a = o.transpose(1, 2).reshape(1, t, -1)
                out = form.post(layer, x, attn.o_proj(a * got[2] if gate else a))
                err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
                if out.shape == ref.shape and err <= PROBE_RTOL:
                    return form, f"{type(layer).__name__}: {form.name} layer (probe rel. error {err:.1e})", kwargs
                why = f"{form.name} form differs from stock by {err:.1e}"
    except Exception as err:  # noqa: BLE001 - any failure of the probe means: keep stock
        return None, f"probe failed: {type(err).__name__}: {err}", {}
    finally:
        for m, flag in flags:
            m.training = flag
    return None, f"{type(layer).__name__}: {why}", {}


def _required_beyond_first(fn: Any) -> list[str]:
    """The parameters of ``fn`` after its first that have no default, and a ``gate`` one even with a default
    (transformers 5.0's ``Qwen3NextRMSNormGated.forward(hidden_states, gate=None)`` fails without it); ``[]`` where
    the signature is unreadable."""
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if (p.default is p.empty or p.name == "gate")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
