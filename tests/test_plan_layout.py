"""The plan's layout (docs/design.md "The plan"): one decision, one module, and ``resolve_plan`` visits each rule
module once, in order, never walking back to one it left.

Traced with ``sys.setprofile`` over runs under every engine (one process, DDP, FSDP2, ZeRO-2/3; VLM and text;
checkpointing on and off), so the test sees the calls a real ``resolve_plan`` makes, not the imports.

Shown failing once (2026-12-02): with ``decide_fsdp_shared(facts)`` called again from ``resolve_plan`` after
``decide_vision`` (as before this layout: the FSDP module re-entered for the ``fsdp_shared`` line), the first test
names ``hf_ddpfix.plan.fsdp`` visited twice; with ``vision.decide_vision`` calling ``ddp.unused_reason`` the
second names the call from ``vision`` into ``ddp``.
"""

from __future__ import annotations

import itertools
import sys

from hf_ddpfix.config.options import DDPFixConfig
from hf_ddpfix.integrations.deepspeed.zero import DeepSpeedFacts
from hf_ddpfix.plan import RunFacts, resolve_plan

PLAN = "hf_ddpfix.plan."
#: modules that are part of another (its helpers): fsdp_skippable of fsdp (the fold arithmetic), memory_fit of memory
PART_OF = {"fsdp_skippable": "fsdp", "memory_fit": "memory"}
#: what every rule module reads: the types, not a decision
SHARED = {"types"}


def _room(module: str) -> str | None:
    if not module.startswith(PLAN):
        return None
    name = module[len(PLAN):]
    return None if name in SHARED else PART_OF.get(name, name)


def _runs():
    for parallel, vlm, ckpt, stage in itertools.product(("single", "ddp", "fsdp", "deepspeed"), (False, True),
                                                         ("off", "reentrant", "non_reentrant"), (2, 3)):
        if stage == 2 and parallel != "deepspeed":
            continue
        facts = RunFacts(parallel=parallel, world_size=1 if parallel == "single" else 2, checkpointing=ckpt,
                         is_peft=True, is_vlm=vlm, vlm_adapter="qwen2_vl" if vlm else None,
                         trainable_vision_params=vlm, fsdp_version=2 if parallel == "fsdp" else None,
                         zero_stage=stage if parallel == "deepspeed" else None,
                         deepspeed=DeepSpeedFacts(stage=stage, version="0.19.8") if parallel == "deepspeed" else None)
        yield facts, DDPFixConfig(tiled_mlp="auto", offload_activations="auto")


def _trace(facts: RunFacts, config: DDPFixConfig) -> list[tuple[str, str, str]]:
    """``(caller room, callee room, callee function)`` of every call between two rule modules (or from
    ``resolve``) made while ``resolve_plan`` runs."""
    calls: list[tuple[str, str, str]] = []

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        if event != "call" or frame.f_back is None:
            return
        callee = _room(frame.f_globals.get("__name__", ""))
        caller = _room(frame.f_back.f_globals.get("__name__", ""))
        if callee and caller and callee != caller:
            calls.append((caller, callee, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        resolve_plan(facts, config)
    finally:
        sys.setprofile(None)
    return calls


def test_resolve_plan_visits_each_rule_module_once_in_order():
    for facts, config in _runs():
        order = [callee for caller, callee, _ in _trace(facts, config) if caller == "resolve"]
        visited = [m for i, m in enumerate(order) if i == 0 or order[i - 1] != m]
        again = sorted({m for m in visited if visited.count(m) > 1})
        assert not again, (facts.parallel, facts.is_vlm, facts.checkpointing, facts.zero_stage, again, visited)


def test_a_rule_module_makes_no_other_modules_decision_and_reads_an_earlier_one_only_through_its_helpers():
    """A rule module may read what an earlier decision means through that module's helpers (``fsdp_units_ours``),
    or share a version comparison; it never calls another module's ``decide_*`` or rule (only ``resolve`` does)."""
    allowed = {("vision", "fsdp", "fsdp_units_ours"), ("vision", "fsdp", "fsdp_unit_classes"),
               ("checkpointing", "deepspeed", "_older")}
    for facts, config in _runs():
        stray = {c for c in _trace(facts, config) if c[0] != "resolve" and c not in allowed}
        assert not stray, (facts.parallel, facts.is_vlm, facts.checkpointing, sorted(stray))
