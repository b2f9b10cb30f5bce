"""`hf-ddpfix` command line: `doctor` (environment check + launch advice), `plan` (dry-run plan) and `rehearse`
(run your own multi-GPU launch line on CPU processes with the model shrunk: hf_ddpfix/rehearse/, docs/rehearse.md).

    hf-ddpfix doctor                                  # versions, devices, backends, HF_DDPFIX_* settings
    hf-ddpfix doctor --model path/to/config.json      # + a launch recommendation for that model
    hf-ddpfix doctor --model LlamaConfig --config-kwargs '{"hidden_size": 4096, ...}'
    hf-ddpfix doctor --params 7e9 --devices 8 --device-mem-gb 80 --full --json
    hf-ddpfix plan --model Qwen/Qwen2.5-VL-7B-Instruct --checkpointing reentrant --world-size 8 --ga 4
    hf-ddpfix plan --model path/to/model --accelerate-config accelerate_configs/fsdp.yaml --world-size 64
    python -m hf_ddpfix doctor                        # same thing
    hf-ddpfix rehearse --skew -- accelerate launch --config_file fsdp.yaml train.py --my-args

Except `rehearse`, nothing here launches processes or downloads weights: models are built on the meta device
from their config only (a Hub id needs the network for its config.json). Under FSDP2, `plan` shards a meta copy of the model with
accelerate's own `fsdp2_prepare_model` inside torch's fake process group (no communication; destroyed before it
prints) to report rank 0's unit bytes at `--world-size`.

Guarantees: `doctor` reports an invalid `HF_DDPFIX_*` value (and unknown `HF_DDPFIX_*` names) instead of
crashing, and exits 1 when it found one; `recommend_launch` is a pure function; `plan` builds its facts with the
run's own functions (`facts.model_facts`, `integrations.fsdp.fsdp_facts` with the plugin `accelerate launch`
builds from `--accelerate-config`), so for the same model and launch it prints the run's plan lines
(tests/test_fsdp_trainer.py compares them with the FSDP2 launches' plans, every family).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

from .facts.advice import GiB, qlora_advice, recommend_launch

_PACKAGES = ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "bitsandbytes", "deepspeed",
             "hf-ddpfix")
#: HF_DDPFIX_* variables that are not `DDPFixConfig` options.
_EXTRA_VARS = {"HF_DDPFIX_DISABLE": "1/true/yes/on: `patches/` (the `PYTHONPATH` zero-code patch, "
                                   "patches/sitecustomize.py) does nothing; 0/false/no/off or unset: it runs; any "
                                   "other value is a ValueError on every route (patch_trainer, DDPFixTrainer, "
                                   "patches/, hf-ddpfix plan)."}
_RELATED_VARS = ("TORCH_DISTRIBUTED_DEBUG", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                 "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_FSDP")


# ----------------------------------------------------------------------------------------------------
# Environment checks
# ----------------------------------------------------------------------------------------------------


def check_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every HF_DDPFIX_* / compatibility variable that is set, each parsed on its own.

    Returns:
        {"settings": [{"var", "value", "option", "ok", "error"}], "unknown": [{"var", "did_you_mean"}],
         "config": [resolved option lines] or None, "config_error": str or None, "related": {var: value}}
    """
    from .config.options import OPTIONS, DDPFixConfig, env_name

    env = os.environ if env is None else env
    settings, known = [], set(_EXTRA_VARS)
    for option, opt in OPTIONS.items():
        for var in (env_name(option), *opt.compat):
            known.add(var)
            if var not in env:
                continue
            entry = {"var": var, "value": env[var], "option": option, "ok": True, "error": None}
            try:
                if var == env_name(option):
                    opt.parse(var, env[var])
                else:
                    from .config.options import compat_value_of

                    compat_value_of(opt, var, env[var])
            except ValueError as e:
                entry.update(ok=False, error=str(e))
            settings.append(entry)
    for var, doc in _EXTRA_VARS.items():
        if var in env:
            entry = {"var": var, "value": env[var], "option": None, "ok": True, "error": None, "doc": doc}
            try:
                if env[var].strip():  # patches/sitecustomize.py reads "" as unset
                    from .config.options import parse_bool

                    parse_bool(var, env[var])  # the spellings patches/sitecustomize.py accepts
            except ValueError as e:
                entry.update(ok=False, error=str(e))
            settings.append(entry)
    unknown = []
    for var in sorted(v for v in env if v.startswith("HF_DDPFIX_") and v not in known):
        close = difflib.get_close_matches(var, sorted(known), n=1)
        unknown.append({"var": var, "did_you_mean": close[0] if close else None})
    config_lines, config_error = None, None
    try:
        config_lines = DDPFixConfig.from_env(env).describe()
    except ValueError as e:
        config_error = str(e)
    return {"settings": settings, "unknown": unknown, "config": config_lines, "config_error": config_error,
            "related": {v: env[v] for v in _RELATED_VARS if v in env}}


