"""`DDPFixConfig`: every hf_ddpfix option once, with the environment variables that set it.

Sources, highest first: an explicit argument > `HF_DDPFIX_<OPTION>` > an `UNSLOTH_*` compatibility
variable > the default. `None` in a field means "unset: let the plan decide". Every resolved value
remembers where it came from, so the plan log can say it.

Guarantees: a value that is not one of the allowed spellings raises `ValueError` naming the variable,
the bad value and the allowed values; two environment variables that contradict each other raise
`ValueError` naming both (never silently resolved).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .parsers import _FALSE, _TRUE, parse_bool, parse_choice, parse_positive_int, parse_str  # noqa: F401 (re-exported)

CheckpointingMode = Literal["auto", "non_reentrant", "reentrant"]


@dataclass(frozen=True)
class _Option:
    """How one option is read: its env var, compatibility aliases and parser."""

    parse: Callable[[str, Any], Any]
    doc: str
    # compatibility variables: name -> value they imply when set to a true value
    compat: Mapping[str, Any] = field(default_factory=dict)


def _bool(name: str, value: Any) -> bool | None:
    return parse_bool(name, value, allow_auto=True)


def _offload(name: str, value: Any) -> bool | str | None:
    """A boolean, or auto (resolved by the plan, plan/memory_fit.py: on only where memory needs it)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return parse_bool(name, value)


def _checkpointing(name: str, value: Any) -> str | None:
    return parse_choice(name, value, ("auto", "non_reentrant", "reentrant"))


def _fsdp_skippable(name: str, value: Any) -> str | None:
    return parse_choice(name, value, ("auto", "fold", "shard"))


def _int1(name: str, value: Any) -> int | None:
    return parse_positive_int(name, value)


def _int0(name: str, value: Any) -> int | None:
    return parse_positive_int(name, value, allow_zero=True)


def _tiled_mlp(name: str, value: Any) -> str | None:
    """A TiledMLP setting, normalised: off, on (forced: 1/true/yes/on), auto, arctic, target, target:GB or N
    (fixed shard count)."""
    from ..ops.tiled import parse_tiled_mlp_setting

    v = parse_str(name, value)
    if v is None:
        return None
    setting = parse_tiled_mlp_setting(v, name=name)
    if setting.mode == "fixed":
        return str(setting.shards)
    if setting.mode == "target" and setting.target_gb is not None:
        return f"target:{setting.target_gb:g}"
    return setting.mode


def _unsloth_tiled_mlp(name: str, value: Any) -> str | None:
    """`UNSLOTH_TILED_MLP` as Unsloth reads it: 1 (or true/yes/on) means arctic (unsloth_zoo's `patch_tiled_mlp`
    treats "1" as "arctic", ceil(tokens/hidden) shards); 0/off, arctic, target, target:GB, N and auto as
    `HF_DDPFIX_TILED_MLP`."""
    v = parse_str(name, value)
    if v is not None and v.lower() in _TRUE:
        return "arctic"
    return _tiled_mlp(name, v)


_unsloth_tiled_mlp.alias_doc = "1 means arctic, as in Unsloth; its other values as this variable's"  # type: ignore[attr-defined]

def _tiled_loss(name: str, value: Any) -> str | None:
    """The tiled loss head: off, on (auto chunking) or N (label tokens per chunk)."""
    v = parse_str(name, value)
    if v is None:
        return None
    low = v.lower()
    if low in _FALSE:
        return "off"
    if low == "auto":  # resolved by the plan (plan/memory_fit.py): on only where memory needs it
        return "auto"
    if low in _TRUE:
        return "on"
    if low.isdigit() and int(low) >= 1:
        return low
    raise ValueError(f"{name}={value!r} is not a recognised value; allowed: off, on, auto, N (tokens per chunk)")


def _long_context(name: str, value: Any) -> str | None:
    """Long-context layer features: off, all, or a comma list of rms_norm, attention, tiled_layer."""
    from ..integrations.long_context.long_context import parse_long_context_setting

    v = parse_str(name, value)
    if v is None:
        return None
    if v.strip().lower() == "auto":  # resolved by the plan (plan/memory_fit.py): on only where memory needs it
        return "auto"
    feats = parse_long_context_setting(v, name=name)
    return ",".join(feats) if feats else "off"


