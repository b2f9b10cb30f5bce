"""What a pytest run records for CI: seconds per test file, pass counts and the versions it ran on.

Active only when ``DDPFIX_CI_DIR`` is set (not ``HF_DDPFIX_*``: ``hf-ddpfix doctor`` reports every unknown
``HF_DDPFIX_*`` variable as a likely typo and the suite checks it does) (``.ci/run`` and the stack scripts set it); a developer's plain
``pytest`` writes nothing. Each pytest invocation writes one JSON file
``$DDPFIX_CI_DIR/<stack>/<label>-<pid>.json`` (``DDPFIX_CI_STACK``, default ``pinned``; ``DDPFIX_CI_LABEL``,
default ``pytest``), which ``scripts/ci_report.py`` merges into one results file per stack and the table of the
slowest files printed at the end of every CI run.

Guarantees (tests/test_ci_report.py):
- ``files`` maps every test file that ran to the seconds its tests took (setup + call + teardown, summed over
  its tests; under pytest-xdist the workers' reports are summed by the controller, so a file's seconds are
  its work, not the wall time of the run);
- ``cpu`` maps every test file to the CPU-seconds its tests used, children included (:func:`tree_cpu_seconds`
  before its setup and after its teardown, in the process that ran it): unlike seconds, a file's CPU-seconds do
  not grow when other work shares the cores, so two runs on one machine compare by them;
- ``counts`` counts each test once by its outcome: passed, failed (a failed setup, call or teardown), skipped,
  xfailed, xpassed; ``exitstatus`` is pytest's own exit code;
- ``versions`` are the installed distributions' versions, torch's as the running torch reports it when the tests
  imported it (``torch.__version__``, build tag included);
- nothing is written by an xdist worker (the controller writes the one file).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from importlib import metadata
from pathlib import Path

import pytest

PACKAGES = ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "deepspeed", "bitsandbytes")


def installed_versions() -> dict[str, str | None]:
    """The versions of the packages a stack is defined by (None: not installed); torch as it reports itself."""
    import platform

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    torch = sys.modules.get("torch")  # imported by the tests that ran; never imported here just to ask
    if torch is not None:
        out["torch"] = str(torch.__version__)  # the build tag (+cpu, +cu130) is in the running torch's version only
    return out


def _live_children_cpu(tick: float) -> float:
    """CPU-seconds of this process's live children, each with its waited-for descendants (``/proc``; 0 elsewhere)."""
    total = 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            kids = Path(f"/proc/self/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for pid in kids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # ended between the two reads: counted by RUSAGE_CHILDREN once waited
            total += sum(int(f) for f in fields[11:15]) / tick  # utime, stime, cutime, cstime
    return total


def tree_cpu_seconds() -> float:
    """CPU-seconds used so far by this process, its ended children (waited for) and its live ones with their
    ended descendants: the suite's fork server (tests/launch.py) lives across tests, and each launch it forks is
    counted in it once the launch has ended."""
    import resource

    own, ended = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime
            + _live_children_cpu(float(os.sysconf("SC_CLK_TCK"))))


_CPU_AT_START = pytest.StashKey[float]()
CPU_PROPERTY = "ddpfix_cpu_s"  # the teardown report's user property carrying a test's CPU-seconds (xdist sends it)


class CIRecord:
    """The pytest plugin: collects outcomes and per-file seconds, writes them at the end of the session."""

    def __init__(self, out_dir: Path, stack: str, label: str) -> None:
        self.out_dir, self.stack, self.label = out_dir, stack, label
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.outcome: dict[str, str] = {}
        self.start = time.time()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item) -> None:  # before the fixtures are set up
        item.stash[_CPU_AT_START] = tree_cpu_seconds()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when == "teardown" and _CPU_AT_START in item.stash:  # after the fixtures' teardown
            outcome.get_result().user_properties.append(
                (CPU_PROPERTY, round(tree_cpu_seconds() - item.stash[_CPU_AT_START], 3)))

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration
        for key, value in report.user_properties:
            if key == CPU_PROPERTY:
                self.cpu[report.nodeid.split("::", 1)[0]] += value
        if (report.when == "setup" and report.passed) or (report.when == "teardown" and not report.failed):
            return
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome  # passed, failed or skipped
        if self.outcome.get(report.nodeid) != "failed":
            self.outcome[report.nodeid] = outcome

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes the record
            return
        counts = {k: 0 for k in ("passed", "failed", "skipped", "xfailed", "xpassed")}
        for outcome in self.outcome.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        record = {
            "stack": self.stack, "label": self.label, "args": list(session.config.invocation_params.args),
            "date": time.strftime("%Y-%m-%d", time.gmtime(self.start)), "wall_s": round(time.time() - self.start, 1),
            "exitstatus": int(exitstatus), "counts": counts, "versions": installed_versions(),
            "files": {k: round(v, 2) for k, v in sorted(self.seconds.items())},
            "cpu": {k: round(v, 2) for k, v in sorted(self.cpu.items())},
        }
        target = self.out_dir / self.stack
        target.mkdir(parents=True, exist_ok=True)
        (target / f"{self.label}-{os.getpid()}.json").write_text(json.dumps(record, indent=1) + "\n")


def register(config) -> None:
    """Register the plugin when ``DDPFIX_CI_DIR`` is set (called from tests/conftest.py)."""
    out = os.environ.get("DDPFIX_CI_DIR")
    if out:
        plugin = CIRecord(Path(out), os.environ.get("DDPFIX_CI_STACK", "pinned"),
                          os.environ.get("DDPFIX_CI_LABEL", "pytest"))
        config.pluginmanager.register(plugin, "hf_ddpfix_ci_record")
