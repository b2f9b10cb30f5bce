"""The plan's memory decisions, under every engine: activation offload, TiledMLP, long-context layers, tiled loss
head, the offload's size limits.

Pure rules (facts + options -> `Decision` with its reason); :func:`decide_memory` is what
:func:`hf_ddpfix.plan.resolve.resolve_plan` calls (once). Under ZeRO-3 the opt-in tiling is kept off here too
(:func:`_zero3_unverified`): one decision, one module (docs/design.md "The plan").
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from ..config.options import DDPFixConfig, env_name
from .memory_fit import MemoryFit, fit_memory
from .types import Decision, RunFacts

#: The features the `auto` memory plan governs, by option name (plan/memory_fit.py's ladder names).
AUTO_OPTIONS = ("tiled_loss", "tiled_mlp", "long_context")
_ALL_LONG_CONTEXT = "rms_norm,attention,tiled_layer"


def decide_memory_fit(facts: RunFacts, c: DDPFixConfig, ckpt: str, offload: Decision,
                      sp_size: int = 1) -> MemoryFit | None:
    """The `auto` memory plan for this run (``None`` when no memory option is ``auto``).

    Options set explicitly are on in every projection (``long_context`` counted only when it is the full
    set); the offload counts where the plan runs it; with sequence parallelism of ``sp_size`` ranks each
    device holds ``ceil(tokens / sp_size)`` tokens.
    """
    auto = tuple(n for n in AUTO_OPTIONS if getattr(c, n) == "auto")
    if (c.offload_activations == "auto" and offload.value is not True and ckpt == "non_reentrant"
            and facts.accelerator_available and (facts.rank_device or "cuda").startswith("cuda")):
        auto += ("offload",)  # where the offload could run (CUDA, non-reentrant checkpointing)
    if not auto and c.offload_activations != "auto":
        return None
    explicit = [n for n in ("tiled_loss", "tiled_mlp") if getattr(c, n) not in (None, "off", "auto")]
    if c.long_context == _ALL_LONG_CONTEXT:
        explicit.append("long_context")
    if offload.value is True:
        explicit.append("offload")
    m = facts.memory
    if m is not None and m.tokens and sp_size > 1:
        m = replace(m, tokens=-(-int(m.tokens) // sp_size),
                    tokens_source=f"{m.tokens_source} / sequence_parallel={sp_size}")
    return fit_memory(m, auto, tuple(explicit), ckpt)


def decide_offload(facts: RunFacts, c: DDPFixConfig, ckpt: str, fit: MemoryFit | None = None) -> Decision:
    """``offload_activations=auto``: as unset, unless the memory plan (``fit``) turns the offload on."""
    option = c.offload_activations
    memo = ""
    if option == "auto":
        option = True if fit is not None and fit.turns_on("offload") else None
        memo = "" if fit is None else f"; {fit.reason}"
    requested = bool(facts.offload_requested) if option is None else bool(option)
    source = "activation_checkpointing_kwargs" if option is None else c.source("offload_activations")
    if not requested:
        return Decision(False, f"not requested{memo}")
    if ckpt == "off":
        return Decision(False, f"requested ({source}) but checkpointing is off: nothing is saved to offload",
                        changed=bool(facts.offload_requested))
    if ckpt == "reentrant":
        return Decision(False, "requested but checkpointing is reentrant: the async offload hooks need non-reentrant",
                        changed=bool(facts.offload_requested))
    if not facts.accelerator_available:
        return Decision(False, "no-op: no accelerator, activations already live in host memory (nothing to "
                        "offload to; stock would crash in pin_memory)", changed=bool(facts.offload_requested))
    device_type = (facts.rank_device or "cuda").split(":")[0]
    if device_type not in ("cuda", "cpu", "meta"):  # ROCm reports "cuda" too; MPS, XPU, NPU, HPU do not
        if facts.offload_requested and option is None:  # unset or auto: transformers' request decides
            return Decision("stock", f"on {device_type}: transformers' own offload kept (blocking save_on_cpu "
                            "copies); hf_ddpfix's asynchronous offload supports CUDA/ROCm only")
        return Decision(False, f"off on {device_type}: hf_ddpfix's asynchronous offload supports CUDA/ROCm only, "
                        "activations stay on the device", changed=bool(facts.offload_requested))
    mib = DEFAULT_OFFLOAD_MIN_LAYER_MIB if c.offload_min_layer_mib is None else int(c.offload_min_layer_mib)
    if mib == 0:
        policy = f"every step copies (offload_min_layer_mib=0, {c.source('offload_min_layer_mib')})"
    else:
        policy = (f"auto: a step copies checkpoint inputs >= {mib} MiB, or any when the device was >= 90% reserved; "
                  f"smaller ones stay (H100, 1.1B Llama: 1.57x step time at 8 MiB per layer, 1.08x at 32 MiB, "
                  f"0.99x at 64 MiB) ({c.source('offload_min_layer_mib')})")
    fsdp = ("; under FSDP2 the checkpointed inputs of each layer are copied, the sharded parameters are FSDP's"
            if facts.parallel == "fsdp" else "")
    return Decision(True, f"async pinned-memory offload of checkpointed layer inputs ({source}); {policy}{fsdp}"
                    f"{memo}", changed=True)


#: Offload policy default (MiB per checkpoint input): the smallest layer input at which offloading cost
#: nothing in the H100 measurement (2026-11-23, benchmarks/offload.py, BENCHMARKS.md): 1.57x step time at
#: 8 MiB (2K tokens x 2048 hidden x bf16), 1.08x at 32 MiB (8K), 0.99x at 64 MiB (16K), 1.01x at 128 MiB.
DEFAULT_OFFLOAD_MIN_LAYER_MIB = 64


def offload_min_layer_bytes(config: DDPFixConfig | None) -> int:
    """The offload policy's threshold in bytes for ``ActivationOffload(min_layer_bytes=...)``."""
    mib = None if config is None else config.offload_min_layer_mib
    return (DEFAULT_OFFLOAD_MIN_LAYER_MIB if mib is None else int(mib)) << 20


