"""Which decoder layers the long-context layer patch takes, per layer type, decided by structure alone.

One function decides it for the run and for ``hf-ddpfix plan`` (a meta-device model): :func:`layer_verdict`. It
reads no weight value, so the offline plan and the run give every layer the same verdict, and the plan line
(:func:`kinds_summary`) names each layer type with its count and what happens to it:

- a layer with no ``self_attn`` whose token mixer is another module (Qwen3.5 / Qwen3-Next ``linear_attn``: a gated
  delta net, a recurrent scan over the sequence; Mamba-style mixers) is not a candidate: stock, with the mixer named;
- the attention module's ``forward`` requires an argument the patched layer does not pass (Gemma 4's
  ``shared_kv_states``: keys and values shared across layers): stock;
- the attention module, run once on the meta device (its parameters replaced by meta tensors: nothing is
  computed, nothing moved), does something to the kernel's output other than reshaping it before ``o_proj``
  (Qwen3.5's full attention multiplies it by ``sigmoid(gate)``): stock, with the operations named; or calls no
  registry attention function / gives the kernel keywords that change its math (``kernel_refusal``): stock;
- anything else is a candidate; its residual wiring is still checked against stock on its first call
  (:func:`~hf_ddpfix.integrations.long_context.layer_forms.probe_layer`), whose refusal the run counts.

Where the meta run cannot run (a quantized or ZeRO-3-partitioned weight), the verdict is ``None``: "checked at
first call", and the plan says so.

Guarantees: pure structure (no weight value read, nothing moved or changed: ``functional_call`` on meta copies);
the same verdict for the same layer on the meta device and on a real one (tests/test_layer_kinds.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..._compat import attention_function_override, attention_implementation
from .layer_forms import GATE_OPS, candidate_forms, kernel_refusal

__all__ = ["LayerKind", "calls_summary", "decoder_layers", "has_attention", "is_decoder_layer", "kind_lines", "kinds_summary",
           "layer_kind_label", "layer_kinds", "layer_verdict", "sequence_scans"]

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
#: What may happen to the kernel's output on its way to ``o_proj`` without changing the math the patched layer runs
#: (it reshapes the output itself): views, copies and shape queries.
_RESHAPES = frozenset({"reshape", "view", "contiguous", "transpose", "flatten", "permute", "size", "dim", "__get__",
                       "numel", "shape", "dtype", "device", "unflatten", "type", "to", "float", "is_contiguous"})
#: Parameters of an attention ``forward`` the patched layer passes (or that take a default).
_PASSED = frozenset({"hidden_states", "position_embeddings", "attention_mask"})


@dataclass(frozen=True)
class LayerKind:
    """One layer type of a model: ``label`` (the config's layer type, else the class name), ``cls``, ``count``,
    ``patched`` (``True``: a candidate of the layer patch; ``False``: stock; ``None``: checked at first call) and
    ``reason``; ``short``: the reason in a few words (the plan line); ``names``: the layers' qualified names;
    ``gate``: the attention's output is multiplied by a gate before ``o_proj`` (the patched layer applies it)."""

    label: str
    cls: str
    count: int
    patched: bool | None
    reason: str
    short: str = ""
    names: tuple[str, ...] = ()
    gate: bool = False


def is_decoder_layer(m: nn.Module) -> bool:
    """A residual block with a token mixer and an MLP: ``self_attn`` + ``mlp`` (what the layer patch takes), or
    ``mlp`` + a decoder norm (``input_layernorm`` ...) with another token mixer (a linear-attention layer)."""
    if not isinstance(getattr(m, "mlp", None), nn.Module):
        return False
    return isinstance(getattr(m, "self_attn", None), nn.Module) or any(
        isinstance(getattr(m, n, None), nn.Module) for n in _NORMS)


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every decoder layer of ``model`` (:func:`is_decoder_layer`), outermost only, in module order."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if is_decoder_layer(m) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, m))
    return found


def layer_kind_label(layer: nn.Module) -> str:
    """The layer's type as its model names it (``full_attention``, ``linear_attention``, ``sliding_attention``:
    Qwen3.5 ``block_type``, Gemma ``attention_type`` / ``self_attn.layer_type``), else its class name."""
    attn = getattr(layer, "self_attn", None)
    for owner, attr in ((layer, "layer_type"), (layer, "block_type"), (layer, "attention_type"),
                        (attn, "layer_type"), (attn, "attention_type")):
        value = getattr(owner, attr, None) if owner is not None else None
        if isinstance(value, str) and value:
            return value
    return type(layer).__name__


#: Projections an attention module has (Llama/Qwen/Gemma ``q_proj``..., fused ``qkv_proj`` / ``query_key_value`` /
#: ``Wqkv`` / ``c_attn``, DeepSeek's ``q_a_proj``): a decoder layer with none of them mixes tokens another way.
_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "Wqkv", "c_attn", "q_a_proj",
                          "kv_a_proj_with_mqa")


