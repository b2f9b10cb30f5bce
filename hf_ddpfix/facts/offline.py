"""``hf-ddpfix plan``'s run, built without the run: `RunFacts` from the command line and a meta-device model.

Under FSDP the facts come through the run's own functions (`facts.model_facts`, `integrations.fsdp.fsdp_facts`
with the plugin ``accelerate launch`` builds from the yaml: `_compat.fsdp_plugin_from_launch`), and the units the
plan hands accelerate are sharded on a meta copy inside torch's fake process group
(`integrations.fsdp.scale.shard_layout`) for rank 0's bytes. Used by :mod:`hf_ddpfix.cli` and
tests/test_fsdp_scale.py.

Guarantee: for the same model and launch, the plan built here prints the run's plan lines
(tests/test_fsdp_trainer.py, every family of its FSDP2 launches).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .advice import ModelInfo, describe_model

__all__ = ["DEFAULT_FSDP_CONFIG", "DEFAULT_FSDP_MIXED_PRECISION", "OfflinePlan", "add_model_arguments",
           "add_plan_arguments", "build_facts", "fsdp_layout", "json_kwargs", "launch_config", "meta_model",
           "model_info", "model_line", "parse_plan_args", "plan_offline"]


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model options ``hf-ddpfix doctor`` and ``plan`` share (``--model``, ``--config-kwargs``, ``--params``,
    ``--full``, ``--json``)."""
    p.add_argument("--model", help="config.json path, model folder, config class (LlamaConfig), "
                   "model type (llama; its default config: qwen2_5_vl is 75.8 B), or Hub id (needs the network)")
    p.add_argument("--config-kwargs", help='JSON object of config overrides, e.g. \'{"hidden_size": 64}\'')
    p.add_argument("--params", type=float, help="parameter count when no config is at hand, e.g. 7e9")
    p.add_argument("--full", action="store_true", help="full fine-tune (default: LoRA / adapters)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of ``hf-ddpfix plan`` on ``p`` (the CLI's subcommand, and :func:`parse_plan_args` for the
    rehearsal's projection of the real model: one definition, so both read a command line alike)."""
    add_model_arguments(p)
    p.add_argument("--checkpointing", choices=["off", "reentrant", "non_reentrant"], default="off",
                   help="activation checkpointing the run asks for (TrainingArguments)")
    p.add_argument("--find-unused", help="ddp_find_unused_parameters: true/false (default: unset)")
    p.add_argument("--static-graph", help="ddp_static_graph: true/false (default: unset)")
    p.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--world-size", type=int, help="processes of the run (default: --accelerate-config's "
                   "num_processes, else 2); under FSDP2 the per-rank bytes of the units are printed for it")
    p.add_argument("--parallel", choices=["single", "ddp", "fsdp", "deepspeed"])
    p.add_argument("--accelerate-config", help="the accelerate yaml the run is launched with (distributed_type, "
                   "num_processes, mixed_precision, fsdp_config); default under --parallel fsdp: "
                   "accelerate_configs/fsdp.yaml's settings, its mixed_precision bf16 included")
    p.add_argument("--seq-len", type=int, help="tokens per micro-batch on one device (the run's max_length x "
                   "per_device_train_batch_size): the memory facts of the auto options (with --device-mem-gb)")
    p.add_argument("--device-mem-gb", type=float, help="memory of one device for the auto memory plan")
    p.add_argument("--wrap-classes", help="fsdp_transformer_layer_cls_to_wrap, e.g. 'LlamaDecoderLayer,SiglipEncoderLayer'")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the model's parameters (auto: the config's dtype, else float32)")
    p.add_argument("--lora-targets", help="LoRA target_modules of the run (comma list, a regex or all-linear): the "
                   "adapter is put on the meta model and the plan reads its trainable parameters")
    p.add_argument("--lora-target-parameters", help="LoRA target_parameters with --lora-targets (peft: fused MoE "
                   "expert tensors, e.g. 'mlp.experts.gate_up_proj,mlp.experts.down_proj')")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank for --lora-targets")
    p.add_argument("--train-vision", action="store_true", help="LoRA/training on the vision tower or merger")
    p.add_argument("--train-experts", action="store_true", help="MoE experts are trainable (LoRA on them)")
    p.add_argument("--offload", action="store_true", help="activation_checkpointing_kwargs={'offload': True}")
    p.add_argument("--cpu", action="store_true", help="no accelerator (CPU / gloo run)")
    p.add_argument("--quant", choices=["none", "4bit", "8bit"], default="none",
                   help="bitsandbytes base weights (BitsAndBytesConfig load_in_4bit / load_in_8bit)")
    p.add_argument("--quant-storage", default="uint8", choices=["uint8", "bfloat16", "float16", "float32"],
                   help="bnb_4bit_quant_storage (default uint8)")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"],
                   help="TrainingArguments bf16/fp16: the dtype FSDP / DeepSpeed cast parameters to (default: "
                   "--accelerate-config's; under --parallel fsdp without one, fsdp.yaml's bf16; else no)")
    p.add_argument("--fsdp-version", type=int, choices=[1, 2], default=2, help="under --parallel fsdp (default: 2)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=3,
                   help="under --parallel deepspeed (default: 3)")
    p.add_argument("--placement", help="devices one rank's hf_device_map names, e.g. 'cuda:0,cuda:1' "
                   "(device_map='auto' on a 2-GPU node)")
    p.add_argument("--set", action="append", metavar="OPTION=VALUE",
                   help="an hf_ddpfix option as if passed to patch_trainer(), e.g. --set static_graph=0")

