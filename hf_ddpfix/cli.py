"""`hf-ddpfix` command line: `doctor` (environment check + launch advice) and `plan` (dry-run plan).

    hf-ddpfix doctor                                  # versions, devices, backends, HF_DDPFIX_* settings
    hf-ddpfix doctor --model path/to/config.json      # + a launch recommendation for that model
    hf-ddpfix doctor --model LlamaConfig --config-kwargs '{"hidden_size": 4096, ...}'
    hf-ddpfix doctor --params 7e9 --devices 8 --device-mem-gb 80 --full --json
    hf-ddpfix plan --model Qwen/Qwen2.5-VL-7B-Instruct --checkpointing reentrant --world-size 8 --ga 4
    python -m hf_ddpfix doctor                        # same thing

Nothing here launches processes, initialises torch.distributed or downloads weights: models are built
on the meta device from their config only (a Hub id needs the network for its config.json).

Guarantees: `doctor` reports an invalid `HF_DDPFIX_*` value (and unknown `HF_DDPFIX_*` names) instead of
crashing, and exits 1 when it found one; `recommend_launch` is a pure function.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

GiB = 2**30
#: Bytes of training state per *trainable* parameter: fp32 master weight + fp32 gradient + two fp32 AdamW
#: moments (the standard mixed-precision estimate, ZeRO paper §3).
TRAIN_STATE_BYTES = 16
#: Fraction of device memory we plan to use: the rest is CUDA context, allocator fragmentation, NCCL buffers.
USABLE_FRACTION = 0.85
#: Trainable fraction of a LoRA run when not given (r=16 on every linear of a Llama-style model: ~0.5%).
DEFAULT_LORA_FRACTION = 0.005
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_PACKAGES = ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "hf-ddpfix")
#: HF_DDPFIX_* variables that are not `DDPFixConfig` options.
_EXTRA_VARS = {"HF_DDPFIX_DISABLE": "patches/sitecustomize.py: 1 turns the zero-code patch off"}
_RELATED_VARS = ("TORCH_DISTRIBUTED_DEBUG", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                 "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_FSDP")


# ----------------------------------------------------------------------------------------------------
# Launch recommendation (pure)
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recommendation:
    """How to launch a run, and why.

    Attributes:
        mode: "single" (one process), "ddp" (replicas) or "fsdp" (sharded).
        fits: the estimate fits in device memory with at least one sample per device.
        world_size: processes (devices) in the launch.
        per_device_batch / grad_accum: sequences per device per micro-step, and accumulation steps to
            reach `target_global_batch`.
        bytes_per_device: estimated peak bytes per device at `per_device_batch`.
        launch: a command line to start it.
        reasons: one line per decision.
    """

    mode: str
    fits: bool
    world_size: int
    per_device_batch: int
    grad_accum: int
    bytes_per_device: int
    launch: str
    reasons: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["reasons"] = list(self.reasons)
        d["gb_per_device"] = round(self.bytes_per_device / GiB, 2)
        return d


def _shape_guess(num_params: float) -> tuple[int, int]:
    """(layers, hidden) of a Llama-like model with `num_params` (P ~ 12 L h^2; L ~ 16 (P/1e9)^(1/3))."""
    layers = max(2, round(16 * (num_params / 1e9) ** (1 / 3)))
    hidden = max(64, int(math.sqrt(num_params / (12 * layers))))
    return layers, hidden


def _pow2_floor(x: float, cap: int) -> int:
    if x < 1:
        return 0
    return min(cap, 2 ** int(math.log2(x)))


def recommend_launch(
    num_params: float,
    device_mem_bytes: float,
    num_devices: int,
    lora: bool,
    *,
    num_nodes: int = 1,
    dtype_bytes: int = 2,
    seq_len: int = 2048,
    hidden_size: int | None = None,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    trainable_fraction: float | None = None,
    target_global_batch: int = 32,
    max_per_device_batch: int = 16,
    accelerator: bool = True,
) -> Recommendation:
    """Recommend single device / DDP / FSDP and a batch layout from a memory estimate.

    Estimate per device (activation checkpointing on, as hf_ddpfix plans it):
    weights `P * dtype_bytes` (frozen base for LoRA) + `TRAIN_STATE_BYTES` per trainable parameter,
    divided by the world size under FSDP (+ two gathered layers), plus per sequence
    `seq * hidden * dtype_bytes * (layers + 20)` (checkpointed layer inputs + one layer's recompute)
    + `seq * vocab * 8` (fp32 logits and their gradient). Unknown shapes are guessed from `num_params`.

    Args:
        num_params: total parameters of the model.
        device_mem_bytes: memory of ONE device (bytes).
        num_devices: devices per node; num_nodes: nodes.
        lora: LoRA/adapters (frozen base) rather than a full fine-tune.
        dtype_bytes: bytes per weight/activation element (2 for bf16/fp16).
        trainable_fraction: trainable share of `num_params` (default: 1.0 full, 0.005 LoRA).
        target_global_batch: sequences per optimizer step the advice aims for.
        accelerator: False for a CPU-only machine (gloo processes instead of GPUs).

    Returns:
        A `Recommendation` whose `reasons` explain every choice.

    Raises:
        ValueError: a non-positive size, memory or device count.
    """
    if num_params <= 0 or device_mem_bytes <= 0 or num_devices < 1 or num_nodes < 1 or seq_len < 1:
        raise ValueError("num_params, device_mem_bytes, num_devices, num_nodes and seq_len must be positive")
    world = num_devices * num_nodes
    layers_guess, hidden_guess = _shape_guess(num_params)
    guessed = hidden_size is None or num_layers is None
    layers = num_layers or layers_guess
    hidden = hidden_size or hidden_guess
    vocab = vocab_size or 32000
    frac = trainable_fraction if trainable_fraction is not None else (DEFAULT_LORA_FRACTION if lora else 1.0)
    trainable = num_params * frac
    weights = num_params * dtype_bytes if lora else 0.0  # full FT: the fp32 master copy is in TRAIN_STATE
    state = weights + trainable * TRAIN_STATE_BYTES
    per_sample = seq_len * hidden * dtype_bytes * (layers + 20) + seq_len * vocab * 8
    usable = device_mem_bytes * USABLE_FRACTION
    reasons: list[str] = []
    what = (f"LoRA ({frac:.1%} trainable)" if lora else "full fine-tune") + f", {num_params / 1e9:.2f}B params"
    reasons.append(f"{what}: training state {state / GiB:.1f} GiB "
                   f"({'bf16 frozen weights + ' if lora else ''}{TRAIN_STATE_BYTES} B per trainable param)")
    reasons.append(f"activations ~{per_sample / GiB:.2f} GiB per {seq_len}-token sequence with checkpointing"
                   + (" (shape guessed from the parameter count)" if guessed else ""))

    # per-device batch: what fits, but no more than the target needs (a power of two at or above
    # target/world), so accumulation makes up the rest instead of overshooting the global batch
    enough = 2 ** math.ceil(math.log2(max(1, math.ceil(target_global_batch / world))))

    def layout(static: float) -> tuple[int, int]:
        b = min(_pow2_floor((usable - static) / per_sample, max_per_device_batch), enough)
        ga = max(1, math.ceil(target_global_batch / max(1, b * world))) if b else 0
        return b, ga

    sharded_static = state / world + 2 * (num_params / layers) * dtype_bytes  # + two gathered layers
    b_rep, ga_rep = layout(state)
    b_sh, ga_sh = layout(sharded_static)
    device = "GPU" if accelerator else "CPU process"
    if world == 1:
        mode, fits, b, ga, static = "single", b_rep > 0, b_rep, max(1, math.ceil(target_global_batch / max(1, b_rep))), state
        reasons.append(f"one {device}: no replication or sharding to choose")
    elif b_rep > 0:
        mode, fits, b, ga, static = "ddp", True, b_rep, ga_rep, state
        reasons.append(f"the whole training state fits on one {device} ({state / GiB:.1f} of {usable / GiB:.1f} "
                       "usable GiB): DDP replicas, the least communication"
                       + (" (LoRA: only the adapter gradients are all-reduced)" if lora else ""))
        if b_sh > 2 * b_rep and b_rep < 4:
            reasons.append(f"FSDP would allow {b_sh} sequences per device instead of {b_rep}; prefer it if the "
                           "per-device batch limits throughput")
    else:
        mode, b, ga, static = "fsdp", b_sh, ga_sh, sharded_static
        fits = b_sh > 0
        reasons.append(f"the training state ({state / GiB:.1f} GiB) does not fit on one {device} "
                       f"({usable / GiB:.1f} usable GiB): FSDP shards it to {sharded_static / GiB:.1f} GiB each")
    if not fits and static > usable:
        needed = math.ceil(state / max(usable - 2 * (num_params / layers) * dtype_bytes - per_sample, 1))
        tips = [] if lora else ["LoRA instead of a full fine-tune"]
        tips.append(f"about {needed} devices of this size (more nodes) so FSDP shards fit")
        if accelerator:
            tips.append("FSDP CPU offload (fsdp_offload_params: true), slower")
        reasons.append(f"the training state alone ({static / GiB:.1f} GiB per device) exceeds the usable "
                       "memory: " + "; ".join(tips))
    elif not fits:
        tips = ["HF_DDPFIX_TILED_LOSS=auto (the logits are never materialised)", f"a max length below {seq_len}"]
        if accelerator:
            tips.append("HF_DDPFIX_OFFLOAD_ACTIVATIONS=1 (checkpointed layer inputs to pinned host memory)")
        reasons.append(f"the state fits but one {seq_len}-token sequence of activations does not: " + "; ".join(tips))
    else:
        reasons.append(f"per-device batch {b} (the largest power of two that fits, capped by the target), "
                       f"gradient accumulation {ga} -> global batch {b * ga * world} (target {target_global_batch})")
        if ga > 1 and mode == "ddp":
            reasons.append("gradient accumulation > 1: hf_ddpfix keeps DDP static_graph off (no_sync breaks it)")
    total = static + max(b, 1) * per_sample
    launch = _launch_command(mode, num_devices, num_nodes, accelerator)
    return Recommendation(mode, fits, world, b, ga if fits else 0, int(total), launch, tuple(reasons))


def _launch_command(mode: str, num_devices: int, num_nodes: int, accelerator: bool) -> str:
    if mode == "single":
        return "python train.py"
    if num_nodes > 1:
        if mode == "fsdp":
            return (f"ACCELERATE_CONFIG=accelerate_configs/multinode_fsdp.yaml sbatch --nodes={num_nodes} "
                    f"--gpus-per-node={num_devices} examples/slurm/train_accelerate.sbatch train.py")
        return (f"sbatch --nodes={num_nodes} --gpus-per-node={num_devices} examples/slurm/train_ddp.sbatch train.py"
                "   # or examples/slurm/train_accelerate.sbatch (accelerate_configs/multinode_ddp.yaml)")
    if not accelerator:
        return f"accelerate launch --config_file accelerate_configs/ddp_cpu.yaml --num_processes {num_devices} train.py"
    cfg = "fsdp.yaml" if mode == "fsdp" else "ddp.yaml"
    alt = f"   # or: torchrun --nproc_per_node={num_devices} train.py" if mode == "ddp" else ""
    return f"accelerate launch --config_file accelerate_configs/{cfg} --num_processes {num_devices} train.py{alt}"


# ----------------------------------------------------------------------------------------------------
# Model description from a config (meta device: no weights)
# ----------------------------------------------------------------------------------------------------


@dataclass
class ModelInfo:
    source: str
    model_type: str
    num_params: int
    hidden_size: int | None
    num_layers: int | None
    vocab_size: int | None
    is_vlm: bool
    is_moe: bool
    vlm_adapter: str | None = None


def load_config(spec: str, config_kwargs: Mapping[str, Any] | None = None) -> Any:
    """A transformers config from a config.json path, a model folder, a config class name
    (`LlamaConfig`), a model type (`llama`), or a Hub id (needs the network or the local cache).

    Raises:
        ValueError: with what was tried and the `--params` fallback.
    """
    import transformers
    from transformers import AutoConfig

    kwargs = dict(config_kwargs or {})
    try:
        if os.path.isfile(spec):
            with open(spec) as f:
                data = json.load(f)
            data.update(kwargs)
            model_type = data.pop("model_type", None)
            if model_type is None:
                raise ValueError(f"{spec} has no 'model_type'")
            return AutoConfig.for_model(model_type, **data)
        if os.path.isdir(spec):
            return AutoConfig.from_pretrained(spec, **kwargs)
        if spec.endswith("Config") and isinstance(getattr(transformers, spec, None), type):
            return getattr(transformers, spec)(**kwargs)
        from transformers import CONFIG_MAPPING

        if spec in CONFIG_MAPPING:
            return AutoConfig.for_model(spec, **kwargs)
        return AutoConfig.from_pretrained(spec, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the user with the fallback
        raise ValueError(f"cannot read a model config from {spec!r}: {type(e).__name__}: {str(e)[:300]}. "
                         "Pass a local config.json / model folder, a config class name with --config-kwargs, "
                         "or the size with --params (e.g. --params 7e9)") from e


def _meta_model(config: Any) -> Any:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    classes: list[Any] = [AutoModelForCausalLM]
    try:
        from transformers import AutoModelForImageTextToText

        classes.insert(0 if getattr(config, "vision_config", None) is not None else 1, AutoModelForImageTextToText)
    except ImportError:  # pragma: no cover - older transformers
        pass
    classes.append(AutoModel)
    last: Exception | None = None
    for cls in classes:
        try:
            with torch.device("meta"):
                return cls.from_config(config)
        except Exception as e:  # noqa: BLE001 - try the next auto class
            last = e
    raise ValueError(f"cannot build {type(config).__name__} on the meta device: {last}; pass --params instead")


def describe_model(spec: str, config_kwargs: Mapping[str, Any] | None = None) -> ModelInfo:
    """Parameter count and shape of the model `spec` names, built on the meta device (no memory)."""
    config = load_config(spec, config_kwargs)
    model = _meta_model(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    is_vlm = getattr(config, "vision_config", None) is not None
    adapter = None
    if is_vlm:
        try:
            from .vlm import find_vision_adapter

            found = find_vision_adapter(model)
            adapter = found.name if found is not None else None
        except Exception:  # noqa: BLE001 - adapter lookup is advisory here
            adapter = None
    return ModelInfo(
        source=spec,
        model_type=str(getattr(config, "model_type", type(config).__name__)),
        num_params=sum(p.numel() for p in model.parameters()),
        hidden_size=getattr(text, "hidden_size", None),
        num_layers=getattr(text, "num_hidden_layers", None),
        vocab_size=getattr(text, "vocab_size", None),
        is_vlm=is_vlm,
        is_moe=any((getattr(c, k, None) or 0) > 1 for c in (config, text) for k in _MOE_KEYS),
        vlm_adapter=adapter,
    )


# ----------------------------------------------------------------------------------------------------
# Environment checks
# ----------------------------------------------------------------------------------------------------


def check_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every HF_DDPFIX_* / compatibility variable that is set, each parsed on its own.

    Returns:
        {"settings": [{"var", "value", "option", "ok", "error"}], "unknown": [{"var", "did_you_mean"}],
         "config": [resolved option lines] or None, "config_error": str or None, "related": {var: value}}
    """
    from .config import OPTIONS, DDPFixConfig, env_name

    env = os.environ if env is None else env
    settings, known = [], set(_EXTRA_VARS)
    for option, opt in OPTIONS.items():
        for var in (env_name(option), *opt.compat):
            known.add(var)
            if var not in env:
                continue
            entry = {"var": var, "value": env[var], "option": option, "ok": True, "error": None}
            try:
                if var == env_name(option) or var in ("UNSLOTH_TILED_MLP",):
                    opt.parse(var, env[var])
                else:
                    from .config import parse_bool

                    parse_bool(var, env[var])
            except ValueError as e:
                entry.update(ok=False, error=str(e))
            settings.append(entry)
    for var, doc in _EXTRA_VARS.items():
        if var in env:
            settings.append({"var": var, "value": env[var], "option": None, "ok": True, "error": None, "doc": doc})
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
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in _PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
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


def _json_kwargs(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"hf-ddpfix: --config-kwargs is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise SystemExit("hf-ddpfix: --config-kwargs must be a JSON object")
    return value


def _model_info(args: argparse.Namespace) -> tuple[ModelInfo | None, str | None]:
    if args.model:
        try:
            return describe_model(args.model, _json_kwargs(args.config_kwargs)), None
        except ValueError as e:
            if args.params is None:
                return None, str(e)
    if args.params is not None:
        return ModelInfo(f"--params {args.params:g}", "size only", int(args.params), None, None, None, False, False), None
    return None, None


def _doctor(args: argparse.Namespace) -> int:
    import torch

    report: dict[str, Any] = {"versions": _versions(), "devices": _devices(), "distributed": _backends(),
                              "env": check_env()}
    info, model_error = _model_info(args)
    report["model"] = dataclasses.asdict(info) if info else None
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
          f"{m['num_params'] / 1e9:.3f}B params{shape}")
    rec = r.get("recommendation")
    if rec:
        p(f"  recommendation: {rec['mode'].upper()} on {rec['world_size']} device(s)"
          + ("" if rec["fits"] else " -- does NOT fit as configured"))
        for reason in rec["reasons"]:
            p(f"    - {reason}")
        p(f"    launch: {rec['launch']}")
    elif not m:
        p("  recommendation: pass --model (config.json, folder, config class, hub id) or --params 7e9")


def _tri(value: str | None) -> bool | None:
    if value is None:
        return None
    from .config import parse_bool

    return parse_bool("flag", value, allow_auto=True)


def build_facts(args: argparse.Namespace, info: ModelInfo | None) -> Any:
    """`RunFacts` for `hf-ddpfix plan` from the command line and the model description."""
    from .plan import RunFacts

    world = args.world_size
    parallel = args.parallel or ("single" if world == 1 else "ddp")
    ckpt = args.checkpointing
    is_vlm = bool(info and info.is_vlm)
    return RunFacts(
        parallel=parallel, world_size=world, checkpointing=ckpt, is_peft=not args.full, is_vlm=is_vlm,
        vlm_adapter=info.vlm_adapter if info else None,
        trainable_vision_params=is_vlm and (args.train_vision or args.full),
        conditional_params=bool(info and info.is_moe and (args.full or args.train_experts)),
        grad_accum_steps=args.ga, user_find_unused=_tri(args.find_unused), user_static_graph=_tri(args.static_graph),
        user_reentrant={"reentrant": True, "non_reentrant": False}.get(ckpt), offload_requested=args.offload,
        accelerator_available=not args.cpu,
    )


def _plan(args: argparse.Namespace) -> int:
    from .config import DDPFixConfig
    from .plan import PlanError, resolve_plan

    info, model_error = _model_info(args)
    if model_error:
        print(f"hf-ddpfix: {model_error}", file=sys.stderr)
        return 2
    explicit = {}
    for item in args.set or []:
        key, _, value = item.partition("=")
        explicit[key.strip()] = value.strip()
    try:
        config = DDPFixConfig.from_env(**explicit)
        facts = build_facts(args, info)
        plan = resolve_plan(facts, config)
    except (ValueError, PlanError) as e:
        print(f"hf-ddpfix: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {"facts": dataclasses.asdict(facts), "ddp_kwargs": plan.ddp_kwargs(),
               "decisions": {k: dataclasses.asdict(d) for k, d in plan.decisions().items()},
               "corrections": list(plan.corrections), "report": plan.report()}
        print(json.dumps(out, indent=2, default=str))
        return 0
    if info is not None:
        print(f"model: {info.source} ({info.model_type}{', VLM' if info.is_vlm else ''}"
              f"{', MoE' if info.is_moe else ''}), {info.num_params / 1e9:.3f}B params")
    print(plan.report())
    if plan.parallel == "ddp":
        print(f"DDP kwargs: {plan.ddp_kwargs()}")
    return 0


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="hf-ddpfix", description=__doc__.split("\n\n")[0])
    sub = top.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", help="config.json path, model folder, config class (LlamaConfig), "
                       "model type (llama), or Hub id (needs the network)")
        p.add_argument("--config-kwargs", help='JSON object of config overrides, e.g. \'{"hidden_size": 64}\'')
        p.add_argument("--params", type=float, help="parameter count when no config is at hand, e.g. 7e9")
        p.add_argument("--full", action="store_true", help="full fine-tune (default: LoRA / adapters)")
        p.add_argument("--json", action="store_true", help="machine-readable output")

    d = sub.add_parser("doctor", help="versions, devices, backends, settings, launch recommendation")
    model_args(d)
    d.add_argument("--devices", type=int, help="devices per node to plan for (default: the GPUs here)")
    d.add_argument("--device-mem-gb", type=float, help="memory of one device (default: the smallest GPU here)")
    d.add_argument("--nodes", type=int, default=1)
    d.add_argument("--seq-len", type=int, default=2048)
    d.add_argument("--global-batch", type=int, default=32, help="target sequences per optimizer step")
    d.add_argument("--cpu", action="store_const", const=True, default=None, help="plan for CPU processes")
    d.set_defaults(func=_doctor)

    p = sub.add_parser("plan", help="print the hf_ddpfix plan for a run, without training")
    model_args(p)
    p.add_argument("--checkpointing", choices=["off", "reentrant", "non_reentrant"], default="off",
                   help="activation checkpointing the run asks for (TrainingArguments)")
    p.add_argument("--find-unused", help="ddp_find_unused_parameters: true/false (default: unset)")
    p.add_argument("--static-graph", help="ddp_static_graph: true/false (default: unset)")
    p.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--parallel", choices=["single", "ddp", "fsdp", "deepspeed"])
    p.add_argument("--train-vision", action="store_true", help="LoRA/training on the vision tower or merger")
    p.add_argument("--train-experts", action="store_true", help="MoE experts are trainable (LoRA on them)")
    p.add_argument("--offload", action="store_true", help="activation_checkpointing_kwargs={'offload': True}")
    p.add_argument("--cpu", action="store_true", help="no accelerator (CPU / gloo run)")
    p.add_argument("--set", action="append", metavar="OPTION=VALUE",
                   help="an hf_ddpfix option as if passed to patch_trainer(), e.g. --set static_graph=0")
    p.set_defaults(func=_plan)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-ddpfix` and `python -m hf_ddpfix`. Returns the exit status."""
    args = _parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
