"""The rehearsal report: what ran, what broke and where, what hf_ddpfix changed, the projected real memory.

:func:`build_report` turns the launches' outcomes into a plain dict (what ``--json`` writes); :func:`format_report`
prints it in about forty lines.

Guarantees: ``status`` is ``"passed"`` only when every launch passed (every rank finished training); a rank that
raised, hung or was killed is listed with its collective and frames when the rank recorded them.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["build_report", "format_report"]

_MISMATCH = re.compile(r"Detected mismatch between collectives on ranks\.[^\n]*")
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\((.*?)TensorDeviceTypes")
#: What a CPU lacks, as torch / accelerate / bitsandbytes / DeepSpeed word it: matched against the FIRST line of a
#: rank's error only (hf_ddpfix's own hints, later lines such as "NCCL_DEBUG=WARN on GPUs", are no evidence; a bare
#: "nccl" matched them and turned a crash into "cannot rehearse", issue 46).
_CUDA = re.compile(r"Torch not compiled with CUDA|No CUDA GPUs are available|Found no NVIDIA driver|CUDA driver|"
                   r"requires a GPU|only supported on CUDA|Cannot access accelerator device|"
                   r"Distributed package doesn't have NCCL|ProcessGroupNCCL is only supported with GPUs|"
                   r"NCCL is not available|CUDA is not available|no CUDA-capable device", re.IGNORECASE)
#: The verdicts and their exit status (docs/rehearse.md "Exit status").
EXIT_CODES = {"passed": 0, "failed": 1, "hang": 1, "timeout": 1, "not distributed": 1, "cannot": 2}
# torch.distributed.elastic's failure summary (torchrun / accelerate launch): each failed rank's block names its rank
# and exit code ("rank      : 1 (local_rank: 1)" then "exitcode  : -6 (pid: 14777)")
_ELASTIC_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", re.M)
# libstdc++'s message when a joinable std::thread is destroyed: a C++ thread still running at interpreter shutdown
_TERMINATE = "terminate called without an active exception"
WIDTH = 160  # the longest report line (a single word longer than that, e.g. a path, is kept whole)
_FIELDS = re.compile(r"(SequenceNumber|OpType|TensorShape|TensorDtypes)=(\[[^\]]*\]|[^,]*)")


def _short(path: str) -> str:
    path = path.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _frame(f: dict[str, Any] | None) -> str:
    if not f:
        return "?"
    return f"{_short(f['file'])}:{f['line']} in {f['func']}" + (f"  `{f['code']}`" if f.get("code") else "")


def _mismatch(message: str) -> dict[str, Any] | None:
    m = _MISMATCH.search(message)
    if not m:
        return None
    prints = {}
    for rank, body in _FINGERPRINT.findall(message):
        prints[int(rank)] = ", ".join(f"{k}={v.strip()}" for k, v in _FIELDS.findall(body))
    return {"summary": m.group(0)[:600], "fingerprints": prints}


def _stack_head(text: str, n: int = 4) -> list[str]:
    """The innermost frames of the main thread from a faulthandler dump (most recent first)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    for block in blocks:
        if "hf_ddpfix/rehearse/watchdog.py" in block or "threading.py" in block.split("\n", 2)[-1][:400]:
            continue
        frames = [line.strip() for line in block.splitlines()[1:] if line.strip().startswith("File")]
        if frames:
            return frames[:n]
    return []


def launcher_rank_exits(logs: list[str]) -> dict[int, int]:
    """``{rank: exit code}`` of the ranks the launcher's failure summary lists (torch.distributed.elastic's, which
    ``torchrun`` and ``accelerate launch`` print); a negative code is the signal that ended the rank. ``{}`` when
    no summary was printed. A rank listed twice (the "Root Cause" block repeats the first failure) keeps its code."""
    out: dict[int, int] = {}
    for text in logs:
        for rank, code in _ELASTIC_RANK.findall(text):
            out.setdefault(int(rank), int(code))
    return out


def _exit_words(code: int) -> str:
    import signal

    if code >= 0:
        return f"exit code {code}"
    try:
        return f"exit code {code}, {signal.Signals(-code).name}"
    except ValueError:
        return f"exit code {code}"