def parse_plan_args(argv: Sequence[str]) -> argparse.Namespace:
    """An ``hf-ddpfix plan`` command line (its leading ``plan`` optional) parsed as the CLI parses it."""
    parser = argparse.ArgumentParser(prog="hf-ddpfix plan")
    add_plan_arguments(parser)
    args = list(argv)
    return parser.parse_args(args[1:] if args[:1] == ["plan"] else args)


def json_kwargs(text: str | None) -> dict[str, Any]:
    """``--config-kwargs``: a JSON object of config overrides (``{}`` when not given); bad JSON exits naming the flag."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"hf-ddpfix: --config-kwargs is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise SystemExit("hf-ddpfix: --config-kwargs must be a JSON object")
    return value


def model_info(args: argparse.Namespace) -> tuple[ModelInfo | None, str | None]:
    """``(info, error)``: ``--model`` described from its config, else ``--params`` alone, else ``(None, None)``."""
    if args.model:
        try:
            return describe_model(args.model, json_kwargs(args.config_kwargs)), None
        except ValueError as e:
            if args.params is None:
                return None, str(e)
    if args.params is not None:
        return ModelInfo(f"--params {args.params:g}", "size only", int(args.params), None, None, None, False, False), None
    return None, None


class OfflinePlan:
    """What :func:`plan_offline` returns: ``info`` (the model's description), ``model`` (meta device, the LoRA
    adapter applied), ``plugin`` (the FSDP plugin the launch builds, else ``None``), ``facts``, ``plan`` and
    ``layout`` (the FSDP2 units and per-rank bytes, :class:`~hf_ddpfix.integrations.fsdp.scale.ShardLayout`;
    ``None`` outside FSDP2, when not asked for, or when accelerate refuses the units)."""

    def __init__(self, info: ModelInfo | None, model: Any, plugin: Any, facts: Any, plan: Any, layout: Any) -> None:
        self.info, self.model, self.plugin, self.facts, self.plan, self.layout = info, model, plugin, facts, plan, layout


def plan_offline(args: argparse.Namespace, *, layout: bool = True, env: Any = None) -> OfflinePlan:
    """``hf-ddpfix plan``'s whole computation for the parsed command line ``args``: the meta model, the facts, the
    plan (options from ``--set`` over ``env``, default ``os.environ``) and, under FSDP2, the units and per-rank
    bytes (:func:`fsdp_layout`: the one layout function). The CLI, ``hf-ddpfix rehearse`` (the real-size model of
    a rehearsed launch, and the choices it carries over to the shrunk run) and the GPU suite call this.

    Raises:
        ValueError: a bad command line, accelerate config or model (the message names it).
        PlanError: the plan refuses the run (as the run would before step 1).
    """
    from ..config.options import DDPFixConfig
    from ..plan.resolve import resolve_plan

    launch_config(args)
    info, model, error = meta_model(args)
    if error:
        raise ValueError(error)
    explicit = {}
    for item in getattr(args, "set", None) or []:
        key, _, value = item.partition("=")
        explicit[key.strip()] = value.strip()
    config = DDPFixConfig.from_env(env, **explicit)
    plugin = None
    if args.parallel == "fsdp":
        from .._compat import fsdp_plugin_from_launch

        plugin = fsdp_plugin_from_launch(args.fsdp_config)
        args.fsdp_version = int(plugin.fsdp_version)
    facts = build_facts(args, info, model, plugin)
    plan = resolve_plan(facts, config)
    shards = fsdp_layout(plan, facts, model, plugin, args.world_size, args.mixed_precision) if layout else None
    return OfflinePlan(info, model, plugin, facts, plan, shards)


def _tri(value: str | None) -> bool | None:
    if value is None:
        return None
    from ..config.options import parse_bool

    return parse_bool("flag", value, allow_auto=True)


def build_facts(args: argparse.Namespace, info: ModelInfo | None, model: Any = None, plugin: Any = None) -> Any:
    """`RunFacts` for `hf-ddpfix plan` from the command line and the model description.

    With ``model`` (the meta-device model built from ``--model``, LoRA applied where ``--lora-targets`` names it),
    the model's facts are read from it by the run's own functions (`facts.model_facts`; under FSDP,
    `integrations.fsdp.fsdp_facts` with ``plugin``, the plugin the launch would build); a LoRA run whose targets
    are not given keeps the flags (``--train-vision``, ``--train-experts``)."""
    from ..plan.types import RunFacts

    world = args.world_size
    parallel = _parallel(args)
    ckpt = args.checkpointing
    is_vlm = bool(info and info.is_vlm)
    from_model: dict[str, Any] = {}
    if model is not None:
        from .gather import model_facts

        from_model = model_facts(model, parallel)
        from ..integrations.sequence_parallel.facts import gather_sequence_parallel_facts

        # as the run reads them, for a stock Trainer with default arguments (no parallelism_config, stock loss)
        from_model["sequence_parallel"] = gather_sequence_parallel_facts(None, model)
        from_model["memory"] = _memory_facts(args, model, parallel)
        if not args.full and not args.lora_targets:  # a LoRA run whose adapter the command line does not describe
            from_model.update(is_peft=True, trainable_vision_params=from_model["is_vlm"] and args.train_vision,
                              conditional_params=bool(info and info.is_moe and args.train_experts))
        if parallel == "fsdp" and plugin is not None:
            from ..integrations.fsdp import fsdp_facts

            from_model["fsdp"] = fsdp_facts(plugin, model)
    else:
        from_model = dict(
            is_peft=not args.full, is_vlm=is_vlm,
            vlm_adapter=(info.zero_vlm_adapter if parallel == "deepspeed" else info.vlm_adapter) if info else None,
            trainable_vision_params=is_vlm and (args.train_vision or args.full),
            conditional_params=bool(info and info.is_moe and (args.full or args.train_experts)))
    return RunFacts(
        parallel=parallel, world_size=world, checkpointing=ckpt, **from_model,
        grad_accum_steps=args.ga, user_find_unused=_tri(args.find_unused), user_static_graph=_tri(args.static_graph),
        user_reentrant={"reentrant": True, "non_reentrant": False}.get(ckpt), offload_requested=args.offload,
        accelerator_available=not args.cpu, **_quant_facts(args, info, parallel),
    )


def _memory_facts(args: argparse.Namespace, model: Any, parallel: str) -> Any:
    """The run's `MemoryFacts` (`facts.memory_facts`) from ``--seq-len`` (tokens per micro-batch on one device, as
    the run reads ``max_length x per_device_train_batch_size``) and ``--device-mem-gb``; ``None`` under ``--cpu``
    (a CPU run gathers none) or when neither is given (the run then knows no more than today's rules)."""
    seq, mem = getattr(args, "seq_len", None), getattr(args, "device_mem_gb", None)
    if args.cpu or (seq is None and mem is None):
        return None
    from .gather import memory_facts

    return memory_facts(model, parallel, seq, "--seq-len" if seq is not None else "no --seq-len given",
                        int(mem * (1 << 30)) if mem is not None else None, args.mixed_precision in ("bf16", "fp16"),
                        args.world_size if parallel != "single" else 1)


def _parallel(args: argparse.Namespace) -> str:
    return args.parallel or ("single" if args.world_size == 1 else "ddp")


#: The ``fsdp_config`` of accelerate_configs/fsdp.yaml, used for ``--parallel fsdp`` without ``--accelerate-config``.
DEFAULT_FSDP_CONFIG = {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                       "fsdp_reshard_after_forward": True, "fsdp_cpu_ram_efficient_loading": True,
                       "fsdp_offload_params": False}
#: accelerate_configs/fsdp.yaml's ``mixed_precision``, the default of ``--parallel fsdp`` without
#: ``--accelerate-config`` (with it, accelerate 1.15's ``fsdp2_prepare_model`` keeps trainable parameters in fp32:
#: a bf16 model's LoRA weights take twice the bytes; before 2026-12-02 the default was "no", so the same plan with
#: and without the flag gave different per-rank bytes).
DEFAULT_FSDP_MIXED_PRECISION = "bf16"


def launch_config(args: argparse.Namespace) -> None:
    """Fill ``--parallel``, ``--world-size`` and ``--mixed-precision`` from ``--accelerate-config`` (what
    ``accelerate launch --config_file`` would give the run) where the command line leaves them unset; keep the
    file's ``fsdp_config`` on ``args``."""
    import yaml

    args.fsdp_config = None
    if args.accelerate_config:
        try:
            with open(args.accelerate_config) as f:
                data = yaml.safe_load(f) or {}
        except OSError as e:
            raise ValueError(f"--accelerate-config: cannot read {args.accelerate_config}: {e}") from None
        kind = str(data.get("distributed_type", "")).upper()
        if args.parallel is None:
            args.parallel = {"FSDP": "fsdp", "DEEPSPEED": "deepspeed", "MULTI_GPU": "ddp", "MULTI_CPU": "ddp",
                             "NO": "single"}.get(kind)
        if args.world_size is None and data.get("num_processes"):
            args.world_size = int(data["num_processes"])
        if args.mixed_precision is None and data.get("mixed_precision"):
            args.mixed_precision = str(data["mixed_precision"])
        if kind == "FSDP":
            args.fsdp_config = dict(data.get("fsdp_config") or {})
            args.fsdp_version = int(args.fsdp_config.get("fsdp_version", 1))
    if args.world_size is None:
        args.world_size = 2
    if args.mixed_precision is None:  # fsdp.yaml's under --parallel fsdp without a config: the default IS that file
        args.mixed_precision = DEFAULT_FSDP_MIXED_PRECISION if (args.parallel == "fsdp" and
                                                                not args.accelerate_config) else "no"
    if args.parallel == "fsdp":
        cfg = dict(args.fsdp_config if args.fsdp_config is not None else DEFAULT_FSDP_CONFIG)
        if args.accelerate_config is None:
            cfg["fsdp_version"] = args.fsdp_version
        if args.wrap_classes is not None:
            cfg["fsdp_transformer_layer_cls_to_wrap"] = args.wrap_classes
        args.fsdp_config = cfg


def meta_model(args: argparse.Namespace) -> tuple[ModelInfo | None, Any, str | None]:
    """``(info, model, error)``: ``--model`` built on the meta device in ``--dtype``, with a LoRA adapter on
    ``--lora-targets`` (peft's ``get_peft_model``), or ``--params`` alone (no model)."""
    from .advice import build_meta_model, describe_built

    if not args.model:
        info, error = model_info(args)
        return info, None, error
    try:
        config, model = build_meta_model(args.model, json_kwargs(args.config_kwargs), args.dtype)
    except ValueError as e:
        return None, None, str(e)
    info = describe_built(args.model, config, model)
    if args.lora_targets and not args.full:
        from peft import LoraConfig, get_peft_model

        targets: Any = args.lora_targets
        if targets != "all-linear" and ("," in targets or targets.isidentifier()):  # else a regex
            targets = [t.strip() for t in targets.split(",")]
        extra = {"target_parameters": [t.strip() for t in args.lora_target_parameters.split(",")]
                 } if args.lora_target_parameters else {}
        try:
            model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=targets,
                                                     **extra))
        except ValueError as e:
            return None, None, f"--lora-targets {args.lora_targets!r}: {e}"
    return info, model, None


