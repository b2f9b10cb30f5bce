"""The REAL model of a rehearsal: its plan, the choices carried over to the shrunk run, and its per-rank memory.

A rehearsal runs a shrunk model; every choice the plan makes from the model's SIZE must still be the real launch's,
or the rehearsal checks other collectives than the GPUs will run (issue 46: the shrunk Mllama folded its tower and
cross-attention layers into the root, 10 units, where the real 90 B model shards them, 146 units, dummy on). So:

- in every rank, when the script loads a checkpoint (:func:`carry_over`, called by ``loading._from_pretrained``),
  the real config is planned by ``hf-ddpfix plan``'s own computation (:func:`hf_ddpfix.facts.offline.plan_offline`:
  the real-size meta model, the launch's accelerate config, the real world size) and its size-dependent choices
  (:data:`CARRIED`: ``fsdp_skippable``, fold or shard) are forced on the shrunk run through their ``HF_DDPFIX_*``
  variables (an option the user set keeps its value); the rank's record lists them;
- the report's projection (:func:`project_memory`) is that same plan with its FSDP2 units and per-rank bytes
  (:mod:`hf_ddpfix.integrations.fsdp.scale`, the one layout model): the ``hf-ddpfix plan`` command printed with it
  gives the same units and bytes. The trainable set is the shrunk run's mapped onto the real model: LoRA matrices
  on ``layers.N.self_attn.q_proj`` become a LoRA of the same rank on every real module of that path (layer numbers
  as wildcards); a run training at least half the parameters is a full fine-tune.

Not carried over (the rehearsal cannot know them): the ``auto`` memory options (tiled loss / MLP, activation
offload, long-context layers) choose from the real device's memory and sequence lengths; the report says so.

Per rank outside FSDP2 (DDP, ZeRO-2/3; pure arithmetic, no units): weights (all of them; 1/world under ZeRO-3 plus
two of the largest block gathered), gradients (fp32 trainable, divided by world under ZeRO, doubled by DDP's
buckets), Adam (8 bytes per trainable parameter, + 4 for ZeRO's fp32 master copy, divided by world under ZeRO).

Guarantees: no weights are read and no device is queried; :func:`project_memory` returns ``(None, reason)`` when the
real model cannot be built on the meta device; :func:`carry_over` never raises (a failure is recorded, the
rehearsal runs the shrunk model's own plan and says so).
"""

from __future__ import annotations

import os
import re
from typing import Any

from .._compat.models import no_split_modules

__all__ = ["CARRIED", "carry_over", "project_memory", "real_plan", "real_plan_argv"]

GIB = 1 << 30
#: The plan's choices made from the model's size, forced on the shrunk run (decision name = option name).
CARRIED = ("fsdp_skippable",)
_DIGITS = re.compile(r"\.\d+(?=\.|$)")
_PEFT_PREFIX = ("base_model.model.",)
_LORA = re.compile(r"\.lora_(A|B|embedding_A|embedding_B)\.[^.]+(\.weight)?$")


def _strip(name: str) -> str:
    for prefix in _PEFT_PREFIX:
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def _pattern(name: str) -> str:
    return _DIGITS.sub(".*", _strip(name))


def _regex(name: str) -> str:
    """A module path with its layer numbers as ``\\d+`` (what peft's regex ``target_modules`` fullmatches)."""
    return r"\.\d+".join(re.escape(part) for part in _DIGITS.split(_strip(name)))


def _dtype_bytes(dtype: str, quantized: bool) -> float:
    if quantized:
        return 0.5
    return 2.0 if any(t in dtype for t in ("bfloat16", "float16", "bf16", "fp16", "half")) else 4.0


def _dtype_arg(dtype: str) -> str:
    for name in ("bfloat16", "float16", "float32"):
        if name in (dtype or ""):
            return name
    return "auto"


def real_trainable(model: Any, trainable: list[tuple[str, list[int]]]) -> int:
    """Trainable parameters of the real ``model`` matching the shrunk run's trainable names (see module doc)."""
    lora: dict[str, int] = {}
    plain: set[str] = set()
    for name, shape in trainable:
        m = _LORA.search(name)
        if m:
            module = _pattern(name[:m.start()])
            r = int(shape[0] if m.group(1) in ("A", "embedding_A") else shape[-1])
            lora[module] = r
        else:
            plain.add(_pattern(name.replace(".base_layer", "")))
    total = 0
    if lora:
        for mname, module in model.named_modules():
            r = lora.get(_pattern(mname))
            if r is None:
                continue
            w = getattr(module, "weight", None)
            if w is not None and w.dim() == 2:
                total += r * (w.shape[0] + w.shape[1])
    if plain:
        total += sum(p.numel() for n, p in model.named_parameters() if _pattern(n) in plain)
    return total


