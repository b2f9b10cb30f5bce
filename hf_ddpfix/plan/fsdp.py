"""The plan's FSDP2 decisions (accelerate's FSDP through the Trainer): which classes become units, and how every
rank then issues the same collectives. Pure rules over :class:`~hf_ddpfix.integrations.fsdp.FsdpFacts`.

The rule the class of failures teaches (issue 26): under FSDP2 every rank must issue the same all-gathers and
reduce-scatters **in the same order**, and accelerate decides the units (the wrap policy's classes, then the
input embedding and ``[final norm, head]`` carved out, the root last: accelerate 1.15). A rank that skips a
subtree (a text-only step skips the vision tower and projector, Mllama's cross-attention layers, a LayerDrop
layer) skips the all-gathers of every unit inside it, and a dummy input run to avoid that must run exactly
where the real one would, which depends on each model's forward (Qwen2.5-VL embeds its tokens first, then runs
the tower: a dummy in a forward pre-hook gathered the tower before the embedding unit, measured "16384 vs 12512"
bytes on gloo).

So hf_ddpfix owns the unit layout: **no unit inside a subtree a rank may skip**. The classes it hands the
plugin are the block classes the model really has (``_no_split_modules`` that exist, else its repeated blocks),
minus every class with an instance in such a subtree; those parameters belong to the enclosing unit (the root
for a vision tower), which every rank all-gathers at the start of every forward, evaluation and prediction
included. The order of all-gathers is then the order of the units every rank runs, whatever the model does
with its images. What a rank did not use in a unit is tied into that unit's output with an exact-zero
gradient (``parameter_usage``), so every rank reduce-scatters the same gradients; where no rank used a
parameter in the step its gradient is reset to ``None`` before clipping (stock DDP ``find_unused=True``
semantics). No dummy image runs. Cost: the folded subtrees stay unsharded for the root's forward and
backward (a vision tower's parameters, once per rank).

Where folding is not cheap (``fsdp_skippable``, :mod:`hf_ddpfix.plan.fsdp_skippable`: beyond max(64 MiB, 10 % of
a rank's parameter shard), the tower's blocks become units too and a rank without an image runs the stabiliser's
dummy image at the language model's start, where an image rank runs its tower
(:mod:`hf_ddpfix.integrations.fsdp.dummy`). LayerDrop stacks and families without a dummy always fold.

A user's explicit ``fsdp_transformer_layer_cls_to_wrap`` is honoured where it is safe: a class inside the tower that
a dummy can run keeps its units and the dummy runs there (``fsdp_skippable = shard``); a class inside a subtree a
rank may skip that no dummy runs (a family without one, a LayerDrop stack, the stabiliser disabled) is folded out
of the list, with the bytes then gathered whole on the plan line (issue 45: GLM-4V with
``Glm4vTextDecoderLayer,Glm4vVisionBlock`` died at step 2 with a gloo size mismatch, as in stock). Only with
``parameter_usage`` disabled, which folding needs, is such a list kept as given, said so. Where accelerate's default
(``_no_split_modules``) names classes the model lacks, the plan's classes replace it even when the plan does not
choose the units otherwise, so accelerate never raises "Could not find the transformer layer class".
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .fsdp_skippable import SkippableFacts, decide_skippable
from .types import Decision, PlanError, RunFacts

if TYPE_CHECKING:
    from ..config.options import DDPFixConfig
    from ..integrations.fsdp import FsdpFacts

__all__ = ["check_fsdp_loading", "decide_fsdp", "decide_fsdp_shared", "decide_fsdp_skippable", "decide_fsdp_units",
           "fsdp_unit_classes", "fsdp_units_ours", "skippable_facts"]

_STOCK_FAILS = ("ranks that skip them (a text-only step, LayerDrop) all-gather different units: mixed batches fail "
                "(gloo size mismatch, NCCL hang) as in stock")


def _list(names: tuple[str, ...], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit})" if len(names) > limit else "")


def _cost(f: FsdpFacts, size: int | None = None) -> str:
    """What folding costs, said in the plan line: the folded parameters (``size`` bytes, default all of ``f``'s
    skippable subtrees) stay unsharded on every rank."""
    size = f.folded_bytes if size is None else size
    if not size:
        return ""
    amount = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB" if size >= 2**20 else (
        f"{size / 2**10:.0f} KiB")
    return (f"; cost: their parameters ({amount}) are all-gathered whole on every rank for the enclosing unit's "
            "forward and backward")


def skippable_facts(facts: RunFacts) -> SkippableFacts | None:
    """The facts :func:`~hf_ddpfix.plan.fsdp_skippable.decide_skippable` reads, from an FSDP2 run's facts."""
    f = facts.fsdp
    if facts.parallel != "fsdp" or facts.fsdp_version != 2 or f is None:
        return None
    user = f.user_classes is not None and f.policy == "transformer_based_wrap" and any(
        n in f.skippable and n not in f.fold_only for n in f.user_classes)
    return SkippableFacts(folded_bytes=f.shardable_bytes if f.dummy else f.folded_bytes,
                          total_bytes=f.total_bytes, world_size=max(1, facts.world_size), dummy=f.dummy,
                          no_dummy=f.no_dummy, dummy_tokens=f.dummy_tokens, tower_params=f.tower_params,
                          user_shards=user)


