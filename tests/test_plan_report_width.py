"""Every plan line fits a terminal; the long reasons live in docs/plan.md, one section per decision (issue 40, item 4).

Table-driven over the run contexts of tests/test_asked_options.py (one process, DDP, FSDP2, ZeRO-2/3; text and
VLM) x (nothing asked, every option asked on in turn, explicit reentrant checkpointing: a `corrected:` line), on
the pure plan. A decision added later (its reason however long) is covered without a new test, and fails until
docs/plan.md has its section.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_asked_options import CONTEXTS, _asked_value

from hf_ddpfix.config.options import OPTIONS, DDPFixConfig, env_name
from hf_ddpfix.plan.resolve import resolve_plan
from hf_ddpfix.plan.types import REPORT_WIDTH, PlanError, RunFacts, fit_line

DOC = Path(__file__).resolve().parents[1] / "docs" / "plan.md"
LINK = re.compile(r"docs/plan\.md#([\w-]+)")


def _anchors() -> set[str]:
    """GitHub's heading anchors of docs/plan.md (lower case, punctuation but `-`/`_` dropped, spaces -> `-`)."""
    heads = re.findall(r"^#+ (.+)$", DOC.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower().replace("`", "")).replace(" ", "-") for h in heads}


def _configs() -> dict[str, DDPFixConfig]:
    configs = {"nothing asked": DDPFixConfig.from_env({}),
               "explicit reentrant": DDPFixConfig.from_env({"HF_DDPFIX_CHECKPOINTING": "reentrant"})}
    for name in OPTIONS:
        configs[f"{name} asked"] = DDPFixConfig.from_env({env_name(name): _asked_value(name)})
    return configs


@pytest.mark.parametrize("context", list(CONTEXTS))
def test_every_plan_line_fits_and_every_link_has_its_section(context):
    anchors, seen = _anchors(), 0
    for label, config in _configs().items():
        try:
            report = resolve_plan(CONTEXTS[context], config).report()
        except PlanError:
            continue
        seen += 1
        for line in report.splitlines():
            assert len(line) <= REPORT_WIDTH, f"{context}, {label}: a plan line of {len(line)} characters:\n{line}"
            missing = set(LINK.findall(line)) - anchors
            assert not missing, f"{context}, {label}: {line}\nlinks docs/plan.md#{missing}, which has no such section"
    assert seen > len(OPTIONS) // 2, seen


def test_every_decision_has_a_section_in_docs_plan():
    anchors = _anchors()
    names = [*resolve_plan(RunFacts()).decisions(), "corrected", "settings", "asked-for-not-applied"]
    missing = [n for n in names if n not in anchors]
    assert not missing, f"docs/plan.md lacks a section (### <name>) for {missing}"


def test_a_long_line_is_cut_at_a_clause_boundary_with_its_link():
    long = " * parameter_usage         = on             " + "; ".join(f"clause {i} (with a, b)" for i in range(30))
    cut = fit_line(long, "parameter_usage")
    assert len(cut) <= REPORT_WIDTH and cut.endswith(" … (docs/plan.md#parameter_usage)"), cut
    head = cut[: -len(" … (docs/plan.md#parameter_usage)")]
    assert long.startswith(head) and long[len(head):].startswith("; ") and head.count("(") == head.count(")"), cut
    opened = fit_line("x = on (" + "word, " * 60 + "end)", "x")
    assert len(opened) <= REPORT_WIDTH and opened.startswith("x = on (word") and "word) … (docs" in opened, opened
    assert fit_line("short", "x") == "short"