def _versions() -> dict[str, str | None]:
    """The installed version of each package; torch's as the running torch reports it (``torch.__version__``):
    its build tag (``+cpu``, ``+cu130``) says which build runs, and PyPI's CUDA wheels carry it there only
    (their distribution metadata says ``2.14.1``, the running torch ``2.14.1+cu130``)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in _PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    if out.get("torch") is not None:
        import torch

        out["torch"] = str(torch.__version__)
    return out


def _devices() -> dict[str, Any]:
    import torch

    cuda = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            cuda.append({"index": i, "name": prop.name, "total_mem_gb": round(prop.total_memory / GiB, 2),
                         "capability": f"{prop.major}.{prop.minor}"})
    xpu = torch.xpu.device_count() if hasattr(torch, "xpu") and torch.xpu.is_available() else 0
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = None
    cpu = {"cores": os.cpu_count(), "ram_gb": round(ram / GiB, 2) if ram else None,
           "torch_threads": torch.get_num_threads()}
    return {"cuda": cuda, "cuda_version": torch.version.cuda, "xpu": xpu, "mps": mps, "cpu": cpu}


def _backends() -> dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"available": False}
    out = {"available": True}
    for name in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        probe = getattr(dist, f"is_{name}_available", None)
        out[name] = bool(probe()) if probe is not None else False
    return out


# ----------------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------------


def _doctor(args: argparse.Namespace) -> int:
    import torch

    report: dict[str, Any] = {"versions": _versions(), "devices": _devices(), "distributed": _backends(),
                              "env": check_env()}
    from .facts.offline import model_info

    info, model_error = model_info(args)
    report["model"] = dataclasses.asdict(info) if info else None
    if info is not None and args.config_kwargs:
        report["config_kwargs"] = args.config_kwargs  # the size is the user's, not a default config's
    if model_error:
        report["model_error"] = model_error
    dev = report["devices"]
    accelerator = (bool(dev["cuda"]) or args.device_mem_gb is not None) if args.cpu is None else not args.cpu
    n = args.devices or (len(dev["cuda"]) if dev["cuda"] else 1)
    if args.device_mem_gb:
        mem = args.device_mem_gb * GiB
    elif dev["cuda"]:
        mem = min(d["total_mem_gb"] for d in dev["cuda"]) * GiB
    else:  # CPU processes share the machine's RAM
        mem = (dev["cpu"]["ram_gb"] or 16) * GiB / max(1, n)
    if info is not None:
        rec = recommend_launch(info.num_params, mem, n, not args.full, num_nodes=args.nodes, seq_len=args.seq_len,
                               hidden_size=info.hidden_size, num_layers=info.num_layers, vocab_size=info.vocab_size,
                               accelerator=accelerator, target_global_batch=args.global_batch)
        report["recommendation"] = rec.as_dict()
    report["qlora"] = qlora_advice(report["versions"].get("bitsandbytes"), n, accelerator=accelerator)
    from .plan.deepspeed import deepspeed_advice

    report["deepspeed"] = deepspeed_advice(report["versions"].get("deepspeed"))
    problems = [s for s in report["env"]["settings"] if not s["ok"]] + report["env"]["unknown"]
    if report["env"]["config_error"] and not problems:
        problems.append({"var": "(combination)", "error": report["env"]["config_error"]})
    report["ok"] = not problems and not model_error
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_doctor(report, torch)
    return 0 if not problems else 1


def _print_doctor(r: dict[str, Any], torch: Any) -> None:
    p = print
    p("hf-ddpfix doctor")
    p("  versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in r["versions"].items()))
    d = r["devices"]
    if d["cuda"]:
        for g in d["cuda"]:
            p(f"  cuda:{g['index']}: {g['name']} {g['total_mem_gb']} GiB (sm {g['capability']})")
    else:
        p("  no CUDA device" + (f"; {d['xpu']} XPU" if d["xpu"] else "") + ("; MPS available" if d["mps"] else ""))
    c = d["cpu"]
    p(f"  cpu: {c['cores']} cores, {c['ram_gb']} GiB RAM, torch threads {c['torch_threads']}")
    b = r["distributed"]
    p("  torch.distributed: " + (", ".join(f"{k} {'yes' if v else 'no'}" for k, v in b.items() if k != "available")
                                 if b.get("available") else "not available in this torch build"))
    e = r["env"]
    if not e["settings"] and not e["unknown"]:
        p("  hf_ddpfix settings: none set (the plan decides everything)")
    for s in e["settings"]:
        status = "ok" if s["ok"] else f"INVALID: {s['error']}"
        p(f"  {s['var']}={s['value']!r}: {status}")
    for u in e["unknown"]:
        hint = f" (did you mean {u['did_you_mean']}?)" if u["did_you_mean"] else ""
        p(f"  {u['var']}: UNKNOWN hf_ddpfix variable, ignored{hint}")
    if e["config_error"] and all(s["error"] != e["config_error"] for s in e["settings"]):
        p(f"  settings conflict: {e['config_error']}")
    elif e["config"]:
        p("  resolved: " + "; ".join(e["config"]))
    for k, v in e["related"].items():
        p(f"  {k}={v}")
    if r.get("model_error"):
        p(f"  model: {r['model_error']}")
    m = r.get("model")
    if m:
        shape = f", {m['num_layers']} layers, hidden {m['hidden_size']}" if m["num_layers"] else ""
        kind = (" VLM" + (f" (adapter {m['vlm_adapter']})" if m["vlm_adapter"] else "")) if m["is_vlm"] else ""
        p(f"  model: {m['source']} ({m['model_type']}{kind}{', MoE' if m['is_moe'] else ''}): "
          f"{m['num_params'] / 1e9:.3f}B params{shape}{_default_config_note(m['source'], r.get('config_kwargs'))}")
    rec = r.get("recommendation")
    if rec:
        p(f"  recommendation: {rec['mode'].upper()} on {rec['world_size']} device(s)"
          + ("" if rec["fits"] else " -- does NOT fit as configured"))
        for reason in rec["reasons"]:
            p(f"    - {reason}")
        p(f"    launch: {rec['launch']}")
    elif not m:
        p("  recommendation: pass --model (config.json, folder, config class, hub id) or --params 7e9")
    qlora = r.get("qlora") or []
    if qlora:
        p(f"  qlora: {qlora[0]}")
        for line in qlora[1:]:
            p(f"    - {line}")
    for line in r.get("deepspeed") or []:
        p(f"  {line}")


def _plan(args: argparse.Namespace) -> int:
    from .facts.offline import model_line, plan_offline
    from .plan.types import PlanError

    try:
        done = plan_offline(args)
    except (ValueError, PlanError) as e:
        print(f"hf-ddpfix: {e}", file=sys.stderr)
        return 2
    info, facts, plan, layout = done.info, done.facts, done.plan, done.layout
    if args.json:
        out = {"facts": dataclasses.asdict(facts), "ddp_kwargs": plan.ddp_kwargs(),
               "decisions": {k: dataclasses.asdict(d) for k, d in plan.decisions().items()},
               "corrections": list(plan.corrections), "not_applied": dict(plan.not_applied),
               "report": plan.report(), "model": dataclasses.asdict(info) if info else None,
               "fsdp_layout": dict(dataclasses.asdict(layout), peak_bytes=layout.peak_bytes,
                                   rank_bytes=layout.rank_bytes) if layout else None}
        print(json.dumps(out, indent=2, default=str))
        return 0
    if info is not None:
        print(model_line(info))
        from .rehearse.family_sweep import status_line

        family = status_line(info.model_type)
        if family:
            print(family)
    print(plan.report())
    if plan.parallel == "ddp":
        print(f"DDP kwargs: {plan.ddp_kwargs()}")
    for line in layout.lines() if layout else ():
        print(line)
    return 0


def _default_config_note(source: str, config_kwargs: Any = None) -> str:
    """What the size means when `--model` named a model type or a config class: transformers' default config of
    that type (`qwen2_5_vl` is a 75.8 B model), not a checkpoint of yours."""
    if os.path.exists(source) or "/" in source or config_kwargs:
        return ""
    return (f" -- the default config of {source!r}, not your checkpoint: pass its config.json, its folder, a Hub "
            "id or --config-kwargs for your size")


def _parser() -> argparse.ArgumentParser:
    from .facts.offline import add_model_arguments, add_plan_arguments

    top = argparse.ArgumentParser(prog="hf-ddpfix", description=__doc__.split("\n\n")[0])
    sub = top.add_subparsers(dest="command", required=True)

    d = sub.add_parser("doctor", help="versions, devices, backends, settings, launch recommendation")
    add_model_arguments(d)
    d.add_argument("--devices", type=int, help="devices per node to plan for (default: the GPUs here)")
    d.add_argument("--device-mem-gb", type=float, help="memory of one device (default: the smallest GPU here)")
    d.add_argument("--nodes", type=int, default=1)
    d.add_argument("--seq-len", type=int, default=2048)
    d.add_argument("--global-batch", type=int, default=32, help="target sequences per optimizer step")
    d.add_argument("--cpu", action="store_const", const=True, default=None, help="plan for CPU processes")
    d.set_defaults(func=_doctor)

    p = sub.add_parser("plan", help="print the hf_ddpfix plan for a run, without training")
    add_plan_arguments(p)
    p.set_defaults(func=_plan)

    r = sub.add_parser("rehearse", help="run your own launch line on CPU processes, model shrunk: what breaks "
                       "before you pay for GPUs (docs/rehearse.md)",
                       description="Run `-- <launch line>` (accelerate launch / torchrun / deepspeed / python) on "
                       "CPU gloo processes with the checkpoint shrunk, a few steps, collectives fingerprinted; "
                       "report what ran, what broke and where, and the projected memory of the real model.")
    from .rehearse.run import add_arguments  # no torch: the rehearsal imports it in the launched ranks only

    add_arguments(r)
    r.set_defaults(func=_rehearse)
    return top


def _rehearse(args: argparse.Namespace) -> int:
    from .rehearse.run import rehearse

    return rehearse(args)[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-ddpfix` and `python -m hf_ddpfix`. Returns the exit status."""
    args = _parser().parse_args(argv)
    _quiet_bitsandbytes_kernels_notice()
    return int(args.func(args) or 0)


def _quiet_bitsandbytes_kernels_notice() -> None:
    """bitsandbytes 0.50, imported by peft whenever it is installed, logs "Failed to load CPU gemm_4bit_forward
    from kernels-community ..." on a CPU without the optional `kernels` package (it then uses its own kernel);
    the CLI quantizes nothing, so that one message of that one logger is dropped (docs/examples.md)."""
    import logging

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")

    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_Drop())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