def decide_fsdp_skippable(facts: RunFacts, c: DDPFixConfig) -> Decision:
    """The ``fsdp_skippable`` decision (``"fold"`` / ``"shard"``; ``None`` outside FSDP2 or with nothing a rank
    may skip that a dummy could run). A model already sharded keeps its units: ``"shard"`` where some lie inside
    a subtree a dummy runs (the dummy then runs), else ``None``. The user's ``fsdp_transformer_layer_cls_to_wrap``
    naming classes inside such a subtree means ``"shard"``; ``parameter_usage`` off or another wrap policy: ``None``
    (accelerate's units, as stock)."""
    sf = skippable_facts(facts)
    f = facts.fsdp
    if sf is None or f is None:
        return Decision(None, "")
    if f.wrapped:
        if f.skipped_units and f.dummy:
            return Decision("shard", f"the model is already sharded with units inside skippable subtrees: "
                            f"{f.dummy} dummy on ranks without an image", changed=True)
        return Decision(None, "")
    if f.policy != "transformer_based_wrap" or (c.parameter_usage is False and not sf.user_shards):
        return Decision(None, "")
    if c.vlm_stabilizer is False and f.dummy:  # the dummy is the stabiliser's: disabled, nothing runs it
        sf = dataclasses.replace(sf, dummy="", no_dummy=f"vlm_stabilizer disabled ({c.source('vlm_stabilizer')})",
                                 user_shards=False)
        if f.user_classes is not None and c.parameter_usage is False:  # the list is kept (decide_fsdp_units)
            return Decision(None, "")
        return decide_skippable(sf, "fold")
    if not f.shardable_bytes and not sf.user_shards:
        if f.folded and not f.dummy and f.no_dummy != "LayerDrop only":
            return decide_skippable(sf, "fold")
        return Decision(None, "")
    return decide_skippable(sf, c.fsdp_skippable)


def decide_fsdp_units(facts: RunFacts, c: DDPFixConfig, skippable: Decision | None = None) -> Decision:
    """The ``fsdp_units`` decision: the class names accelerate's transformer policy is to wrap.

    Returns:
        ``Decision(None)`` outside FSDP2; ``False`` where the units stay accelerate's (another policy, an explicit
        class list, the model already wrapped, ``parameter_usage`` off) with the reason; otherwise a string
        ``"A,B"`` of class names (changed from stock when it differs from ``_no_split_modules``), or ``"root"``
        for no block class (accelerate's embedding and head units and the root only).

    Guarantees: the chosen classes all exist in the model and none has an instance inside a subtree a rank may
    skip (tests/test_fsdp_plan.py).
    """
    f = facts.fsdp
    if facts.parallel != "fsdp" or facts.fsdp_version != 2 or f is None:
        return Decision(None, "")
    if skippable is None:
        skippable = decide_fsdp_skippable(facts, c)
    shard = skippable.value == "shard"
    if f.wrapped:
        return Decision(False, "the model is already sharded: its units stay as they are")
    if f.policy != "transformer_based_wrap":
        return Decision(False, f"accelerate's {f.policy} decides the units (hf_ddpfix chooses classes only for "
                        "transformer_based_wrap)" + (f"; subtrees a rank may skip ({_list(f.folded)}) may become "
                                                     f"units: {_STOCK_FAILS}" if f.folded else ""))
    if f.user_classes is not None:
        return _user_units(f, c, shard)
    if c.parameter_usage is False:
        return _accelerates_units(f, c)
    from ..integrations.fsdp.units import unit_classes  # the facts came from there: loaded already

    chosen, source, only_skippable = unit_classes(f, shard)
    if not chosen:  # "root": the plugin gets no class; accelerate's embedding / head units and the root remain
        blocks = tuple(dict.fromkeys(f.present + source)) if only_skippable else source
        what = "no block class of its own" if not blocks else f"only blocks a rank may skip ({_list(blocks)})"
        return Decision("root", f"the model has {what}: accelerate's embedding and [norm, head] units and the root "
                        "only" + (f"; folded into the root: {_list(f.folded)}{_cost(f)}" if f.folded else ""),
                        changed=bool(f.no_split))
    parts = [f"one unit per {_list(chosen)}, then accelerate's embedding and [norm, head] units and the root"]
    absent = tuple(n for n in f.no_split if n not in f.present)
    if only_skippable:
        parts.append(f"_no_split_modules names only blocks a rank may skip ({_list(f.present)}): classes of its "
                     "repeated blocks")
    if only_skippable and absent:
        parts.append(f"not in the model: {_list(absent)}")
    elif only_skippable:
        pass
    elif not f.present:
        parts.append("_no_split_modules " + ("names none of the model's classes (" + _list(absent) + ")"
                                             if f.no_split else "is empty") + ": classes of its repeated blocks")
    elif absent:
        parts.append(f"not in the model: {_list(absent)} (accelerate would raise 'Could not find the transformer "
                     "layer class')")
    if shard:
        inside = tuple(n for n in chosen if n in f.skippable)
        parts.append(f"units inside subtrees a rank may skip ({_list(inside)}): ranks without an image run the "
                     f"{f.dummy} dummy there (fsdp_skippable)")
        if f.fold_only:
            parts.append(f"folded (no dummy): {_list(f.fold_only)}")
    elif f.folded:
        parts.append(f"folded into the enclosing unit (a rank may skip them, so they get no unit of their own; "
                     f"every rank gathers them with it): {_list(f.folded)}{_cost(f)}")
    return Decision(",".join(chosen), "; ".join(parts), changed=chosen != f.no_split)


