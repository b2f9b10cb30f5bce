"""Launch and memory advice as pure functions, and a model description from its config alone.

- :func:`recommend_launch`: DDP / FSDP / ZeRO layout, per-device batch and accumulation for a model size
  and a device budget (pure: numbers in, a :class:`Recommendation` out).
- :func:`describe_model`: parameter count and shape of a model built on the meta device from its config
  (no weights, no memory); :func:`load_config` reads a config from a path, class name, type or Hub id.

Used by ``hf-ddpfix doctor`` / ``plan`` (:mod:`hf_ddpfix.cli`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GiB = 2**30
#: Bytes of training state per *trainable* parameter: fp32 master weight + fp32 gradient + two fp32 AdamW
#: moments (the standard mixed-precision estimate, ZeRO paper §3).
TRAIN_STATE_BYTES = 16
#: Fraction of device memory we plan to use: the rest is CUDA context, allocator fragmentation, NCCL buffers.
USABLE_FRACTION = 0.85
#: Trainable fraction of a LoRA run when not given (r=16 on every linear of a Llama-style model: ~0.5%).
DEFAULT_LORA_FRACTION = 0.005

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
    zero_vlm_adapter: str | None = None  # the adapter under DeepSpeed ZeRO (LLaVA / Gemma 3 too: families docstring)
    default_config: bool = False  # built from a class / model type name with its default sizes (no file, no hub id)
    dtype: str = "float32"  # the parameters' dtype of the meta model


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


def is_default_config(spec: str) -> bool:
    """True when :func:`load_config` reads ``spec`` as a config class or model type name: the class's default
    sizes (``qwen2_5_vl`` is a 75.8 B-parameter default), not a user's model."""
    import transformers
    from transformers import CONFIG_MAPPING

    if os.path.exists(spec):
        return False
    return (spec.endswith("Config") and isinstance(getattr(transformers, spec, None), type)) or spec in CONFIG_MAPPING


def build_meta_model(spec: str, config_kwargs: Mapping[str, Any] | None = None, dtype: str | None = None) -> Any:
    """``(config, model)``: ``spec``'s config (:func:`load_config`) and its model built on the meta device, with
    parameters in ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``; ``None`` / ``"auto"``: the config's own
    ``dtype`` when it names one, else float32, as ``from_pretrained(dtype="auto")`` loads it)."""
    config = load_config(spec, config_kwargs)
    return config, _meta_model(config, _dtype(config, dtype))


def _dtype(config: Any, dtype: str | None) -> Any:
    import torch

    if dtype in (None, "auto"):
        own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = str(own).replace("torch.", "") if own is not None else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: expected auto, float32, bfloat16 or float16, got {dtype!r}")
    return getattr(torch, dtype)


def _meta_model(config: Any, dtype: Any = None) -> Any:
    import torch
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    from ..integrations.vision.parts import tower_config

    classes: list[Any] = [AutoModelForCausalLM]
    try:
        from transformers import AutoModelForImageTextToText

        classes.insert(0 if tower_config(config) is not None else 1, AutoModelForImageTextToText)
    except ImportError:  # pragma: no cover - older transformers
        pass
    if getattr(config, "is_encoder_decoder", False):
        classes.insert(0, transformers.AutoModelForSeq2SeqLM)
    # a checkpoint's config.json names the class it was saved from: the model users load
    named = [getattr(transformers, a, None) for a in (getattr(config, "architectures", None) or [])]
    classes = [c for c in named if isinstance(c, type)] + classes
    classes.append(AutoModel)
    last: Exception | None = None
    for cls in classes:
        try:
            with torch.device("meta"):
                if hasattr(cls, "from_config"):  # an auto class
                    return cls.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
                default = torch.get_default_dtype()  # a model class: built in the default dtype
                torch.set_default_dtype(dtype or default)
                try:
                    return cls(config)
                finally:
                    torch.set_default_dtype(default)
        except Exception as e:  # noqa: BLE001 - try the next auto class
            last = e
    raise ValueError(f"cannot build {type(config).__name__} on the meta device: {last}; pass --params instead")


def describe_model(spec: str, config_kwargs: Mapping[str, Any] | None = None) -> ModelInfo:
    """Parameter count and shape of the model `spec` names, built on the meta device (no memory)."""
    config, model = build_meta_model(spec, config_kwargs, "float32")
    return describe_built(spec, config, model)


