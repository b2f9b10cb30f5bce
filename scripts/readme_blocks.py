"""The docs' generated blocks (docs/trainers.md, docs/models.md, docs/options.md, docs/plan.md): text between a BEGIN and an END marker line that a script renders from
committed test results (scripts/supported_models.py, scripts/trainers_table.py). The test of each table
compares :func:`readme_block` of the README with the script's rendering, and the script's ``--readme`` writes
it back with :func:`with_block`."""

from __future__ import annotations


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
