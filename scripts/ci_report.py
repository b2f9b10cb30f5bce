"""CI's records, read: the per-file seconds table, one results file per stack, and docs/versions.md's table.

Every pytest run under CI writes a record (tests/ci_record.py: seconds per file, counts, versions) into
``$DDPFIX_CI_DIR/<stack>/``. This script reads them. CI commits nothing: ``.ci/run`` calls ``summary``, which
prints the table of the slowest files and writes the merged ``<dir>/stacks/<stack>.json``; after a green run a
person keeps those (``keep``), which copies them to tests/results/stacks/ and regenerates docs/versions.md's
table from them (``tests/test_ci_report.py`` checks the page matches the kept files).

    python scripts/ci_report.py summary build/ci [--top 25]   # the table; writes build/ci/stacks/<stack>.json
    python scripts/ci_report.py keep build/ci                 # copy the stacks' results + regenerate the page
    python scripts/ci_report.py versions [--check]            # regenerate (or check) docs/versions.md's table

Guarantees (tests/test_ci_report.py):
- ``merge`` sums counts, per-file seconds and per-file CPU-seconds over a stack's runs, keeps each run's selection, counts and exit
  status, and refuses records of one stack that ran on different versions (a stack is one set of versions);
- ``render_table`` is a pure function of the kept results: the page's table, its date and its counts come from
  them and nowhere else.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEPT = ROOT / "tests" / "results" / "stacks"
PAGE = ROOT / "docs" / "versions.md"
#: the launch log `.ci/run` has tests/launch.py write (DDPFIX_LAUNCH_LOG) under the CI folder
LAUNCH_LOG = "launches.jsonl"
BEGIN, END = "<!-- versions-table:begin (scripts/ci_report.py versions) -->", "<!-- versions-table:end -->"
STACKS = ("oldest", "pinned", "newest")  # the page's column order
HEADINGS = {"oldest": "oldest (`constraints-oldest.txt`)", "pinned": "pinned (`constraints.txt`)",
            "newest": "newest releases (`scripts/test_newest.sh`)"}
ROWS = ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "deepspeed", "bitsandbytes", "python")
COUNTS = ("passed", "failed", "skipped", "xfailed", "xpassed")


def merge(records: list[dict]) -> dict:
    """One stack's results from the records of its pytest runs (each a dict written by tests/ci_record.py)."""
    if not records:
        raise ValueError("no records to merge")
    stacks = {r["stack"] for r in records}
    if len(stacks) != 1:
        raise ValueError(f"records of several stacks: {sorted(stacks)}")
    versions = records[0]["versions"]
    for r in records[1:]:
        if r["versions"] != versions:
            raise ValueError(f"stack {r['stack']!r} ran on different versions: {versions} vs {r['versions']}")
    counts = {k: sum(r["counts"].get(k, 0) for r in records) for k in COUNTS}
    files: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for r in records:
        for name, seconds in r["files"].items():
            files[name] = round(files.get(name, 0.0) + seconds, 2)
        for name, seconds in r.get("cpu", {}).items():  # records before 2026-12-03 have none
            cpu[name] = round(cpu.get(name, 0.0) + seconds, 2)
    return {"stack": records[0]["stack"], "date": max(r["date"] for r in records), "versions": versions,
            "counts": counts, "exitstatus": max(r["exitstatus"] for r in records),
            "runs": [{"label": r["label"], "args": r["args"], "counts": r["counts"], "exitstatus": r["exitstatus"],
                      "wall_s": r["wall_s"]} for r in sorted(records, key=lambda r: r["label"])],
            "files": dict(sorted(files.items())), "cpu": dict(sorted(cpu.items()))}


def read_records(ci_dir: Path) -> dict[str, dict]:
    """The merged results of every stack that left records under ``ci_dir``."""
    out = {}
    for folder in sorted(p for p in ci_dir.iterdir() if p.is_dir() and p.name != "stacks"):
        records = [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))]
        if records:
            out[folder.name] = merge(records)
    return out


def seconds_table(results: dict[str, dict], top: int = 25) -> str:
    """Seconds per test file, slowest first (seconds, CPU-seconds with children, share of that stack's test
    seconds, stack, file). CPU-seconds are what the file costs the machine: its seconds grow when other work shares
    the cores, its CPU-seconds do not ("-": a record without them)."""
    rows = [(seconds, stack, name) for stack, r in results.items() for name, seconds in r["files"].items()]
    totals = {stack: sum(r["files"].values()) for stack, r in results.items()}
    lines = [f"{'seconds':>8}  {'CPU-s':>8}  {'share':>5}  {'stack':<7} file",
             f"{'-' * 8}  {'-' * 8}  {'-' * 5}  {'-' * 7} {'-' * 40}"]
    for seconds, stack, name in sorted(rows, reverse=True)[:top]:
        share = seconds / totals[stack] if totals[stack] else 0.0
        cpu = results[stack].get("cpu", {}).get(name)
        lines.append(f"{seconds:8.1f}  {'-' if cpu is None else f'{cpu:.1f}':>8}  {share:5.1%}  {stack:<7} {name}")
    lines.append(f"({len(rows) - min(top, len(rows))} faster files not shown)")
    for stack, r in results.items():
        c = r["counts"]
        walls = ", ".join(f"{run['label']} {run['wall_s']:.0f}s" for run in r["runs"])
        cpu = sum(r.get("cpu", {}).values())
        lines.append(f"{stack}: {totals[stack]:.0f} s of tests, {cpu:.0f} CPU-s ({walls}); {c['passed']} passed, "
                     f"{c['failed']} failed, {c['skipped']} skipped; pytest exit {r['exitstatus']}")
    return "\n".join(lines)


