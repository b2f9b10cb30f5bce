"""What the model offers accelerate's FSDP2 wrap: the block classes it really has, and which of them a rank
may skip. Read-only facts for :func:`hf_ddpfix.plan.fsdp.decide_fsdp_units`.

Why (issue 26, accelerate 1.15 through the Trainer, 2 gloo ranks):
- ``transformer_based_wrap`` makes a unit of every module whose class ``_no_split_modules`` names; a name the
  model lacks raises ``Could not find the transformer layer class X`` (tiny Gemma 3:
  ``SiglipMultiheadAttentionPoolingHead``; LLaVA: ``CLIPTextEmbeddings``), and a model without
  ``_no_split_modules`` gets no unit but the embedding, the head and the root.
- A unit inside a subtree one rank runs and another skips (the vision tower on a text-only step, Mllama's
  cross-attention layers without an image, a LayerDrop stack) makes the ranks all-gather different units, or
  the same units in a different order: a gloo size mismatch, an NCCL hang. Where the model runs its tower
  (after or before the embedding, inside or outside the language model) decides that order, so no placement of
  a dummy input is right for every model; keeping those subtrees out of units of their own is.

So :class:`FsdpFacts` lists the candidate block classes (``_no_split_modules`` that exist, else the classes of
the model's repeated blocks: the elements of its ``nn.ModuleList`` stacks) and, of every candidate, whether
some instance lies inside a subtree a rank may skip
(:func:`hf_ddpfix.integrations.fsdp.wrap.skippable_subtrees`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..._compat import (
    fsdp_module_units,
    fsdp_plugin,
    fsdp_wrap_classes,
    fsdp_wrap_policy,
    no_split_modules,
    shared_parameter_holders,
    unwrap_model,
)
from ..vision.parts import get_submodule
from .cross_attention import cross_attention_parts
from .wrap import layerdrop_stacks, skippable_subtrees

__all__ = ["FsdpFacts", "fsdp_facts", "fsdp_wrap_plan", "gather_fsdp_facts", "repeated_block_classes", "unit_classes"]


@dataclass(frozen=True)
class FsdpFacts:
    """The wrap-relevant facts of an FSDP run (all class names as ``type(module).__name__`` spells them).

    Attributes:
        policy: the plugin's wrap policy (``"transformer_based_wrap"``, ``"size_based_wrap"``, ``"no_wrap"``...).
        user_classes: ``fsdp_transformer_layer_cls_to_wrap`` as the user gave it, ``None`` when unset.
        no_split: the model's ``_no_split_modules`` (what accelerate wraps by default), possibly empty.
        present: the names of ``no_split`` the model really has.
        repeated: classes of the model's repeated blocks (elements of ``nn.ModuleList`` stacks with parameters).
        skippable: candidate classes (``present``, ``repeated`` or ``user_classes``) with an instance inside a
            subtree a rank may skip.
        folded: names of those subtrees (the vision tower, the projector, LayerDrop stacks...).
        wrapped: the model is already sharded (a second ``train()``): prepare will not wrap it again.
        skipped_units: when ``wrapped``, the names of its FSDP units inside subtrees a rank may skip.
        folded_bytes: the bytes of the parameters in those subtrees (each counted once): what folding them keeps
            unsharded on every rank for the enclosing unit's forward and backward.
        shared: for every parameter tensor several modules hold (a tie), the names of those modules.
        carved: the names of the input and output embedding modules (what accelerate keeps together in one unit
            when their weights are tied), ``()`` where the model has none.
        ram_efficient: the plugin's ``cpu_ram_efficient_loading`` (accelerate then moves the model to meta, calls
            ``tie_weights()`` and broadcasts every ``state_dict`` entry from rank 0 as a DTensor).
        params4bit: the model holds bitsandbytes ``Params4bit`` (accelerate then skips that loading path).
        persistent_buffers: names of the model's persistent buffers (``state_dict`` entries that are no parameter).
        wrapped_tied_head: the name of the output embedding when its weight is the input embedding's but is no
            parameter of its own (an adapter layer around the tied head, e.g. LoRA's ``lm_head``), else ``""``.
        fold_only: candidate classes with an instance in a subtree no dummy can run (LayerDrop stacks; every
            skippable subtree of a family without a dummy): they never get a unit of their own.
        shardable_bytes: bytes of the skippable subtrees a dummy can run (``folded_bytes`` less LayerDrop).
        total_bytes: bytes of every parameter of the model (each tensor once).
        dummy: the stabiliser family whose dummy image runs where the tower runs (``fsdp_skippable = shard``;
            a cross-attention VLM: its ``model_type``, :mod:`.cross_attention`), ``""`` when none can be built;
            ``no_dummy`` says why.
        dummy_tokens: patches of that dummy image (an estimate from ``vision_config``).
        tower_params: parameters the dummy's forward reads (tower and projector).
        cache_fed: sub-models whose KV cache another part of the model reads in a training forward (PI0: its
            ``vlm`` run with ``use_cache=True``, its ``past_key_values`` fed to the action expert;
            :func:`cache_fed_submodels`); ``cache_fed_classes``: the classes inside them.
        shard_roots: classes of the skippable subtrees a dummy runs that are no model of their own (the projector),
            no ``torch.nn`` built-in and have no instance elsewhere: under ``shard`` they become units too, so the
            projector's parameters leave the root; with the cross-attention dummy also the tower model's own
            modules holding parameters directly (Mllama's position and aspect-ratio embeddings).
    """

    policy: str = "transformer_based_wrap"
    user_classes: tuple[str, ...] | None = None
    no_split: tuple[str, ...] = ()
    present: tuple[str, ...] = ()
    repeated: tuple[str, ...] = ()
    skippable: tuple[str, ...] = ()
    folded: tuple[str, ...] = ()
    wrapped: bool = False
    skipped_units: tuple[str, ...] = ()
    folded_bytes: int = 0
    shared: tuple[tuple[str, ...], ...] = ()
    carved: tuple[str, ...] = ()
    ram_efficient: bool = False
    params4bit: bool = False
    persistent_buffers: tuple[str, ...] = ()
    wrapped_tied_head: str = ""
    fold_only: tuple[str, ...] = ()
    shardable_bytes: int = 0
    total_bytes: int = 0
    dummy: str = ""
    no_dummy: str = ""
    dummy_tokens: int = 0
    tower_params: int = 0
    shard_roots: tuple[str, ...] = ()
    cache_fed: tuple[str, ...] = ()
    cache_fed_classes: tuple[str, ...] = ()


def repeated_block_classes(model: nn.Module) -> list[str]:
    """Class names of the blocks the model stacks: elements of every ``nn.ModuleList`` whose elements share
    one class and hold parameters (decoder layers, vision blocks), in ``named_modules`` order."""
    out: list[str] = []
    for mod in model.modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        kinds = {type(m) for m in mod}
        if len(kinds) == 1 and any(True for _ in mod[0].parameters()):
            name = type(mod[0]).__name__
            if name not in out:
                out.append(name)
    return out


def _classes_inside(subtrees: Iterable[nn.Module]) -> set[str]:
    return {type(m).__name__ for s in subtrees for m in s.modules()}


def unit_classes(f: FsdpFacts, shard: bool) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """THE choice of FSDP2 unit classes for a model under the transformer policy (no explicit class list): the one
    the plan makes (:func:`hf_ddpfix.plan.fsdp.decide_fsdp_units`, whose units ``shard_layout`` then sizes) and
    the one :func:`fsdp_wrap_plan` lists for plain ``fully_shard`` loops.

    ``shard`` (``fsdp_skippable = shard``: a dummy runs the skippable subtrees): units inside them too, except the
    classes no dummy runs (``f.fold_only``), plus the tower's own roots (``f.shard_roots``: the projector, so its
    parameters leave the root); otherwise (fold) no class with an instance inside a subtree a rank may skip.

    Returns:
        ``(chosen, source, only_skippable)``: the classes to wrap (``()``: the root only), the candidates they came
        from (``_no_split_modules`` that exist, else the repeated blocks' classes), and whether
        ``_no_split_modules`` named only skippable blocks (the repeated blocks were used instead).
    """
    source = f.present or f.repeated
    avoid = f.fold_only if shard else f.skippable  # shard: units inside the tower too (the dummy runs them)
    chosen = tuple(n for n in source if n not in avoid)
    only_skippable = bool(f.present) and not chosen  # e.g. transformers 5.0's PaliGemma: only its projector
    if only_skippable:
        source = f.repeated
        chosen = tuple(n for n in source if n not in avoid)
    if shard and chosen:  # the tower model and projector too: their own parameters leave the root
        chosen += tuple(c for c in f.shard_roots if c not in chosen and c not in f.fold_only)
    return chosen, source, only_skippable


def fsdp_wrap_plan(model: nn.Module, *, fold_skippable: bool = False) -> list[tuple[str, nn.Module]]:
    """Modules to pass to ``torch.distributed.fsdp.fully_shard``, innermost first, root last: a view on the plan's
    unit choice for plain ``fully_shard`` loops, not a layout of its own. The classes are
    :func:`unit_classes` of the model's :func:`fsdp_facts` (what the
    plan hands accelerate's transformer policy and ``shard_layout`` sizes: the one unit-layout model, issue 46);
    this lists their instances bottom-up, then ``model`` (the root). Accelerate's own embedding and ``[norm, head]``
    units are not made here: a plain loop keeps them in the root.

    ``fold_skippable=False`` is the plan's ``fsdp_skippable = shard``: units inside the vision tower too (its
    blocks and projector; the tower model's own parameters stay in the root), so :class:`VisionStabilizer` must be
    attached: every rank then runs the tower before the language model in every training forward and all ranks
    issue the same all-gathers / reduce-scatters in the same order (without it mixed image/text ranks hang).
    Subtrees no dummy runs (LayerDrop stacks, a family without a dummy) are folded either way.

    ``fold_skippable=True`` (any model, no dummy input needed) is the plan's ``fold``: no unit inside a subtree a
    rank may skip — the vision tower and projector (text-only step), cross-attention decoder layers (Mllama without
    an image), LayerDrop stacks: their parameters belong to the enclosing unit (the root for a tower), which every
    rank all-gathers, and :class:`~hf_ddpfix.integrations.usage.ParameterUsage` built with ``units=`` ties the ones
    a rank did not use, so every rank reduce-scatters the same set. Cost: a folded tower stays unsharded for the
    root's whole forward/backward.

    Guarantees: fully_shard over this plan + the stabiliser trains LoRA Qwen2.5-VL and Qwen3-VL with mixed
    image/text ranks (and an imageless step) to the same weights as DDP (1e-5; tests/scripts/vlm_fsdp.py); with
    ``fold_skippable`` + ParameterUsage every VLM of the zoo ends with stock DDP's (find_unused_parameters=True)
    weights within 2e-7 (tests/scripts/usage_fsdp.py, results in tests/results/fsdp2_parity.json); the classes
    are the plan's for the same model and mode (tests/test_vlm.py).
    """
    classes = set(unit_classes(fsdp_facts(None, model), not fold_skippable)[0])
    ids = {id(m): n for n, m in model.named_modules()}
    plan: list[tuple[str, nn.Module]] = []

    def walk(mod: nn.Module) -> None:  # post-order: a unit's inner units are sharded before it
        for child in mod.children():
            walk(child)
        if type(mod).__name__ in classes and mod is not model and any(True for _ in mod.parameters()):
            plan.append((ids[id(mod)], mod))

    walk(unwrap_model(model))
    plan.append(("", model))
    return plan


def gather_fsdp_facts(trainer: Any, model: nn.Module) -> FsdpFacts:
    """The facts for the Trainer's FSDP run on ``model`` (read-only): :func:`fsdp_facts` with the Trainer's plugin."""
    return fsdp_facts(fsdp_plugin(trainer), model)


def fsdp_facts(plugin: Any, model: nn.Module) -> FsdpFacts:
    """The facts for an FSDP run of ``model`` under accelerate's ``plugin`` (``None``: the transformer policy with
    the model's classes), read-only; the run (:func:`gather_fsdp_facts`) and ``hf-ddpfix plan`` (a meta-device
    model, the plugin a launch would build) both read them here. A ``_no_split_modules`` set (Gemma 3, LLaVA) is
    read in sorted order, so every process spells the plan the same way whatever its hash seed."""
    hf = unwrap_model(model)
    names, ours = fsdp_wrap_classes(plugin) if plugin is not None else (None, False)
    no_split = tuple(no_split_modules(hf))
    have = {type(m).__name__ for m in hf.modules()}
    skip = skippable_subtrees(hf)
    inside = _classes_inside(skip)
    repeated = tuple(repeated_block_classes(hf))
    user = None if ours else names
    candidates = set(no_split) | set(repeated) | set(user or ())
    ids = {id(m): n for n, m in hf.named_modules()}
    units = fsdp_module_units(model)
    drop = [m for m in layerdrop_stacks(hf) if _inside(m, skip)]
    dummy = _dummy_facts(hf, skip)
    runnable = [s for s in skip if not any(s is d for d in drop)] if dummy[0] else []
    no_dummy_inside = _classes_inside([s for s in skip if not any(s is r for r in runnable)])
    fed = cache_fed_submodels(hf)
    return FsdpFacts(
        policy=fsdp_wrap_policy(plugin) if plugin is not None else "transformer_based_wrap",
        user_classes=user,
        no_split=no_split,
        present=tuple(n for n in no_split if n in have),
        repeated=repeated,
        skippable=tuple(sorted(c for c in candidates if c in inside)),
        folded=tuple(ids.get(id(s), type(s).__name__) or type(s).__name__ for s in skip),
        wrapped=bool(units),
        skipped_units=tuple(ids.get(id(u), type(u).__name__) for u in units if _inside(u, skip)),
        folded_bytes=sum({id(p): p.numel() * p.element_size() for s in skip for p in s.parameters()}.values()),
        shared=tuple(shared_parameter_holders(hf)),
        carved=tuple(ids[id(m)] for m in _embeddings(hf) if id(m) in ids),
        ram_efficient=bool(getattr(plugin, "cpu_ram_efficient_loading", False)),
        params4bit=any(type(p).__name__ == "Params4bit" for p in model.parameters()),
        persistent_buffers=_persistent_buffers(model),
        wrapped_tied_head=_wrapped_tied_head(hf, ids),
        fold_only=tuple(sorted(c for c in candidates if c in no_dummy_inside)),
        shardable_bytes=_bytes(runnable),
        total_bytes=_bytes([hf]),
        dummy=dummy[0],
        no_dummy=dummy[1],
        dummy_tokens=dummy[2],
        tower_params=dummy[3],
        shard_roots=_shard_roots(hf, runnable, deep=bool(dummy[0]) and cross_attention_parts(hf) is not None),
        cache_fed=tuple(fed),
        cache_fed_classes=tuple(sorted({type(m).__name__ for n in fed if (sub := get_submodule(hf, n)) is not None
                                        for m in sub.modules()})),
    )


_CACHE_CALLS: dict[type, tuple[str, ...]] = {}
#: the output field holding the KV cache: ``past_key_values`` (transformers 5.23), ``cache`` (5.24)
_CACHE_FIELDS = ("past_key_values", "cache")


def _reads_cache_of(cls: type) -> tuple[str, ...]:
    """Attributes ``a`` for which ``cls.forward`` does ``self.a(..., use_cache=True, ...).past_key_values`` (``.cache``
    on transformers 5.24; kept per class; ``()`` without source)."""
    if cls not in _CACHE_CALLS:
        import ast
        import inspect
        import textwrap

        found: list[str] = []
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
        except (OSError, TypeError, SyntaxError):
            tree = None
        for node in ast.walk(tree) if tree is not None else ():
            call = node.value if isinstance(node, ast.Attribute) and node.attr in _CACHE_FIELDS else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "self"):
                continue
            if any(k.arg == "use_cache" and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in call.keywords):
                found.append(call.func.attr)
        _CACHE_CALLS[cls] = tuple(found)
    return _CACHE_CALLS[cls]


def cache_fed_submodels(hf: nn.Module) -> list[str]:
    """Dotted names of the sub-models whose KV cache the model reads in its own forward: a module whose ``forward``
    runs ``self.<sub>(..., use_cache=True).past_key_values`` (or ``.cache``; PI0: the VLM's cache is the action expert's
    prefix).
    Gradients reach such a sub-model's layers through the cache tensors, not through the layers' outputs, so an FSDP2
    unit there never sees its pre-backward all-gather: backward reads a freed shard ("setStorage ... storage of size
    0", measured on PI0, 2 gloo ranks, 2026-12-02)."""
    out: list[str] = []
    for name, mod in hf.named_modules():
        for attr in _reads_cache_of(type(mod)):
            if isinstance(getattr(mod, attr, None), nn.Module):
                out.append(f"{name}.{attr}" if name else attr)
    return out


def _shard_roots(hf: nn.Module, runnable: list[nn.Module], deep: bool = False) -> tuple[str, ...]:
    """``deep`` (the cross-attention dummy, which runs the whole tower model): also the tower model's own modules
    holding parameters directly (Mllama's gated positional embedding: 74 M parameters at 90 B, issue 36)."""
    inside = {id(m) for s in runnable for m in s.modules()}
    out: list[str] = []
    if deep:
        for s in runnable:
            for m in s.modules() if hasattr(s, "config") else ():
                cls = type(m)
                if (m is s or cls.__module__.startswith("torch.") or hasattr(m, "config") or cls.__name__ in out
                        or not any(True for _ in m.parameters(recurse=False))):
                    continue
                if all(id(x) in inside for x in hf.modules() if type(x) is cls):
                    out.append(cls.__name__)
    for s in runnable:
        cls = type(s)
        # a tower model (a PreTrainedModel: it has a config) stays out: as a unit of its own its hidden states
        # are no longer captured (LLaVA's get_image_features read None); its blocks are units already
        if cls.__module__.startswith("torch.") or cls.__name__ in out or hasattr(s, "config"):
            continue
        if all(id(m) in inside for m in hf.modules() if type(m) is cls):
            out.append(cls.__name__)
    return tuple(out)


def _bytes(subtrees: Iterable[nn.Module]) -> int:
    return sum({id(p): p.numel() * p.element_size() for s in subtrees for p in s.parameters()}.values())


def _dummy_facts(hf: nn.Module, skip: list[nn.Module]) -> tuple[str, str, int, int]:
    """(family, why not, tokens, tower parameters) of the dummy image that could run a skippable subtree."""
    from ..vision.adapter import grid_geometry, image_size_hw, materialized
    from ..vision.families import describe_unsupported, find_vision_adapter
    from ..vision.parts import vlm_parts
    from ..vision.zero import forward_order_problem, language_model_path

    vision = [s for s in skip if not isinstance(s, nn.ModuleList)]
    if not vision:
        return "", "LayerDrop only", 0, 0
    if vlm_parts(hf).cross_attention:
        from .cross_attention import dummy_tokens, nonzero_contribution

        parts = cross_attention_parts(hf)
        if parts is None:
            return "", "cross-attention layers: no vision_model/projector/language_model", 0, 0
        refused = nonzero_contribution(parts[3])
        if refused:
            return "", refused, 0, 0
        cross = [m for s in skip for m in s.modules()] + [m for p in parts[1:3] for m in p.modules()]
        params = sum({id(p): p.numel() for m in cross for p in m.parameters(recurse=False)}.values())
        name = getattr(getattr(hf, "config", None), "model_type", None) or type(parts[0]).__name__
        return name, "", dummy_tokens(parts[1]), params
    adapter = find_vision_adapter(hf, zero=True)
    if adapter is None:
        return "", describe_unsupported(hf, zero=True)[:60], 0, 0
    lm_path = language_model_path(adapter)
    if lm_path is None:
        return "", "no language model module to run it before", 0, 0
    order = forward_order_problem(adapter, lm_path)  # as the dummy's own check at attach: the plan folds instead
    if order:
        return "", f"the forward order: {order}", 0, 0
    if adapter.family.discovered and materialized([p for _, m in adapter.parts() for p in m.parameters()]):
        try:  # whole weights, before wrapping: the run-time trial now (its verdict is kept for attach), so a
            adapter.verify()  # dummy that does not run folds the tower instead of refusing the plan's own units
        except ValueError as err:
            return "", f"its dummy does not run ({' '.join(str(err).split())[:160]})", 0, 0
    vc = adapter.vision_config
    grid = grid_geometry(vc) if adapter.kind == "grid" else None
    if grid is not None:  # one merged token: merge x merge patches (VisionAdapter.dummy_inputs)
        tokens = grid[0] ** 2
    else:
        hw = image_size_hw(vc) or (224, 224)
        patch = getattr(vc, "patch_size", None) or 14
        patch = patch if isinstance(patch, int) else 14
        tokens = max(1, (hw[0] // patch) * (hw[1] // patch))
    params = sum({id(p): p.numel() for _, m in adapter.parts() for p in m.parameters()}.values())
    return adapter.family.name, "", tokens, params


def _persistent_buffers(model: nn.Module) -> tuple[str, ...]:
    keys = set(model.state_dict(keep_vars=True))
    return tuple(n for n, _ in model.named_buffers() if n in keys)


def _wrapped_tied_head(model: nn.Module, ids: dict[int, str]) -> str:
    mods = {g: _embedding(model, g) for g in ("get_input_embeddings", "get_output_embeddings")}
    inp, out = mods["get_input_embeddings"], mods["get_output_embeddings"]
    if inp is None or out is None or getattr(inp, "weight", None) is None:
        return ""
    if getattr(out, "weight", None) is not inp.weight or "weight" in dict(out.named_parameters(recurse=False)):
        return ""
    return ids.get(id(out), type(out).__name__)


def _embedding(model: nn.Module, getter: str) -> nn.Module | None:
    try:
        mod = getattr(model, getter, lambda: None)()
    except (AttributeError, NotImplementedError):  # a model without one raises in transformers 5
        return None
    return mod if isinstance(mod, nn.Module) else None


def _embeddings(model: nn.Module) -> list[nn.Module]:
    found = (_embedding(model, g) for g in ("get_input_embeddings", "get_output_embeddings"))
    return [m for m in found if m is not None]


def _inside(mod: nn.Module, subtrees: list[nn.Module]) -> bool:
    return any(mod is m for s in subtrees for m in s.modules())
