"""Every module is at most 450 lines, and every file a docstring or comment cites exists: a ``tests/...`` path anywhere in the package, the tests, the
scripts and the benchmarks, and any ``scripts/`` / ``benchmarks/`` / ``examples/`` / ``patches/`` /
``accelerate_configs/`` / ``docs/`` path in the package (from the repository root); ``path::name`` names a
function or class defined in that file. A guarantee that cites a test which does not exist is not a guarantee."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launch import ROOT

_EXT = r"\.(?:py|json|md|yaml|yml|sh|txt|toml)"
_TESTS = re.compile(rf"(?<![\w/.])(tests/[\w./-]+?{_EXT})(?:::(\w+))?(?![\w/])")
_PACKAGE_ONLY = re.compile(
    rf"(?<![\w/.])((?:scripts|benchmarks|examples|patches|accelerate_configs|docs)/[\w./-]+?{_EXT})(?:::(\w+))?(?![\w/])")


def cited_paths(text: str, in_package: bool) -> list[tuple[int, str, str | None]]:
    """``(line, path, name or None)`` of every repository path ``text`` cites (see the module docstring)."""
    found = []
    for i, line in enumerate(text.splitlines(), 1):
        for pattern in (_TESTS, _PACKAGE_ONLY) if in_package else (_TESTS,):
            found += [(i, m.group(1), m.group(2)) for m in pattern.finditer(line)]
    return found


def _sources() -> list[Path]:
    here = Path(__file__).resolve()  # its own examples cite files that do not exist, on purpose
    return sorted(p for d in ("hf_ddpfix", "tests", "scripts", "benchmarks") for p in (ROOT / d).rglob("*.py")
                  if p.resolve() != here)


def test_every_cited_file_and_test_exists():
    missing = []
    for path in _sources():
        in_package = path.relative_to(ROOT).parts[0] == "hf_ddpfix"
        for line, ref, name in cited_paths(path.read_text(), in_package):
            target = ROOT / ref
            where = f"{path.relative_to(ROOT)}:{line}"
            if not target.exists():
                missing.append(f"{where}: {ref} does not exist")
            elif name and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", target.read_text(), re.M):
                missing.append(f"{where}: {ref} defines no {name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("text, in_package, want", [
    ("Guarantees (tests/test_sequence_parallel_ops.py): x", True, ["tests/test_sequence_parallel_ops.py"]),
    ("see tests/test_a.py::test_b.", False, ["tests/test_a.py::test_b"]),
    ("(scripts/vlm_ddp.py)", True, ["scripts/vlm_ddp.py"]),
    ("(scripts/vlm_ddp.py)", False, []),
    ("tests/scripts/usage_*.py and hf_ddpfix/tests/x.py", True, []),
])
def test_the_citation_pattern_finds_what_it_should(text, in_package, want):
    got = [ref + (f"::{name}" if name else "") for _, ref, name in cited_paths(text, in_package)]
    assert got == want


MAX_MODULE_LINES = 450


def test_every_module_is_at_most_450_lines():
    """The developers' guide: one concept per module, at most 450 lines."""
    long = {}
    for path in sorted((ROOT / "hf_ddpfix").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long[name] = lines
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split by concept): {long}"
