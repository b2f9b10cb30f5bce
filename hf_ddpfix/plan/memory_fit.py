"""The `auto` memory plan: the cheapest set of memory features that fits the device (pure arithmetic).

Rule. The memory features, ordered by their time cost (cheapest first), are :data:`LADDER`: the tiled loss
head, TiledMLP, the asynchronous activation offload, the long-context layers. For every option set to
``auto`` (``tiled_loss``, ``tiled_mlp``, ``offload_activations``, ``long_context``) :func:`fit_memory` projects the device bytes of
one training step for each prefix of the ladder (the features the user turned on explicitly are on in
every prefix; features that are off or unset are never turned on) and turns on the **smallest prefix whose
projection fits** ``FIT_FRACTION`` of the device. A length where stock fits runs with no `auto` feature:
at stock's speed. When no prefix fits, every `auto` feature is turned on and the result says so: the
projected bytes, the budget and the longest sequence that fits with every feature (a warning in the plan
log, not an error: the figures are projections).

The projection (bytes, one device, non-reentrant checkpointing, the model of
:mod:`hf_ddpfix.ops.offload.budget`)::

    device = fixed + slack + loss_head + tokens x (max(layer_working, loss_per_token) + layers x hidden x dtype_bytes)

(the loss head's peak and one layer's backward peak come one after the other; the stored layer inputs are
live at both). Check against the H100 run of 2026-11-25 (BENCHMARKS.md, Llama-8B, 32K tokens): stock
projects 71.0 GiB, measured peak 70.97 GiB; every feature projects 24.9 GiB, measured 25.4 GiB.

- ``layer_working``: one decoder layer's forward + recompute + backward per token, the CPU ledger's
  projections for a Llama-8B layer (``benchmarks/long_context.py --ledger``, docs/memory.md; LoRA r=16,
  sdpa/flash, bf16 autocast): stock 344.9, with TiledMLP 180.8, with the long-context layers
  (``rms_norm,attention,tiled_layer``) 52.6 KiB/token. Scaled by ``hidden / 4096`` for other shapes: an
  **estimate** off that shape (the per-family ledger: Qwen3-8B 337.0, Gemma-3-12B 417.4 KiB/token stock).
- ``loss_per_token``: the untiled head holds ``vocab x 12`` bytes per token (bf16 logits, their fp32 copy,
  fp32 log-softmax / its gradient: an **estimate**); the tiled head holds one chunk (``4 x 64 MiB``, an
  estimate of ``ops/tiled_loss.py``'s 64 MiB fp32 chunk and its temporaries) and nothing per token.
- with the offload, the stored layer inputs leave the device except the last one: the device and host
  budgets are checked by :func:`hf_ddpfix.ops.offload.budget.plan_offload_budget` itself.

Unknown facts (no accelerator, no length the run names, checkpointing not non-reentrant, sharded
weights): no projection; :func:`fit_memory` returns ``known=False`` with the reason, and each `auto`
option keeps today's rule (``tiled_mlp=auto``: tile from 8K tokens; ``tiled_loss=auto``: on;
``offload_activations=auto``: as unset; ``long_context=auto``: stock layers).

Guarantees: pure (no torch, no device query); the chosen features are a prefix of the ladder restricted
to the `auto` options; a prefix is chosen only if its projection fits; ``fits`` is ``False`` exactly when
none does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.offload.budget import OffloadBudgetError, plan_offload_budget
from .types import MemoryFacts

__all__ = ["FIT_FRACTION", "LADDER", "LAYER_KIB_PER_TOKEN", "MemoryFit", "fit_memory", "project_bytes"]

GIB = 1 << 30

#: Memory features, cheapest time cost first (what each costs: docs/memory.md). The offload is a candidate
#: only where it could run (``offload_activations=auto`` on CUDA with non-reentrant checkpointing).
LADDER: tuple[str, ...] = ("tiled_loss", "tiled_mlp", "offload", "long_context")

#: The share of device memory a projection may use (the offload's "device full" mark is the same 90 %).
FIT_FRACTION = 0.90

#: One Llama-8B-shaped decoder layer (hidden 4096), KiB per token, forward + recompute + backward: the
#: CPU ledger's projections (docs/memory.md, BENCHMARKS.md).
LAYER_KIB_PER_TOKEN = {"stock": 344.9, "tiled_mlp": 180.8, "long_context": 52.6}
LEDGER_HIDDEN = 4096
#: Untiled loss head, bytes per token per vocabulary entry (an estimate: bf16 logits 2 + fp32 copy 4 +
#: fp32 log-softmax 4 + part of its gradient 2).
LOSS_BYTES_PER_LOGIT = 12
#: Tiled loss head: one 64 MiB fp32 chunk and its temporaries (an estimate).
TILED_LOSS_BYTES = 4 * (64 << 20)
#: CUDA context and allocator slack (an estimate; the budget's 10 % margin comes on top).
SLACK_BYTES = 1 << 30


@dataclass(frozen=True)
class MemoryFit:
    """What the `auto` memory plan decided.

    Attributes:
        known: the facts allowed a projection; when ``False`` nothing was chosen and ``reason`` says why.
        features: the `auto` features to turn on (a prefix of :data:`LADDER` restricted to ``auto``).
        fits: the chosen set's projection fits the device (``False``: not even with every feature).
        need_bytes / budget_bytes: the chosen set's projected device bytes and the budget.
        reason: one line for the plan log (the figures, their source, the rule).
    """

    known: bool
    features: tuple[str, ...] = ()
    fits: bool = True
    need_bytes: int = 0
    budget_bytes: int = 0
    reason: str = ""
    tokens: int = 0  # the tokens per device projected

    def turns_on(self, feature: str) -> bool:
        return self.known and feature in self.features


def _layer_kib(on: frozenset[str]) -> float:
    if "long_context" in on:
        return LAYER_KIB_PER_TOKEN["long_context"]
    if "tiled_mlp" in on:
        return LAYER_KIB_PER_TOKEN["tiled_mlp"]
    return LAYER_KIB_PER_TOKEN["stock"]


def project_bytes(m: MemoryFacts, on: frozenset[str], tokens: int | None = None) -> tuple[int, bool]:
    """Projected device bytes of one step with the features ``on``, and whether it fits the budget.

    ``m`` must be known (see :func:`fit_memory`). With ``offload`` on, the device bytes are those of
    ``plan_offload_budget`` (as many layer inputs kept as fit), and a host budget that cannot hold the
    rest does not fit.
    """
    t = int(m.tokens if tokens is None else tokens)
    hidden, layers, dtype = int(m.hidden or 0), int(m.layers or 0), int(m.dtype_bytes)
    working = _layer_kib(on) * 1024 * hidden / LEDGER_HIDDEN
    if "tiled_loss" in on:
        loss_fixed, loss_tok = TILED_LOSS_BYTES, 0
    else:
        loss_fixed, loss_tok = 0, int(m.vocab or 0) * LOSS_BYTES_PER_LOGIT
    fixed = int(m.fixed_bytes or 0) + loss_fixed + SLACK_BYTES
    working = max(working, loss_tok)  # the loss head's peak and one layer's backward peak do not overlap
    budget = int(FIT_FRACTION * int(m.device_total_bytes or 0))
    if "offload" in on:
        try:
            b = plan_offload_budget(layers=layers, tokens=t, layer_bytes=t * hidden * dtype,
                                    device_budget_bytes=budget,
                                    host_budget_bytes=int(m.host_budget_bytes if m.host_budget_bytes is not None
                                                          else 1 << 62),
                                    fixed_device_bytes=fixed, working_bytes_per_token=working)
            return b.device_bytes, True
        except OffloadBudgetError as err:
            return err.needed, False
    need = int(fixed + t * (working + layers * hidden * dtype))
    return need, need <= budget


def _missing(m: MemoryFacts | None, checkpointing: str) -> str:
    if m is None:
        return "no device memory facts (no accelerator)"
    if m.unknown:
        return m.unknown
    names = [n for n, v in (("device memory", m.device_total_bytes), ("tokens per step", m.tokens),
                            ("layer count", m.layers), ("hidden size", m.hidden), ("vocabulary", m.vocab),
                            ("weights' bytes", m.fixed_bytes)) if not v]
    if names:
        return "unknown: " + ", ".join(names)
    if checkpointing != "non_reentrant":
        return f"checkpointing is {checkpointing}: the ledger's figures assume non-reentrant checkpointing"
    return ""


def _longest(m: MemoryFacts, on: frozenset[str]) -> int:
    """The largest token count whose projection fits with ``on`` (binary search; 0 if none)."""
    lo, hi = 0, max(1, int(m.tokens or 1))
    while project_bytes(m, on, hi)[1] and hi < 1 << 24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if project_bytes(m, on, mid)[1] else (lo, mid)
    return lo


def fit_memory(m: MemoryFacts | None, auto: tuple[str, ...], explicit: tuple[str, ...],
               checkpointing: str) -> MemoryFit:
    """Choose the smallest prefix of :data:`LADDER` (restricted to ``auto``) whose projection fits.

    Args:
        m: the run's memory facts (``None``: not gathered).
        auto: the features whose option is ``auto``.
        explicit: the features turned on explicitly (on in every prefix; ``"offload"`` when it runs).
        checkpointing: the plan's checkpointing mode (the figures assume ``"non_reentrant"``).

    Returns:
        ``MemoryFit``: ``known=False`` with the missing fact when no projection is possible; else the
        chosen features, whether they fit, the projected bytes and a reason naming figures and source.
    """
    why = _missing(m, checkpointing)
    if why:
        return MemoryFit(False, reason=f"{why}; today's auto rule kept")
    assert m is not None
    candidates = [f for f in LADDER if f in auto]
    base = frozenset(f for f in explicit if f in LADDER)
    src = ("ledger projection, Llama-8B layer figures" +
           ("" if m.hidden == LEDGER_HIDDEN else f" scaled to hidden {m.hidden} (an estimate)") +
           f"; tokens {m.tokens} from {m.tokens_source or 'the run'}")
    budget = int(FIT_FRACTION * int(m.device_total_bytes or 0))
    need = 0
    for n in range(len(candidates) + 1):
        on = base | frozenset(candidates[:n])
        need, ok = project_bytes(m, on)
        if ok:
            chosen = tuple(candidates[:n])
            what = (f"cheapest set that fits: {'+'.join(chosen)}" if chosen
                    else "stock fits: no auto memory feature turned on" if not base
                    else f"fits with the explicit {'+'.join(sorted(base))}: no auto memory feature turned on")
            return MemoryFit(True, chosen, True, need, budget, tokens=int(m.tokens or 0), reason=
                             f"auto memory plan: {what} ({need / GIB:.1f} of {budget / GIB:.1f} GiB, "
                             f"{int(FIT_FRACTION * 100)}% of the device; {src})")
    every = base | frozenset(candidates)
    hint = "" if "offload" in every else ", HF_DDPFIX_OFFLOAD_ACTIVATIONS=1"
    longest = _longest(m, every)
    return MemoryFit(True, tuple(candidates), False, need, budget, tokens=int(m.tokens or 0), reason=
                     f"auto memory plan: WARNING projected not to fit even with every feature "
                     f"({'+'.join(sorted(every)) or 'none'}): needs {need / GIB:.1f} GiB, budget {budget / GIB:.1f} GiB; "
                     f"longest that fits about {longest} tokens per micro-batch. Fix: fewer tokens per step, "
                     f"sequence parallelism{hint} ({src})")
