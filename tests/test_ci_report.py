"""CI's records and what is generated from them (tests/ci_record.py, scripts/ci_report.py), all in one process:

- docs/versions.md's table is the one scripts/ci_report.py renders from the kept results (tests/results/stacks/);
- pyproject.toml's lower bounds are constraints-oldest.txt's versions (the oldest stack tests what is declared),
  and every stack CI runs is inside pyproject.toml's bounds (the newest stack included: torch's upper bound is the
  newest release CI runs);
- a pytest run under ``DDPFIX_CI_DIR`` records each test once by outcome and the seconds of each file;
- merging refuses a stack whose runs saw different versions; pytest's exit 5 is a failure in CI's runner.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess

import pytest
from launch import ROOT

pytest_plugins = ["pytester"]


def _report():
    spec = importlib.util.spec_from_file_location("ci_report", ROOT / "scripts" / "ci_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_versions_page_is_generated_from_the_kept_results():
    report = _report()
    kept = report.load_kept()
    assert {"oldest", "pinned", "newest"} <= set(kept), f"kept results: {sorted(kept)} (tests/results/stacks/)"
    page = (ROOT / "docs" / "versions.md").read_text()
    assert report.page_with_table(page, report.render_table(kept)) == page, \
        "docs/versions.md differs from tests/results/stacks/: python scripts/ci_report.py versions"
    for stack, result in kept.items():  # the page states the date and the counts of each stack
        assert f"**{stack}**, {result['date']}: {result['counts']['passed']} passed" in page


def test_pyproject_lower_bounds_are_the_oldest_tested_versions():
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "constraints-oldest.txt").read_text(), flags=re.M))
    text = (ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.M | re.S).group(1)
    extras = [re.search(rf"^{extra} = \[(.*?)\]", text, flags=re.M).group(1) for extra in ("qlora", "deepspeed")]
    declared = re.findall(r'"([^"]+>=[^"]+)"', dependencies + " ".join(extras))
    base = {re.match(r"([A-Za-z0-9_.-]+)", r).group(1) for r in re.findall(r'"([^"]+)"', dependencies)}
    oldest_text = (ROOT / "constraints-oldest.txt").read_text()
    checked = 0
    for requirement in declared[len(re.findall(r'"([^"]+>=[^"]+)"', dependencies)):]:
        name = re.match(r"([A-Za-z0-9_.-]+)", requirement).group(1)
        if name in base:  # an extra's higher floor of a base dependency: constraints-oldest.txt states it
            assert requirement in oldest_text, f"extra floor {requirement}: not stated in constraints-oldest.txt"
    for requirement in declared:
        name, bound = re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement).groups()
        if name == "packaging" or (name in base and requirement not in dependencies):
            continue
        assert name in pins, f"{name} is declared ({requirement}) but the oldest stack does not pin it"
        assert tuple(map(int, pins[name].split("."))) == tuple(map(int, bound.split("."))) + (0,) * (
            len(pins[name].split(".")) - len(bound.split("."))), f"{requirement} vs constraints-oldest {pins[name]}"
        checked += 1
    assert checked >= 6  # torch, transformers, accelerate, peft, bitsandbytes, deepspeed


def test_a_run_records_each_test_once_by_outcome_and_seconds_per_file(pytester, tmp_path, monkeypatch):
    pytester.makeconftest(f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                          "import ci_record\n\ndef pytest_configure(config):\n    ci_record.register(config)\n")
    pytester.makepyfile(test_a="""
        import pytest, time
        def test_pass(): time.sleep(0.2)
        def test_fail(): assert 0
        @pytest.mark.skip(reason="x")
        def test_skip(): pass
        @pytest.mark.xfail
        def test_xfail(): assert 0
        @pytest.fixture
        def broken():
            yield
            raise RuntimeError("teardown")
        def test_teardown_error(broken): pass
    """, test_b="def test_b(): pass\n", test_c="""
        import subprocess, sys, time
        BURN = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.4: pass"
        SERVER = []  # a child that lives across tests, as the suite's fork server does

        def _burn(seconds):
            t = time.process_time()
            while time.process_time() - t < seconds:
                pass

        def test_own_cpu(): _burn(0.3)
        def test_sleep_is_not_cpu(): time.sleep(0.5)
        def test_an_ended_child(): subprocess.run([sys.executable, "-c", BURN], check=True)
        def test_a_live_child_starts():
            SERVER.append(subprocess.Popen([sys.executable, "-c", BURN + "\\nsys.stdin.read()"],
                                           stdin=subprocess.PIPE))
            time.sleep(3)  # it burns its 0.4 s (plus its start) and then waits, alive
    """, test_d="""
        def test_the_live_child_ends_in_another_file():
            import test_c
            test_c.SERVER[0].stdin.close()
            test_c.SERVER[0].wait()
    """)
    monkeypatch.setenv("DDPFIX_CI_DIR", str(tmp_path))
    monkeypatch.setenv("DDPFIX_CI_STACK", "oldest")
    monkeypatch.setenv("DDPFIX_CI_LABEL", "unit")
    pytester.runpytest_subprocess("-p", "no:cacheprovider")
    [record_file] = (tmp_path / "oldest").glob("unit-*.json")
    record = json.loads(record_file.read_text())
    assert record["counts"] == {"passed": 2 + 4 + 1, "failed": 2, "skipped": 1, "xfailed": 1, "xpassed": 0}, record
    assert record["exitstatus"] == 1 and record["versions"]["torch"]
    assert set(record["files"]) == {"test_a.py", "test_b.py", "test_c.py", "test_d.py"} and record["files"]["test_a.py"] >= 0.2
    # CPU-seconds per file, children included, each counted once: test_c burns 0.3 s itself and 0.4 s in each of two
    # children (one ended within its test, one still alive when the file ends: counted where it ran, not in test_d
    # where it is waited for); its 3.5 s asleep are not
    assert 1.1 <= record["cpu"]["test_c.py"] < 3.0, record["cpu"]
    assert record["cpu"]["test_b.py"] < 0.2 and record["cpu"]["test_d.py"] < 0.2, record["cpu"]
    assert record["files"]["test_c.py"] > 3.5, record
    merged = _report().merge([record, {**record, "label": "cells"}])
    assert merged["counts"]["passed"] == 2 * (2 + 4 + 1) and merged["files"]["test_a.py"] == round(2 * record["files"]["test_a.py"], 2)
    assert merged["cpu"]["test_c.py"] == round(2 * record["cpu"]["test_c.py"], 2)
    assert "CPU-s" in _report().seconds_table({"oldest": merged}) and "test_c.py" in _report().seconds_table(
        {"oldest": merged})
    with pytest.raises(ValueError, match="different versions"):
        _report().merge([record, {**record, "versions": {**record["versions"], "torch": "0.0"}}])


def test_ci_runner_treats_no_test_run_as_a_failure(tmp_path):
    script = f"source {ROOT / 'scripts' / 'ci_lib.sh'}; run_tests empty bash -c 'exit 5'; echo rc=$?"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert "rc=5" in done.stdout and "ran NO test (pytest exit 5)" in done.stdout, done.stdout


def test_launch_table_counts_each_files_launches_and_their_seconds(tmp_path, monkeypatch):
    """tests/launch.py writes one line per launch under ``DDPFIX_LAUNCH_LOG``; the report groups them per stack and
    file, most launch seconds first, and says the total and how many were forked; a cut last line is skipped; no log,
    no table."""
    import launch

    report = _report()
    log = tmp_path / report.LAUNCH_LOG
    assert report.launch_table(log) == ""
    monkeypatch.setenv("DDPFIX_LAUNCH_LOG", str(log))
    for stack, test, seconds in (("pinned", "suite/alpha.py::t1", 3.0), ("pinned", "suite/alpha.py::t2", 4.0),
                                 ("newest", "suite/alpha.py::t1", 1.5), ("pinned", "suite/beta.py::t", 9.0)):
        monkeypatch.setenv("DDPFIX_CI_STACK", stack)
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{test} (call)")
        first = "forklaunch" if test.endswith("t2") else "python"
        launch._record_launch([first, "-m", "torch.distributed.run", "x.py"], seconds)
    with open(log, "a") as f:
        f.write('{"stack": "pinned", "te')  # a run killed mid-line
    rows = report.launch_table(log).splitlines()
    assert [r.split() for r in rows[2:5]] == [["1", "9.0", "pinned", "suite/beta.py"],
                                               ["2", "7.0", "pinned", "suite/alpha.py"],
                                               ["1", "1.5", "newest", "suite/alpha.py"]], rows
    assert rows[-1] == ("(4 launches in all, 18 s of their wall time; 1 forked from a pre-imported server, 3 started "
                        "fresh interpreters)"), rows


def test_the_installed_stack_is_inside_the_declared_bounds():
    """Declared = tested: each requirement pyproject.toml declares (the dependencies, and the deepspeed / qlora
    extras where installed) holds for the versions installed on this stack. Every CI stack runs it, so the newest
    stack fails when a release moves past a declared upper bound (torch: `<2.16`), until the bound is raised
    with that stack green. Shown failing (2026-12-02) on the newest stack (torch 2.15.0) with `torch>=2.13,<2.15`."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.M | re.S).group(1)
    extras = [re.search(rf"^{extra} = \[(.*?)\]", text, flags=re.M).group(1) for extra in ("qlora", "deepspeed")]
    outside = []
    # an extra's own package (deepspeed, bitsandbytes); its higher floor of a base dependency (the deepspeed extra's
    # accelerate>=1.15, transformers>=5.2) is not the oldest stack's: it runs ZeRO's unit tests only (constraints-oldest.txt)
    own = [r for extra in extras for r in re.findall(r'"([^"]+)"', extra) if Requirement(r).name in ("deepspeed",
                                                                                                     "bitsandbytes")]
    for line in re.findall(r'"([^"]+)"', dependencies) + own:
        req = Requirement(line)
        try:
            have = version(req.name)
        except PackageNotFoundError:  # an extra not installed on this stack (its tests skip)
            assert req.name in ("bitsandbytes", "deepspeed"), f"{req.name} is required but not installed"
            continue
        if not req.specifier.contains(have, prereleases=True):
            outside.append(f"{req.name} {have} (declared {req.specifier})")
    assert not outside, (f"this stack runs versions pyproject.toml does not declare: {outside}; once this stack is "
                         "green, move the bound in pyproject.toml, README and docs/versions.md")
