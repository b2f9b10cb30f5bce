"""Gather `RunFacts` from a live `Trainer` (and its model) for `resolve_plan`.

Read-only: nothing here changes the trainer, the model or the environment.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch import nn

from .._compat import checkpointing_args, unwrap_parallel
from ..integrations import quantized
from ..integrations.checkpointing import (
    detect_checkpointing,
    requested_checkpointing,
    tool_checkpoint_functions,
)
from ..integrations.deepspeed.zero import gather_deepspeed_facts
from ..integrations.fsdp.units import gather_fsdp_facts
from ..integrations.long_context.layer_kinds import layer_kinds
from ..integrations.sequence_parallel.facts import gather_sequence_parallel_facts
from ..integrations.vision import families
from ..ops.offload.host_memory import DEFAULT_HOST_FRACTION, physical_bytes
from ..plan.types import MemoryFacts, ParallelMode, RunFacts

MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but stay importable without it
        return False
    return isinstance(model, PeftModel)


def _configs(model: nn.Module) -> list[Any]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return []
    out = [cfg]
    for key in ("text_config", "language_config"):
        sub = getattr(cfg, key, None)
        if sub is not None:
            out.append(sub)
    return out


_PER_EXPERT = re.compile(r"(^|\.)experts?\.\d+\.")  # "...mlp.experts.3.up_proj...": one module per expert


def has_conditional_params(model: nn.Module) -> bool:
    """Trainable parameters of per-expert modules (an expert may get no token in a step).

    Fused expert tensors (transformers 5.x ``experts.gate_up_proj`` of shape ``[E, 2I, H]``, and peft's
    ``target_parameters`` LoRA on them) are indexed by the experts that got tokens, so the tensor gets a
    gradient whenever any expert does: observed on the zoo (tests/test_usage.py, Qwen3-MoE leaves nothing
    unused), hence not conditional. Per-expert modules (``experts.<i>.<proj>``) can go unused.
    """
    moe = any((getattr(c, k, None) or 0) > 1 for c in _configs(model) for k in MOE_CONFIG_KEYS)
    if not moe:
        return False
    return any(p.requires_grad and _PER_EXPERT.search(n) for n, p in model.named_parameters())


def parallel_mode(trainer: Any) -> tuple[ParallelMode, int]:
    """("single" | "ddp" | "fsdp" | "deepspeed", world size) as the Trainer's accelerator will wrap the model.

    Mirrors `Accelerator.prepare_model`: multi-device types wrap in DDP when more than one process runs,
    and MULTI_CPU wraps in DDP even with one process (torchrun --nproc_per_node=1).
    """
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    world = int(accelerator.num_processes or 1)
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "deepspeed", world
    if getattr(trainer, "is_fsdp_enabled", False):
        return "fsdp", world
    if accelerator.distributed_type == DistributedType.MULTI_CPU or accelerator.multi_device:
        return "ddp", world
    return "single", world


def launch_world_mismatch(trainer: Any) -> str | None:
    """Why this process, launched as one of ``WORLD_SIZE > 1`` processes (torchrun / accelerate launch), trains
    alone (its Trainer sees world size 1), or `None`.

    Measured (2026-12-02, transformers 5.23, accelerate 1.15, CPU machine): ``accelerate launch --config_file
    ddp_cpu.yaml`` on a script whose ``TrainingArguments`` lack ``use_cpu=True`` gives every rank
    ``DistributedType.NO`` and world size 1: N independent trainings, each on the whole data, each metric printed N
    times, nothing said (issue 46). The cause named: no accelerator and ``use_cpu`` unset; else the launch itself.
    """
    try:
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return None
    seen = int(getattr(trainer.args, "world_size", 1) or 1)
    if launched <= 1 or seen > 1:
        return None
    head = (f"this process was launched as rank {os.environ.get('RANK', '?')} of WORLD_SIZE={launched}, but its "
            "Trainer sees world size 1: every process trains alone (the full data each, no gradient averaging), "
            "not one distributed run. Cause: ")
    if not torch.accelerator.is_available() and not getattr(trainer.args, "use_cpu", False):
        return head + ("no accelerator on this machine and TrainingArguments(use_cpu=False): accelerate sets up the "
                       "gloo process group on CPUs only with use_cpu=True. Fix: TrainingArguments(..., use_cpu=True) "
                       "(docs/testing.md); `hf-ddpfix rehearse` runs a GPU launch line on CPUs (docs/rehearse.md)")
    return head + ("the launch's environment (WORLD_SIZE, RANK, MASTER_ADDR) did not reach the Trainer's "
                   "accelerator (a state built before the launch set it, or a launcher accelerate does not read)")


def _code_names(code: Any) -> set[str]:
    """Every global / attribute name a code object (and the functions nested in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def loss_unseen_reason(trainer: Any) -> str | None:
    """Why the loss this trainer back-propagates may not pass through ``accelerator.backward`` (where
    hf_ddpfix observes it), or `None`.

    Read from the code of the trainer's own ``training_step`` / ``compute_loss`` overrides (every class
    between ``type(trainer)`` and ``transformers.Trainer``): a ``training_step`` that does not call
    ``super().training_step``, or a method that calls ``backward`` without going through the accelerator.
    TRL's trainers (1.x) override ``training_step`` only to add a context or a timer around the stock one.
    Anything not a plain function (a C extension, a callable object) counts as unseen.
    """
    from transformers import Trainer

    for cls in type(trainer).__mro__:
        if cls is Trainer or not issubclass(cls, Trainer):
            break
        for name in ("training_step", "compute_loss"):
            fn = vars(cls).get(name)
            if fn is None:
                continue
            code = getattr(fn, "__code__", None)
            if code is None:
                return f"{cls.__name__}.{name} is not a plain function"
            names = _code_names(code)
            if "backward" in names and "accelerator" not in names:
                return f"{cls.__name__}.{name} calls backward() itself"
            if name == "training_step" and not {"super", "training_step"} <= names:
                return f"{cls.__name__}.training_step does not call Trainer.training_step"
    return None


def model_facts(model: nn.Module, parallel: str) -> dict[str, Any]:
    """The `RunFacts` fields read from the model alone (``is_peft``, ``is_vlm``, ``vlm_adapter``,
    ``trainable_vision_params``, ``conditional_params``, ``long_context_layers``): what `gather_facts` reads in a run, and what
    ``hf-ddpfix plan`` reads from its meta-device model, through this one function."""
    vision = families.is_vision_language_model(model)
    # LLaVA / Gemma 3: a dummy image under ZeRO only; DDP / FSDP keep parameter_usage (families docstring)
    adapter = families.find_vision_adapter(model, zero=parallel == "deepspeed") if vision else None
    return {"is_peft": is_peft_model(model), "is_vlm": vision,
            "vlm_adapter": adapter.family.name if adapter is not None else None,
            "trainable_vision_params": vision and families.has_trainable_vision_params(model),
            "conditional_params": has_conditional_params(model),
            "long_context_layers": layer_kinds(model)}


def gather_facts(trainer: Any, model: nn.Module | None = None) -> RunFacts:
    """Facts about `trainer`'s run: parallel mode, checkpointing, model kind, explicit DDP flags.

    Checkpointing is read from `TrainingArguments.activation_checkpointing(_kwargs)` (`gradient_checkpointing(_kwargs)`
    before transformers 5.23: `_compat.checkpointing_args`) and, when those are off, from the model itself (the
    user may have enabled it before building the Trainer).
    """
    args = trainer.args
    model = unwrap_parallel(model if model is not None else trainer.model)
    parallel, world = parallel_mode(trainer)
    user_reentrant = None
    offload = False
    ckpt_requested, ckpt_kwargs = checkpointing_args(args)
    if ckpt_requested:
        mode, user_reentrant, offload = requested_checkpointing(ckpt_kwargs)
    else:
        mode = detect_checkpointing(model)
    tools = tool_checkpoint_functions(model)
    if tools:  # a trainer / tool installed its own function: what it really runs decides (not the kwargs)
        mode = "reentrant" if any(i.reentrant for i in tools.values()) else "non_reentrant"
    quant = quantized.quantization_facts(model)
    return RunFacts(
        parallel=parallel,
        world_size=world,
        checkpointing=mode,  # type: ignore[arg-type]
        **model_facts(model, parallel),
        grad_accum_steps=int(args.gradient_accumulation_steps or 1),
        user_find_unused=args.ddp_find_unused_parameters,
        user_static_graph=getattr(args, "ddp_static_graph", None),
        user_reentrant=user_reentrant,
        offload_requested=offload,
        accelerator_available=torch.device(args.device).type not in ("cpu", "meta"),
        host_memory_bytes=physical_bytes(),
        local_processes=_local_processes(),
        quant=quant,
        placement=quantized.placement_devices(model),
        rank_device=quantized.device_name(args.device),
        **quantized.sharding_facts(trainer, parallel),
        deepspeed=gather_deepspeed_facts(trainer, model) if parallel == "deepspeed" else None,
        fsdp=gather_fsdp_facts(trainer, trainer.model) if parallel == "fsdp" else None,
        loss_unseen=loss_unseen_reason(trainer),
        sequence_parallel=gather_sequence_parallel_facts(trainer, model),
        checkpoint_function="; ".join(tools) or None,
        memory=gather_memory_facts(trainer, model, parallel),
    )


#: Where a run names its longest sequence, in the order read: TRL's ``SFTConfig.max_length`` (sequences
#: are truncated or packed to it), a ``max_seq_length`` field, then a collator that pads to ``max_length``.
#: Preference / RL configs (DPO, KTO, GRPO, reward: chosen and rejected concatenated, prompt + completion
#: lengths) are not read: their ``max_length`` is not the tokens of one forward. The model config's
#: ``max_position_embeddings`` is not read either: an upper bound far above most runs (128K on Llama 3.1)
#: that would turn every memory feature on.
LENGTH_FIELDS = {"max_length": ("SFTConfig",), "max_seq_length": None}


def tokens_per_step(trainer: Any) -> tuple[int | None, str]:
    """The longest tokens per micro-batch on one device the run names (length x micro-batch size), and
    where it was read; ``(None, why)`` when the run names no length."""
    args = trainer.args
    batch = int(getattr(args, "per_device_train_batch_size", 1) or 1)
    for name, configs in LENGTH_FIELDS.items():
        if configs is not None and not any(c.__name__ in configs for c in type(args).__mro__):
            continue
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value * batch, f"{type(args).__name__}.{name}={value} x per_device_train_batch_size={batch}"
    collator = getattr(trainer, "data_collator", None)
    value = getattr(collator, "max_length", None)
    if getattr(collator, "padding", None) == "max_length" and isinstance(value, int) and value > 0:
        return value * batch, f"{type(collator).__name__}.max_length={value} x per_device_train_batch_size={batch}"
    return None, "the run names no sequence length (args.max_length / max_seq_length, a max_length collator)"


def gather_memory_facts(trainer: Any, model: nn.Module, parallel: str) -> MemoryFacts | None:
    """Device memory, tokens per step and model sizes for the `auto` memory options (plan/memory_fit.py).

    ``None`` unless the run trains on a CUDA device (CPU runs keep today's `auto` rules unchanged). The fixed
    bytes are an estimate: the parameters' bytes plus 12 bytes per trainable parameter (its fp32 gradient
    and AdamW's two moments); under FSDP / ZeRO they are left unknown (the weights are sharded).
    """
    device = torch.device(trainer.args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    tokens, source = tokens_per_step(trainer)
    args = trainer.args
    return memory_facts(model, parallel, tokens, source, int(torch.cuda.get_device_properties(device).total_memory),
                        bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)), _local_processes())


