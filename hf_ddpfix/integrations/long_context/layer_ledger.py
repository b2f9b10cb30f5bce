"""Bytes per token of one decoder layer's forward + recompute + backward (the CPU ledger), any family.

Builds a one-layer model of the shape's family with transformers' own class (``AutoModel`` of
``LayerShape.family``: Llama, Qwen3, the Qwen2.5-VL text decoder, Mistral, Gemma 3, ...; bf16 weights,
LoRA on every linear layer through peft with its default fp32 adapters, sdpa, non-reentrant checkpointing,
autocast bf16 as ``Trainer(bf16=True)`` runs it) and lets ``apply_long_context`` read it **by structure**,
as in training: norms are recognised and the layer's first-call probe compares the decomposed layer with
stock on real values of the real shape (a tiled random fill, no init). The keywords the layer is called
with (rotary tables of the family's kind, mask, position ids) come from the model's own call at the
measured length. Then every weight becomes a **fake** tensor (``FakeTensorMode``: shapes, dtypes and
storages, no data, no math), and the checkpointed forward and the backward run under
:class:`hf_ddpfix.ops.memory_ledger.MemoryLedger`, which reports the peak of live activation bytes: the
layer input (on the device while its layer runs backward), rotary cos/sin, the incoming gradient and every
tensor the ops create. Weights are not counted, nor the layer's output (the next layer's checkpoint
input, counted there). :data:`FAMILY_LAYERS` lists the real shapes ``benchmarks/long_context_families.py``
reports.

Attention: sdpa's choice on a CUDA GPU for causal bf16 training is a FlashAttention kernel; the ledger
runs the same-layout CPU flash op (``aten._scaled_dot_product_flash_attention_for_cpu``, which saves the
same output and fp32 log-sum-exp) and adds the FlashAttention-2 backward workspace that a dispatch
mode cannot see as a *modelled* entry: an fp32 ``dq`` accumulator plus, with grouped KV heads, expanded
``dk``/``dv`` (``flash_bwd_workspace``). Pass ``flash_workspace=False`` to leave it out.

Per-token figures are slopes between two sequence lengths (``(peak(S2) - peak(S1)) / (S2 - S1)``), so
constant terms (LoRA gradients, one tile's intermediates) cancel; the constant is reported too.

Guarantees: on real CPU tensors the same code gives the same per-op records and peak as on fake
tensors (tests/test_layer_ledger.py checks both on a small shape, and checks the peak against
``torch.distributed._tools.mem_tracker.MemTracker``; the families' small shapes are checked against torch's
CPU allocator there too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..._compat import (
    FLASH_CPU_BACKWARD_OP,
    fake_from_meta,
    fake_tensor_mode,
    flash_attention_forward,
    module_buffer_slots,
    module_parameter_slots,
)
from ...ops.memory_ledger import LedgerEntry, MemoryLedger

__all__ = [
    "LEDGER_FEATURES",
    "LLAMA_8B_LAYER",
    "LayerLedger",
    "LayerShape",
    "flash_bwd_workspace",
    "ledger_slope",
    "measure_layer",
]

# Feature sets the ledger measures: stock, each feature alone, and everything.
LEDGER_FEATURES: dict[str, tuple[str, ...]] = {
    "stock": (),
    "rms_norm": ("rms_norm",),
    "attention": ("attention",),
    "tiled_mlp": ("tiled_mlp",),
    "tiled_layer": ("tiled_layer",),
    "hf_ddpfix": ("rms_norm", "attention", "tiled_layer"),
}


@dataclass(frozen=True)
class LayerShape:
    """A decoder layer to measure: its family (a transformers ``model_type``) and sizes.

    ``head_dim`` ``None``: the family's default (``hidden // heads``); ``config``: other config fields as
    ``(name, value)`` pairs (e.g. Gemma 3's ``layer_types`` to pick a global or a sliding layer).
    """

    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    lora_r: int = 16
    family: str = "llama"
    head_dim: int | None = None
    config: tuple[tuple[str, Any], ...] = ()


LLAMA_8B_LAYER = LayerShape()
#: Qwen3-8B (config.json of Qwen/Qwen3-8B): per-head q/k RMSNorm, head_dim 128.
QWEN3_8B_LAYER = LayerShape(4096, 12288, 32, 8, family="qwen3", head_dim=128)
#: The text decoder of Qwen2.5-VL-7B-Instruct: q/k/v bias, M-RoPE sections 16/24/24.
QWEN2_5_VL_7B_TEXT_LAYER = LayerShape(3584, 18944, 28, 4, family="qwen2_5_vl_text", head_dim=128, config=(
    ("rope_scaling", {"type": "mrope", "mrope_section": [16, 24, 24]}),))
#: Mistral-7B-v0.3: Llama's wiring and sizes, no sliding window.
MISTRAL_7B_LAYER = LayerShape(4096, 14336, 32, 8, family="mistral", head_dim=128, config=(("sliding_window", None),))
#: Gemma-3-12B's global (full-attention) layer: sandwich norms, (1 + w) RMSNorm, q/k norm, head_dim 256.
GEMMA3_12B_LAYER = LayerShape(3840, 15360, 16, 8, family="gemma3_text", head_dim=256, config=(
    ("layer_types", ["full_attention"]), ("sliding_window", 1024), ("query_pre_attn_scalar", 256)))
#: Gemma-3-12B's local layers (40 of 48): the same with a 1024-token sliding window.
GEMMA3_12B_SLIDING_LAYER = LayerShape(3840, 15360, 16, 8, family="gemma3_text", head_dim=256, config=(
    ("layer_types", ["sliding_attention"]), ("sliding_window", 1024), ("query_pre_attn_scalar", 256)))
#: The real shapes the ledger table reports (benchmarks/long_context.py --ledger --families).
FAMILY_LAYERS: dict[str, LayerShape] = {
    "Llama-3.1-8B": LLAMA_8B_LAYER,
    "Qwen3-8B": QWEN3_8B_LAYER,
    "Qwen2.5-VL-7B text": QWEN2_5_VL_7B_TEXT_LAYER,
    "Mistral-7B-v0.3": MISTRAL_7B_LAYER,
    "Gemma-3-12B global": GEMMA3_12B_LAYER,
}


def flash_bwd_workspace(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *_: Any, **__: Any) -> int:
    """Bytes FlashAttention-2's backward allocates internally for ``q [B, Hq, S, D]``, ``k [B, Hk, S, D]``.

    ``dq_accum`` fp32 ``[B, round128(S), Hq, round32(D)]``, ``softmax_d`` fp32 ``[B, Hq, round128(S)]``,
    and when ``Hk < Hq`` expanded ``dk``/``dv`` ``[B, S, Hq, D]`` in the input dtype (flash_api.cpp
    ``mha_bwd`` of the FA2 port in PyTorch). A model of the kernel, not a measurement.
    """
    b, hq, s, d = q.shape
    s_r = -(-s // 128) * 128
    d_r = -(-d // 32) * 32
    total = b * s_r * hq * d_r * 4 + b * hq * s_r * 4
    if k.shape[1] != hq:
        total += 2 * b * s * hq * d * q.element_size()
    return total


@contextlib.contextmanager
def _flash_sdpa() -> Iterator[None]:
    """Route ``F.scaled_dot_product_attention`` (unmasked, causal) to the CPU flash op while measuring.

    Fake and meta tensors would otherwise take sdpa's math path, which materialises the S x S scores
    a GPU flash kernel never does. Restored on exit.
    """
    orig = F.scaled_dot_product_attention

    def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: float | None = None, enable_gqa: bool = False) -> Any:
        if attn_mask is not None:
            return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        if dropout_p or not is_causal:
            return orig(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return flash_attention_forward(q, k, v, scale if scale is not None else q.shape[-1] ** -0.5)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


def _fill(t: torch.Tensor, gen: torch.Generator) -> None:
    """Give ``t`` finite values for the first-call probe, cheaply: a random tile of a prime length repeated
    (no two rows alike), scaled as an init would (``fan_in ** -0.5``; 1-D weights around 1)."""
    n = t.numel()
    tile = torch.randn(4099, generator=gen)
    vals = tile.repeat(-(-n // tile.numel()))[:n].view(t.shape)
    vals = 1 + 0.1 * vals if t.dim() < 2 else vals * t.shape[-1] ** -0.5
    t.copy_(vals)


def _build(shape: LayerShape, seed: int, checkpointing: bool = True) -> torch.nn.Module:
    """One-layer model of ``shape.family`` (bf16 weights, sdpa, peft LoRA on every linear layer), real CPU
    tensors with values (the probe of :mod:`.layer_forms` compares against stock on them)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModel

    kw: dict[str, Any] = dict(shape.config)
    if shape.head_dim is not None:
        kw["head_dim"] = shape.head_dim
    cfg = AutoConfig.for_model(
        shape.family, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, num_hidden_layers=1, vocab_size=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = AutoModel.from_config(cfg, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(old)
    model.to_empty(device="cpu")  # no init (seconds at 8B-layer sizes): a tiled random fill instead
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point():
                _fill(t, gen)
    model = get_peft_model(model, LoraConfig(r=shape.lora_r, lora_alpha=2 * shape.lora_r, target_modules="all-linear",
                                             init_lora_weights=False))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _to_fake(model: torch.nn.Module, fake_mode: Any) -> None:
    """Replace every parameter and buffer by a fake tensor of the same metadata (the values are dropped)."""
    cpu = torch.device("cpu")
    for mod in model.modules():
        params, buffers = module_parameter_slots(mod), module_buffer_slots(mod)
        for n, p in list(params.items()):
            if p is not None:
                params[n] = torch.nn.Parameter(fake_from_meta(fake_mode, p.detach().to("meta"), cpu),
                                               requires_grad=p.requires_grad)
        for n, b in list(buffers.items()):
            if b is not None:
                buffers[n] = fake_from_meta(fake_mode, b.to("meta"), cpu)


def _fake_like(fake_mode: Any, v: Any) -> Any:
    """``v`` (a tensor, or a tuple / list of them, or anything else) with every tensor made fake."""
    if isinstance(v, torch.Tensor):
        return fake_from_meta(fake_mode, v.to("meta"), torch.device("cpu"))
    if isinstance(v, (tuple, list)):
        return type(v)(_fake_like(fake_mode, t) for t in v)
    return v


class _LayerCalled(Exception):  # noqa: N818 - a control-flow signal
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("layer call captured")
        self.args, self.kwargs = args, kwargs


def _layer_call(base: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """The keywords the model hands its first decoder layer for ``inputs_embeds=x`` (rotary tables of the
    family's own kind, mask, position ids), read by running the model up to that call (``no_grad``)."""
    layer = base.layers[0]

    def stop(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise _LayerCalled(args, kwargs)

    hook = layer.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            base(inputs_embeds=x, use_cache=False)
    except _LayerCalled as got:
        kwargs = dict(got.kwargs)
        for k in ("past_key_values", "use_cache", "cache_position", "cache"):
            kwargs.pop(k, None)
        return kwargs
    finally:
        hook.remove()
    raise RuntimeError(f"{type(base).__name__} never called its first decoder layer")


def _apply(model: torch.nn.Module, features: tuple[str, ...], tokens_per_tile: int) -> None:
    from .long_context import apply_long_context
    from .tiled_mlp import apply_tiled_mlp

    if "tiled_mlp" in features:
        apply_tiled_mlp(model, "auto")
    lc = tuple(f for f in features if f != "tiled_mlp")
    if lc:
        apply_long_context(model, lc, tokens_per_tile=tokens_per_tile)


@dataclass
class LayerLedger:
    """One measurement: peak live bytes, where it happened, and what was live then."""

    features: tuple[str, ...]
    seq: int
    peak_bytes: int
    peak_phase: str
    peak_op: str
    modelled_workspace_bytes: int
    retained_after_forward_bytes: int  # kept from forward to backward besides the layer input
    breakdown: list[LedgerEntry] = field(default_factory=list)
    by_op: dict[tuple[str, str, str], int] = field(default_factory=dict)
    ops: list[Any] = field(default_factory=list)


def measure_layer(
    features: tuple[str, ...] | str = (),
    seq: int = 8192,
    *,
    shape: LayerShape = LLAMA_8B_LAYER,
    batch: int = 1,
    fake: bool = True,
    flash_workspace: bool = True,
    tokens_per_tile: int = 2048,
    seed: int = 0,
    checkpointing: bool = True,
    around: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> LayerLedger:
    """Peak live activation bytes of one decoder layer's checkpointed forward + recompute + backward.

    Args:
        features: a key of ``LEDGER_FEATURES`` or a tuple of ``rms_norm``, ``attention``,
            ``tiled_layer``, ``tiled_mlp``.
        seq: tokens per sequence; ``batch`` sequences.
        shape: the layer shape (default Llama-8B).
        fake: fake tensors (no data, any size) or real CPU tensors (small shapes only).
        flash_workspace: add the modelled FlashAttention-2 backward workspace.
        tokens_per_tile: tile length of ``tiled_layer``.
        checkpointing: non-reentrant checkpointing of the layer (default True).
        around: a context entered around exactly the measured forward + backward (e.g. a real
            allocator's tracker, ``benchmarks/long_context.py --ledger-check``).

    Returns:
        ``LayerLedger``.
    """
    feats = LEDGER_FEATURES[features] if isinstance(features, str) else tuple(features)
    model = _build(shape, seed, checkpointing)
    _apply(model, feats, tokens_per_tile)
    base = model.base_model.model
    layer = base.layers[0]
    gen = torch.Generator().manual_seed(seed + 1)
    # The patched layer's one-time first-call probe (layer_forms.probe_layer), unmeasured, on real values.
    probe_x = torch.randn(batch, 4, shape.hidden, generator=gen).to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(probe_x, **_layer_call(base, probe_x))
    # The layer's keywords at the measured length, read from a real call of the model (an expanded zero
    # input: the rotary tables and the mask read only its shape): a fake-mode call would build a mask
    # (transformers treats fake tensors as tracing) where a real run passes none.
    kwargs = _layer_call(base, torch.zeros((), dtype=torch.bfloat16).expand(batch, seq, shape.hidden))
    fake_mode = fake_tensor_mode() if fake else None
    if fake_mode is not None:
        _to_fake(model, fake_mode)
        kwargs = {k: _fake_like(fake_mode, v) for k, v in kwargs.items()}
    workspace = {FLASH_CPU_BACKWARD_OP: flash_bwd_workspace} if flash_workspace else {}
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        x = torch.randn(batch, seq, shape.hidden, generator=gen).to(torch.bfloat16).requires_grad_()
        rotary = [t for t in kwargs.get("position_embeddings") or () if isinstance(t, torch.Tensor)]
        grad = torch.randn(batch, seq, shape.hidden, generator=gen).to(torch.bfloat16)
        with _flash_sdpa(), around() if around is not None else contextlib.nullcontext(), \
                MemoryLedger(workspace=workspace) as ledger:
            ledger.label_modules(layer, "layer.")
            ledger.track([x, *rotary], "layer input, cos, sin")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = layer(x, **kwargs)
            out = out[0] if isinstance(out, (tuple, list)) else out  # a release whose layers return tuples
            ledger.ignore([out])
            # What the layer keeps from its forward until its backward (beyond its input): ~0 when
            # checkpointing works; with 32 layers this is what would pile up per layer.
            retained = ledger.live_bytes() - sum(t.untyped_storage().nbytes() for t in (x, *rotary))
            ledger.phase = "backward"
            ledger.track(grad, "incoming gradient")
            out.backward(grad)
    return LayerLedger(feats, seq, ledger.peak, ledger.peak_phase, ledger.peak_op, ledger.modelled_workspace_peak,
                       retained, ledger.peak_breakdown(), ledger.by_op(), ledger.ops)


def ledger_slope(
    features: tuple[str, ...] | str = (),
    seqs: tuple[int, int] = (8192, 16384),
    **kwargs: Any,
) -> dict[str, Any]:
    """Per-token slope of :func:`measure_layer` between two sequence lengths.

    Returns:
        ``{"features", "seqs", "peaks", "bytes_per_token", "kib_per_token", "constant_bytes",
        "peak_phase", "peak_op", "modelled_workspace_bytes", "retained_bytes_per_token", "breakdown",
        "allocated_per_token_by_op"}``
        (``retained_bytes_per_token``: what the layer keeps from forward to backward besides its
        input, the per-layer cost that multiplies by the layer count; ~0 under checkpointing) (breakdown at the longer length: phase, module, op,
        bytes, shape, dtype of each live tensor at the peak).
    """
    s1, s2 = seqs
    a = measure_layer(features, s1, **kwargs)
    b = measure_layer(features, s2, **kwargs)
    per_token = (b.peak_bytes - a.peak_bytes) / (s2 - s1)
    return {
        "features": list(b.features),
        "seqs": [s1, s2],
        "peaks": [a.peak_bytes, b.peak_bytes],
        "bytes_per_token": per_token,
        "kib_per_token": per_token / 1024,
        "constant_bytes": a.peak_bytes - per_token * s1,
        "peak_phase": b.peak_phase,
        "peak_op": b.peak_op,
        "modelled_workspace_bytes": b.modelled_workspace_bytes,
        "retained_bytes_per_token": (b.retained_after_forward_bytes - a.retained_after_forward_bytes) / (s2 - s1),
        "breakdown": [
            {"phase": e.phase, "module": e.module, "op": e.op, "bytes": e.nbytes, "shape": list(e.shape), "dtype": e.dtype}
            for e in b.breakdown
        ],
        # Bytes each (phase, module, op) allocated over the step, per token of the longer run, largest first.
        "allocated_per_token_by_op": [
            {"phase": k[0], "module": k[1], "op": k[2], "bytes_per_token": round(v / s2, 1)}
            for k, v in sorted(b.by_op.items(), key=lambda kv: -kv[1])[:25]
        ],
    }
