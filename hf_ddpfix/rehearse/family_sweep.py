"""Every image-text-to-text family transformers ships, built tiny and tried: the sweep behind docs/vlm-families.md.

The families are transformers' own ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` (no list kept here). Each is
built from its default config by the rehearsal's checked shrinker (:func:`hf_ddpfix.rehearse.shrink_check.
shrink_checked`: on the meta device first, to size it, then for real with seeded weights), run forward and
backward on a batch without and with an image (:func:`hf_ddpfix.integrations.vision.sample.sample_batch`), and
asked what hf_ddpfix would do with it: the dummy image under DDP / FSDP and under ZeRO (or why there is none:
:func:`~hf_ddpfix.integrations.vision.families.find_vision_adapter` / ``describe_unsupported``), and the plan's
FSDP2 units and ``fsdp_skippable`` decision for LoRA on every linear layer, tower included, on 2 ranks (the
run's own ``fsdp_facts`` and ``resolve_plan``). A family that cannot be built is kept with its reason.

:func:`status_line` reads the results shipped with the package (``vlm_families.json``, and the 2-process cells'
``vlm_family_cells.json``, both written by ``scripts/vlm_families.py``) for ``hf-ddpfix plan``.

Guarantees: :func:`sweep_family` never raises for a family transformers lists (every failure is a field of the
record); a record's ``verdict`` is the part tests/test_vlm_families.py compares with the shipped results.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["CELLS_RESULTS", "CELL_LABELS", "RESULTS", "families", "load_results", "meta_family", "size_family", "status_line",
           "sweep_family", "verdict", "with_lora"]

#: the results shipped with the package (scripts/vlm_families.py writes it; docs/vlm-families.md renders it)
RESULTS = Path(__file__).with_name("vlm_families.json")
#: the 2-process cells of every built family (``scripts/vlm_families.py --cells``), shipped beside it
CELLS_RESULTS = Path(__file__).with_name("vlm_family_cells.json")
#: the 2-process cells (tests/scripts/vlm_family_cells.py), in order: cell -> (how its verdict reads on one line,
#: ``status_line``; its column title in docs/vlm-families.md, ``scripts/vlm_families.py``)
CELL_LABELS = {"ddp": ("DDP", "DDP (2 proc.)"), "fsdp_plan": ("FSDP2 with the plan's units", "FSDP2, plan's units"),
               "fsdp_list": ("FSDP2 with your layer list", "FSDP2, your list"), "zero3": ("ZeRO-3", "ZeRO-3 (2 proc.)")}
#: tiny models bigger than this (meta count) are not built for real: the sweep stays within its time budget
MAX_PARAMS = 60_000_000

_NEEDS = (("timm", "needs the timm package"), ("flash_attn", "needs flash-attn"), ("CUDA", "needs CUDA"),
          ("causal_conv1d", "needs causal-conv1d kernels"), ("mamba", "needs mamba kernels"))


def families() -> dict[str, str]:
    """``model_type -> model class name`` of every image-text-to-text family the installed transformers ships."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return {k: v if isinstance(v, str) else v[0] for k, v in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items())}


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    for word, why in _NEEDS:
        if word in text and isinstance(e, ImportError | RuntimeError | OSError):
            return why
    return f"{type(e).__name__}: {text[:240]}"


