"""Parse a user's launch line and rewrite it for CPU processes on this machine (pure: no torch, no processes).

Understood launchers (the first words of the line):
    accelerate launch [launcher options] script.py [script args]     (``--config_file``, its yaml, or the default
                                                                       config accelerate itself would read)
    torchrun [options] script.py [args]  /  python -m torch.distributed.run [...]  /  ... torch.distributed.launch
    deepspeed [--num_gpus N] [--num_nodes M] script.py [args]          (rehearsed through torch.distributed.run)
    python script.py [args]  /  python -m package.module [args]        (one process unless ``--nproc``)

Guarantees: :func:`parse_launch_line` never runs anything; an unknown launcher or a line without a script raises
``LaunchLineError`` naming the token and the launchers understood; :func:`rewrite` keeps the script, its arguments
and every launcher option except the ones that place processes (process/node counts, ranks, addresses, ports),
which it sets for localhost nodes on free ports.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LaunchLineError", "LaunchSpec", "parse_launch_line", "rewrite", "MODES"]

#: Parallel modes a rehearsal tells apart, with what decides each.
MODES = {"single": "one process", "ddp": "DistributedDataParallel (MULTI_GPU / MULTI_CPU, torchrun)",
         "fsdp": "FSDP through accelerate (distributed_type FSDP or --use_fsdp)",
         "zero2": "DeepSpeed ZeRO stage <= 2", "zero3": "DeepSpeed ZeRO stage 3"}

_ACCELERATE_FLAGS = {"--cpu", "--multi_gpu", "--tpu", "--ipex", "--use_xpu", "--use_deepspeed", "--use_fsdp",
                     "--use_megatron_lm", "-m", "--module", "--no_python", "--debug", "-q", "--quiet",
                     "--same_network", "--dynamo_use_fullgraph", "--dynamo_use_dynamic", "--enable_cpu_affinity",
                     "--tpu_use_cluster", "--tpu_use_sudo", "--downcast_bf16", "--deepspeed_moe_layer_cls_names",
                     "--fsdp_use_orig_params"}
#: accelerate launcher options that place processes: the rehearsal sets them itself.
_ACCELERATE_PLACEMENT = {"--num_processes", "--num_machines", "--machine_rank", "--main_process_ip",
                         "--main_process_port", "--gpu_ids", "--rdzv_backend", "--rdzv_conf", "--max_restarts",
                         "--monitor_interval"}
_TORCHRUN_FLAGS = {"--standalone", "--no_python", "--no-python", "-m", "--module", "--run_path", "--run-path",
                   "--use_env", "--use-env"}
_TORCHRUN_PLACEMENT = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank",
                       "--master_addr", "--master-addr", "--master_port", "--master-port", "--rdzv_endpoint",
                       "--rdzv-endpoint", "--rdzv_backend", "--rdzv-backend", "--rdzv_id", "--rdzv-id",
                       "--standalone", "--max_restarts", "--max-restarts"}


class LaunchLineError(ValueError):
    """The launch line cannot be rehearsed; the message names the token and what is understood."""


@dataclass
class LaunchSpec:
    """What a launch line asks for.

    Attributes:
        launcher: "accelerate", "torchrun", "deepspeed" or "python".
        options: the launcher's own options, as given (placement options included).
        program: the script path, or the module name when ``module`` is true.
        module: ``-m package.module`` instead of a script.
        args: the script's arguments, untouched.
        processes: total processes the line asks for (``None``: not stated, e.g. ``--nproc_per_node=gpu``).
        nodes: machines the line asks for.
        mode: one of :data:`MODES`.
        mode_source: where ``mode`` came from (a yaml key, a flag, a script argument).
        config_file: the accelerate yaml used (given or accelerate's default), if any.
        mixed_precision: "no", "bf16", "fp16" or None (not stated).
        notes: what the parse had to assume.
    """

    launcher: str
    options: list[str]
    program: str
    module: bool
    args: list[str]
    processes: int | None
    nodes: int
    mode: str
    mode_source: str
    config_file: str | None = None
    mixed_precision: str | None = None
    accelerate_config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        prog = f"-m {self.program}" if self.module else self.program
        n = "?" if self.processes is None else str(self.processes)
        return (f"{self.launcher} · {prog} · {n} processes on {self.nodes} node(s) · mode {self.mode} "
                f"({self.mode_source})" + (f" · mixed precision {self.mixed_precision}" if self.mixed_precision else ""))


def _split_options(tokens: list[str], flags: set[str]) -> tuple[list[str], int]:
    """Launcher options up to the program: ``(options, index of the program token)``."""
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("-") or tok == "--":
            break
        if "=" in tok or tok in flags:
            i += 1
        else:
            i += 2
    if i < len(tokens) and tokens[i] == "--":
        i += 1
    return tokens[:i], i


def _option(options: list[str], *names: str) -> str | None:
    """The value of the last of ``names`` in ``options`` (``--x v`` or ``--x=v``)."""
    value = None
    for i, tok in enumerate(options):
        key, eq, inline = tok.partition("=")
        if key in names:
            value = inline if eq else (options[i + 1] if i + 1 < len(options) else None)
    return value


def _has_flag(options: list[str], *names: str) -> bool:
    return any(tok.split("=")[0] in names for tok in options)


def _load_yaml(path: str) -> dict[str, Any]:
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - accelerate depends on pyyaml
        raise LaunchLineError(f"reading {path} needs pyyaml (installed with accelerate)") from e
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise LaunchLineError(f"--config_file {path}: {e.strerror} (paths are read from the current folder, "
                              f"{os.getcwd()}, as accelerate reads them)") from e
    if not isinstance(data, dict):
        raise LaunchLineError(f"--config_file {path}: not a yaml mapping")
    return data


def _zero_stage(ds_config: Any, where: str) -> int | None:
    if isinstance(ds_config, str):
        try:
            with open(ds_config) as f:
                ds_config = json.load(f)
        except (OSError, ValueError) as e:
            raise LaunchLineError(f"{where}: cannot read the DeepSpeed config {ds_config}: {e}") from e
    if isinstance(ds_config, dict):
        stage = (ds_config.get("zero_optimization") or {}).get("stage", ds_config.get("zero_stage"))
        return int(stage) if stage is not None and str(stage) != "auto" else None
    return None


def _int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None if str(value) in ("gpu", "auto", "cpu", "xpu") else _bad(what, value)


def _bad(what: str, value: Any) -> int:
    raise LaunchLineError(f"{what}={value!r} is not a number of processes")


def _script_mode(args: list[str]) -> tuple[str, str] | None:
    """A mode the script's own arguments ask for (HfArgumentParser's ``--deepspeed``, ``--fsdp``)."""
    ds = _option(args, "--deepspeed")
    if ds:
        stage = _zero_stage(ds, "--deepspeed") if ds.endswith(".json") else None
        return ("zero3" if stage == 3 else "zero2"), f"script argument --deepspeed {ds} (stage {stage})"
    fsdp = _option(args, "--fsdp")
    if fsdp:
        return "fsdp", f"script argument --fsdp {fsdp}"
    return None


def _accelerate(tokens: list[str]) -> LaunchSpec:
    options, at = _split_options(tokens, _ACCELERATE_FLAGS)
    if at >= len(tokens):
        raise LaunchLineError("accelerate launch: no script after the launcher options")
    module = _has_flag(options, "-m", "--module")
    program, args = tokens[at], tokens[at + 1:]
    notes: list[str] = []
    config_file = _option(options, "--config_file", "--config-file")
    if config_file is None:
        default = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "accelerate" / \
            "default_config.yaml"
        if default.is_file():
            config_file = str(default)
            notes.append(f"no --config_file: accelerate's default config {default} (as accelerate reads it)")
    cfg = _load_yaml(config_file) if config_file else {}
    dist = str(cfg.get("distributed_type", "NO")).upper()
    mode, source = "ddp", f"distributed_type {dist}"
    if _has_flag(options, "--use_fsdp") or dist == "FSDP":
        mode, source = "fsdp", "--use_fsdp" if _has_flag(options, "--use_fsdp") else "distributed_type FSDP"
        version = _option(options, "--fsdp_version") or (cfg.get("fsdp_config") or {}).get("fsdp_version", 1)
        source += f", FSDP{version}"
    elif _has_flag(options, "--use_deepspeed") or dist == "DEEPSPEED":
        ds = cfg.get("deepspeed_config") or {}
        stage = _option(options, "--zero_stage")
        stage = int(stage) if stage else ds.get("zero_stage")
        file = _option(options, "--deepspeed_config_file") or ds.get("deepspeed_config_file")
        if stage is None and file:
            stage = _zero_stage(file, "deepspeed_config_file")
        mode = "zero3" if stage == 3 else "zero2"
        source = f"distributed_type DEEPSPEED, ZeRO stage {stage}" + (f" ({file})" if file else "")
    elif dist == "NO" and not _has_flag(options, "--multi_gpu"):
        script = _script_mode(args)
        if script:
            mode, source = script
    nodes = _int(_option(options, "--num_machines") or cfg.get("num_machines", 1), "num_machines") or 1
    processes = _int(_option(options, "--num_processes") or cfg.get("num_processes"), "num_processes")
    if dist == "NO" and processes in (None, 1) and mode == "ddp" and not _has_flag(options, "--multi_gpu"):
        mode, source = "single", f"distributed_type {dist}, one process"
    mixed = _option(options, "--mixed_precision") or cfg.get("mixed_precision")
    return LaunchSpec("accelerate", options, program, module, args, processes, nodes, mode, source, config_file,
                      str(mixed) if mixed is not None else None, cfg, notes)


def _torchrun(tokens: list[str], launcher: str = "torchrun") -> LaunchSpec:
    options, at = _split_options(tokens, _TORCHRUN_FLAGS)
    if at >= len(tokens):
        raise LaunchLineError(f"{launcher}: no script after the launcher options")
    module = _has_flag(options, "-m", "--module")
    program, args = tokens[at], tokens[at + 1:]
    per_node = _int(_option(options, "--nproc_per_node", "--nproc-per-node") or 1, "--nproc_per_node")
    nnodes_raw = _option(options, "--nnodes") or "1"
    nodes = _int(nnodes_raw.split(":")[-1], "--nnodes") or 1
    processes = per_node * nodes if per_node is not None else None
    mode, source = ("ddp", f"{launcher} (DDP unless the script asks otherwise)")
    script = _script_mode(args)
    if script:
        mode, source = script
    notes = [] if per_node is not None else ["--nproc_per_node names devices, not a number: say --real-world-size"]
    return LaunchSpec(launcher, options, program, module, args, processes, nodes, mode, source, notes=notes)


def _deepspeed(tokens: list[str]) -> LaunchSpec:
    options, at = _split_options(tokens, {"--no_python", "--module", "--no_local_rank", "--autotuning"})
    if at >= len(tokens):
        raise LaunchLineError("deepspeed: no script after the launcher options")
    gpus = _int(_option(options, "--num_gpus", "--num-gpus") or 1, "--num_gpus") or 1
    nodes = _int(_option(options, "--num_nodes", "--num-nodes") or 1, "--num_nodes") or 1
    args = tokens[at + 1:]
    script = _script_mode(args) or ("zero2", "deepspeed launcher (stage not found in the script arguments)")
    return LaunchSpec("deepspeed", options, tokens[at], _has_flag(options, "--module"), args, gpus * nodes, nodes,
                      script[0], script[1],
                      notes=["the deepspeed launcher is rehearsed through torch.distributed.run (same ranks and "
                             "environment; the script gets LOCAL_RANK from the environment, not --local_rank)"])


def parse_launch_line(line: list[str] | str) -> LaunchSpec:
    """Parse ``line`` (a list of words, or one string split as a shell would).

    Raises:
        LaunchLineError: empty line, an unknown launcher, or no script.
    """
    tokens = shlex.split(line) if isinstance(line, str) else list(line)
    if tokens and tokens[0] == "--":
        tokens = tokens[1:]
    while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):  # VAR=value prefixes: not ours to drop
        raise LaunchLineError(f"{tokens[0]!r}: put environment variables before `hf-ddpfix rehearse`, not in the "
                              "launch line (the rehearsal passes its environment on)")
    if not tokens:
        raise LaunchLineError("no launch line: give it after `--`, e.g. `hf-ddpfix rehearse -- accelerate launch "
                              "--config_file fsdp.yaml train.py`")
    head = os.path.basename(tokens[0])
    if head == "accelerate":
        if len(tokens) < 2 or tokens[1] != "launch":
            raise LaunchLineError(f"accelerate {' '.join(tokens[1:2])}: only `accelerate launch` is understood")
        return _accelerate(tokens[2:])
    if head == "torchrun":
        return _torchrun(tokens[1:])
    if head == "deepspeed":
        return _deepspeed(tokens[1:])
    if head.startswith("python"):
        rest = tokens[1:]
        if rest[:2] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"]):
            return _torchrun(rest[2:], f"python -m {rest[1]}")
        if rest[:2] == ["-m", "accelerate.commands.launch"]:
            return _accelerate(rest[2:])
        if rest[:1] == ["-m"] and len(rest) > 1:
            return LaunchSpec("python", [], rest[1], True, rest[2:], 1, 1, "single", "python (one process)")
        if rest and not rest[0].startswith("-"):
            script = _script_mode(rest[1:])
            return LaunchSpec("python", [], rest[0], False, rest[1:], 1, 1, script[0] if script else "single",
                              script[1] if script else "python (one process)",
                              notes=["one process: no collective is rehearsed; --nproc N runs the script as N ranks "
                                     "under torch.distributed.run"])
        raise LaunchLineError(f"python {' '.join(rest[:1])}: expected `python script.py` or `python -m module`")
    raise LaunchLineError(f"{tokens[0]!r}: not a launcher the rehearsal understands; use accelerate launch, torchrun, "
                          "python -m torch.distributed.run, deepspeed or python")


def _without(options: list[str], names: set[str], flags: set[str]) -> list[str]:
    out, i = [], 0
    while i < len(options):
        tok = options[i]
        key = tok.split("=")[0]
        if key in names:
            i += 1 if ("=" in tok or key in flags) else 2
            continue
        out.append(tok)
        i += 1
    return out


def rewrite(spec: LaunchSpec, *, processes: int, nodes: int, node_rank: int, port: int,
            python: str = "python", accelerate: str = "accelerate") -> list[str]:
    """The command that runs node ``node_rank`` of ``nodes`` localhost nodes, ``processes`` ranks in all.

    Raises:
        LaunchLineError: ``processes`` not a multiple of ``nodes``.
    """
    if processes % nodes:
        raise LaunchLineError(f"--nproc {processes} is not a multiple of the {nodes} nodes of the launch")
    per_node = processes // nodes
    prog = (["-m", spec.program] if spec.module and spec.launcher != "accelerate" else [spec.program])
    if spec.launcher == "accelerate":
        keep = _without(spec.options, _ACCELERATE_PLACEMENT, _ACCELERATE_FLAGS)
        place = ["--num_processes", str(processes), "--num_machines", str(nodes), "--machine_rank", str(node_rank),
                 "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
        if processes > 1 and not spec.accelerate_config and not _has_flag(keep, "--multi_gpu", "--use_fsdp",
                                                                          "--use_deepspeed"):
            place.append("--multi_gpu")  # no yaml: accelerate would otherwise start one process
        if nodes > 1:
            place += ["--rdzv_backend", "static", "--same_network"] if not _has_flag(keep, "--same_network") else \
                ["--rdzv_backend", "static"]
        return [accelerate, "launch", *keep, *place, *prog, *spec.args]
    keep = _without(spec.options, _TORCHRUN_PLACEMENT, _TORCHRUN_FLAGS) if spec.launcher != "deepspeed" else \
        [t for t in spec.options if t.split("=")[0] in ("--no_python", "--module")]
    place = [f"--nnodes={nodes}", f"--nproc_per_node={per_node}", f"--node_rank={node_rank}",
             "--master_addr=127.0.0.1", f"--master_port={port}"]
    return [python, "-m", "torch.distributed.run", *keep, *place, *prog, *spec.args]