def _no_dummy_why(f: FsdpFacts, c: DDPFixConfig, shard: bool) -> str:
    """Why no dummy runs the risky classes of an explicit list (see :func:`_user_units`)."""
    if f.dummy and c.vlm_stabilizer is False and not shard:
        return f"vlm_stabilizer disabled ({c.source('vlm_stabilizer')})"
    if f.dummy or f.no_dummy == "LayerDrop only":  # the dummy runs the tower: what is left is a LayerDrop stack
        return "LayerDrop: a random per-layer skip has no dummy"
    return f.no_dummy or "no stabiliser adapter"


def _user_units(f: FsdpFacts, c: DDPFixConfig, shard: bool) -> Decision:
    """The units for an explicit ``fsdp_transformer_layer_cls_to_wrap`` (issue 45).

    Classes with an instance inside a subtree a rank may skip are *risky* unless a dummy runs them there
    (``fsdp_skippable = shard`` and not a LayerDrop / no-dummy class): as units of their own, a rank that skips the
    subtree all-gathers other units than a rank that runs it (gloo size mismatch at the first mixed step, an NCCL
    hang). The plan folds them out of the list: the units are the user's classes less the risky ones (``"root"``
    when none is left), handed to accelerate's plugin as the plan's own units are (``apply_fsdp_units``), and
    ``parameter_usage`` ties what a rank leaves unused in the enclosing unit. With ``parameter_usage`` disabled
    folding cannot keep the ranks' reduce-scatters equal, so the list stays as given and the reason says that
    mixed batches fail as in stock (a run whose every step has an image on every rank trains as in stock).

    Returns:
        ``Decision(False)`` (the list kept) or ``Decision("A,B" | "root", changed=True)`` (risky classes folded).
    """
    listed = _list(f.user_classes or ())
    risky = tuple(n for n in f.user_classes or () if n in f.skippable and (not shard or n in f.fold_only))
    driven = tuple(n for n in f.user_classes or () if n in f.skippable and n not in risky)
    note = (f"; {_list(driven)} lie inside subtrees a rank may skip: ranks without an image run the {f.dummy} dummy "
            "there (fsdp_skippable)") if driven else ""
    if not risky:
        return Decision(False, f"explicit fsdp_transformer_layer_cls_to_wrap kept: {listed}{note}")
    why = _no_dummy_why(f, c, shard)
    if c.parameter_usage is False:
        return Decision(False, f"explicit fsdp_transformer_layer_cls_to_wrap kept: {listed}; {_list(risky)} lie "
                        f"inside subtrees a rank may skip that no dummy runs ({why}) and parameter_usage is disabled "
                        f"({c.source('parameter_usage')}), which folding them needs: {_STOCK_FAILS}{note}")
    kept = tuple(n for n in f.user_classes or () if n not in risky)
    gathered = f.folded_bytes - (f.shardable_bytes if shard else 0)
    units = (f"one unit per {_list(kept)}, then" if kept else "no class left:") + (
        " accelerate's embedding and [norm, head] units and the root")
    return Decision(",".join(kept) or "root",
                    f"explicit fsdp_transformer_layer_cls_to_wrap less {_list(risky)}: they lie inside subtrees a rank "
                    f"may skip ({_list(f.folded)}) that no dummy runs ({why}); as units of their own, ranks with and "
                    "without them would all-gather different units (gloo size mismatch at the first mixed step, NCCL "
                    f"hang), so they are folded into the enclosing unit{_cost(f, gathered)}; {units}{note}",
                    changed=True)


