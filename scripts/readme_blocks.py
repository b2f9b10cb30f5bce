"""The docs' generated blocks (docs/trainers.md, docs/models.md, docs/options.md, docs/plan.md): text between a BEGIN and an END marker line that a script renders from
committed test results (scripts/supported_models.py, scripts/trainers_table.py). The test of each table
compares :func:`readme_block` of the README with the script's rendering, and the script's ``--readme`` writes
it back with :func:`with_block`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def readme_block(text: str, begin: str, end: str) -> str:
    """What stands between the ``begin`` and ``end`` markers of ``text``, without the markers (ValueError
    when either is missing)."""
    if begin not in text or end not in text:
        raise ValueError(f"README has no generated block: expected the lines {begin!r} and {end!r}")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def with_block(text: str, block: str, begin: str, end: str) -> str:
    """``text`` with the generated block replaced by ``block`` (ValueError when the markers are missing)."""
    readme_block(text, begin, end)
    head, rest = text.split(begin, 1)
    return head + begin + "\n" + block + end + rest.split(end, 1)[1]


# ------------------------------------------------------------------------------------------ results files
# The results a table is rendered from are written by the test run that measures them (tests/test_trainer_zoo.py,
# tests/test_usage.py, tests/test_step_overhead.py): on the pinned stack (constraints.txt) a run rewrites the file
# when what it measured differs from what the file holds in what a rerun must reproduce (the table's classes:
# a weight difference from a run that sums in another order, another engine or AdamW's normalised step, moves in
# its last bits with the CPU the run lands on, so its class is compared, not its value), so an unchanged run
# leaves the file, and git, untouched; the test compares the documentation block with what the file then holds.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pinned_versions(constraints: str = "constraints.txt") -> dict[str, str]:
    """``package -> version`` pinned by ``constraints`` (a path relative to the repository root)."""
    pins: dict[str, str] = {}
    with open(os.path.join(ROOT, constraints)) as f:
        for line in f:
            name, sep, version = line.split("#", 1)[0].strip().partition("==")
            if sep:
                pins[name.strip().lower()] = version.strip()
    return pins


def on_pinned_stack(versions: dict[str, str], constraints: str = "constraints.txt") -> bool:
    """True when every package in ``versions`` (e.g. ``{"torch": "2.13.0+cpu", "transformers": "5.23.0"}``) is
    at the version ``constraints`` pins (a local ``+cpu`` tag ignored; packages it does not pin are ignored)."""
    pins = pinned_versions(constraints)
    return all(str(v).split("+")[0] == pins[k.lower()] for k, v in versions.items() if k.lower() in pins)


def _without(results: dict, volatile: tuple[tuple[str, ...], ...]) -> dict:
    import copy

    out = copy.deepcopy(results)
    for path in volatile:
        node = out
        for key in path[:-1]:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return out


def refresh_results(path: str, fresh: dict, versions: dict[str, str],
                    volatile: tuple[tuple[str, ...], ...] = (("date",),),
                    sort_keys: bool = False,
                    reproduces: Callable[[dict], Any] | None = None) -> tuple[dict, dict | None, bool]:
    """Record a test run's ``fresh`` results in the results file ``path``.

    Returns ``(results, stored, written)``: ``stored`` is what the file held before (None without a file);
    ``results`` is what the documentation must now show: ``stored`` when ``fresh`` agrees with it in what a rerun
    must reproduce (the date and numbers stay those of the run that first measured them), else ``fresh``. What
    must be reproduced is ``reproduces(results)`` when given (the table's classes: a weight difference as "within
    its tolerance", not its last bits), else the results without the ``volatile`` keys (each a path of keys). On
    the pinned stack (:func:`on_pinned_stack` of ``versions``) a differing ``fresh`` is written to ``path``
    (``written``); on another stack nothing is written (the file documents the pinned stack) and ``results`` is
    ``fresh``.
    """
    import json

    def kept(results: dict) -> Any:
        return reproduces(results) if reproduces is not None else _without(results, volatile)

    stored = None
    if os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
    if stored is not None and kept(stored) == kept(fresh):
        return stored, stored, False
    if not on_pinned_stack(versions):
        return fresh, stored, False
    with open(path, "w") as f:
        f.write(json.dumps(fresh, indent=1, sort_keys=sort_keys) + "\n")
    return fresh, stored, True


def file_block(path: str, begin: str, end: str) -> str:
    """:func:`readme_block` of the file at ``path`` (README.md or a page under docs/)."""
    with open(path) as f:
        return readme_block(f.read(), begin, end)


def write_block(path: str, block: str, begin: str, end: str) -> None:
    """Replace the generated block of the file at ``path`` by ``block`` (ValueError before writing when the
    markers are missing)."""
    with open(path) as f:
        new = with_block(f.read(), block, begin, end)
    with open(path, "w") as f:
        f.write(new)