def _short(text: str, n: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def with_lora(model: Any) -> Any:
    """A copy of ``model`` with LoRA (r=2, alpha 4) on every linear layer but the output embedding, as a peft model: peft's
    ``"all-linear"``, or the same layers named in full where ``"all-linear"`` breaks the model. It matches by the last
    name part, so a Linear named ``0`` (Qwen3-Omni's merger list) can make a module named ``0`` a target, an audio
    encoder layer ("Target module ... is not supported"); and it wraps a Linear subclass with a forward of its own
    (Llama 4's router returns a tuple: "'tuple' object has no attribute 'dtype'" in stock and hf_ddpfix alike): plain
    ``nn.Linear`` layers then. The sweep and the 2-process cells (tests/scripts/vlm_family_cells.py) build here."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn

    def plain(m: Any) -> bool:
        return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward

    def adapted(targets: str | list[str]) -> Any:  # on a copy: a failed injection leaves ``model`` as it was
        return get_peft_model(copy.deepcopy(model), LoraConfig(r=2, lora_alpha=4, target_modules=targets))

    if all(plain(m) for m in model.modules() if isinstance(m, nn.Linear)):
        rng = torch.random.get_rng_state()
        try:
            return adapted("all-linear")
        except ValueError:
            torch.random.set_rng_state(rng)  # the second try draws the same adapter weights
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return adapted([n for n, m in model.named_modules() if plain(m) and m is not out])


def _plan_record(model: Any) -> dict[str, Any]:
    """The plan's answers for LoRA on every linear layer (tower included), 2 ranks, under DDP and FSDP2."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from ..config.options import DDPFixConfig
    from ..facts.gather import model_facts
    from ..integrations.fsdp import fsdp_facts
    from ..integrations.vision.families import describe_unsupported, find_vision_adapter
    from ..plan.resolve import resolve_plan
    from ..plan.types import RunFacts

    out: dict[str, Any] = {}
    ddp = find_vision_adapter(model)
    out["ddp_dummy"] = ddp.family.name if ddp is not None else ""
    out["ddp_no_dummy"] = "" if ddp is not None else _short(describe_unsupported(model), 240)
    zero = find_vision_adapter(model, zero=True)
    out["zero_dummy"] = zero.family.name if zero is not None else ""
    out["zero_no_dummy"] = "" if zero is not None else _short(describe_unsupported(model, zero=True), 240)
    try:
        peft = with_lora(model)
    except Exception as e:  # noqa: BLE001 - reported
        out["plan_error"] = f"LoRA: {_reason(e)}"
        return out
    config = DDPFixConfig()
    try:
        facts = RunFacts(parallel="ddp", world_size=2, checkpointing="none", **model_facts(peft, "ddp"))
        plan = resolve_plan(facts, config)
        out["ddp_find_unused"] = plan.find_unused_parameters.value
        out["ddp_stabilizer"] = _short(f"{plan.vlm_stabilizer.value}: {plan.vlm_stabilizer.reason}", 160)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        f = fsdp_facts(plugin, peft)
        facts = RunFacts(parallel="fsdp", world_size=2, fsdp_version=2, checkpointing="none",
                         **model_facts(peft, "fsdp"), fsdp=f)
        plan = resolve_plan(facts, config)
        units = plan.fsdp_units.value
        out["fsdp_units"] = list(units) if isinstance(units, list | tuple) else units
        out["fsdp_skippable"] = plan.fsdp_skippable.value
        out["fsdp_skippable_reason"] = _short(plan.fsdp_skippable.reason, 200)
        out["fsdp_dummy"] = f.dummy
        out["fsdp_no_dummy"] = _short(f.no_dummy, 200)
        out["user_list"] = [c for c in f.repeated if c.endswith(("DecoderLayer", "Block", "Layer"))][:4]
    except Exception as e:  # noqa: BLE001 - a plan refusal is an outcome
        out["plan_error"] = _reason(e)
    return out


def meta_family(model_type: str, class_name: str | None = None) -> Any:
    """``model_type``'s default config shrunk and repaired, built on the meta device (no memory, no weights): the
    module tree the sweep builds for real. Raises the build's error where it cannot be built."""
    import transformers
    from transformers import AutoConfig

    from .config_gaps import give_vision_config
    from .shrink import shrink_config
    from .shrink_check import _meta, repaired_meta

    cls = getattr(transformers, class_name or families()[model_type])
    config = AutoConfig.for_model(model_type)
    give_vision_config(config, [])  # as the sweep's build does (shrink_checked with small_images)
    sized = shrink_config(config)
    return repaired_meta(sized, cls) or _meta(cls, sized.config)  # the second names the build's error


def size_family(model_type: str, class_name: str | None = None) -> dict[str, Any]:
    """The cheap part of :func:`sweep_family`: the default config shrunk and repaired, built on the meta device;
    ``meta_params`` (its parameter count) or ``reason``. No weights, no forward (the fast tier runs it for every
    family)."""
    class_name = class_name or families()[model_type]
    rec: dict[str, Any] = {"model_type": model_type, "class": class_name, "builds": False, "reason": "",
                           "text": "", "image": ""}
    try:
        meta = meta_family(model_type, class_name)
        rec["meta_params"] = sum(p.numel() for p in meta.parameters())
    except Exception as e:  # noqa: BLE001 - the family's outcome
        rec["reason"] = _reason(e)
        return rec
    if rec["meta_params"] > MAX_PARAMS:
        rec["reason"] = (f"shrunk model still {rec['meta_params'] / 1e6:.0f} M parameters (> {MAX_PARAMS / 1e6:.0f} M):"
                         " not built")
    return rec


def sweep_family(model_type: str, class_name: str | None = None, *, plan: bool = True) -> dict[str, Any]:
    """Build ``model_type`` tiny, run it without and with an image (forward + backward), and ask the plan.

    Returns a record: ``builds``, ``reason`` (why not), ``meta_params`` / ``params``, ``shrink`` (fields changed),
    ``text`` / ``image`` (``"ok"`` or the error), the dummy fields of :func:`_plan_record` and ``seconds``."""
    import torch
    import transformers
    from transformers import AutoConfig

    from .shrink_check import shrink_checked

    t0 = time.perf_counter()
    rec = size_family(model_type, class_name)
    if rec["reason"]:
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        return rec
    try:
        checked = shrink_checked(AutoConfig.for_model(model_type), getattr(transformers, rec["class"]),
                                 backward=True, small_images=True)
    except Exception as e:  # noqa: BLE001 - the family's outcome
        rec["reason"] = _reason(e)
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        return rec
    rec.update(builds=True, params=sum(p.numel() for p in checked.model.parameters()),
               shrink=len(checked.shrunk.lines), text=_short(checked.text, 240), image=_short(checked.image, 240))
    if plan:
        with torch.no_grad():
            rec.update(_plan_record(checked.model))
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


_VERDICT_KEYS = ("builds", "text_ok", "image_ok", "ddp_dummy", "zero_dummy", "fsdp_dummy", "fsdp_skippable")


def verdict(rec: dict[str, Any]) -> dict[str, Any]:
    """The part of a record a fresh run must reproduce (what the docs table states)."""
    v = dict(rec)
    v["text_ok"], v["image_ok"] = rec.get("text") == "ok", rec.get("image") == "ok"
    return {k: v.get(k) for k in _VERDICT_KEYS}


def load_results(path: Path | str | None = None) -> dict[str, Any]:
    """The shipped results (``{"transformers", "torch", "date", "families": {model_type: record}}``)."""
    return json.loads(Path(path or RESULTS).read_text())


def status_line(model_type: str, path: Path | str | None = None) -> str:
    """One line: where ``model_type`` stands in the shipped sweep (``""`` when it is no image-text-to-text family
    of the sweep or the results are missing)."""
    try:
        data = load_results(path)
    except (OSError, ValueError):
        return ""
    rec = data.get("families", {}).get(model_type)
    if rec is None:
        return ""
    head = f"family {model_type!r} in the VLM sweep (transformers {data.get('transformers')}, {data.get('date')}):"
    if not rec.get("builds"):
        return f"{head} not built tiny -- {rec.get('reason')} (docs/vlm-families.md)"
    ok = lambda v: "runs" if v == "ok" else "fails"  # noqa: E731
    dummy = rec.get("ddp_dummy") or rec.get("zero_dummy") and f"{rec['zero_dummy']} (ZeRO only)" or "none"
    return (f"{head} text {ok(rec.get('text'))}, image {ok(rec.get('image'))}; dummy image {dummy}; "
            f"FSDP2 fsdp_skippable={rec.get('fsdp_skippable')}{_cells_words(model_type, path)} "
            "(docs/vlm-families.md)")


def _cells_words(model_type: str, path: Path | str | None) -> str:
    """``"; on 2 processes vs stock DDP: DDP equal, ..."``: the family's shipped 2-process cells (``""`` without
    them, or when ``path`` names another results file)."""
    if path is not None:
        return ""
    try:
        rec = json.loads(CELLS_RESULTS.read_text()).get("families", {}).get(model_type)
    except (OSError, ValueError):
        return ""
    if not rec:
        return ""
    words = []
    for cell, (name, _) in CELL_LABELS.items():
        v = rec.get("cells", {}).get(cell, {})
        status = v.get("status", "missing")
        if status == "refused":
            status = "refused before step 1 (" + v.get("error", "").removeprefix("PlanError: ")[:80] + ")"
        else:
            status = status.replace("_", " ")
        words.append(f"{name} {status}")
    images = rec.get("images")
    how = "mixed image/text ranks" if images is True else "text only" if not images else f"images {images}"
    return f"; on 2 processes vs stock DDP ({how}): " + ", ".join(words)
