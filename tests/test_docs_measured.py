"""The docs' counts of tested families and their limits match what the tests measure (issue 40, item 6).

docs/limits.md said "tested on seven families" (FSDP2) and "Llama-style layers only" (long context) long after
the tests measured more. Pure file reading, no processes: each number the README and docs/limits.md state is
derived here from the source of truth: the family lists tests/test_fsdp_trainer.py launches (2 and 4 processes)
and docs/long-context-families.json (written by tests/test_long_context_families.py).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def _fsdp_trainer_families() -> tuple[int, int]:
    """(families launched at 2 processes, at 4 processes) by tests/test_fsdp_trainer.py, read from its source."""
    tree = ast.parse((ROOT / "tests" / "test_fsdp_trainer.py").read_text())
    two: list[str] = []
    four: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names == ["FAMILIES"] and isinstance(node.value, ast.Tuple):
                two += [ast.literal_eval(e) for e in node.value.elts]
            for t in targets:  # `families, four = "a,b,c,d", (...)`: the 4-process launch
                if isinstance(t, ast.Tuple) and [getattr(e, "id", None) for e in t.elts][:2] == ["families", "four"]:
                    four = ast.literal_eval(node.value.elts[0]).split(",")
    assert two and four, "tests/test_fsdp_trainer.py no longer lists FAMILIES / the 4-process families"
    return len(two), len(four)


def _long_context() -> tuple[int, int]:
    """(families measured, families that ran patched layers) in docs/long-context-families.json."""
    families = json.loads((ROOT / "docs" / "long-context-families.json").read_text())["families"]
    return len(families), sum(1 for f in families.values() if f["layers_patched"] > 0)


def _number(text: str) -> int:
    return int(text) if text.isdigit() else WORDS[text]


def test_fsdp2_family_counts_in_readme_and_limits_are_what_the_test_launches():
    two, four = _fsdp_trainer_families()
    for page in ("README.md", "docs/limits.md"):
        text = (ROOT / page).read_text()
        found = re.findall(r"(\w+) families at 2 processes and (\w+) at 4 processes", text)
        assert found, f"{page}: no 'N families at 2 processes and M at 4 processes' statement"
        assert {(_number(a), _number(b)) for a, b in found} == {(two, four)}, (page, found, (two, four))
    assert "seven families" not in (ROOT / "docs" / "limits.md").read_text()


def test_long_context_coverage_in_limits_is_what_the_family_test_measured():
    measured, patched = _long_context()
    text = (ROOT / "docs" / "limits.md").read_text()
    found = re.search(r"of the (\w+)\s+decoder families measured \(docs/long-context-families\.json\), (\w+) run "
                      r"patched layers", text)
    assert found, "docs/limits.md: no 'of the N decoder families measured (...), M run patched layers' statement"
    assert (_number(found.group(1)), _number(found.group(2))) == (measured, patched), (found.groups(), measured, patched)
    assert "Llama-style layers only" not in text
