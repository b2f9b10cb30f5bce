"""How transformers calls a decoder layer, across the supported releases: :func:`bind_layer_call`.

A patched decoder-layer forward must accept exactly what the model's layer loop passes, and each release
passes something a little different (transformers 5.0-5.23: ``past_key_values=``; 5.24: ``cache=``, with
``past_key_values=`` still accepted by the stock forward as a deprecated alias). Rather than spelling one
release's parameter list, the call is bound to the stock forward's own signature and read by role:
hidden states, attention mask, position embeddings, the KV cache (any name in
:data:`hf_ddpfix._compat.CACHE_KEYWORDS`), ``use_cache`` and everything else. Anything this module does
not know is reported (``unknown``), so the caller runs stock with the reason instead of guessing.

Guarantees: binding never raises (a call that does not bind is described in ``unbound``); the original
``args`` / ``kwargs`` are never modified (tests/test_upstream_contracts.py runs the real layer loop of
the installed transformers through it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from ..._compat import CACHE_KEYWORDS

__all__ = ["FALSE_ONLY_LAYER_KEYWORDS", "HARMLESS_LAYER_KEYWORDS", "LayerCall", "bind_layer_call"]

#: Keyword arguments transformers 5.x Llama models pass down to a decoder layer that do not change its
#: math. ``num_items_in_batch``, ``shift_labels`` and ``ignore_index`` are the causal-LM loss's keywords
#: (``ForCausalLMLoss``): the model's forward passes its ``**kwargs`` on to every layer, where only the loss
#: reads them (hf_ddpfix's sequence-parallel forward passes ``shift_labels``, the labels shifted on the full
#: sequence, on every micro-batch: before 2026-11-27 every patched layer ran stock under SP through the
#: Trainer, counted as ``keyword arguments ['shift_labels']``). Any other keyword with a value (packing
#: ``cu_seq_lens_*``/``max_length_*``, ``output_attentions``, ...) makes the call run stock.
HARMLESS_LAYER_KEYWORDS = frozenset({"cache_position", "position_ids", "num_items_in_batch", "shift_labels",
                                     "ignore_index", "output_hidden_states", "return_dict"})

#: Flags that change nothing while ``False`` (MoE models pass ``output_router_logits=False`` to every layer;
#: ``True`` records the router's logits per call, which a tiled layer would record once per tile: stock).
FALSE_ONLY_LAYER_KEYWORDS = frozenset({"output_router_logits", "output_attentions"})


@dataclass
class LayerCall:
    """One decoder-layer call, by role. ``unbound`` is the reason when the call does not bind."""

    hidden_states: Any = None
    attention_mask: Any = None
    position_embeddings: Any = None
    cache: Any = None
    use_cache: Any = False
    unknown: set[str] = field(default_factory=set)
    unbound: str | None = None


def bind_layer_call(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> LayerCall:
    """Read ``layer(*args, **kwargs)`` against the stock forward's ``signature`` (bound: no ``self``).

    The first parameter is the hidden states whatever its name. A keyword whose value is ``None`` is
    treated as not passed (every release passes some optional inputs as ``None``).
    """
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        return LayerCall(unbound=f"arguments do not bind to the layer's forward ({err})")
    params = list(signature.parameters.values())
    values: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        p = signature.parameters[name]
        if p.kind is p.VAR_KEYWORD:
            values.update(value)
        elif p.kind is p.VAR_POSITIONAL:
            if value:
                return LayerCall(unbound=f"extra positional arguments ({len(value)})")
        else:
            values[name] = value
    if not params or params[0].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        return LayerCall(unbound="the layer's forward names no hidden-states parameter")
    call = LayerCall(hidden_states=values.pop(params[0].name, None))
    call.attention_mask = values.pop("attention_mask", None)
    call.position_embeddings = values.pop("position_embeddings", None)
    call.use_cache = values.pop("use_cache", False)
    for name in CACHE_KEYWORDS:
        cache = values.pop(name, None)
        if cache is not None and call.cache is None:
            call.cache = cache
    call.unknown = {k for k, v in values.items() if v is not None and k not in HARMLESS_LAYER_KEYWORDS
                    and not (k in FALSE_ONLY_LAYER_KEYWORDS and v is False)}
    return call