def memory_facts(model: nn.Module, parallel: str, tokens: int | None, source: str, device_total_bytes: int | None,
                 half: bool, local_processes: int = 1) -> MemoryFacts:
    """`MemoryFacts` from the model and what the run names: ``tokens`` per micro-batch on one device (``source``:
    where it was read, or why it is unknown), the device's bytes, ``half`` (bf16/fp16 activations). The run
    (`gather_memory_facts`) and ``hf-ddpfix plan --seq-len`` (its meta-device model) both build them here."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = {n: getattr(text, n, None) for n in ("num_hidden_layers", "hidden_size", "vocab_size")}
    fixed = None
    unknown = "" if tokens is not None else source
    if parallel in ("fsdp", "deepspeed"):
        unknown = unknown or f"{parallel}: weights sharded, the per-device fixed bytes are not projected"
    else:
        fixed = sum(p.numel() * p.element_size() + (12 * p.numel() if p.requires_grad else 0)
                    for p in model.parameters())
    host = physical_bytes()
    return MemoryFacts(
        device_total_bytes=device_total_bytes,
        tokens=tokens, tokens_source=source if tokens is not None else "",
        layers=sizes["num_hidden_layers"], hidden=sizes["hidden_size"], vocab=sizes["vocab_size"],
        dtype_bytes=2 if half else 4,
        fixed_bytes=fixed,
        host_budget_bytes=None if host is None else int(host * DEFAULT_HOST_FRACTION) // max(local_processes, 1),
        unknown=unknown,
    )


def _local_processes() -> int:
    """Training processes on this node (``LOCAL_WORLD_SIZE`` as torchrun / accelerate set it; 1 if unset)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
