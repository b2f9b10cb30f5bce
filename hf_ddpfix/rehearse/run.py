"""The ``hf-ddpfix rehearse`` command: launch the user's line on CPU processes, watch it, collect, report.

    hf-ddpfix rehearse [--nproc N] [--steps 3] [--skew] [--stock] [--hang-timeout 20] [--timeout 900]
                       [--no-shrink] [--no-resume] [--workdir DIR] [--json FILE] -- <launch line>

Exit status (``report.EXIT_CODES``, docs/rehearse.md): 0 the rehearsal passed; 1 it found a failure (a crash, a
collective mismatch, a hang, a timeout, replicas out of sync, a step that did not run, ranks that each trained
alone); 2 the launch cannot be rehearsed: a step of the rehearsal itself cannot run here, or the script needs what a
CPU lacks (CUDA, NCCL), named.

Writes outside the rehearsal folder are redirected into it (``sandbox.py``); the folder is removed after the report
unless ``--keep`` (or ``--workdir``).

Guarantees: the user's script runs unchanged (only environment and ``sitecustomize`` hooks); a launch that ends
without a single finished training step on every rank is never reported as passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import device_dir, shim_dir
from .launch_line import LaunchLineError, LaunchSpec, parse_launch_line, rewrite

__all__ = ["Outcome", "add_arguments", "main", "rehearse"]


@dataclass
class Outcome:
    """One launch of the line (one phase): how it ended and what every rank recorded."""

    label: str
    status: str  # "passed", "failed", "hang", "timeout", "cannot"
    seconds: float
    returncodes: list[int | None]
    records: dict[int, dict[str, Any]]
    hangs: dict[int, dict[str, Any]]
    stacks: dict[int, str]
    logs: list[str]
    commands: list[list[str]]
    folder: str
    notes: list[str] = field(default_factory=list)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=None,
                   help="CPU processes to run (default: the launch line's count, else 2). Fewer than the real run: "
                        "same collectives per rank, different shard sizes and per-rank batch counts")
    p.add_argument("--real-world-size", type=int, default=None,
                   help="world size of the real run for the memory projection (default: the launch line's)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps to run (max_steps cap; default 3)")
    p.add_argument("--skew", action="store_true",
                   help="the last rank's batches are text-only and shorter (what a real data mix hits later)")
    p.add_argument("--stock", action="store_true",
                   help="rehearse without hf_ddpfix (patch_trainer() a no-op, HF_DDPFIX_DISABLE=1)")
    p.add_argument("--hang-timeout", type=float, default=20.0,
                   help="seconds a rank may wait in one collective before it is called hung (default 20)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole launch (default 900)")
    p.add_argument("--no-shrink", action="store_true", help="load checkpoints at full size (slow; needs weights)")
    p.add_argument("--no-resume", action="store_true", help="skip the resume-from-checkpoint phase")
    p.add_argument("--workdir", default=None, help="folder for records, logs and checkpoints, kept (default: a new "
                   "temporary folder, removed after the report unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the temporary rehearsal folder (its size is printed)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    p.add_argument("--quiet", action="store_true", help="leave the launcher's output tail out of a failure's report "
                   "(rank 0's last lines stay)")
    p.add_argument("launch", nargs=argparse.REMAINDER, help="-- then the launch line, e.g. -- accelerate launch "
                   "--config_file fsdp.yaml train.py --my-args")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(args: argparse.Namespace, folder: str, resume: str | None, phase: str, single: bool) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(shim_dir()), str(device_dir())]
    root = str(Path(__file__).resolve().parents[2])  # the package's own root, for a source checkout
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else []), root])
    work = os.path.dirname(os.path.abspath(folder))  # the rehearsal's workdir: every phase's folder
    os.makedirs(os.path.join(work, "tmp"), exist_ok=True)
    env["TMPDIR"] = os.path.join(work, "tmp")  # temporary files inside the rehearsal (sandbox.py)
    env.update({"DDPFIX_REHEARSE_DIR": folder, "DDPFIX_REHEARSE_ROOT": work, "DDPFIX_REHEARSE_STEPS": str(args.steps),
                "DDPFIX_REHEARSE_SKEW": "1" if args.skew else "0", "DDPFIX_REHEARSE_STOCK": "1" if args.stock else "0",
                "DDPFIX_REHEARSE_SHRINK": "0" if args.no_shrink else "1",
                "DDPFIX_REHEARSE_HANG_S": str(args.hang_timeout), "DDPFIX_REHEARSE_RESUME": resume or "",
                "DDPFIX_REHEARSE_PHASE": phase, "DDPFIX_REHEARSE_SINGLE": "1" if single else "0",
                # the real launch's world size and accelerate config: the ranks plan the real model (memory.carry_over)
                "DDPFIX_REHEARSE_REAL_WORLD": str(getattr(args, "real_world", "") or ""),
                "DDPFIX_REHEARSE_ACCELERATE_CONFIG": getattr(args, "accelerate_config_file", None) or "",
                "TORCH_DISTRIBUTED_DEBUG": "DETAIL",  # torch's own fingerprint of every collective (REFERENCES §14)
                "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                "PYTHONFAULTHANDLER": "1"})
    env.setdefault("OMP_NUM_THREADS", "1")
    if args.stock:
        env["HF_DDPFIX_DISABLE"] = "1"
    return env


def _records(folder: str) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]], dict[int, str]]:
    records, hangs, stacks = {}, {}, {}
    for path in Path(folder).glob("rank*.json"):
        name = path.name
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rank = int(name[4:].split(".")[0])
        (hangs if name.endswith(".hang.json") else records)[rank] = data
    for path in Path(folder).glob("rank*.stacks.txt"):
        text = path.read_text(errors="replace").strip()
        if text:
            stacks[int(path.name[4:].split(".")[0])] = text
    return records, hangs, stacks


def _signal_ranks(records: dict[int, dict[str, Any]], sig: int, skip: set[int] = frozenset()) -> None:
    for rank, rec in records.items():
        if rank in skip or not rec.get("pid"):
            continue
        try:
            os.kill(int(rec["pid"]), sig)
        except (ProcessLookupError, PermissionError):
            pass


def _launch(spec: LaunchSpec, args: argparse.Namespace, processes: int, folder: str, label: str,
            resume: str | None = None) -> Outcome:
    os.makedirs(folder, exist_ok=True)
    single = processes == 1 and spec.launcher == "python"
    env = _env(args, folder, resume, "resume" if resume else "train", single)
    port = _free_port()
    commands = []
    if single:
        commands.append([sys.executable, *(["-m"] if spec.module else []), spec.program, *spec.args])
    else:
        launcher = Path(sys.executable).with_name("accelerate")
        for node in range(spec.nodes):
            commands.append(rewrite(spec, processes=processes, nodes=spec.nodes, node_rank=node, port=port,
                                    python=sys.executable, accelerate=str(launcher) if launcher.exists() else "accelerate"))
    logs = [os.path.join(folder, f"node{n}.log") for n in range(len(commands))]
    procs = []
    start = time.monotonic()
    for cmd, log in zip(commands, logs, strict=True):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    status = None
    while status is None:
        time.sleep(0.5)
        if all(p.poll() is not None for p in procs):
            break
        records, hangs, _ = _records(folder)
        if hangs:
            time.sleep(min(3.0, args.hang_timeout))  # the other ranks' own watchdogs may fire too
            records, hangs, _ = _records(folder)
            # a rank that raised before anyone was signalled (a rank-0-only bug): the others waiting for it in a
            # collective is the consequence, the verdict is its failure (issue 46: "a crash is a failure")
            crashed = any((rec.get("error") or {}).get("message") for r, rec in records.items() if r not in hangs)
            _signal_ranks(records, getattr(signal, "SIGUSR1", signal.SIGTERM), skip=set(hangs))
            time.sleep(1.0)
            status = "failed" if crashed else "hang"
        elif time.monotonic() - start > args.timeout:
            _signal_ranks(records, getattr(signal, "SIGUSR1", signal.SIGTERM))
            time.sleep(1.0)
            status = "timeout"
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()
    seconds = time.monotonic() - start
    records, hangs, stacks = _records(folder)
    texts = [Path(log).read_text(errors="replace") for log in logs]
    codes = [p.returncode for p in procs]
    if status is None:
        status = "passed" if all(c == 0 for c in codes) else "failed"
        if status == "passed":
            expected = processes
            done = [r for r in records.values() if r.get("train_done") is not None]
            if len(done) < expected:
                status = "failed"
    return Outcome(label, status, seconds, codes, records, hangs, stacks, texts, commands, folder)


def rehearse(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """Run the rehearsal ``args`` describe; returns (exit status, report as a dict). Prints the report."""
    from .report import EXIT_CODES, _size, build_report, format_report

    launch = list(args.launch)
    if launch and launch[0] == "--":
        launch = launch[1:]
    try:
        spec = parse_launch_line(launch)
    except LaunchLineError as e:
        print(f"hf-ddpfix rehearse: cannot rehearse this launch line: {e}", file=sys.stderr)
        return 2, {"status": "cannot", "error": str(e)}
    processes = args.nproc or spec.processes or 2
    if spec.launcher == "python" and args.nproc and args.nproc > 1:
        spec = LaunchSpec("torchrun", [], spec.program, spec.module, spec.args, 1, 1, "ddp",
                          f"python line run as {args.nproc} processes (--nproc)")
    if processes < spec.nodes:
        processes = spec.nodes
    if processes % spec.nodes:
        processes += spec.nodes - processes % spec.nodes
    if args.steps < 1:
        print("hf-ddpfix rehearse: --steps must be >= 1", file=sys.stderr)
        return 2, {"status": "cannot", "error": "--steps must be >= 1"}
    workdir = args.workdir or tempfile.mkdtemp(prefix="hf_ddpfix_rehearse_")
    label = "stock" if args.stock else "hf_ddpfix"
    args.real_world = args.real_world_size or spec.processes or processes
    args.accelerate_config_file = os.path.abspath(spec.config_file) if spec.config_file else None
    folder = os.path.join(workdir, label)
    shutil.rmtree(folder, ignore_errors=True)
    outcomes = [_launch(spec, args, processes, folder, "train")]
    first = outcomes[0]
    saved = sorted({s for r in first.records.values() for s in r.get("saved", [])})
    if first.status == "passed" and saved and not args.no_resume:
        outcomes.append(_launch(spec, args, processes, folder + "-resume", "resume", resume=saved[-1]))
    real_world = args.real_world_size or spec.processes
    report = build_report(spec, args, processes, real_world, outcomes, workdir)
    report["kept"] = bool(args.keep or args.workdir)  # a folder the user named is theirs
    if report["kept"]:
        report["workdir_bytes"] = _size(workdir)
    print(format_report(report, verbose=not args.quiet))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if not report["kept"]:
        shutil.rmtree(workdir, ignore_errors=True)
    code = EXIT_CODES.get(report["status"], 1)
    return code, report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hf-ddpfix rehearse")
    add_arguments(p)
    return rehearse(p.parse_args(argv))[0]