def _lora_args(trainable: list[tuple[str, list[int]]] | None) -> list[str]:
    """``--lora-targets REGEX --lora-r R`` for the shrunk run's LoRA matrices, ``--full`` for a run that trains
    parameters without any LoRA matrix (a full fine-tune), ``[]`` when the trainable set is unknown (the plan's
    LoRA flags). Trainable parameters beside LoRA (``modules_to_save``) are not carried into the real model."""
    if not trainable:
        return []
    modules: dict[str, int] = {}
    for name, shape in trainable:
        m = _LORA.search(name)
        if m and m.group(1) in ("A", "B"):
            modules[_regex(name[:m.start()])] = int(shape[0] if m.group(1) == "A" else shape[-1])
    if not modules:
        return ["--full"]
    rank = max(set(modules.values()), key=list(modules.values()).count)
    return ["--lora-targets", "|".join(sorted(modules)), "--lora-r", str(rank)]


def _config_folder(m: dict[str, Any], folder: str) -> str:
    """Save the record's real config (with ``architectures`` = the script's class) to ``folder``; return it."""
    import transformers

    path = os.path.join(folder, f"real-{m['model_class']}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        real = dict(m["real_config"])
        real.pop("transformers_version", None)
        config = getattr(transformers, m["config_class"]).from_dict(real)
        config.architectures = [m["model_class"]]
        config.save_pretrained(path)
    return path


def real_plan_argv(m: dict[str, Any], world: int, folder: str, accelerate_config: str | None,
                   trainable: list[tuple[str, list[int]]] | None = None) -> list[str]:
    """The ``hf-ddpfix plan`` command line of the real model ``m`` (a record's ``models`` entry) at ``world``
    ranks under the launch's ``accelerate_config`` (``None``: ``--parallel fsdp`` with fsdp.yaml's settings)."""
    argv = ["plan", "--model", _config_folder(m, folder), "--world-size", str(world),
            "--dtype", _dtype_arg(m.get("dtype") or "")]
    argv += ["--accelerate-config", accelerate_config] if accelerate_config else ["--parallel", "fsdp"]
    return argv + _lora_args(trainable)


def real_plan(argv: list[str], *, layout: bool) -> Any:
    """:func:`hf_ddpfix.facts.offline.plan_offline` for ``argv`` (an ``hf-ddpfix plan`` command line)."""
    from ..facts.offline import parse_plan_args, plan_offline

    return plan_offline(parse_plan_args(argv), layout=layout)


def _is_fsdp(accelerate_config: str) -> bool:
    import yaml

    with open(accelerate_config) as f:
        return str((yaml.safe_load(f) or {}).get("distributed_type", "")).upper() == "FSDP"


def carry_over(config: Any, model_cls: Any, dtype: str) -> None:
    """In a rehearsal rank, before the shrunk model is planned: plan the REAL ``config`` at the real world size
    (``DDPFIX_REHEARSE_REAL_WORLD``) under the launch's accelerate config (``DDPFIX_REHEARSE_ACCELERATE_CONFIG``)
    and force its :data:`CARRIED` choices on this process (``HF_DDPFIX_<OPTION>``, unless already set). Records
    ``real_plan``: the argv, what was carried, what was kept, or why nothing was. Never raises."""
    from .record import _env, _record, note

    if _env("STOCK") == "1" or _record.get("real_plan") is not None:
        return
    entry: dict[str, Any] = {"carried": {}, "kept": {}}
    try:
        from ..config.options import env_name

        folder = os.path.join(_env("DIR"), "models")
        os.makedirs(folder, exist_ok=True)
        m = {"model_class": model_cls.__name__, "config_class": type(config).__name__,
             "real_config": config.to_dict(), "dtype": dtype}
        world = int(_env("REAL_WORLD") or os.environ.get("WORLD_SIZE", "1") or 1)
        acc = _env("ACCELERATE_CONFIG") or None
        if acc is None:
            entry["why"] = "the launch names no accelerate config: the shrunk model's own plan runs"
        elif not _is_fsdp(acc):
            entry["why"] = "not an FSDP launch: no choice of the plan depends on the model's size"
        else:
            argv = real_plan_argv(m, world, folder, acc)
            entry["argv"] = argv
            plan = real_plan(argv, layout=False).plan
            for option in CARRIED:
                value = getattr(plan, option).value
                if value is None:
                    continue
                var = env_name(option)
                if os.environ.get(var):
                    entry["kept"][option] = f"{var}={os.environ[var]} set by the launch"
                    continue
                os.environ[var] = str(value)
                entry["carried"][option] = str(value)
    except Exception as e:  # noqa: BLE001 - the rehearsal runs on with the shrunk model's own plan, said so
        entry["why"] = f"the real model's plan failed: {type(e).__name__}: {str(e)[:300]}"
    note("real_plan", entry)


def _carried_line(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "carried over to the shrunk run: nothing (no real-size plan was made in the ranks)"
    parts = [f"{k}={v}" for k, v in entry.get("carried", {}).items()]
    parts += [f"{k} kept ({v})" for k, v in entry.get("kept", {}).items()]
    if entry.get("why"):
        parts.append(entry["why"])
    return ("carried over from the real-size plan to the shrunk run: " + ("; ".join(parts) or "nothing size-"
            "dependent (the real plan has no fold/shard choice)") + "; not carried: the `auto` memory options "
            "(they read the real device's memory)")


def project_memory(record: dict[str, Any], mode: str, world: int,
                   folder: str | None = None) -> tuple[list[str] | None, str | None]:
    """Report lines for the real model of ``record`` (a rank's ``models[0]``, ``train`` and ``real_plan``
    entries), or ``(None, reason)``. Under FSDP2 the lines are ``hf-ddpfix plan``'s own for the real model (the
    command is printed with them); ``folder``: where the real config is saved (default: the record's)."""
    models = [m for m in record.get("models", []) if m.get("real_config")]
    if not models:
        return None, "no from_pretrained checkpoint was loaded (a model built in the script has no 'real' size)"
    m = models[0]
    train = record.get("train") or {}
    trainable_names = [(n, s) for n, s in train.get("trainable", [])]
    if mode == "fsdp":
        return _project_fsdp(record, m, world, trainable_names, folder)
    try:
        import torch
        import transformers

        config_cls = getattr(transformers, m["config_class"])
        real = dict(m["real_config"])
        real.pop("transformers_version", None)
        config = config_cls.from_dict(real)
        model_cls = getattr(transformers, m["model_class"])
        with torch.device("meta"):
            model = model_cls(config)
    except Exception as e:  # noqa: BLE001 - the projection is optional
        return None, f"cannot build {m.get('model_class')} on the meta device: {type(e).__name__}: {str(e)[:200]}"
    params = sum(p.numel() for p in model.parameters())
    b = _dtype_bytes(m.get("dtype") or "", bool(m.get("quantized")))
    trainable = real_trainable(model, trainable_names) if train else 0
    full = trainable >= 0.5 * params
    extra_weights = 0 if full else trainable * 4  # adapters live beside the frozen base, fp32
    lines = [f"real model: {m['model_class']} from {m['name']}: {params / 1e9:.2f} B parameters "
             f"({'4-bit' if b == 0.5 else ('bf16/fp16' if b == 2 else 'fp32')} weights), trainable {trainable / 1e6:.1f} M"
             + (" (full fine-tune)" if full else ""),
             f"world size {world}, mode {mode}"]
    w = params * b
    if mode == "zero3":
        blocks = [sum(p.numel() for p in mod.parameters()) for mod in model.modules()
                  if type(mod).__name__ in set(no_split_modules(model))]
        largest = max(blocks, default=0)
        weights = w / world + extra_weights / world
        gathered = 2 * largest * b
        grads = trainable * 4 / world
        optim = trainable * 12 / world
    elif mode == "zero2":
        weights, gathered = w + extra_weights, 0
        grads = trainable * 4 / world
        optim = trainable * 12 / world
    else:
        weights, gathered = w + extra_weights, 0
        grads = trainable * 4 * (2 if mode == "ddp" else 1)  # + DDP's gradient buckets
        optim = trainable * 8
    total = weights + gathered + grads + optim
    lines += [f"per rank: weights {weights / GIB:.2f} GiB + gathered {gathered / GIB:.2f} GiB + gradients "
              f"{grads / GIB:.2f} GiB + optimizer {optim / GIB:.2f} GiB = {total / GIB:.2f} GiB before activations",
              "activations not included: `hf-ddpfix plan` / docs/memory.md project them for a sequence length"]
    return lines, None


def _project_fsdp(record: dict[str, Any], m: dict[str, Any], world: int, trainable: list[tuple[str, list[int]]],
                  folder: str | None) -> tuple[list[str] | None, str | None]:
    import tempfile

    entry = record.get("real_plan") or {}
    argv = list(entry.get("argv") or [])
    if argv:
        argv[argv.index("--world-size") + 1] = str(world)
        if not os.path.isfile(os.path.join(argv[argv.index("--model") + 1], "config.json")):
            argv = []
    try:
        with tempfile.TemporaryDirectory(prefix="hf_ddpfix_real_") as tmp:
            if not argv:
                argv = real_plan_argv(m, world, folder or tmp, None)
            argv += _lora_args(trainable)
            done = real_plan(argv, layout=True)
    except Exception as e:  # noqa: BLE001 - the projection is optional
        return None, f"cannot plan {m.get('model_class')} at its real size: {type(e).__name__}: {str(e)[:200]}"
    lay = done.layout
    if lay is None:
        return None, "the real model's FSDP2 units could not be laid out (see the plan's fsdp_units line)"
    lines = [f"real model: {m['model_class']} from {m.get('name')}: {done.info.num_params / 1e9:.2f} B parameters "
             f"({_dtype_arg(m.get('dtype') or '')}), world size {world}; the plan and units of "
             f"`hf-ddpfix {' '.join(argv)}`:"]
    lines += [d.strip() for d in done.plan.report().splitlines() if "fsdp_" in d][:3]
    lines += lay.lines()
    lines.append(_carried_line(record.get("real_plan")))
    return lines, None

