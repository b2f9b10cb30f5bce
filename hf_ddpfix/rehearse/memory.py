"""The projected per-rank memory of the REAL model at the REAL world size (a projection, not a measurement).

From what a rehearsal recorded: the checkpoint's real config (built on the meta device: no memory), the trainable
parameters of the shrunk run (mapped onto the real model by module path with layer numbers as wildcards: a LoRA
matrix of rank r on ``layers.*.self_attn.q_proj`` becomes ``r x (in + out)`` on every real layer that has that
module), the parallel mode and the launch's world size. FSDP2 units come from the plan's own wrap layout
(``hf_ddpfix.integrations.fsdp.wrap.fsdp_wrap_plan(model, fold_skippable=True)``, the ``fsdp_units`` decision).

Per rank, bytes:
    weights     DDP / ZeRO-2: all of them; FSDP2 / ZeRO-3: 1/world of them
    gathered    FSDP2: the root unit (what no unit wraps: towers a rank may skip, norms; accelerate carves the input
                embedding and the head as units of their own) gathered whole, plus two of the largest unit (the one
                running and the one prefetched); ZeRO-3: two of the largest block
    gradients   trainable x 4 (fp32), divided by world under FSDP2 / ZeRO-2 / ZeRO-3, plus DDP's bucket copy
    optimizer   Adam: trainable x 8 (two fp32 moments), + 4 for the fp32 master copy under ZeRO; sharded likewise
Not included: activations (``hf-ddpfix plan`` and docs/memory.md project those for a sequence length), the CUDA
context, allocator fragmentation.

Guarantees: pure arithmetic on the meta model (no weights are read, no device is queried); returns ``None`` and a
reason when the real model cannot be built on the meta device.
"""

from __future__ import annotations

import re
from typing import Any

from .._compat.models import no_split_modules

__all__ = ["project_memory"]

GIB = 1 << 30
_DIGITS = re.compile(r"\.\d+(?=\.|$)")
_PEFT_PREFIX = ("base_model.model.",)
_LORA = re.compile(r"\.lora_(A|B|embedding_A|embedding_B)\.[^.]+(\.weight)?$")


def _pattern(name: str) -> str:
    for prefix in _PEFT_PREFIX:
        if name.startswith(prefix):
            name = name[len(prefix):]
    return _DIGITS.sub(".*", name)


def _dtype_bytes(dtype: str, quantized: bool) -> float:
    if quantized:
        return 0.5
    return 2.0 if any(t in dtype for t in ("bfloat16", "float16", "bf16", "fp16", "half")) else 4.0


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


def project_memory(record: dict[str, Any], mode: str, world: int) -> tuple[list[str] | None, str | None]:
    """Report lines for the real model of ``record`` (a rank's ``models[0]`` plus its ``train`` entry), or
    ``(None, reason)``."""
    models = [m for m in record.get("models", []) if m.get("real_config")]
    if not models:
        return None, "no from_pretrained checkpoint was loaded (a model built in the script has no 'real' size)"
    m = models[0]
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
    train = record.get("train") or {}
    trainable = real_trainable(model, [(n, s) for n, s in train.get("trainable", [])]) if train else 0
    full = trainable >= 0.5 * params
    extra_weights = 0 if full else trainable * 4  # adapters live beside the frozen base, fp32
    lines = [f"real model: {m['model_class']} from {m['name']}: {params / 1e9:.2f} B parameters "
             f"({'4-bit' if b == 0.5 else ('bf16/fp16' if b == 2 else 'fp32')} weights), trainable {trainable / 1e6:.1f} M"
             + (" (full fine-tune)" if full else ""),
             f"world size {world}, mode {mode}"]
    w = params * b
    if mode == "fsdp":
        from ..integrations.fsdp.wrap import fsdp_wrap_plan

        units = [(n, u) for n, u in fsdp_wrap_plan(model, fold_skippable=True) if u is not model]  # root last
        inside = {id(p) for _, u in units for p in u.parameters()}
        for carved in (model.get_input_embeddings(), model.get_output_embeddings()):  # accelerate's own units
            if carved is not None and not any(id(p) in inside for p in carved.parameters()):
                units.append(("carved", carved))
                inside |= {id(p) for p in carved.parameters()}
        sizes = [sum(p.numel() for p in u.parameters()) for _, u in units]
        root = params - sum(sizes)
        largest = max(sizes, default=0)
        weights = w / world + extra_weights / world
        gathered = (root + 2 * largest) * b
        grads = trainable * 4 / world
        optim = trainable * 8 / world
        lines.append(f"FSDP2 units: {len(units)} (largest {largest / 1e6:.1f} M parameters); root unit {root / 1e9:.2f} B "
                     "parameters gathered whole by every rank")
    elif mode == "zero3":
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