def _rank_failure(rank: int, rec: dict[str, Any], hang: dict[str, Any] | None, stacks: str | None,
                  exit_code: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": rank, "steps": rec.get("steps", 0)}
    if hang:
        out.update(kind="hang", collective=hang.get("collective"), waited_s=hang.get("waited_s"),
                   issued_at=_frame(hang.get("issued_at")), frames=[_frame(f) for f in hang.get("user_frames", [])])
    elif rec.get("error"):
        err = rec["error"]
        first = err["message"].strip().splitlines()[0] if err["message"].strip() else ""
        mm_head = _MISMATCH.search(first)
        first = "Detected mismatch between collectives on ranks (TORCH_DISTRIBUTED_DEBUG=DETAIL)" if mm_head else first
        out.update(kind="error", error=f"{err['type']}: {first[:300]}",
                   collective=err.get("collective"), issued_at=_frame(err.get("issued_at")),
                   frames=[_frame(f) for f in err.get("user_frames", [])])
        mm = _mismatch(err["message"])
        if mm:
            out["mismatch"] = mm
        if not out["frames"] and err.get("stack"):  # nothing of the script's: the innermost frame
            out["frames"] = [_frame(err["stack"][-1])]
        lacks = _CUDA.search(first) or (err["type"] in ("AssertionError", "RuntimeError") and "cuda" in first.lower()
                                        and bool(err.get("stack")) and "torch/cuda/" in
                                        err["stack"][-1]["file"].replace("\\", "/"))
        if err["type"] == "RehearsalStepError" or "rehearse, step '" in first:
            out["cannot"] = err["message"].strip()[:800]
        elif lacks:
            where = out["frames"][-1] if out["frames"] else "?"
            out["cannot"] = (f"rehearse, step 'run the script': it needs CUDA here ({first[:160]}) at {where}. A CPU "
                             "rehearsal cannot run CUDA-only code; guard it with torch.cuda.is_available() (the "
                             "collectives and wrapping are rehearsed without it)")
    elif stacks:
        out.update(kind="not in a collective when the others hung; its frame then", frames=_stack_head(stacks))
    elif rec.get("exited") is not None and exit_code not in (None, 0) and exit_code != -15:
        # its script returned and Python's exit handlers ran (inject.py's "exited"), then the process died: in the
        # interpreter's shutdown (SIGTERM, -15, is the launcher stopping a rank after another one failed)
        out.update(kind="died at interpreter exit, after its script ended", exit_code=exit_code)
    else:
        out.update(kind="ended" if rec.get("train_done") is not None else "no record of the failure")
    return out


def _sandbox(recs: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's writes outside the rehearsal (sandbox.py), once per (kind, path, how), rank 0's first; a folder
    made (``os.makedirs``) where something was then saved is not listed on its own."""
    out, seen = [], set()
    for rank in sorted(recs):
        for e in recs[rank].get("sandbox") or []:
            key = (e.get("kind"), e.get("asked"), e.get("how"))
            if key not in seen:
                seen.add(key)
                out.append({**e, "rank": rank})
    saved = [str(e.get("asked")) for e in out if not str(e.get("how")).startswith("os.m")]
    return [e for e in out if not str(e.get("how")).startswith(("os.makedirs", "os.mkdir")) or not any(
        s == e["asked"] or s.startswith(str(e["asked"]).rstrip("/") + "/") for s in saved)]


def _output_tail(folder: str, n: int = 10) -> list[str]:
    """The last ``n`` lines rank 0 printed (``rank0.out``, inject's tee; a progress bar's redraws collapsed)."""
    import os

    try:
        with open(os.path.join(folder, "rank0.out"), errors="replace", newline="") as f:
            text = f.read()[-20000:]
    except OSError:
        return []
    lines = [line.split("\r")[-1].rstrip() for line in text.split("\n")]  # a redraw (\r): its last state
    return [line for line in lines if line.strip()][-n:]


def _phase(o: Any, processes: int) -> dict[str, Any]:
    recs = o.records
    r0 = recs.get(0, {})
    train = r0.get("train") or {}
    ranks = sorted(recs)
    phase: dict[str, Any] = {
        "label": o.label, "status": o.status, "seconds": round(o.seconds, 1), "returncodes": o.returncodes,
        "folder": o.folder, "ranks_seen": len(ranks), "processes": processes,
        "mode": train.get("mode"), "fsdp": train.get("fsdp"), "zero_stage": train.get("zero_stage"),
        "trainer": train.get("trainer"), "model": train.get("model"), "fsdp_units": train.get("fsdp_units"),
        "trainable_params": train.get("trainable_params"), "hf_ddpfix": train.get("hf_ddpfix"),
        "plan": train.get("plan"), "steps": {r: recs[r].get("steps", 0) for r in ranks},
        "evaluated": bool(r0.get("evaluated")), "predicted": bool(r0.get("predicted")),
        "saved": (r0.get("saved") or [])[-1:] or None, "resumed_from": r0.get("resumed_from"),
        "replicas": r0.get("replicas"), "features": r0.get("features"), "models": [
            {k: m.get(k) for k in ("name", "class", "model_class", "shrunk", "shrink", "substitutions")}
            for m in r0.get("models", [])],
        "training_args": r0.get("training_args"), "skew": recs.get(max(ranks), {}).get("skew") if ranks else None,
        "stock_note": r0.get("stock"), "world_seen": train.get("world"),
        "sandbox": _sandbox(recs), "output_tail": _output_tail(o.folder),
    }
    if processes > 1 and train.get("world") == 1:
        phase["not_distributed"] = (
            f"{processes} processes launched, but the Trainer saw world size 1 in each: every process trained "
            "alone (the same steps on the full data, N times). Cause: "
            + ("no accelerator and TrainingArguments(use_cpu=False): accelerate sets up the process group on the "
               "CPU only with use_cpu=True" if not any(str(x).startswith("use_cpu") for x in (r0.get("training_args") or {}).get("substitutions", [])) else
               "the launch's environment (WORLD_SIZE) did not reach the Trainer's accelerator"))
    starts = [r["train"]["started"] for r in recs.values() if (r.get("train") or {}).get("started")]
    errors = [r["error"]["at"] for r in recs.values() if (r.get("error") or {}).get("at")]
    if starts and errors:  # the launch's start-up (imports, model load) excluded
        phase["seconds_to_failure"] = round(max(0.0, min(errors) - min(starts)), 1)
    if o.status != "passed":
        exits = launcher_rank_exits(o.logs)
        phase["failures"] = [_rank_failure(r, recs.get(r, {}), o.hangs.get(r), o.stacks.get(r), exits.get(r))
                             for r in sorted(set(ranks) | set(o.hangs))]
        if any(_TERMINATE in text for text in o.logs):
            phase["terminate"] = True
        if not any(f.get("kind") in ("error", "hang") for f in phase["failures"]):
            phase["log_tail"] = [line for text in o.logs for line in text.strip().splitlines()[-25:]]
    return phase


def build_report(spec: Any, args: Any, processes: int, real_world: int | None, outcomes: list[Any],
                 workdir: str) -> dict[str, Any]:
    """The report as a dict (see :func:`format_report` for the printed form)."""
    from .memory import project_memory

    phases = [_phase(o, processes) for o in outcomes]
    cannot = [f["cannot"] for p in phases for f in p.get("failures", []) if f.get("cannot")]
    status = "cannot" if cannot else ("passed" if all(p["status"] == "passed" for p in phases) else
                                      next(p["status"] for p in phases if p["status"] != "passed"))
    if status == "passed" and any(p.get("not_distributed") for p in phases):
        status = "not distributed"
    mode = spec.mode
    first = phases[0]
    if first.get("fsdp"):
        mode = "fsdp"
    elif first.get("zero_stage") is not None:
        mode = "zero3" if first["zero_stage"] == 3 else "zero2"
    world = real_world or processes
    rec0 = outcomes[0].records.get(0, {})
    memory, why = project_memory(rec0, mode, world)
    n_note = ("same world size as the launch" if real_world == processes else
              f"the launch runs {real_world if real_world else 'an unstated number of'} processes, rehearsed on "
              f"{processes}: the same collectives in the same order per rank; shard sizes, per-rank batch counts "
              "and the global batch differ")
    return {"status": status, "cannot": cannot[0] if cannot else None, "launch": spec.describe(),
            "launch_notes": spec.notes, "rehearsed": f"{processes} CPU processes (gloo) on {spec.nodes} localhost "
            f"node(s)", "world_note": n_note, "mode": mode, "stock": bool(args.stock), "skew": bool(args.skew),
            "steps_asked": args.steps, "phases": phases, "memory": memory, "memory_missing": why,
            "workdir": workdir}


def _fit(line: str, width: int = WIDTH, indent: str = "           ") -> list[str]:
    """``line`` wrapped at spaces to ``width`` characters, continuation lines indented: words (paths, doc links
    with their anchors) are never cut."""
    import textwrap

    if len(line) <= width:
        return [line]
    lead = len(line) - len(line.lstrip(" "))
    return textwrap.wrap(line, width, subsequent_indent=indent if lead < len(indent) else " " * (lead + 2),
                         break_long_words=False, break_on_hyphens=False, drop_whitespace=True) or [line]


def _plan_lines(plan: list[str]) -> list[str]:
    """The plan report's lines that differ from stock (``*``), options asked on that do not run (``!``),
    corrections and settings; not the decisions that stay stock."""
    keep = [line for line in plan[1:] if line.startswith((" *", " !", "   corrected:", "   settings:"))]
    return [plan[0], *keep] if plan else []


def _model_lines(m: dict[str, Any]) -> list[str]:
    """``model:`` (the call, a long path shortened to its last two parts) and, shrunk, the first cut fields that fit
    one line and how many more (``--json`` keeps them all)."""
    name = str(m["name"])
    if len(name) > 48 and "/" in name:
        name = ".../" + "/".join(name.rstrip("/").split("/")[-2:])
    head = f"model:     {m['class']}.from_pretrained({name!r}) -> {m.get('model_class') or m['class']}"
    cut = m.get("shrink") or []
    if not m.get("shrunk"):
        return [head + ", full size"]
    if not cut:
        return [head + ", not shrunk (already small: nothing to cut), random weights"]
    lead, shown = f"           shrunk ({len(cut)} fields): ", []
    for c in cut:
        if len(lead) + len("; ".join([*shown, c])) + 32 > WIDTH:
            break
        shown.append(c)
    rest = len(cut) - len(shown)
    return [head, lead + "; ".join(shown) + (f"; {rest} more (--json lists all)" if rest else "")]


def _size(path: str) -> int:
    import os

    total = 0
    for top, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(top, f)).st_size
            except OSError:
                pass
    return total


def format_report(r: dict[str, Any], verbose: bool = True) -> str:
    """The report in plain text, about forty lines, none over :data:`WIDTH` characters but a single long word."""
    status = r["status"].upper()
    # --stock turns off what hf_ddpfix installs (patch_trainer, patches/); a script's own DDPFixTrainer still runs it
    ran = r["stock"] and any(p.get("hf_ddpfix") for p in r.get("phases", []))
    how = ("--stock asked, but the script's own DDPFixTrainer ran hf_ddpfix: not a stock run" if ran else
           "stock, without hf_ddpfix" if r["stock"] else "with hf_ddpfix")
    out = [f"=== hf-ddpfix rehearse: {status} (exit {EXIT_CODES.get(r['status'], 1)}; "
           f"{how}{', skewed batches' if r['skew'] else ''})"
           " ===", f"launch:    {r['launch']}", f"rehearsed: {r['rehearsed']}; {r['world_note']}"]
    out += [f"note:      {n}" for n in r["launch_notes"]]
    if r.get("cannot"):
        out.append(f"CANNOT REHEARSE: {r['cannot']}")
    for p in r["phases"]:
        out.append(f"--- {p['label']}: {p['status']} in {p['seconds']} s (exit codes {p['returncodes']})"
                   + (f"; failed {p['seconds_to_failure']} s after training started" if "seconds_to_failure" in p
                      else ""))
        failures = [f for f in p.get("failures", []) if f.get("kind") in ("error", "hang")]
        if failures and not r.get("cannot"):
            f = failures[0]
            where = (f.get("frames") or [f.get("issued_at") or "?"])[-1]
            what = f.get("error") or f"hung in {f.get('collective')}"
            out.append(f"FAILED:    rank {f['rank']} at step {f['steps'] + 1} ({f['steps']} finished): {what[:200]}")
            out.append(f"           at {where}")
        elif p["status"] == "failed" and not r.get("cannot"):
            at_exit = [f for f in p.get("failures", []) if "exit_code" in f]
            if at_exit:
                f = at_exit[0]
                out.append(f"FAILED:    rank {f['rank']} ran its script to the end ({f['steps']} steps), then died at "
                           f"interpreter exit ({_exit_words(f['exit_code'])})")
                out.append("           its work was done, but the launch fails, as it would on the cluster")
                if p.get("terminate"):
                    out.append(f"           \"{_TERMINATE}\": a C++ thread was still running when Python shut down")
                    out.append("           (e.g. a process group a library keeps after destroy_process_group; "
                               "docs/rehearse.md)")
            else:
                out.append(f"FAILED:    the launch exited with codes {p['returncodes']} and no rank recorded an "
                           "exception" + (" (rank 0's last output below)" if p.get("output_tail") else ""))
        if p.get("not_distributed"):
            out.append(f"NOT DISTRIBUTED: {p['not_distributed']}")
        if p.get("mode"):
            par = "FSDP" if p["fsdp"] else (f"DeepSpeed ZeRO-{p['zero_stage']}" if p["zero_stage"] is not None else
                                             p["mode"])
            units = f", {p['fsdp_units']} FSDP units" if p.get("fsdp") else ""
            shrunk = " of the shrunk model" if any(m.get("shrunk") for m in p["models"]) else ""
            out.append(f"ran:       {p['trainer']} on {p['model']} ({par}{units}), {p['trainable_params'] or 0:,} "
                       f"trainable parameters{shrunk}; steps per rank {p['steps']}"
                       + ("; evaluated" if p["evaluated"] else "") + ("; predicted" if p["predicted"] else "")
                       + (f"; saved {p['saved'][0]}" if p["saved"] else "")
                       + (f"; resumed from {p['resumed_from']}" if p.get("resumed_from") else ""))
        for m in p["models"]:
            out += _model_lines(m)
            out += [f"           substituted: {s}" for s in m.get("substitutions") or []]
        ta = p.get("training_args") or {}
        out += [f"args:      substituted: {s}" for s in ta.get("substitutions", [])]
        if p.get("skew"):
            out.append(f"skew:      rank {p['skew']['rank']}: text-only (media keys dropped, media tokens "
                       f"{p['skew']['media_token_ids']} -> {p['skew']['pad_id']}), last half of each sequence")
        if p.get("plan"):
            shown = _plan_lines(p["plan"])
            out.append(shown[0].rstrip(":") + ", what differs from stock:")
            out += shown[1:] or ["   nothing: every decision is stock's"]
        elif p.get("mode"):
            out.append("hf_ddpfix: not active (" + (p.get("stock_note") or "stock run") + ")")
        if p.get("features"):
            out.append("features:  " + ", ".join(f"{k.replace('hf_ddpfix/', '')}={v}" for k, v in
                                                  sorted(p["features"].items())[:12]))
        if p.get("replicas"):
            out.append(f"replicas:  {p['replicas']}")
        for e in (p.get("sandbox") or [])[:8]:
            if e["kind"] == "redirected":
                out.append(f"outside:   your script saved to {e['asked']} ({e['how']}); the rehearsal wrote it to "
                           f"{e['wrote']}")
            elif e["kind"] == "kept":
                out.append(f"outside:   your script changed {e['asked']} ({e['how']}); the rehearsal left it as it was")
            else:
                out.append(f"outside:   your script wrote {e['asked']} ({e['how']}): refused, the rehearsal never "
                           "writes outside its folder")
        if len(p.get("sandbox") or []) > 8:
            out.append(f"outside:   ... {len(p['sandbox']) - 8} more (--json lists all)")
        for f in p.get("failures", []):
            head = f"rank {f['rank']} (after {f['steps']} steps): {f['kind']}"
            if f.get("error"):
                head += f": {f['error']}"
            if f.get("waited_s"):
                head += f" (waited {f['waited_s']} s)"
            out.append(head)
            if f.get("mismatch"):
                for rank, fp in sorted(f["mismatch"]["fingerprints"].items()):
                    out.append(f"    rank {rank} collective: {fp[:220]}")
            if f.get("collective"):
                issued = f.get("issued_at") or "?"
                by = f" issued in {issued}" if not any(w in issued for w in ("_contextlib", "contextlib.py", "?")) else ""
                out.append(f"    in collective: {f['collective']} (torch.distributed){by}; model/script frames "
                           "(innermost last):")
            out += [f"    frame: {fr}" for fr in f.get("frames", [])]
        if p.get("output_tail"):
            out.append(f"output (rank 0, last {len(p['output_tail'])} lines):")
            out += [f"  | {line if len(line) <= WIDTH - 4 else line[:WIDTH - 5] + '…'}" for line in p["output_tail"]]
        if p.get("log_tail") and verbose:
            out.append("launcher output tail:")
            out += [f"  {line}" for line in p["log_tail"][-30:]]
    if r["memory"]:
        out.append(f"projected memory of the REAL model (a projection, not measured; {r['mode']}):")
        out += [f"  {line}" for line in r["memory"]]
    elif r.get("memory_missing"):
        out.append(f"projected memory: none ({r['memory_missing']})")
    if r.get("kept", True):
        size = r.get("workdir_bytes")
        out.append(f"records, logs, checkpoints: {r['workdir']}" + (f" ({size / 2**20:,.1f} MiB; remove it when done)"
                                                                    if size is not None else ""))
    else:
        out.append(f"rehearsal folder removed ({r['workdir']}; --keep keeps records, logs and checkpoints)")
    if r["status"] != "passed" and not r["stock"]:
        out.append("compare with stock: the same command with --stock")
    elif r["status"] == "passed" and r["stock"] and not ran:
        out.append("stock passes this rehearsal")
    return "\n".join(line for raw in out for line in _fit(raw))
