"""Options asked for explicitly that the plan does not run: said in the plan, never silently dropped.

An option is *asked* when its value comes from the user (argument, `HF_DDPFIX_*` or a compatibility variable)
and asks for something to run: a boolean `1`, a variant (`non_reentrant`, `arctic`, `N`), a number. `0`/off,
`auto` and unset ask for nothing. `ASKS` says, for every `DDPFixConfig` option, what asks it on and where it
runs: its own plan decision (on when the decision's value is truthy), or, for a setting of another decision or
of the run (`offload_min_layer_mib`, `sync_check_steps`, ...), a rule over the facts and the plan.

:func:`mark_not_applied` (called last by `resolve_plan`) turns each asked option that does not run into a plan
line `! <option> = off  asked on (<where>): <why>` (its own decision's line, the decision then `False` with that
reason, or a line of its own) and lists it in `Plan.not_applied`; :func:`not_applied_warning` is the one warning
a run logs for them. Pure: facts and plan in, plan out.

Guarantees: every option in `OPTIONS` has an entry (import fails otherwise); an option asked on is either on in
the plan or in `Plan.not_applied` with its reason; nothing asked, nothing listed (tests/test_asked_options.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..config.options import OPTIONS, DDPFixConfig, env_name
from .types import Decision, Plan, RunFacts

__all__ = ["ASKS", "asked_options", "mark_not_applied", "mark_not_run_by", "not_applied_warning"]


@dataclass(frozen=True)
class Ask:
    """How one option is judged.

    Attributes:
        asks: the option's (parsed) value asks for something to run.
        runs: where it is no decision of its own: `runs(facts, plan)` is true where it takes effect; `None`: its
            own decision (same name) runs it when that decision's value is truthy.
        why: `why(facts, plan)`, the reason it does not run where its decision says nothing (value `None`) or it
            has no decision.
    """

    asks: Callable[[Any], bool]
    why: Callable[[RunFacts, Plan], str]
    runs: Callable[[RunFacts, Plan], bool] | None = None
    own_why: bool = False  # say `why` even where the decision has a reason of its own (it reads better)


def _true(v: Any) -> bool:
    return v is True


def _feature(v: Any) -> bool:  # tiled_mlp / tiled_loss / long_context: a variant, not off or auto
    return v not in (None, "off", "auto")


def _where(f: RunFacts) -> str:
    if f.parallel == "single":
        return "one process"
    if f.parallel == "deepspeed":
        stage = f.deepspeed.stage if f.deepspeed is not None else f.zero_stage
        return f"DeepSpeed ZeRO-{stage if stage is not None else '?'}"
    return f"{f.parallel.upper() if f.parallel == 'ddp' else 'FSDP' + str(f.fsdp_version or '')}, world size {f.world_size}"


def _ddp_flag(f: RunFacts, p: Plan) -> str:
    return f"a DistributedDataParallel setting; this run is {_where(f)}: no DDP reducer to set it on"


def _stabilizer_why(f: RunFacts, p: Plan) -> str:
    return ("a text-only model: no vision tower to stabilise" if not f.is_vlm
            else f"nothing to stabilise in this run ({_where(f)})")


def _hang_guard_why(f: RunFacts, p: Plan) -> str:
    if f.parallel != "ddp":
        return f"the hang guard checks DDP ranks before backward; this run is {_where(f)}"
    return ("not needed: parameter_usage ties every trainable parameter into the loss, so every rank reduces "
            "the same gradients" if p.parameter_usage.value else "not needed: find_unused_parameters=True")


def _usage_why(f: RunFacts, p: Plan) -> str:
    if f.parallel == "fsdp":
        return f"runs under FSDP2 only (with accelerate's FSDP2 facts); this run is {_where(f)}"
    return f"runs under DDP and FSDP2; this run is {_where(f)}" + (
        " (ZeRO: HF_DDPFIX_ZERO_SKIP_UNUSED=1 gives DDP's semantics)" if f.parallel == "deepspeed" else "")


def _offload_setting(f: RunFacts, p: Plan) -> str:
    return f"a setting of the activation offload, which is off: {p.offload_activations.reason}"


def _sync_why(f: RunFacts, p: Plan) -> str:
    if f.parallel in ("ddp", "single"):
        return "one process: no replica to compare"
    return f"compares DDP replicas; under {_where(f)} parameters are sharded, not replicated: nothing to compare"


def _static_with_ckpt_why(f: RunFacts, p: Plan) -> str:
    if f.parallel != "ddp":
        return _ddp_flag(f, p)
    if not p.checkpointing.value:
        return f"a setting of static_graph with checkpointing, which is off ({p.checkpointing.reason})"
    return f"static_graph is off: {p.static_graph.reason}"


def _generic(f: RunFacts, p: Plan) -> str:
    return f"does not arise in this run ({_where(f)})"


#: option -> how it is judged; one entry per `DDPFixConfig` option.
ASKS: dict[str, Ask] = {
    "static_graph": Ask(_true, _ddp_flag),
    "static_graph_with_checkpointing": Ask(
        _true, _static_with_ckpt_why, runs=lambda f, p: bool(p.static_graph.value) and bool(p.checkpointing.value)),
    "find_unused_parameters": Ask(_true, _ddp_flag),
    "checkpointing": Ask(lambda v: v in ("reentrant", "non_reentrant"),
                         lambda f, p: "checkpointing is off in this run (gradient_checkpointing not enabled): no "
                         "variant to choose", own_why=True),
    "assume_checkpointing": Ask(
        _true, lambda f, p: f"read by DDP's static_graph decision only; this run is {_where(f)}",
        runs=lambda f, p: f.parallel == "ddp"),
    "strict": Ask(_true, _generic, runs=lambda f, p: True),
    "offload_activations": Ask(_true, _generic),
    "offload_min_layer_mib": Ask(lambda v: v is not None, _offload_setting,
                                 runs=lambda f, p: p.offload_activations.value is True),
    "offload_host_gib": Ask(lambda v: v not in (None, "auto"), _offload_setting,
                            runs=lambda f, p: p.offload_activations.value is True),
    "vlm_stabilizer": Ask(_true, _stabilizer_why),
    "hang_guard": Ask(_true, _hang_guard_why),
    "eval_outputs": Ask(_true, lambda f, p: "one process: the Trainer gathers predictions across no ranks"),
    "parameter_usage": Ask(_true, _usage_why),
    "fsdp_skippable": Ask(lambda v: v in ("fold", "shard"),
                          lambda f, p: f"an FSDP2 setting for subtrees a rank may skip; this run is {_where(f)}",
                          runs=lambda f, p: p.fsdp_skippable.value is not None),
    "zero_skip_unused": Ask(_true, lambda f, p: f"a DeepSpeed ZeRO setting; this run is {_where(f)}"),
    "tiled_mlp": Ask(_feature, _generic),
    "tiled_loss": Ask(_feature, _generic),
    "long_context": Ask(_feature, _generic),
    "sequence_parallel": Ask(lambda v: v is not None and v > 1, _generic),
    "sync_check_steps": Ask(lambda v: v is not None and v > 0, _sync_why,
                            runs=lambda f, p: f.parallel == "ddp" and f.world_size > 1),
    "log_plan": Ask(_true, _generic, runs=lambda f, p: True),
}

_missing = set(OPTIONS) - set(ASKS)
if _missing:  # a new option must say where it runs (and tests/test_asked_options.py covers it)
    raise ImportError(f"hf_ddpfix.plan.asked: no ASKS entry for option(s) {sorted(_missing)}")


def asked_options(c: DDPFixConfig) -> list[str]:
    """The options `c` asks on explicitly (set by the user to a value that asks for something to run)."""
    return [n for n, a in ASKS.items() if c.source(n) != "default" and a.asks(getattr(c, n))]


def _asked_text(c: DDPFixConfig, name: str) -> str:
    """`asked on (HF_DDPFIX_VLM_STABILIZER=1)`, `asked arctic (UNSLOTH_TILED_MLP)`, `asked on (argument x=True)`."""
    v, src = getattr(c, name), c.source(name)
    shown = "on" if v is True else str(v)
    raw = "1" if v is True else str(v)
    if src == "argument":
        return f"asked {shown} (argument {name}={v!r})"
    if src == env_name(name):
        return f"asked {shown} ({src}={raw})"
    return f"asked {shown} ({src})"


def _runs(name: str, facts: RunFacts, plan: Plan) -> bool:
    ask = ASKS[name]
    if ask.runs is not None:
        return ask.runs(facts, plan)
    value = plan.decisions()[name].value
    return bool(value) and value != "deepspeed"  # "deepspeed": DeepSpeed's own Ulysses runs, not hf_ddpfix's


def mark_not_applied(plan: Plan, facts: RunFacts, c: DDPFixConfig) -> Plan:
    """`plan` with every option `c` asks on that does not run said: its decision (if it has one) off with the
    reason `asked ... (<where>): <why>`, and `Plan.not_applied[option]` = that line. Unchanged when nothing
    asked is dropped."""
    decisions = plan.decisions()
    changes: dict[str, Decision] = {}
    said: dict[str, str] = {}
    for name in asked_options(c):
        if _runs(name, facts, plan):
            continue
        d = decisions.get(name)
        own = d is not None and d.value is False and d.reason and not ASKS[name].own_why
        why = d.reason if own else ASKS[name].why(facts, plan)
        said[name] = f"{_asked_text(c, name)}: {why}"
        if d is not None:
            changes[name] = Decision(False, said[name], changed=d.changed)
    if not said:
        return plan
    return replace(plan, **changes, not_applied=said)


def mark_not_run_by(plan: Plan, c: DDPFixConfig, runs: frozenset[str], entry: str) -> Plan:
    """`plan` for an entry point that runs only the options in `runs` (e.g. `prepare_accelerate_loop`: DDP kwargs,
    checkpointing, parameter usage): every other option asked on and on in the plan is turned off and listed in
    `Plan.not_applied` with "not run by <entry>"."""
    decisions = plan.decisions()
    changes: dict[str, Decision] = {}
    said = dict(plan.not_applied)
    for name in asked_options(c):
        if name in runs or name in said:
            continue
        said[name] = f"{_asked_text(c, name)}: {entry} does not run it (the Trainer entry points do)"
        if name in decisions:
            changes[name] = Decision(False, said[name], changed=False)
    if said == plan.not_applied:
        return plan
    return replace(plan, **changes, not_applied=said)


def not_applied_warning(plan: Plan) -> str | None:
    """The one warning a run logs for the options asked on that its plan does not run (`None`: none)."""
    if not plan.not_applied:
        return None
    lines = [f"  {name} {text}" for name, text in plan.not_applied.items()]
    return ("hf_ddpfix: asked for but not applied in this run (the plan log says the same; unset them to "
            "silence this):\n" + "\n".join(lines))