def offload_max_pool_bytes(facts: RunFacts, c: DDPFixConfig | None) -> int | str | None:
    """The host pool's cap for ``ActivationOffload(max_pool_bytes=...)`` from ``offload_host_gib``:
    ``"default"`` (auto: a quarter of physical memory per local process), ``None`` (unlimited) or bytes.

    Raises:
        ValueError: the cap times the node's training processes exceeds its physical memory (the host
            cannot hold what the plan asks for), naming the variable, the figures and the allowed values.
    """
    value = None if c is None else c.offload_host_gib
    if value in (None, "auto"):
        return "default"
    if value == "unlimited":
        return None
    cap = int(float(value) * (1 << 30))
    host, local = facts.host_memory_bytes, max(1, facts.local_processes)
    if host is not None and cap * local > host:
        raise ValueError(
            f"{env_name('offload_host_gib')}={value} ({c.source('offload_host_gib')}): {local} process(es) x {float(value):g} GiB of pinned host memory "
            f"exceeds this node's {host / (1 << 30):.1f} GiB of physical memory; allowed: auto, unlimited, or "
            f"at most {host / local / (1 << 30):.1f} GiB per process (pinned pages cannot be swapped)")
    return cap


def decide_tiled_mlp(facts: RunFacts, c: DDPFixConfig, fit: MemoryFit | None = None) -> Decision:
    """``auto``: where the memory plan needs it (``fit``); an explicit ``on`` (``1``) or any other setting
    runs whatever the memory plan says (it is on in every projection of ``fit``)."""
    value = c.tiled_mlp
    if value is None or value == "off":
        return Decision(False, "not requested" if value is None else f"off ({c.source('tiled_mlp')})")
    if value == "auto" and fit is not None and fit.known:
        if not fit.turns_on("tiled_mlp"):
            return Decision(False, f"auto: not needed ({c.source('tiled_mlp')}); {fit.reason}")
        tokens = fit.tokens
        if tokens < 8192:  # the auto shard rule would not tile below 8K: a fixed count tiles these steps
            value = str(max(2, math.ceil(tokens / 2048)))
    rule = {
        "on": "on as asked: every MLP call tiled at every length, ceil(tokens/2048) shards and at least 2",
        "auto": "no tiling below 8K tokens, then ceil(tokens/2048) shards",
        "arctic": "ceil(tokens/hidden) shards",
        "target": "shards so one shard's MLP intermediate fits the memory target",
    }.get(value.split(":")[0], f"{value} shards per MLP call")
    sync = ("; shard count all-reduced (MAX) so FSDP ranks gather alike, for an MLP that is or holds an FSDP unit "
            "and in training forwards only (under no_grad, e.g. a rank-0-only evaluation, the MLP runs untiled "
            "with no collective); an MLP inside a unit (a decoder layer's, a vision tower's folded into the root, "
            "which text-only ranks skip) keeps its own count: its chunks gather nothing"
            if facts.parallel == "fsdp" else "")
    memo = "" if fit is None else f"; {fit.reason}"
    return Decision(value, f"{rule}, one gradient hook per parameter ({c.source('tiled_mlp')}){sync}{memo}", True)


