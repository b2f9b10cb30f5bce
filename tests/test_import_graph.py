"""The package's import graph has no cycle and no arrow back up, and its top holds only the entry points (issue 49): every ``import`` and ``from ... import`` of an hf_ddpfix
module, at module level or inside a function (a deferred import still ties two modules), resolved to the file it
loads (a submodule where the name is one, else the module or package that defines it).

Shown failing once (2026-12-02): with ``from .cli import _parser`` back in ``rehearse/memory.py`` (the circle the
one-layout-model change had made: cli -> rehearse/run -> report -> memory -> cli) the test names those four modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "hf_ddpfix"
# not modules of the package: sitecustomize files run at interpreter start by the rehearsal and its FSDP device
NOT_MODULES = ("device", "shim")


def _name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the package's files."""
    files = {_name(p): p for p in PKG.rglob("*.py") if not set(NOT_MODULES) & set(p.relative_to(PKG).parts)}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hf_ddpfix")):
                base = ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else [])) \
                    if node.level else str(node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("hf_ddpfix")]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert sum(map(len, graph.values())) > 300  # the graph was read (429 arrows on 2026-12-02)
    assert cycles(graph) == []


def test_a_cycle_is_found_where_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The layout rule of docs/design.md ("Layout"), bottom up: a module imports only from its own folder and the folders
# below it. The entry points sit at the package top.
LAYERS = (
    ("_compat",),
    ("ops",),
    ("integrations",),
    ("config",),
    ("plan",),
    ("facts",),
    ("runtime",),
    ("callbacks",),
    ("trainer", "accelerate_loop"),
    ("rehearse",),
    ("cli",),
    ("__main__",),
    ("",),  # the package's own __init__: the lazy public names
)
ENTRY_POINTS = {"__init__", "__main__", "trainer", "accelerate_loop", "callbacks", "cli"}


def layer(module: str) -> int:
    """The rank of ``module``'s top folder (or top-level module) in :data:`LAYERS`."""
    top = module.split(".")[1] if "." in module else ""
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module}: its folder {top!r} has no place in LAYERS (docs/design.md, Layout)")


def arrows_back_up(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import from a module to one in a higher layer."""
    return sorted((m, d) for m, deps in graph.items() for d in deps if layer(d) > layer(m))


def test_no_arrow_points_back_up():
    """Shown failing once (2026-12-02): ``from ..facts.offline import model_info`` added inside a function of
    ``plan/fsdp.py`` -> ``[('hf_ddpfix.plan.fsdp', 'hf_ddpfix.facts.offline')]``."""
    assert arrows_back_up(import_graph()) == []


def test_an_arrow_back_up_is_found():
    graph = {"hf_ddpfix.ops.a": {"hf_ddpfix.plan.b"}, "hf_ddpfix.plan.b": {"hf_ddpfix.ops.a"}}
    assert arrows_back_up(graph) == [("hf_ddpfix.ops.a", "hf_ddpfix.plan.b")]


def test_the_package_top_holds_only_the_entry_points():
    """The rest sits in folders named for what they are (docs/design.md, Layout)."""
    assert {p.stem for p in PKG.glob("*.py")} == ENTRY_POINTS