def _host_gib(name: str, value: Any) -> str | None:
    """The offload host pool's cap: auto (a quarter of physical memory per local process), unlimited, or
    a positive number of GiB per process."""
    v = parse_str(name, value)
    if v is None:
        return None
    low = v.strip().lower()
    if low in ("auto", "default"):
        return "auto"
    if low in ("unlimited", "none", "inf"):
        return "unlimited"
    try:
        gib = float(low)
    except ValueError:
        gib = -1.0
    if not gib > 0 or gib != gib or gib == float("inf"):
        raise ValueError(f"{name}={value!r} is not a recognised value; allowed: auto, unlimited, or a number of "
                         "GiB > 0 (per process, e.g. 96 or 1.5)")
    return f"{gib:g}"


_META_KEY = "hf_ddpfix"


def compat_value_of(opt: _Option, var: str, raw: str | None) -> Any:
    """What the compatibility variable `var` of `opt` set to `raw` asks for (`None`: nothing, e.g. unset, or 0
    for a variable that implies a fixed value).

    Raises:
        ValueError: `raw` is not one of the variable's spellings, naming `var` and the allowed values.
    """
    if raw is None or raw.strip() == "":
        return None
    implied = opt.compat[var]
    if callable(implied):
        return implied(var, raw)
    return implied if parse_bool(var, raw) else None


def option(parse: Callable[[str, Any], Any], doc: str, *, compat: Mapping[str, Any] | None = None) -> Any:
    """A `DDPFixConfig` field: unset (`None`) by default, with how it is parsed and documented as metadata.

    Args:
        parse: `parse(variable_name, raw_value) -> typed value or None`; raises `ValueError` naming the
            variable and the allowed values.
        doc: one line for docs/options.md's table (scripts/options_table.py) and `hf-ddpfix doctor`.
        compat: compatibility variables -> the value they imply when set to a true value, or a parser
            `parse(variable_name, raw_value)` that reads the variable's own value (e.g. `UNSLOTH_TILED_MLP=arctic`).
    """
    return field(default=None, metadata={_META_KEY: _Option(parse, doc, dict(compat or {}))})


#: The variable that turns the zero-code route (patches/) off; no option, but validated on every route.
DISABLE_VAR = "HF_DDPFIX_DISABLE"


def check_disable(env: Mapping[str, str] | None = None) -> bool:
    """`HF_DDPFIX_DISABLE` as patches/sitecustomize.py reads it: True for 1/true/yes/on, False for 0/false/no/off or
    unset / empty.

    Raises:
        ValueError: any other value, naming the variable and the allowed values (so the library route,
            `patch_trainer()` / `DDPFixTrainer`, and the CLI refuse what patches/ refuses).
    """
    raw = (os.environ if env is None else env).get(DISABLE_VAR, "")
    if not raw.strip():
        return False
    return bool(parse_bool(DISABLE_VAR, raw))


def env_name(option: str) -> str:
    """The `HF_DDPFIX_*` variable of an option, e.g. `static_graph` -> `HF_DDPFIX_STATIC_GRAPH`."""
    return "HF_DDPFIX_" + option.upper()


def env_setting(option: str, value: str) -> str:
    """`VAR=value` for messages and logs, e.g. `env_setting("static_graph", "0")` -> `HF_DDPFIX_STATIC_GRAPH=0`.

    Raises:
        KeyError: `option` is not a `DDPFixConfig` option (a renamed option cannot leave a stale hint).
    """
    if option not in OPTIONS:
        raise KeyError(f"no hf_ddpfix option {option!r}; options: {', '.join(OPTIONS)}")
    return f"{env_name(option)}={value}"