def _quant_facts(args: argparse.Namespace, info: ModelInfo | None, parallel: str) -> dict[str, Any]:
    """The QLoRA / placement part of `RunFacts` from `--quant`, `--quant-storage`, `--mixed-precision`,
    `--fsdp-version`, `--zero-stage` and `--placement` (4-bit bytes estimated as half the parameters)."""
    from ..integrations.quantized import QuantFacts, device_name, dtype_name

    out: dict[str, Any] = {"placement": tuple(sorted({device_name(d.strip()) for d in args.placement.split(",")}))
                           if args.placement else ()}
    if args.quant != "none":
        four = args.quant == "4bit"
        storage = dtype_name(args.quant_storage) if four else "int8"
        params = int(info.num_params) if info else 0
        out["quant"] = QuantFacts("bnb_4bit" if four else "bnb_8bit", 0, params // 2 if four else params,
                                  storage, None, "nf4" if four else None, None)
    cast = None if args.mixed_precision == "no" else dtype_name(args.mixed_precision)
    if parallel == "fsdp":
        out.update(fsdp_version=args.fsdp_version, shard_cast_dtype=cast)
    elif parallel == "deepspeed":
        from ..integrations.deepspeed.zero import DeepSpeedFacts, deepspeed_version

        out.update(zero_stage=args.zero_stage, shard_cast_dtype=cast,
                   deepspeed=DeepSpeedFacts(stage=args.zero_stage, version=deepspeed_version(), source="command line",
                                            cast_dtype=cast))
    return out