def _accelerates_units(f: FsdpFacts, c: DDPFixConfig) -> Decision:
    """``parameter_usage`` disabled: accelerate's units from ``_no_split_modules`` (stock), except that a name the
    model lacks is dropped (accelerate 1.15 would raise "Could not find the transformer layer class X" in
    ``prepare``): the classes that exist, else the model's repeated blocks, said so."""
    off = (f"accelerate's units from _no_split_modules kept (parameter_usage disabled ({c.source('parameter_usage')}): "
           "units without a skippable subtree need its ties)")
    absent = tuple(n for n in f.no_split if n not in f.present)
    if not absent:
        return Decision(False, off)
    chosen = f.present or f.repeated
    what = (f"one unit per {_list(chosen)}" if chosen else "no block class") + (
        ", then accelerate's embedding and [norm, head] units and the root")
    return Decision(",".join(chosen) or "root",
                    f"{off}, less what the model lacks: {_list(absent)} (accelerate would raise 'Could not find the "
                    f"transformer layer class'); {what}" + ("" if f.present else
                                                            " (_no_split_modules names none: its repeated blocks)"),
                    changed=True)


def _under(name: str, tops: tuple[str, ...]) -> bool:
    return any(name == t or name.startswith(t + ".") for t in tops)


def decide_fsdp_shared(facts: RunFacts) -> Decision:
    """The ``fsdp_shared`` decision: whether every module holding a tied tensor joins one FSDP group.

    accelerate 1.15 keeps a tied input / output embedding in one unit (``[final norm, embedding, head]``) and
    leaves every other module in the root; torch 2.13 refuses a parameter two groups manage (``is shared with a
    parameter already managed by another FSDP group``, stock's failure at the first forward). So where a tied
    tensor is held beyond the input and output embedding (BART / T5-style ``encoder.embed_tokens`` and
    ``decoder.embed_tokens`` beside ``shared``, a tied projection), the modules holding it join the group
    accelerate makes for the first of them (``_compat.join_shared_holders``).

    Returns:
        ``Decision(None)`` outside FSDP2 or where no tie reaches beyond the embeddings; ``False`` where the model
        is already sharded; ``True`` (changed from stock) with the modules that join.

    Guarantee: every module holding a tied tensor is managed by one FSDP group, so the tie holds (one sharded
    tensor) and each rank all-gathers and reduce-scatters it once per step (tests/test_fsdp_plan.py).
    """
    f = facts.fsdp
    if facts.parallel != "fsdp" or facts.fsdp_version != 2 or f is None:
        return Decision(None, "")
    beyond = tuple(h for group in f.shared for h in group if not _under(h, f.carved))
    if not beyond:
        return Decision(None, "")
    if f.wrapped:
        return Decision(False, f"the model is already sharded: tied tensors held by {_list(beyond)} stay in the "
                        "groups they have")
    return Decision(True, f"tied tensors are held beyond the input/output embedding ({_list(beyond)}): every "
                    "module holding one joins the FSDP group accelerate makes for the first of them (torch refuses "
                    "a parameter in two groups: stock fails at the first forward with 'shared with a parameter "
                    "already managed by another FSDP group'); the tie stays one sharded tensor", changed=True)