@dataclass(frozen=True)
class DDPFixConfig:
    """All hf_ddpfix options. `None` means unset (the plan decides). Each field's parser, documentation and
    compatibility variables are its metadata (`option(...)`); `OPTIONS` and `env_table()` derive from them.

    Build it with `DDPFixConfig.from_env(**explicit)` to apply the environment; the plain constructor
    takes only explicit values. `sources` maps each set option to where its value came from.
    """

    static_graph: bool | None = option(
        _bool,
        "DDP `static_graph`: 1 asks for it (kept where the graph is fixed; where it would fail, e.g. with gradient "
        "accumulation, it is corrected to off and logged, or refused under strict), 0 never uses it, auto lets "
        "the plan decide.",
        compat={"UNSLOTH_DISABLE_DDP_STATIC_GRAPH": False},
    )
    static_graph_with_checkpointing: bool | None = option(
        _bool,
        "0 disables static graph whenever activation checkpointing is on.",
        compat={"UNSLOTH_DISABLE_DDP_STATIC_GRAPH_FOR_GRAD_CHECKPOINT": False},
    )
    find_unused_parameters: bool | None = option(
        _bool,
        "DDP `find_unused_parameters`: 1/0 force it, auto decides. Forcing 0 on a VLM whose vision "
        "parameters can go unused is honoured with the hang guard on (fails fast instead of hanging).",
    )
    checkpointing: CheckpointingMode | None = option(
        _checkpointing,
        "Checkpointing implementation when checkpointing is on: auto (non-reentrant under DDP/FSDP), "
        "non_reentrant, reentrant.",
    )
    assume_checkpointing: bool | None = option(
        _bool,
        "1: treat the run as checkpointed even when detection misses it (custom checkpointing).",
        compat={"UNSLOTH_USE_GRADIENT_CHECKPOINTING": True},
    )
    strict: bool | None = option(_bool, "1: raise before training instead of correcting a known-bad explicit setting.")
    offload_activations: bool | str | None = option(
        _offload,
        "1: asynchronous CPU offload of checkpointed layer inputs (no-op without an accelerator); auto: on where "
        "the memory plan needs it (unknown device memory or length: as unset).",
    )
    offload_min_layer_mib: int | None = option(
        _int0,
        "Offload policy: a step copies a checkpoint input only when it has at least this many MiB, or when the "
        "device was >= 90% reserved (default 64: no slowdown from there on in the H100 measurement; 0: always).",
    )
    offload_host_gib: str | None = option(
        _host_gib,
        "Cap on the pinned host memory each process's activation offload may hold: auto (a quarter of physical "
        "memory / local processes), unlimited, or GiB per process. Checked against the host's memory at setup.",
    )
    vlm_stabilizer: bool | None = option(
        _bool, "VLM dummy-image stabiliser so every rank uses every vision parameter each step (auto: on)."
    )
    hang_guard: bool | None = option(
        _bool, "Detect ranks disagreeing on used parameter groups before backward and raise (auto: on)."
    )
    eval_outputs: bool | None = option(
        _bool, "Evaluation/prediction: every rank hands the Trainer's gathers the same prediction fields (those all "
        "ranks have at the first step; auto: on with more than one process)."
    )
    parameter_usage: bool | None = option(
        _bool,
        "Tie every trainable parameter a forward did not use into the loss with an exact-zero gradient (observed "
        "each forward), so DDP runs with find_unused_parameters=False for any model (auto: on under DDP).",
    )
    fsdp_skippable: str | None = option(
        _fsdp_skippable,
        "FSDP2: a subtree a rank may skip (vision tower, projector) is folded into the enclosing unit (fold: "
        "gathered whole on every rank) or sharded with a dummy image on ranks without one (shard); auto: fold "
        "only within max(64 MiB, 10% of a rank's parameter shard). docs/plan.md#fsdp_skippable.",
    )
    zero_skip_unused: bool | None = option(
        _bool,
        "DeepSpeed ZeRO-1/2/3: 1 gives parameters no rank used in an optimizer step back their weights and AdamW "
        "state after the step (stock DDP's semantics: AdamW skips them); 0/auto: DeepSpeed's own (zero gradient: "
        "weight decay and momentum move them). torch Adam/AdamW only.",
    )
    tiled_mlp: str | None = option(
        _tiled_mlp,
        "TiledMLP: off, on/1 (tiled at every length: ceil(tokens/2048) shards, at least 2, whatever the memory "
        "plan says), auto (where the memory plan needs it; unknown device memory or length: no tiling below 8K "
        "tokens, then 2K tokens per shard), N shards, arctic (ceil(tokens/hidden) shards), target, target:GB "
        "(one shard's MLP intermediate fits GB).",
        compat={"UNSLOTH_TILED_MLP": _unsloth_tiled_mlp},  # Unsloth's values: 1 = arctic, target, target:GB
    )
    tiled_loss: str | None = option(
        _tiled_loss,
        "Tiled lm_head + cross-entropy that never holds the full logits: off, on (chunk size chosen per run), "
        "auto (on where the memory plan needs it; on when device memory or length is unknown), N label tokens "
        "per chunk.",
    )
    long_context: str | None = option(
        _long_context,
        "Decoder layers for long sequences, by structure (docs/long-context-families.md lists the families "
        "tested): off, all (on), auto (all where the memory plan needs it, else stock layers), or a comma list "
        "of rms_norm (saves bf16 "
        "input + fp32 rstd), attention (flash per KV-head group), tiled_layer (norms, q/k/v/o with LoRA, rotary "
        "and MLP in 2K-token tiles). Ledger: 345 -> 53 KiB/token per Llama-8B layer.",
    )
    sequence_parallel: int | None = option(
        _int1,
        "Ulysses sequence parallelism: N ranks share each sequence (heads split by all-to-all around attention, "
        "token-exact loss); DDP, FSDP2 or DeepSpeed ZeRO with sdpa attention; world size a multiple of N (1: off). "
        "ParallelismConfig(sp_size=N) means the same.",
    )
    sync_check_steps: int | None = option(
        _int0, "Compare a checksum of trainable params across DDP ranks every N steps (default 50; 0: never)."
    )
    log_plan: bool | None = option(_bool, "Log the plan on rank 0 at the start of training (default on).")
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "sources":
                continue
            value = getattr(self, f.name)
            if value is not None:
                # validate explicit values with the same parser as the environment
                parsed = OPTIONS[f.name].parse(f.name, value)
                object.__setattr__(self, f.name, parsed)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **explicit: Any) -> DDPFixConfig:
        """Resolve every option: explicit argument > `HF_DDPFIX_*` > `UNSLOTH_*` > unset.

        Raises:
            ValueError: an unknown option, an invalid value, or contradicting variables.
        """
        env = os.environ if env is None else env
        check_disable(env)
        unknown = set(explicit) - set(OPTIONS)
        if unknown:
            raise ValueError(f"unknown hf_ddpfix option(s) {sorted(unknown)}; allowed: {', '.join(OPTIONS)}")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, opt in OPTIONS.items():
            env_value = opt.parse(env_name(name), env.get(env_name(name)))
            compat_value, compat_var = None, None
            for var in opt.compat:
                raw = env.get(var)
                v = compat_value_of(opt, var, raw)
                if v is None:
                    continue  # unset, or e.g. UNSLOTH_DISABLE_DDP_STATIC_GRAPH=0: asks for nothing
                compat_value, compat_var = v, var
            if env_value is not None and compat_value is not None and env_value != compat_value:
                raise ValueError(
                    f"{env_name(name)}={env[env_name(name)]!r} contradicts {compat_var}={env[compat_var]!r}; "
                    f"unset one of them"
                )
            if explicit.get(name) is not None:
                values[name] = opt.parse(name, explicit[name])
                sources[name] = "argument"
            elif env_value is not None:
                values[name], sources[name] = env_value, env_name(name)
            elif compat_value is not None:
                values[name], sources[name] = compat_value, compat_var
        _check_cross_conflicts(values, sources)
        return cls(**values, sources=sources)

    def source(self, option: str) -> str:
        """Where `option`'s value came from: "argument", an env var name, or "default"."""
        return self.sources.get(option, "default")

    def describe(self) -> list[str]:
        """One `option=value (source)` line per option that is set."""
        return [
            f"{f.name}={getattr(self, f.name)} ({self.source(f.name)})"
            for f in dataclasses.fields(self)
            if f.name != "sources" and getattr(self, f.name) is not None
        ]


#: option name -> how it is read; derived from the `DDPFixConfig` fields (the single declaration).
OPTIONS: dict[str, _Option] = {
    f.name: f.metadata[_META_KEY] for f in dataclasses.fields(DDPFixConfig) if _META_KEY in f.metadata
}


def _check_cross_conflicts(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """Report settings that cannot both hold (e.g. static graph forced on and forbidden with checkpointing)."""
    if values.get("static_graph") is True and values.get("static_graph_with_checkpointing") is False:
        if values.get("assume_checkpointing") is True:
            raise ValueError(
                f"static_graph=1 ({sources['static_graph']}) contradicts static_graph_with_checkpointing=0 "
                f"({sources['static_graph_with_checkpointing']}) with checkpointing assumed on "
                f"({sources['assume_checkpointing']}); unset one of them"
            )


def env_table() -> list[tuple[str, str, str]]:
    """(variable, compatibility aliases, meaning) for every option: docs/options.md's table is generated from this."""
    rows = []
    for name, opt in OPTIONS.items():
        rows.append((env_name(name), ", ".join(opt.compat), opt.doc))
    return rows