def has_attention(layer: nn.Module) -> bool:
    """Some module of ``layer`` outside its MLP holds attention's query/key/value projections."""
    mlp = getattr(layer, "mlp", None)
    inside_mlp = {id(m) for m in mlp.modules()} if isinstance(mlp, nn.Module) else set()
    return any(id(m) not in inside_mlp and any(isinstance(getattr(m, p, None), nn.Module)
                                               for p in _ATTENTION_PROJECTIONS) for m in layer.modules())


def _depthwise_conv_child(layer: nn.Module) -> str | None:
    """The child of ``layer`` holding a depthwise ``Conv1d`` (``groups == in_channels > 1``: the causal convolution
    over the sequence of Mamba, gated-delta-net and short-convolution mixers), as ``"name (Class)"``, else None."""
    for name, child in layer.named_children():
        if any(isinstance(m, nn.Conv1d) and m.groups > 1 and m.groups == m.in_channels for m in child.modules()):
            return f"{name} ({type(child).__name__})"
    return None


def sequence_scans(model: nn.Module) -> tuple[tuple[str, int, str], ...]:
    """The decoder layer types that mix tokens outside attention: a decoder layer (:func:`is_decoder_layer`) with no
    query/key/value projections (a gated delta net), or any layer of a layer list holding a depthwise ``Conv1d``
    (Mamba, short convolutions: Jamba, Falcon-H1, LFM2, whatever their submodules are called): ``(label, count,
    mixer)`` each. They run along the whole sequence outside the attention kernel (a recurrent scan, a causal
    convolution), which sequence parallelism cannot reach."""
    found: dict[tuple[str, str], int] = {}
    seen: set[int] = set()
    for _, layer in decoder_layers(model):
        if not isinstance(getattr(layer, "self_attn", None), nn.Module) and not has_attention(layer):
            key = (layer_kind_label(layer), _mixer(layer))
            found[key] = found.get(key, 0) + 1
            seen.add(id(layer))
    for m in model.modules():
        if not isinstance(m, nn.ModuleList):
            continue
        for layer in m:
            conv = None if id(layer) in seen else _depthwise_conv_child(layer)
            if conv is not None:
                key = (layer_kind_label(layer), conv)
                found[key] = found.get(key, 0) + 1
                seen.add(id(layer))
    return tuple((label, n, mixer) for (label, mixer), n in found.items())


def _mixer(layer: nn.Module) -> str:
    skip = {"mlp", "self_attn", *_NORMS}
    others = [f"{n} ({type(c).__name__})" for n, c in layer.named_children()
              if n not in skip and "norm" not in n.lower() and "dropout" not in n.lower()]
    return ", ".join(others) or "none"


class _Stop(Exception):  # noqa: N818 - a control-flow signal, not an error
    pass