def decide_long_context(facts: RunFacts, c: DDPFixConfig, ckpt: str, fit: MemoryFit | None = None) -> Decision:
    """Patched Llama-style layers (integrations/long_context/long_context.py): gradients equal stock (tests), every
    non-plain call (mask, cache, packing kwargs) runs stock at call time, other layer classes are left alone. The
    reason names each decoder layer type with its count and verdict (``facts.long_context_layers``, by structure:
    the verdict the run's ``apply_long_context`` acts on).
    ``auto``: every layer feature where the memory plan needs it (``fit``), else stock layers."""
    value = c.long_context
    if value is None or value == "off":
        return Decision(False, "not requested" if value is None else f"off ({c.source('long_context')})")
    memo = ""
    if value == "auto":
        if fit is None or not fit.turns_on("long_context"):
            what = "not needed" if fit is not None and fit.known else "stock layers"
            return Decision(False, f"auto: {what} ({c.source('long_context')})"
                            + (f"; {fit.reason}" if fit is not None else ""))
        value, memo = _ALL_LONG_CONTEXT, f"; {fit.reason}"
    notes = []
    if ckpt == "off":
        notes.append("checkpointing is off: each layer keeps q/k/v and the attention output (28 KiB/token on "
                     "Llama-8B) instead of only its input")
    if facts.parallel == "fsdp" and "tiled_layer" in value:
        notes.append("tile count all-reduced (MAX) so FSDP ranks gather alike")
    extra = ("; " + "; ".join(notes)) if notes else ""
    layers, details = "decoder layers patched by structure where a known wiring reproduces them", ()
    if facts.long_context_layers is not None and ("attention" in value or "tiled_layer" in value or value == "on"):
        from ..integrations.long_context.layer_kinds import kind_lines  # pure formatting of the facts

        details = kind_lines(facts.long_context_layers)
        patched = sum(k.count for k in facts.long_context_layers if k.patched)
        later = sum(k.count for k in facts.long_context_layers if k.patched is None)
        total = sum(k.count for k in facts.long_context_layers)
        layers = (f"decoder layers by type (below): {patched} of {total} patched by structure"
                  + (f", {later} checked at first call" if later else ""))
    return Decision(value, f"{layers}, masked/cached calls run stock ({c.source('long_context')}){extra}{memo}",
                    changed=True, details=details)


def decide_tiled_loss(facts: RunFacts, c: DDPFixConfig, fit: MemoryFit | None = None) -> Decision:
    """``auto``: on where the memory plan needs it (``fit``); on when its facts are unknown (today's rule)."""
    value = c.tiled_loss
    if value is None or value == "off":
        return Decision(False, "not requested" if value is None else f"off ({c.source('tiled_loss')})")
    memo = ""
    if value == "auto":
        if fit is not None and fit.known and not fit.turns_on("tiled_loss"):
            return Decision(False, f"auto: not needed ({c.source('tiled_loss')}); {fit.reason}")
        value, memo = "on", ("" if fit is None else f"; {fit.reason}")
    chunk = "auto chunk" if value == "on" else f"{value} tokens per chunk"
    fsdp = ("; under FSDP2 it runs as the forward of lm_head's unit (accelerate's [norm, head]), which gathers the "
            "head's weight and reduce-scatters its gradient" if facts.parallel == "fsdp" else "")
    return Decision(value, f"lm_head + cross-entropy in chunks, full logits never held, {chunk} "
                    f"({c.source('tiled_loss')}){fsdp}{memo}", changed=True)


def _zero3_unverified(facts: RunFacts, decision: Decision) -> Decision:
    """Tiling reads partitioned (empty) weights under ZeRO-3: not verified there, so stock is kept."""
    if facts.parallel != "deepspeed" or facts.zero_stage != 3 or not decision.value:
        return decision
    return Decision(False, f"requested ({decision.value}) but not verified under ZeRO-3 (weights are partitioned "
                    "outside their module's forward): stock computation kept")


class MemoryDecisions(NamedTuple):
    """What :func:`decide_memory` returns: the plan fields of the same names."""

    offload_activations: Decision
    tiled_mlp: Decision
    tiled_loss: Decision
    long_context: Decision
    offload_min_layer_bytes: int
    offload_max_pool_bytes: int | str | None


def decide_memory(facts: RunFacts, c: DDPFixConfig, ckpt: str, sp_size: int = 1) -> MemoryDecisions:
    """Every memory decision for a run whose checkpointing variant is ``ckpt`` ("off" when none) and whose
    sequence-parallel group has ``sp_size`` ranks: the ``auto`` options fitted (:func:`decide_memory_fit`), then
    the offload refitted by that plan where it is ``auto``.

    Raises:
        ValueError: an unreadable ``offload_max_pool`` setting (:func:`offload_max_pool_bytes`).
    """
    offload = decide_offload(facts, c, ckpt)
    fit = decide_memory_fit(facts, c, ckpt, offload, sp_size)  # the `auto` memory options (plan/memory_fit.py)
    if c.offload_activations == "auto":
        offload = decide_offload(facts, c, ckpt, fit)
    # opt-in tiling reads partitioned (empty) weights under ZeRO-3: not verified there, stock kept
    return MemoryDecisions(
        offload_activations=offload,
        tiled_mlp=_zero3_unverified(facts, decide_tiled_mlp(facts, c, fit)),
        tiled_loss=_zero3_unverified(facts, decide_tiled_loss(facts, c, fit)),
        long_context=_zero3_unverified(facts, decide_long_context(facts, c, ckpt, fit)),
        offload_min_layer_bytes=offload_min_layer_bytes(c),
        offload_max_pool_bytes=offload_max_pool_bytes(facts, c),
    )
