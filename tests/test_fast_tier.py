"""The fast tier's lists in tests/conftest.py name tests that exist: a renamed slow test would otherwise move into
the fast tier unnoticed, and a renamed two-process cell would leave the tier with none."""

from __future__ import annotations

import re
from pathlib import Path

import conftest

ROOT = Path(__file__).resolve().parents[1]


def _defines(path: str, function: str) -> bool:
    return re.search(rf"^def {re.escape(function)}\(", (ROOT / path).read_text(), flags=re.M) is not None


def test_every_slow_entry_names_an_existing_file_or_test() -> None:
    for entry in conftest.SLOW:
        path, _, function = entry.partition("::")
        assert (ROOT / path).is_file(), entry
        if function:
            assert _defines(path, function), f"{entry}: no such test (renamed? update tests/conftest.py)"


def test_the_fast_tier_keeps_exactly_one_two_process_cell_and_it_exists() -> None:
    import test_matrix

    [cell] = conftest.FAST_MULTIPROCESS
    path, _, rest = cell.partition("::")
    function, _, param = rest.partition("[")
    assert _defines(path, function), cell
    ids = {"-".join(c).replace("--", "") for c in test_matrix.matrix_cells()}
    assert param.rstrip("]") in ids, f"{cell}: no such matrix cell"