def check_fsdp_loading(facts: RunFacts) -> str | None:
    """Raise :class:`PlanError` before step 1 where accelerate 1.15's ``cpu_ram_efficient_loading`` cannot
    prepare the model (stock fails the same way inside ``accelerator.prepare``, whatever the units):

    - an adapter layer around a tied output embedding (LoRA on a tied ``lm_head``): the ``tie_weights()`` accelerate
      calls after moving the model to meta sets ``weight`` on the adapter layer, where ``weight`` is a property:
      ``KeyError: "attribute 'weight' already exists"``.

    Nothing is raised outside FSDP2, without ``cpu_ram_efficient_loading``, for a 4-bit model (accelerate skips
    that loading path) or a model already sharded.

    Returns: what the run does there for persistent buffers (Gemma 4's ``layer_scalar``, BART's ``final_logits_bias``:
    stock fails on them in ``fsdp2_load_full_state_dict``, ``'Tensor' object has no attribute 'device_mesh'``; the
    run broadcasts them and loads them as non-persistent ones, integrations/fsdp/buffers.py), else ``None``."""
    f = facts.fsdp
    if facts.parallel != "fsdp" or facts.fsdp_version != 2 or f is None:
        return None
    if not f.ram_efficient or f.params4bit or f.wrapped:
        return None
    why = []
    if f.wrapped_tied_head:
        why.append(f"the tied output embedding {f.wrapped_tied_head} is wrapped by an adapter layer, on which the "
                   "tie_weights() of that path raises KeyError: \"attribute 'weight' already exists\" (or leave "
                   f"{f.wrapped_tied_head.rsplit('.', 1)[-1]} out of the adapter's target_modules)")
    if why:
        raise PlanError("FSDP2 with fsdp_cpu_ram_efficient_loading=true cannot prepare this model in accelerate's "
                        "fsdp2_prepare_model (stock fails there the same way): " + "; ".join(why) + ". Set "
                        "fsdp_cpu_ram_efficient_loading: false in the accelerate config (FSDP_CPU_RAM_EFFICIENT_LOADING"
                        "=false); the model is then loaded on every rank and sharded as it is")
    if f.persistent_buffers:
        return (f"persistent buffers ({_list(f.persistent_buffers)}) broadcast from rank 0 and carried through "
                "accelerate's cpu_ram_efficient_loading as non-persistent ones (stock: 'Tensor' object has no "
                "attribute 'device_mesh'), persistent again at train begin")
    return None


def check_fsdp_cache_units(facts: RunFacts, units: Decision) -> None:
    """Raise :class:`PlanError` before step 1 where an FSDP2 unit would sit inside a sub-model whose KV cache the
    model reads in training (:func:`~hf_ddpfix.integrations.fsdp.units.cache_fed_submodels`: PI0's VLM): the cache
    carries gradients into that unit around its outputs, so backward reads its freed shard. The unit classes are
    the plan's, else the user's ``fsdp_transformer_layer_cls_to_wrap``, else accelerate's ``_no_split_modules``."""
    f = facts.fsdp
    if units.value is None or f is None or not f.cache_fed:
        return
    classes = fsdp_unit_classes(units) if fsdp_units_ours(units) else (f.user_classes or f.present)
    inside = [n for n in classes if n in f.cache_fed_classes]
    if inside:
        raise PlanError(
            f"FSDP2 cannot shard this model as planned: {_list(tuple(f.cache_fed))} runs with use_cache=True in the "
            "training forward and another part of the model reads its KV cache, so gradients reach its layers "
            f"through the cache, not through their outputs, and FSDP2 units of {_list(tuple(inside))} there would "
            "run backward on freed shards ('setStorage ... storage of size 0'). Train this model under DDP "
            "(accelerate_configs/ddp_cpu.yaml, or a multi-GPU launch without FSDP)")


def fsdp_units_ours(units: Decision) -> bool:
    """True when the plan chose the unit classes (a string value): no unit inside a skippable subtree."""
    return isinstance(units.value, str)


def fsdp_unit_classes(units: Decision) -> tuple[str, ...]:
    """The class names to hand accelerate's plugin for a decision :func:`fsdp_units_ours` accepts."""
    return () if units.value == "root" else tuple(str(units.value).split(","))


def decide_fsdp(facts: RunFacts, c: DDPFixConfig) -> tuple[Decision, Decision, Decision]:
    """``(fsdp_units, fsdp_skippable, fsdp_shared)``: the plan's FSDP-only decisions; the units' reason carries
    what the run does for persistent buffers under accelerate's ``cpu_ram_efficient_loading``.

    Raises:
        PlanError: accelerate's ``cpu_ram_efficient_loading`` cannot prepare this model (:func:`check_fsdp_loading`),
            or a unit would sit inside a sub-model whose KV cache the model reads (:func:`check_fsdp_cache_units`).
    """
    loading = check_fsdp_loading(facts)
    skippable = decide_fsdp_skippable(facts, c)
    units = decide_fsdp_units(facts, c, skippable)
    check_fsdp_cache_units(facts, units)
    if loading and units.value is not None:  # what the run does for persistent buffers under that loading
        units = dataclasses.replace(units, reason=f"{units.reason}; {loading}")
    return units, skippable, decide_fsdp_shared(facts)