def launch_table(log: Path, top: int = 15) -> str:
    """Launches per test file, most launch seconds first (stack, file, launches, their wall seconds), from the
    ``DDPFIX_LAUNCH_LOG`` lines tests/launch.py writes (one per launch it runs), and how many were forked;
    ``""`` when there is no log."""
    if not log.exists():
        return ""
    per: dict[tuple[str, str], list[float]] = {}
    forked = 0  # ranks forked from a pre-imported server (tests/forklaunch.py), not fresh interpreters
    for raw in log.read_text().splitlines():
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:  # a line cut by a killed run
            continue
        per.setdefault((rec.get("stack", "pinned"), rec["test"].split("::", 1)[0]), []).append(float(rec["s"]))
        forked += str(rec.get("launcher", "")).startswith("forklaunch")
    rows = sorted(((sum(v), len(v), stack, name) for (stack, name), v in per.items()), reverse=True)
    lines = [f"{'launches':>8}  {'seconds':>8}  {'stack':<7} file", f"{'-' * 8}  {'-' * 8}  {'-' * 7} {'-' * 40}"]
    lines += [f"{n:8d}  {s:8.1f}  {stack:<7} {name}" for s, n, stack, name in rows[:top]]
    total = sum(n for _, n, _, _ in rows)
    lines.append(f"({total} launches in all, {sum(s for s, _, _, _ in rows):.0f} s of their wall time; {forked} forked "
                 f"from a pre-imported server, {total - forked} started fresh interpreters)")
    return "\n".join(lines)


def render_table(results: dict[str, dict]) -> str:
    """docs/versions.md's generated block: the versions each stack tested, its date and its counts."""
    stacks = [s for s in STACKS if s in results] + sorted(set(results) - set(STACKS))
    head = "| package | " + " | ".join(HEADINGS.get(s, s) for s in stacks) + " |"
    lines = [BEGIN, head, "|" + "---|" * (len(stacks) + 1)]
    for row in ROWS:
        cells = [results[s]["versions"].get(row) or "—" for s in stacks]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines.append("| **tested** | " + " | ".join(results[s]["date"] for s in stacks) + " |")
    for s in stacks:
        c, runs = results[s]["counts"], results[s]["runs"]
        what = "; ".join(f"{r['label']} ({r['counts'].get('passed', 0)} passed, {r['counts'].get('failed', 0)} failed)"
                         for r in runs)
        lines.append("")
        lines.append(f"- **{s}**, {results[s]['date']}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} "
                     f"skipped; runs: {what}.")
    lines.append(END)
    return "\n".join(lines)


def load_kept(folder: Path = KEPT) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def page_with_table(page: str, table: str) -> str:
    if BEGIN not in page or END not in page:
        raise ValueError(f"docs/versions.md lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = page.split(BEGIN, 1)
    return head + table + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary")
    s.add_argument("ci_dir", type=Path)
    s.add_argument("--top", type=int, default=25)
    k = sub.add_parser("keep")
    k.add_argument("ci_dir", type=Path)
    v = sub.add_parser("versions")
    v.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "summary":
        results = read_records(a.ci_dir)
        (a.ci_dir / "stacks").mkdir(parents=True, exist_ok=True)
        for stack, r in results.items():
            (a.ci_dir / "stacks" / f"{stack}.json").write_text(json.dumps(r, indent=1) + "\n")
        print(seconds_table(results, a.top))
        launches = launch_table(a.ci_dir / LAUNCH_LOG)
        if launches:
            print("\n==== launches per test file (tests/launch.py; each starts interpreters importing torch) ====")
            print(launches)
        return 0
    if a.cmd == "keep":
        KEPT.mkdir(parents=True, exist_ok=True)
        for f in sorted((a.ci_dir / "stacks").glob("*.json")):
            shutil.copy(f, KEPT / f.name)
            print(f"kept {f} -> {KEPT / f.name}")
    page = PAGE.read_text()
    new = page_with_table(page, render_table(load_kept()))
    if a.cmd == "versions" and a.check:
        if new != page:
            print("docs/versions.md's table differs from tests/results/stacks/: python scripts/ci_report.py versions")
            return 1
        return 0
    PAGE.write_text(new)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