def model_line(info: ModelInfo) -> str:
    kind = f"{info.model_type}{', VLM' if info.is_vlm else ''}{', MoE' if info.is_moe else ''}"
    size = f"{info.num_params / 1e9:.3f}B" if info.num_params >= 1e8 else f"{info.num_params / 1e6:.3f}M"
    line = f"model: {info.source} ({kind}), {size} params, {info.dtype} on the meta device"
    if info.default_config:
        line += (f" -- the DEFAULT config of {info.model_type!r}, not a checkpoint's: pass the model's config.json / "
                 "folder / hub id (or --config-kwargs) for its real size")
    return line


def fsdp_layout(plan: Any, facts: Any, model: Any, plugin: Any, world: int, mixed_precision: str = "no") -> Any:
    """Under FSDP2 with a model: the units accelerate makes with the plan's classes, sharded at ``world`` ranks
    (rank 0) on a meta copy (`integrations.fsdp.scale.shard_layout`); ``None`` otherwise or when accelerate's
    prepare refuses (the plan already says why: e.g. a class the model lacks in an explicit list)."""
    if model is None or plugin is None or plan.parallel != "fsdp" or getattr(facts, "fsdp_version", 2) != 2:
        return None
    import copy

    from .._compat import set_fsdp_wrap_classes
    from ..integrations.fsdp.scale import shard_layout
    from ..plan.fsdp import fsdp_unit_classes, fsdp_units_ours

    plugin = copy.copy(plugin)
    if fsdp_units_ours(plan.fsdp_units):  # what the run's applier hands accelerate (runtime.attach_runtime)
        set_fsdp_wrap_classes(plugin, fsdp_unit_classes(plan.fsdp_units))
    try:
        return shard_layout(model, plugin, world, join_shared=bool(plan.fsdp_shared.value),
                            mixed_precision=mixed_precision)
    except (ValueError, RuntimeError) as e:
        print(f"hf-ddpfix: per-rank bytes not measured: {type(e).__name__}: {e}", file=sys.stderr)
        return None
