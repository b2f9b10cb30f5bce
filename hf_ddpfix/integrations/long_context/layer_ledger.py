"""Bytes per token of one Llama-shaped decoder layer's forward + recompute + backward (the CPU ledger).

Builds one ``LlamaDecoderLayer`` (bf16 weights, LoRA on every linear layer through peft with its
default fp32 adapters, sdpa, non-reentrant checkpointing, autocast bf16 as ``Trainer(bf16=True)``
runs it) on **fake** tensors (``FakeTensorMode``: shapes, dtypes and storages, no data, no math), runs
the checkpointed forward and the backward under :class:`hf_ddpfix.ops.memory_ledger.MemoryLedger`, and
reports the peak of live activation bytes: the layer input (on the device while its layer runs
backward), rotary cos/sin, the incoming gradient and every tensor the ops create. Weights are not
counted, nor the layer's output (the next layer's checkpoint input, counted there).

Attention: sdpa's choice on a CUDA GPU for causal bf16 training is a FlashAttention kernel; the ledger
runs the same-layout CPU flash op (``aten._scaled_dot_product_flash_attention_for_cpu``, which saves the
same output and fp32 log-sum-exp) and adds the FlashAttention-2 backward workspace that a dispatch
mode cannot see as a *modelled* entry: an fp32 ``dq`` accumulator plus, with grouped KV heads, expanded
``dk``/``dv`` (``flash_bwd_workspace``). Pass ``flash_workspace=False`` to leave it out.

Per-token figures are slopes between two sequence lengths (``(peak(S2) - peak(S1)) / (S2 - S1)``), so
constant terms (LoRA gradients, one tile's intermediates) cancel; the constant is reported too.

Guarantees: on real CPU tensors the same code gives the same per-op records and peak as on fake
tensors (tests/test_layer_ledger.py checks both on a small shape, and checks the peak against
``torch.distributed._tools.mem_tracker.MemTracker``).
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
    """Decoder-layer shape: hidden, intermediate, q heads, KV heads, LoRA rank."""

    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    lora_r: int = 16


LLAMA_8B_LAYER = LayerShape()


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


def _build(shape: LayerShape, fake_mode: Any | None, seed: int, checkpointing: bool = True) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, num_hidden_layers=1, vocab_size=32, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta" if fake_mode is not None else "cpu"):
            model = LlamaModel(cfg)
    finally:
        torch.set_default_dtype(old)
    model = get_peft_model(model, LoraConfig(r=shape.lora_r, lora_alpha=2 * shape.lora_r, target_modules="all-linear",
                                             init_lora_weights=False))
    if fake_mode is not None:
        cpu = torch.device("cpu")
        for mod in model.modules():
            params, buffers = module_parameter_slots(mod), module_buffer_slots(mod)
            for n, p in list(params.items()):
                if p is not None:
                    params[n] = torch.nn.Parameter(fake_from_meta(fake_mode, p, cpu), requires_grad=p.requires_grad)
            for n, b in list(buffers.items()):
                if b is not None:
                    buffers[n] = fake_from_meta(fake_mode, b, cpu)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


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
    fake_mode = fake_tensor_mode() if fake else None
    model = _build(shape, fake_mode, seed, checkpointing)
    _apply(model, feats, tokens_per_tile)
    base = model.base_model.model
    layer = base.layers[0]
    workspace = {FLASH_CPU_BACKWARD_OP: flash_bwd_workspace} if flash_workspace else {}
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        gen = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(batch, seq, shape.hidden, generator=gen).to(torch.bfloat16).requires_grad_()
        pos = torch.arange(seq)[None]
        cos, sin = base.rotary_emb(x, pos)
        grad = torch.randn(batch, seq, shape.hidden, generator=gen).to(torch.bfloat16)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the patched layer's one-time
            layer(x[:, :2], attention_mask=None, position_ids=pos[:, :2],  # first-call probe, unmeasured
                  position_embeddings=(cos[:, :2], sin[:, :2]))
        with _flash_sdpa(), around() if around is not None else contextlib.nullcontext(), \
                MemoryLedger(workspace=workspace) as ledger:
            ledger.label_modules(layer, "layer.")
            ledger.track([x, cos, sin], "layer input, cos, sin")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
            ledger.ignore([out])
            # What the layer keeps from its forward until its backward (beyond its input): ~0 when
            # checkpointing works; with 32 layers this is what would pile up per layer.
            retained = ledger.live_bytes() - sum(t.untyped_storage().nbytes() for t in (x, cos, sin))
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