def describe_built(spec: str, config: Any, model: Any) -> ModelInfo:
    """:class:`ModelInfo` of a model built from ``config`` (:func:`build_meta_model`)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    from ..integrations.vision.families import find_vision_adapter
    from ..integrations.vision.parts import tower_config

    is_vlm = tower_config(config) is not None
    adapter = zero_adapter = None
    if is_vlm:
        found = find_vision_adapter(model)
        adapter = found.family.name if found is not None else None
        found = find_vision_adapter(model, zero=True)
        zero_adapter = found.family.name if found is not None else None
    from .gather import MOE_CONFIG_KEYS  # here, not at module level: `hf-ddpfix --help` imports no torch

    return ModelInfo(
        source=spec,
        model_type=str(getattr(config, "model_type", type(config).__name__)),
        num_params=sum(p.numel() for p in model.parameters()),
        hidden_size=getattr(text, "hidden_size", None),
        num_layers=getattr(text, "num_hidden_layers", None),
        vocab_size=getattr(text, "vocab_size", None),
        is_vlm=is_vlm,
        is_moe=any((getattr(c, k, None) or 0) > 1 for c in (config, text) for k in MOE_CONFIG_KEYS),
        vlm_adapter=adapter,
        zero_vlm_adapter=zero_adapter,
        default_config=is_default_config(spec),
        dtype=str(next(iter(model.parameters())).dtype).replace("torch.", "") if any(True for _ in model.parameters())
        else "float32",
    )


def qlora_advice(bitsandbytes_version: str | None, num_devices: int = 1, accelerator: bool = True) -> list[str]:
    """What `hf-ddpfix doctor` says about QLoRA (bitsandbytes 4-bit base + adapters) on this machine.

    Pure. Each line is a rule the plan enforces or a setting that decides memory, with the reason
    (measured with bitsandbytes 0.50.2 on 2 gloo processes; see `hf_ddpfix.plan.quantized.decide_quantization`).

    Args:
        bitsandbytes_version: the installed version, `None` when not installed.
        num_devices: devices per node the run will use (the DDP / sharding lines only matter above 1).
        accelerator: False for CPU processes (`doctor --cpu`, or no GPU here): the model is loaded with
            `device_map="cpu"`, since `{'': 0}` fails there.

    Returns:
        Lines without a leading bullet; the first says whether QLoRA is available.
    """
    if bitsandbytes_version is None:
        return ["bitsandbytes not installed: QLoRA (BitsAndBytesConfig(load_in_4bit=True)) unavailable "
                "(pip install bitsandbytes)"]
    lines = [f"bitsandbytes {bitsandbytes_version}: QLoRA available (load_in_4bit / load_in_8bit)"]
    if not accelerator:
        lines.append("no accelerator: load with device_map='cpu' and bnb_4bit_compute_dtype=torch.float32 on every "
                     "process (device_map={'': 0} fails: 'Cannot access accelerator device when none is "
                     "available'); keep each quantized layer's input width a multiple of 64 (bitsandbytes 0.50's "
                     "CPU evaluation path repacks 4-bit weights in blocks of 64)")
    elif num_devices <= 1:
        lines.append("one device: load with device_map={'': 0}; nothing to shard")
    if num_devices <= 1:
        return lines
    if accelerator:
        lines.append("DDP: load each rank's model on its own device, device_map={'': int(os.environ['LOCAL_RANK'])}; "
                     "device_map='auto' under torchrun spreads every rank over all GPUs (hf_ddpfix raises "
                     "PlacementError)")
    lines += [
        "DDP: prepare_model_for_kbit_training's default reentrant checkpointing fails stock DDP ('ready only "
        "once'); under hf_ddpfix the plan switches it to non-reentrant (same weights)",
        "FSDP2 / ZeRO-3 with bf16: bnb_4bit_quant_storage=torch.bfloat16 (and torch_dtype=torch.bfloat16) so the "
        "4-bit weights are sharded and never value-cast; a float storage that differs from the mixed-precision "
        "dtype is refused (QuantStorageError)",
        "FSDP2 with the default uint8 storage trains but accelerate keeps the 4-bit weights unsharded (no memory "
        "saving); ZeRO-3 partitions uint8 storage; FSDP1 needs float storage equal to every other parameter's dtype",
    ]
    return lines
