"""Mixed image/text batches under DeepSpeed ZeRO-2/3: the dummy image, run where the real one runs.

Problem (REFERENCES.md §2, §10; reproduced on CPU with deepspeed 0.19.8, 2 gloo ranks, tiny Qwen2.5-VL
with LoRA on every linear incl. the tower, rank 0 with an image, rank 1 text-only): ZeRO-3 fails at
step 0 in ``fetch_sub_module`` (gloo "37632 vs 64": rank 0 all-gathers the tower's patch embedding,
rank 1 has moved on to the language model; NCCL hangs there) and ZeRO-2 fails in backward (gloo
"15072 vs 6400": the gradient all-reduce covers different parameter sets).

The DDP stabiliser (:class:`~hf_ddpfix.integrations.vision.stabilizer.VisionStabilizer`) runs its dummy image in
the *root* forward pre-hook, i.e. before the input embedding. ZeRO-3 all-gathers every module's
parameters when that module runs, so the text rank then gathers ``visual.patch_embed`` while the image
rank gathers ``embed_tokens``: still a mismatch (measured: "37632 vs 16384"). And tying the dummy output
to the embedding *output* makes that output require grad on the text rank only, so ZeRO-3 re-gathers
the frozen embedding in backward on one rank only.

Fix (:class:`ZeroVisionStabilizer`): on a training forward without visual input, run the minimal dummy
image in a forward pre-hook of the *language model* module — after the input embedding, exactly where
the model runs the real tower (``Qwen2_5_VLModel.forward``, transformers 5.23: embed → tower → masked
scatter into ``inputs_embeds`` → ``language_model(inputs_embeds=...)``) — and tie its merged tokens into
``inputs_embeds`` with :class:`~hf_ddpfix.ops.zero_tie.ZeroTie` (identity forward, exact-zero gradient).
Qwen3-VL's deepstack features are tied to decoder layer ``i``'s output, where the real ones are added.
LLaVA and Gemma 3 (``LlavaModel`` / ``Gemma3Model.forward``: embed → ``get_image_features`` (tower +
projector) → masked scatter → ``language_model``): the dummy is one native-size image through
``get_image_features``, so the projector runs too, and only its projected features (``pooler_output``)
are tied: what a real image's forward leaves out of the loss (Gemma 3's SigLIP pooling head, hidden
states of later layers) gets no gradient on either rank. Every rank then runs the same modules in the same order (ZeRO-3's all-gathers and its prefetch trace
match), the same tensors require grad at every module boundary (ZeRO-3's backward re-gathers match),
and every trainable parameter's gradient becomes ready in the same order (ZeRO-2's buckets and ZeRO-3's
reduce-scatters hold the same parameters at the same offsets).

Optimizer semantics: the loss and every language-model gradient are bit-identical to the stock
forward; vision gradients on a text-only rank are exact zeros, which DeepSpeed averages with the image
rank's — what stock DDP(find_unused_parameters=True) does. When *no* rank has an image in a step, the
vision gradients are zeros on every rank; stock DeepSpeed (all ranks text-only, which it trains) also
zero-fills the gradient of every parameter that got none (``get_flat_partition`` in ZeRO-1/2, the leaf
and epilogue paths in ZeRO-3), so AdamW steps are the stock DeepSpeed ones. (Stock DDP leaves such a
gradient ``None`` and skips the parameter; DeepSpeed's flat fp32 partitions cannot, so there is no
``finalize`` here; ``HF_DDPFIX_ZERO_SKIP_UNUSED=1`` restores such parameters after the step instead:
:mod:`hf_ddpfix.integrations.deepspeed.zero_unused`.)

Evaluation, prediction and generation (``sync_eval=True``, used under ZeRO-3): every forward gathers
parameters there too, so a text-only rank that skips the tower while another rank runs it hangs (NCCL)
or fails (gloo) at the first evaluation batch with images. For a forward that is not a training forward
(``model.eval()`` or no grad), every rank first agrees, with one all-gather of one byte, whether *any* rank
passes visual input; if one does, every rank without it runs the same dummy image at the same point as in
training (before the language model). Under ``no_grad`` nothing is tied: the model's outputs (logits,
loss, generated tokens) are exactly stock's for the real inputs. When no rank has an image (most decode
steps of ``generate``) no dummy runs. Cost: one tiny collective per evaluation forward.

Guarantees: mixed batches train under ZeRO-2 and ZeRO-3 to the weights of stock DDP
(find_unused_parameters=True) within 1e-5 — Qwen2.5-VL and LLaVA, with gradient accumulation 2 under
ZeRO-3 too — and all-text steps to the weights of stock DeepSpeed (tests/test_deepspeed.py,
tests/scripts/deepspeed_train.py). Families: :mod:`hf_ddpfix.integrations.vision.families` (``zero=True`` view).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..._compat import generate_pre_encodes_images
from ...ops.dist import dist_ready, gather_flags
from ...ops.feature_counts import record_amount, record_fallback, record_ran
from ...ops.zero_tie import ZeroTie
from .adapter import VISUAL_INPUT_NAMES
from .families import VisionAdapter, describe_unsupported, find_vision_adapter, get_submodule, output_tensors
from .parts import LANGUAGE_MODEL_PATHS, TOWER_CALLS, vlm_parts

__all__ = ["EMBEDDING_CALLS", "FEATURE", "ZeroVisionStabilizer", "any_rank", "first_embedding_call",
           "forward_order_problem", "language_model_of", "language_model_path"]

#: ``hf_ddpfix.ops.feature_counts`` name: ``ran`` counts dummy images run; amounts ``train_dummies`` /
#: ``eval_dummies`` split them (eval = evaluation, prediction and generation forwards).
FEATURE = "stabilizer"


def any_rank(flag: bool, process_group: Any = None) -> bool:
    """True when ``flag`` is true on some rank (one all-gather of one byte); ``flag`` without a group."""
    if not dist_ready(process_group):
        return bool(flag)
    return any(row[0] for row in gather_flags([flag], process_group))


def count_dummy(kind: str) -> None:
    """Record one dummy-image forward of ``kind`` (``"train"`` or ``"eval"``) in the feature counts."""
    record_ran(FEATURE)
    record_amount(FEATURE, f"{kind}_dummies", 1)

logger = logging.getLogger("hf_ddpfix")

def language_model_path(adapter: VisionAdapter) -> str | None:
    """The dotted name (in ``adapter.root``) of the module the model calls with ``inputs_embeds`` after merging
    image features, or ``None``: :func:`~hf_ddpfix.integrations.vision.parts.vlm_parts`' language model, found at
    one of its :data:`~hf_ddpfix.integrations.vision.parts.LANGUAGE_MODEL_PATHS` (never the adapter's tower). A
    decoder found only through ``get_decoder()`` is not one: that module may also embed the tokens, so a dummy
    placed before it would run before the embedding, not where an image rank runs its tower."""
    parts = vlm_parts(adapter.root, tower=adapter.tower_name)
    return parts.language_model if parts.language_model_by == "path" else None


def language_model_of(adapter: VisionAdapter) -> nn.Module | None:
    """The module the model calls with ``inputs_embeds`` after merging image features, or ``None``."""
    path = language_model_path(adapter)
    return None if path is None else get_submodule(adapter.root, path)


def _self_calls(forward: Any) -> list[tuple[str, tuple[int, int], bool]] | None:
    """Every ``self.<...>.<name>(...)`` call in ``forward``'s source: ``(name, (line, column), on self itself)``,
    line 1 being its ``def``; ``None`` where there is no source."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    calls = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        base = node.func.value
        while isinstance(base, ast.Attribute):
            base = base.value
        if isinstance(base, ast.Name) and base.id == "self":
            direct = isinstance(node.func.value, ast.Name)
            calls.append((node.func.attr, (node.lineno, node.col_offset), direct))
    return calls


def _first(calls: list[tuple[str, tuple[int, int], bool]], names: set[str] | tuple[str, ...],
           direct: bool) -> tuple[int, int] | None:
    found = [at for name, at, on_self in calls if name in names and (on_self or not direct)]
    return min(found) if found else None


def first_calls(forward: Any, lm_attr: str, tower_attrs: set[str]) -> tuple[tuple[int, int] | None, ...]:
    """``(line, column)`` in ``forward``'s source (line 1: its ``def``) of its first ``self.<lm_attr>(...)`` call
    and of its first ``self.<one of tower_attrs>(...)`` call; ``None`` for a call not found or no source."""
    calls = _self_calls(forward)
    if calls is None:
        return None, None
    return _first(calls, {lm_attr}, direct=True), _first(calls, tower_attrs - {lm_attr}, direct=True)


#: the calls that embed the tokens, as ``self.<name>(...)`` or ``self.<...>.<name>(...)`` in a VLM's forward
EMBEDDING_CALLS = ("get_input_embeddings", "embed_tokens")


def first_embedding_call(forward: Any) -> tuple[int, int] | None:
    """``(line, column)`` in ``forward``'s source (line 1: its ``def``) of its first call that embeds the tokens
    (:data:`EMBEDDING_CALLS` on ``self`` or an attribute chain from it); ``None`` where there is none or no source."""
    calls = _self_calls(forward)
    return None if calls is None else _first(calls, EMBEDDING_CALLS, direct=False)


def forward_order_problem(adapter: VisionAdapter, lm_path: str) -> str | None:
    """Why the dummy's placement (the language model's forward pre-hook) is not where this model runs its tower,
    or ``None``.

    The dummy relies on one forward order: an image rank runs its tower after the input embedding and *before*
    it calls the language model, so a text rank's dummy at the language model's pre-hook reaches the tower's
    units (FSDP2) / parameters (ZeRO-3 prefetch) at the same point. Checked at attach time by reading the
    forward of the module that owns the language model (its source, as Python reads it): where that forward
    calls the language model before its first call of the tower (``get_image_features``, the tower's own
    attribute, ...), or runs the tower before its first call that embeds the tokens (:data:`EMBEDDING_CALLS`:
    Ovis2.5 on transformers 5.25, BLIP-2 and InstructBLIP encode the image first), the order is positively
    different and the dummy refuses. Where the forward does not show the calls (the tower run one level up, a compiled forward, no
    source) nothing is concluded: the dummy stays, as before this check.
    """
    owner_path, _, lm_attr = lm_path.rpartition(".")
    owner = get_submodule(adapter.root, owner_path) if owner_path else adapter.root
    tower_attrs = set(TOWER_CALLS) | {adapter.tower_name.rpartition(".")[2]}
    calls = _self_calls(getattr(type(owner), "forward", None))  # the source, read once
    if calls is None:
        return None
    lm_at, tower_at = _first(calls, {lm_attr}, direct=True), _first(calls, tower_attrs - {lm_attr}, direct=True)
    if lm_at is None or tower_at is None:
        return None
    if lm_at < tower_at:
        return (f"{type(owner).__name__}.forward calls self.{lm_attr} (line {lm_at[0]} of the forward) "
                f"before it runs the tower (line {tower_at[0]}): the dummy image, placed where the language "
                "model is entered, would reach the tower at another point of the order than an image rank does")
    embed_at = _first(calls, EMBEDDING_CALLS, direct=False)
    if embed_at is not None and tower_at < embed_at:
        return (f"{type(owner).__name__}.forward runs the tower (line {tower_at[0]} of the forward) before it "
                f"embeds the tokens (line {embed_at[0]}): the dummy image, placed where the language model is "
                "entered, would reach the tower after the embedding, an image rank before it")
    return None


class GenerateSync:
    """While attached, ``adapter.root.generate`` first agrees across ranks whether any rank passes pixels,
    and a rank without them runs the dummy image (no grad) where the others run their tower.

    Needed only where ``generate`` encodes images *before* the prefill forward
    (:func:`hf_ddpfix._compat.generate_pre_encodes_images`, transformers 5.23: ``base_model.
    get_image_features`` on the ranks that pass pixels, then ``forward(mm_encoder_outputs=...)``): the
    forward hooks never see that tower run. Where the tower runs inside the prefill forward, this does
    nothing and the forward hooks agree instead. The prefill forward itself then carries no pixels on any
    rank, so the hooks agree on "no image" there.

    Args:
        adapter: the located tower.
        process_group: the group to agree over.
        on_dummy: called after each dummy run (counting).
    """

    def __init__(self, adapter: VisionAdapter, process_group: Any = None, on_dummy: Any = None) -> None:
        self.adapter, self.process_group, self.on_dummy = adapter, process_group, on_dummy
        self._installed: Any = None
        self._previous: Any = None
        self._had_own = False

    def attach(self) -> GenerateSync:
        """Shadow ``root.generate`` on the instance (idempotent; nothing where generate does not pre-encode)."""
        root = self.adapter.root
        if self._installed is not None or not generate_pre_encodes_images(root):
            return self
        self._had_own = "generate" in vars(root)
        self._previous = vars(root).get("generate")
        inner = root.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            local = any(kwargs.get(name) is not None for name in VISUAL_INPUT_NAMES)
            if any_rank(local, self.process_group) and not local:
                with torch.no_grad():
                    self.adapter.run_dummy()
                if self.on_dummy is not None:
                    self.on_dummy()
            return inner(*args, **kwargs)

        root.generate = generate
        self._installed = generate
        return self

    def remove(self) -> None:
        """Put the previous ``generate`` back (only if ours is still the one installed)."""
        root = self.adapter.root
        if self._installed is None:
            return
        if vars(root).get("generate") is self._installed:
            if self._had_own:
                root.generate = self._previous
            else:
                del root.generate
        self._installed = None


class ZeroVisionStabilizer:
    """Dummy image for text-only micro-batches, placed so ZeRO-2/3 see the same collectives on every rank.

    Args:
        model: HF VLM, PeftModel, or a wrapper (hooks go on the unwrapped HF model).
        adapter: the tower adapter; found with :func:`find_vision_adapter` (``zero=True``: LLaVA and
            Gemma 3 too) when ``None``.
        train: run the dummy on text-only *training* forwards (``model.training`` and grad enabled).
        sync_eval: make every other forward (evaluation, prediction, generation) agree across ranks: one
            all-gather of one byte per forward, and the dummy image on ranks without visual input when
            some rank has it (ZeRO-3; see the module docstring). Every rank must then call the model's
            forward equally often, which ZeRO-3 needs anyway.
        process_group: the group ``sync_eval`` agrees over (default: the world).

    Raises:
        ValueError: no adapter for this model, or no language-model module to place the dummy before.

    Attach before ``deepspeed.initialize`` (the Trainer calls it inside ``train()``): our hooks must run
    before DeepSpeed's own hooks on the same modules, so DeepSpeed sees the tied ``inputs_embeds``.

    Guarantees: on a text-only training forward the loss is a bitwise copy of the stock one, every
    trainable tower parameter gets an exact-zero gradient, and the tower runs between the input
    embedding and the language model, as on an image rank. Batches with visual input are untouched; with
    ``sync_eval`` an evaluation forward's outputs are bitwise the stock ones (nothing is tied under
    ``no_grad``), otherwise eval and no-grad forwards are untouched (tests/test_deepspeed.py).
    """

    def __init__(self, model: nn.Module, adapter: VisionAdapter | None = None, *, train: bool = True,
                 sync_eval: bool = False, process_group: Any = None) -> None:
        adapter = adapter or find_vision_adapter(model, zero=True)
        if adapter is None:
            raise ValueError(
                f"hf_ddpfix: no vision stabiliser for this model: {describe_unsupported(model, zero=True)}")
        lm_path = language_model_path(adapter)
        if lm_path is None:
            raise ValueError(
                f"hf_ddpfix: {adapter.family.name}: no language model module at {LANGUAGE_MODEL_PATHS}; "
                "the ZeRO dummy image needs it to run the tower where the real image runs"
            )
        problem = forward_order_problem(adapter, lm_path)
        if problem:
            raise ValueError(f"hf_ddpfix: {adapter.family.name}: no dummy image: {problem}")
        lm = get_submodule(adapter.root, lm_path)
        adapter.verify()  # a family discovered from the config: a trial run fixes and proves its dummy
        self.adapter = adapter
        self.language_model = lm
        self.train = train
        self.sync_eval = sync_eval
        self.process_group = process_group
        self._handles: list[Any] = []
        self._generate = GenerateSync(adapter, process_group, self._count_generate_dummy)
        self._kind = "train"
        self._text_only = False
        self._deep: list[tuple[nn.Module, torch.Tensor]] = []
        self.dummy_runs = 0  # number of dummy tower forwards so far (for logs and tests)
        self.eval_dummy_runs = 0  # of which in evaluation / prediction / generation forwards
        self.eval_forwards = 0  # evaluation forwards that agreed across ranks (sync_eval)
        self.skipped = 0  # text-only forwards left stock (no inputs_embeds to tie into)

    @property
    def attached(self) -> bool:
        """True while the hooks are registered."""
        return bool(self._handles)

    def attach(self) -> ZeroVisionStabilizer:
        """Register the hooks (idempotent). Returns ``self``.

        The language-model pre-hook is registered first in line (``prepend``), so the dummy runs before
        DeepSpeed's own pre-forward hook on that module even when the engine already exists (evaluation
        after ``deepspeed.initialize``): ZeRO-3 then records and prefetches the same module order on
        every rank.
        """
        if not self._handles:
            self._handles = [
                self.adapter.root.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True),
                self.language_model.register_forward_pre_hook(self._lm_pre_hook, with_kwargs=True, prepend=True),
            ]
            n_deep = len(getattr(self.adapter.vision_config, "deepstack_visual_indexes", None) or [])
            for path in self.adapter.family.deepstack_layer_paths:
                layers = get_submodule(self.adapter.root, path)
                if isinstance(layers, nn.ModuleList):
                    self._handles += [m.register_forward_hook(self._layer_hook) for m in list(layers)[:n_deep]]
                    break
            if self.sync_eval:
                self._generate.attach()
        return self

    def _count_generate_dummy(self) -> None:
        self.dummy_runs += 1
        self.eval_dummy_runs += 1
        count_dummy("eval")

    def remove(self) -> None:
        """Remove the hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._generate.remove()
        self._text_only = False
        self._deep = []

    def _root_pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        training = module.training and torch.is_grad_enabled()
        self._deep = []
        self._text_only = False
        if training:
            self._kind = "train"
            self._text_only = self.train and not self.adapter.has_visual_input(args, kwargs)
        elif self.sync_eval:
            self._kind = "eval"
            local = self.adapter.has_visual_input(args, kwargs)
            self.eval_forwards += 1
            self._text_only = any_rank(local, self.process_group) and not local

    def _lm_pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._text_only:
            return None
        self._text_only = False  # once per root forward
        embeds = kwargs.get("inputs_embeds")
        if not isinstance(embeds, torch.Tensor) or not embeds.is_floating_point():
            if not self.skipped:  # never fail a forward stock runs: stock behaviour, said once
                logger.warning("hf_ddpfix: %s was called without inputs_embeds: no ZeRO dummy image (stock "
                               "behaviour; transformers changed the VLM forward?)", type(module).__name__)
            self.skipped += 1
            record_fallback(FEATURE, "language model called without inputs_embeds: no dummy image")
            return None
        out = self.adapter.run_dummy()
        self.dummy_runs += 1
        count_dummy(self._kind)
        if self._kind == "eval":
            self.eval_dummy_runs += 1
        pooled, deep = self._split(out)
        if pooled is not None and pooled.requires_grad:
            kwargs = dict(kwargs)
            kwargs["inputs_embeds"] = ZeroTie.apply(embeds, pooled)
        self._deep = deep
        return args, kwargs

    def _split(self, out: Any) -> tuple[torch.Tensor | None, list[tuple[nn.Module, torch.Tensor]]]:
        ties = self.adapter.tie_points(out)
        pooled = None
        deep: list[tuple[nn.Module, torch.Tensor]] = []
        for i, (mod, tensors) in enumerate(ties):
            tensors = [t for t in tensors if t.requires_grad]
            if i == 0:
                if mod is None:  # the tower returned no pooler_output: tie everything to inputs_embeds
                    tensors = [t for t in output_tensors(out) if t.requires_grad]
                pooled = _sum_ready(tensors)
            elif mod is not None and tensors:
                deep.append((mod, _sum_ready(tensors)))
        return pooled, deep

    def _layer_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        for i, (mod, feat) in enumerate(self._deep):
            if mod is module:
                del self._deep[i]
                if isinstance(output, torch.Tensor):
                    return ZeroTie.apply(output, feat)
                if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                    return (ZeroTie.apply(output[0], feat), *output[1:])
                logger.warning("hf_ddpfix: cannot tie a deepstack feature to a %s: left untied (stock)",
                               type(output).__name__)
        return None


def _sum_ready(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor carrying all of ``tensors`` into a :class:`ZeroTie` (``None`` if empty)."""
    if not tensors:
        return None
    if len(tensors) == 1:
        return tensors[0]
    return ZeroTie.apply(tensors[0], *tensors[1:])