class _FollowOutput(TorchFunctionMode):
    """Records every operation applied to the kernel's output (and what derives from it) until ``o_proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.derived: dict[int, torch.Tensor] = {}
        self.ops: list[str] = []
        self.gates = 0  # multiplications of the output by one tensor that does not derive from it

    def mark(self, t: torch.Tensor) -> None:
        self.derived[id(t)] = t

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        touched = any(isinstance(a, torch.Tensor) and id(a) in self.derived
                      for a in (*_flat(args), *_flat(kwargs.values())))
        if touched:
            name = getattr(func, "__name__", str(func))
            if name not in _RESHAPES:
                self.ops.append(name)
            hits = [isinstance(a, torch.Tensor) and id(a) in self.derived for a in args]
            if name in GATE_OPS and len(args) == 2 and hits.count(True) == 1 and isinstance(args[hits.index(False)],
                                                                                           torch.Tensor):
                self.gates += 1
            for t in _flat((out,)):
                if isinstance(t, torch.Tensor):
                    self.mark(t)
        return out


def _flat(items: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for a in items:
        if isinstance(a, (tuple, list)):
            out.extend(_flat(a))
        else:
            out.append(a)
    return out


def _meta_attention_check(attn: nn.Module) -> tuple[bool | None, str, str, bool]:
    """Run ``attn`` on meta copies of its weights: what reaches ``o_proj`` (see the module docstring)."""
    impl = attention_implementation(attn)
    if impl is None:
        return None, f"{type(attn).__name__}: no attention implementation set (checked at first call)", "", False
    state: dict[str, torch.Tensor] = {}
    for name, t in (*attn.named_parameters(), *attn.named_buffers()):
        if t.dim() == 0 or t.numel() == 0 or not t.dtype.is_floating_point:  # partitioned / quantized storage
            return None, f"{type(attn).__name__}: weights not readable by shape (quantized or partitioned): " \
                         "checked at first call", "weights quantized or partitioned", False
        state[name] = torch.empty_like(t, device="meta")
    head_dim = getattr(attn, "head_dim", None)
    hidden = getattr(attn.o_proj, "out_features", None) or getattr(getattr(attn.o_proj, "base_layer", None),
                                                                   "out_features", None)
    if not isinstance(head_dim, int) or not isinstance(hidden, int):
        return None, f"{type(attn).__name__}: no head_dim / o_proj.out_features to build a probe input: " \
                     "checked at first call", "no head_dim", False
    dtype = next((t.dtype for t in state.values()), torch.float32)
    x = torch.empty(1, 4, hidden, device="meta", dtype=dtype)
    cos = sin = torch.empty(1, 4, head_dim, device="meta", dtype=dtype)
    follow = _FollowOutput()
    seen: dict[str, Any] = {}

    def kernel(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, *a: Any,
               **kw: Any) -> Any:
        seen["kwargs"] = kw
        out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], device="meta", dtype=q.dtype)
        follow.mark(out)
        return out, None

    def before_o_proj(module: nn.Module, inputs: tuple) -> None:
        seen["reaches"] = any(isinstance(t, torch.Tensor) and id(t) in follow.derived for t in _flat(inputs))
        raise _Stop

    hook = attn.o_proj.register_forward_pre_hook(before_o_proj)
    try:
        with attention_function_override(impl, kernel), follow:
            torch.func.functional_call(attn, state, (), {"hidden_states": x, "position_embeddings": (cos, sin),
                                                         "attention_mask": None}, strict=False)
    except _Stop:
        pass
    except Exception as err:  # noqa: BLE001 - the meta run cannot decide: the probe will
        return None, f"{type(attn).__name__}: not checkable on the meta device ({type(err).__name__}): checked " \
                     "at first call", f"meta run failed ({type(err).__name__})", False
    finally:
        hook.remove()
    if "kwargs" not in seen:  # e.g. transformers 5.0's eager path calls its kernel directly: the probe decides
        return None, f"{type(attn).__name__}: its kernel is not called through the registry here: checked at first " \
                     "call", "kernel outside the registry", False
    refusal = kernel_refusal(seen["kwargs"])
    if refusal is not None:
        return False, refusal, refusal, False
    if not seen.get("reaches"):
        return False, f"{type(attn).__name__}: its o_proj does not read the attention output", \
            "o_proj does not read the attention output", False
    gated = bool(follow.ops) and all(op in GATE_OPS for op in follow.ops) and follow.gates == len(follow.ops) == 1
    if follow.ops and not gated:
        ops = sorted(set(follow.ops))
        return False, (f"{type(attn).__name__} applies {', '.join(ops)} to the attention output before o_proj "
                       "(an output gate), which the patched layer does not run"), \
            f"output gate ({', '.join(ops)}) before o_proj", False
    window = seen["kwargs"].get("sliding_window")
    note = f"; sliding window {window}: a call longer than it runs stock (the window is in the mask)" if window else ""
    short = f"; calls over the {window}-token window stock" if window else ""
    if gated:
        return True, (f"{type(attn).__name__}: kernel output multiplied by a gate before o_proj (the patched layer "
                      f"applies it){note}"), f"; output gate before o_proj applied{short}", True
    return True, f"{type(attn).__name__}: kernel output reaches o_proj as is{note}", short, False


def layer_verdict(layer: nn.Module) -> tuple[bool | None, str, str, bool]:
    """``(patched, reason, short reason, gate)`` for one decoder layer (module docstring): ``True`` a candidate (its
    form is probed at first call), ``False`` stock, ``None`` decided at first call; ``gate``: its attention output is
    multiplied by a gate before ``o_proj`` (Qwen3.5's full attention), which the patched layer applies."""
    name = type(layer).__name__
    attn = getattr(layer, "self_attn", None)
    if not isinstance(attn, nn.Module) and has_attention(layer):
        return False, f"{name}: its attention module is not named self_attn ({_mixer(layer)})", \
            f"attention not named self_attn: {_mixer(layer)}", False
    if not isinstance(attn, nn.Module):
        return False, f"no self_attn: its token mixer {_mixer(layer)} is not softmax attention (a recurrent scan " \
                      "over the sequence), left as the model wrote it", f"recurrent scan: {_mixer(layer)}", False
    if not isinstance(getattr(attn, "o_proj", None), nn.Module):
        return False, f"{name}: no self_attn.o_proj", "no self_attn.o_proj", False
    forms = candidate_forms(layer)
    if not forms:
        return False, f"{name}: no known norm/MLP wiring", "no known norm/MLP wiring", False
    params = inspect.signature(type(attn).forward).parameters
    required = [p.name for p in list(params.values())[1:] if p.default is p.empty and p.name not in _PASSED
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        return False, f"{type(attn).__name__}.forward requires {', '.join(required)} (e.g. keys and values shared " \
                      "across layers), which the patched layer does not pass", f"attention needs {', '.join(required)}", False
    ok, why, short, gate = _meta_attention_check(attn)
    forms_text = "/".join(f.name for f in forms)
    if ok:
        return True, f"{forms_text} form probed at first call; {why}", f"{forms_text}, probed at first call{short}", \
            gate
    if ok is False:
        return False, why, short, False
    return None, f"{forms_text} form; {why}", short, False


def layer_kinds(model: nn.Module) -> tuple[LayerKind, ...]:
    """Every decoder layer of ``model`` grouped by (label, class, verdict, reason), in module order."""
    groups: dict[tuple[str, str, bool | None, str, str, bool], list[str]] = {}
    cache: dict[tuple[str, str], tuple[bool | None, str, str, bool]] = {}
    for name, layer in decoder_layers(model):
        key = (layer_kind_label(layer), type(layer).__name__)
        if key not in cache:  # one verdict per layer type: the same class and type are built alike
            try:
                cache[key] = layer_verdict(layer)
            except Exception as err:  # noqa: BLE001 - structure not readable: the first-call probe decides
                cache[key] = (None, f"{key[1]}: structure not read ({type(err).__name__}: {str(err)[:80]}): "
                              "checked at first call", "structure not read", False)
        groups.setdefault((*key, *cache[key]), []).append(name)
    return tuple(LayerKind(label, cls, len(names), ok, why, short, tuple(names), gate)
                 for (label, cls, ok, why, short, gate), names in groups.items())


def kinds_summary(kinds: Iterable[LayerKind], short: bool = True) -> str:
    """The plan's words per layer type: ``"48 linear_attention layers stock (recurrent scan (linear_attn
    (Qwen3_5GatedDeltaNet))); 16 full_attention layers stock (output gate (mul) before o_proj)"`` (``"checked at first
    call"`` where the verdict waits for it); ``short=False``: the whole reasons and the classes."""
    parts = []
    for k in kinds:
        what = {True: "patched", False: "stock", None: "checked at first call"}[k.patched]
        label = k.label if (k.label == k.cls or short) else f"{k.label} ({k.cls})"
        parts.append(f"{k.count} {label} layer{'s' if k.count != 1 else ''} {what} ({k.short if short else k.reason})")
    return "; ".join(parts)


def kind_lines(kinds: Iterable[LayerKind]) -> tuple[str, ...]:
    """One plan line per layer type: ``"layers: 48 linear_attention (Qwen3_5DecoderLayer) stock: recurrent scan:
    linear_attn (Qwen3_5GatedDeltaNet)"`` (the ``long_context`` decision's details)."""
    out = []
    for k in kinds:
        what = {True: "patched", False: "stock", None: "checked at first call"}[k.patched]
        label = k.label if k.label == k.cls else f"{k.label} ({k.cls})"
        out.append(f"layers: {k.count} {label} {what}: {k.short}")
    return tuple(out)


def calls_summary(kinds: Iterable[LayerKind], stats: Any) -> str:
    """Per layer type: its layers patched or stock, and the calls counted in ``stats`` (``"patched calls [<type>]"``,
    ``"stock calls [<type>]"``: the patched forward's counters)."""
    parts = []
    for k in kinds:
        calls = f"{stats[f'patched calls [{k.label}]']} patched / {stats[f'stock calls [{k.label}]']} stock calls"
        parts.append(f"{k.count} {k.label}: {'stock' if k.patched is False else 'patched'} ({calls})")
    return "; ".join(parts)
