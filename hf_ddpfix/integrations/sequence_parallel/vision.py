"""Sequence parallelism for vision-language models: the vision tower, the image merge and the 3-D (M-RoPE)
position ids run on the full sequence, only the text decoder runs on this rank's slice.

How (the table's Qwen2-VL, Qwen2.5-VL, Qwen3-VL; transformers 5.x layout `model.language_model`):
  - every rank of an SP group calls the model on the *whole* merged batch (`input_ids`, `pixel_values`,
    `image_grid_thw`, `mm_token_type_ids`, ...). The model's own forward embeds the tokens, runs the
    vision tower on every image, scatters the features into the embeddings (so an image's tokens are
    never split from its features: ms-swift#3215's "Image features and image tokens do not match") and
    computes the 3-D position ids with its own `get_rope_index` on the full sequence (verl#1739: ids
    computed per shard are wrong). hf_ddpfix calls no private model method for that;
  - a forward pre-hook on the text decoder cuts its inputs to this rank's slice
    (`ops.sequence_parallel.multimodal.shard_language_model_inputs`: embeddings, position ids,
    Qwen3-VL's visual mask and deepstack features), drops the 2-D mask (attention gets the
    full-sequence mask from the documents instead) and activates Ulysses attention for the decoder;
  - the attention of every module outside the text decoder (the vision tower; a connector with its own
    attention, e.g. Idefics2's perceiver resampler) always runs as given (`keep_full_sequence`), also when a
    checkpointed backward recomputes it;
  - the logits are this rank's slice; the caller takes the cross-entropy against labels shifted on the
    full sequence (`shard_batch`).

Vision parameters under DDP: every rank of a group runs the tower on every image of the group's batch,
its gradient the share of this rank's tokens (the image features of other ranks' tokens get zeros
through the slice), so the parameters are used on every rank of a group that has an image; a group
without one is the stabiliser's text-only micro-batch (`integrations/vision/stabilizer.py`: dummy image
tied with zero gradients, grads `None` when no rank saw an image in the step), which needs no change.

Any other VLM is judged by its structure (`structural_family`: LLaVA, Gemma 3, InternVL, Mistral 3, Aya Vision,
Idefics2/3, SmolVLM, VipLLaVA, Cohere2-Vision on transformers 5.23): its image features are merged into the text
decoder's `inputs_embeds`, the decoder's forward takes nothing else, and it computes no M-RoPE ids. The hook
then cuts embeddings and 2-D position ids as above; masks the model prepared itself on the full sequence (Gemma 3:
bidirectional attention inside each image, sliding-window layers; a dict per layer type) are padded
(`pad_prepared_mask`) and used by the Ulysses attention for the layers the model hands them to.

What the plan refuses (`vision_sequence_parallel_support`), naming the model and the reason: image features that
reach the decoder besides `inputs_embeds` (Mllama's cross-attention), M-RoPE outside the table (Qwen3-VL-MoE), no
decoder or tower found, a table family whose decoder forward lacks the keywords we cut. At run time a decoder call
with an input we do not know how to cut, or a prepared mask that is not boolean, raises (never a silently wrong
result).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..._compat import forward_source, passed_cache, unwrap_model
from ...ops.feature_counts import record_amount
from ...ops.sequence_parallel.inputs import IGNORE_INDEX, shard_batch
from ...ops.sequence_parallel.loss import shard_loss_rows
from ...ops.sequence_parallel.multimodal import shard_language_model_inputs
from ..vision.families import find_vision_adapter
from ..vision.parts import (
    LANGUAGE_MODEL_PATHS,
    TOWER_NAMES,
    get_submodule,
    is_vision_language_model,
    vlm_parts,
)
from .attention import FEATURE, activate_batch, keep_full_sequence

__all__ = ["PER_ITEM_KEYS", "PER_TOKEN_KEYS", "SEQUENCE_PARALLEL_VISION_FAMILIES", "VisionSequenceParallelFamily",
           "VisionSequenceSharding", "merge_vision_batches", "vision_sequence_parallel_support"]


@dataclass(frozen=True)
class VisionSequenceParallelFamily:
    """How a VLM family's text decoder is called (data; the code is `VisionSequenceSharding`; where the decoder is:
    `integrations/vision/parts.py`, `vlm_parts`).

    Args:
        name: the vision family's name (`integrations/vision/families.py`).
        text_positions_from_2d: the decoder reads 2-D `position_ids` as text positions (and finds packed
            documents in them when no mask is given): Qwen3-VL expands them to 4 rows, text first;
            Qwen2-VL / Qwen2.5-VL expand them to 3 rotary rows and read no documents (5.23 modeling).
        cut_keywords: per-token decoder inputs besides `inputs_embeds` / `position_ids` / `attention_mask`
            that are cut (`visual_pos_masks`, `deepstack_visual_embeds`: Qwen3-VL).
    """

    name: str
    text_positions_from_2d: bool = False
    cut_keywords: tuple[str, ...] = ()
    #: built from the model's structure (`structural_family`), not from the table
    structural: bool = False


#: The families whose parity with one process is tested (tests/scripts/sp_parity.py, "vlm/*" cases).
#: Qwen3-VL-MoE is left out: not tested under sequence parallelism here.
SEQUENCE_PARALLEL_VISION_FAMILIES: dict[str, VisionSequenceParallelFamily] = {
    "qwen2_vl": VisionSequenceParallelFamily("qwen2_vl"),
    "qwen2_5_vl": VisionSequenceParallelFamily("qwen2_5_vl"),
    "qwen3_vl": VisionSequenceParallelFamily("qwen3_vl", text_positions_from_2d=True,
                                             cut_keywords=("visual_pos_masks", "deepstack_visual_embeds")),
}

#: `[B, S]` batch keys: right-padded with 0 (text) and concatenated over the group's batches.
PER_TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")
#: per-image / per-video batch keys (flattened patches, grids, frame times): concatenated along dim 0 in
#: batch order, which is the order their tokens appear in the merged rows.
PER_ITEM_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                 "image_sizes")
_TEXT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
BATCH_KEYS = _TEXT_KEYS + PER_TOKEN_KEYS + PER_ITEM_KEYS
#: decoder call keywords the hook passes on unchanged (no per-token content)
_PASS_KEYWORDS = ("input_ids", "past_key_values", "cache", "use_cache", "cache_position", "output_attentions",
                  "output_hidden_states", "return_dict")
_CUT = ("inputs_embeds", "position_ids", "attention_mask")
#: `[B, S]` batch keys a VLM forward may hand on to its decoder through `**kwargs` (transformers 5.0's Qwen-VL
#: takes no `mm_token_type_ids` and passes it down unused): cut like the tokens, never passed at full length
_CUT_PER_TOKEN = PER_TOKEN_KEYS


def reads_text_positions_from_rotary_rows(decoder: nn.Module) -> bool | None:
    """Whether the installed decoder takes row 0 of 3-row M-RoPE position ids as the text positions it finds
    packed documents in (transformers 5.0's Qwen3-VL text model: `else: text_position_ids = position_ids[0]`;
    5.23 reads them from 4-row ids only). Read from its forward's source; None when the source is unavailable.
    The behaviour is checked against the rule by tests/test_sequence_parallel_vision.py (decoder contract)."""
    import re

    try:
        src = forward_source(type(decoder))
    except (OSError, TypeError):
        return None
    return re.search(r"else:\s*\n\s*text_position_ids\s*=\s*position_ids\[0\]", src) is not None


#: the decoder forward's named parameters a structural family may have (anything else, e.g. Mllama's
#: `cross_attention_states`, means image features reach the decoder another way than `inputs_embeds`)
_DECODER_PARAMS = frozenset({"self", "input_ids", "attention_mask", "position_ids", "past_key_values", "cache",
                             "inputs_embeds",
                             "use_cache", "cache_position", "output_attentions", "output_hidden_states", "return_dict",
                             "kwargs", "args"})


def _decoder(hf: nn.Module) -> nn.Module | None:
    """The text decoder where sequence parallelism cuts: `vlm_parts`' language model (at one of its
    `LANGUAGE_MODEL_PATHS`, else `get_decoder()`'s module)."""
    path = vlm_parts(hf).language_model
    return get_submodule(hf, path) if path else None


def vision_tower(hf: nn.Module) -> nn.Module | None:
    """The VLM's vision tower: `vlm_parts`' (the outermost module named one of `TOWER_NAMES`), else the tower a
    registered family locates under another name (`families.find_vision_adapter`, ZeRO view)."""
    path = vlm_parts(hf).tower
    if path is not None:
        return get_submodule(hf, path)
    adapter = find_vision_adapter(hf, zero=True)
    return adapter.tower if adapter is not None else None


def structural_family(hf: nn.Module) -> tuple[VisionSequenceParallelFamily | None, str]:
    """A VLM outside the table, judged by its structure: `(family, "")` when its image features are merged into the
    text decoder's `inputs_embeds` (the decoder `vlm_parts` finds, at one of `LANGUAGE_MODEL_PATHS` or
    `get_decoder()`, takes nothing but text-decoder inputs), it has a vision tower, and it computes no multimodal (M-RoPE) position
    ids; else `(None, reason)`. Its image attention (Gemma 3's bidirectional image blocks, sliding windows) comes
    from the masks the model itself builds on the full sequence (`VisionSequenceSharding`)."""
    mt = getattr(hf.config, "model_type", None)
    head = f"{type(hf).__name__} (model_type {mt!r})"
    lm = _decoder(hf)
    if lm is None:
        return None, (f"{head}: no text decoder at {' / '.join(LANGUAGE_MODEL_PATHS)} or get_decoder() (where "
                      "sequence parallelism cuts)")
    inner = get_submodule(hf, "model") or hf
    if any(callable(getattr(m, "get_rope_index", None)) for m in (hf, inner)):
        return None, (f"{head} computes multimodal (M-RoPE) position ids (get_rope_index) whose rule for a sharded "
                      f"decoder is untested (tested M-RoPE families: {', '.join(SEQUENCE_PARALLEL_VISION_FAMILIES)})")
    params = set(inspect.signature(lm.forward).parameters)
    if "inputs_embeds" not in params:
        return None, f"{head}: its text decoder {type(lm).__name__} takes no inputs_embeds (the merged tokens)"
    other = sorted(params - _DECODER_PARAMS)
    if other:
        return None, (f"{head}: its text decoder {type(lm).__name__} takes {other}: image features reach it besides "
                      "inputs_embeds (e.g. cross-attention), which hf_ddpfix does not know how to cut")
    if vision_tower(hf) is None:
        return None, f"{head}: no vision tower found (named one of {list(TOWER_NAMES)})"
    return VisionSequenceParallelFamily(str(mt), text_positions_from_2d=True, structural=True), ""


def vision_sequence_parallel_support(model: nn.Module) -> tuple[VisionSequenceParallelFamily | None, str]:
    """`(family, "")` for a VLM hf_ddpfix shards, `(None, reason)` for a VLM it refuses, `(None, "")` for a
    model without a vision config. Pure: reads the model's structure and forward signatures.

    The Qwen-VL families (M-RoPE, 3-D position ids, deepstack features) come from the table; any other VLM is
    judged by its structure (`structural_family`)."""
    hf = unwrap_model(model)
    if not is_vision_language_model(hf):
        return None, ""
    adapter = find_vision_adapter(hf)
    name = adapter.family.name if adapter is not None else None
    fam = SEQUENCE_PARALLEL_VISION_FAMILIES.get(name) if name else None
    if fam is None:
        found, why = structural_family(hf)
        if found is None:
            return None, (f"{why}; a vision-language model is sharded when its image features enter the text "
                          "decoder's inputs_embeds")
        return found, ""
    parts = vlm_parts(hf)
    lm = get_submodule(hf, parts.language_model) if parts.language_model_by == "path" else None
    if lm is None:
        return None, (f"{type(hf).__name__}: no text decoder at {' / '.join(LANGUAGE_MODEL_PATHS)} (the "
                      "layout sequence parallelism cuts at)")
    if reads_text_positions_from_rotary_rows(lm) is None:
        return None, f"{type(hf).__name__}: its text decoder's source cannot be read (how it separates documents)"
    params = set(inspect.signature(lm.forward).parameters)
    missing = sorted(set(_CUT + fam.cut_keywords) - params)
    if missing:
        return None, f"{type(hf).__name__}: its text decoder's forward takes no {missing} (the inputs that are cut)"
    return fam, ""


def pad_prepared_mask(mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """A decoder mask the VLM prepared on the full sequence (`[B|1, 1, S, S]` bool, True: may attend; None: plain
    causal), padded to `length`: the padding keys masked, every token may attend to itself (a padding row is never
    all-masked). Attention uses it for the layers the model hands it to (`attention.activate_batch`).

    Raises:
        NotImplementedError: a mask that is not a boolean `[.., 1, S, S]` tensor (a float / block mask)."""
    if mask is None:
        return None
    if not torch.is_tensor(mask) or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 \
            or mask.shape[-1] != mask.shape[-2]:
        raise NotImplementedError(f"sequence parallelism: the VLM prepared a decoder mask hf_ddpfix cannot pad "
                                  f"({type(mask).__name__} {getattr(mask, 'dtype', '')} "
                                  f"{tuple(getattr(mask, 'shape', ()))}; a boolean [B, 1, S, S] is)")
    s = mask.shape[-1]
    out = mask.new_zeros(*mask.shape[:2], length, length)
    out[..., :s, :s] = mask
    return out | torch.eye(length, dtype=torch.bool, device=mask.device)


def _pad_right(t: torch.Tensor, length: int, value: int | float) -> torch.Tensor:
    pad = length - t.shape[-1]
    if not pad:
        return t
    return torch.cat([t, t.new_full((*t.shape[:-1], pad), value)], -1)


def merge_vision_batches(batches: list[Mapping[str, torch.Tensor]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """One batch of the group's batches for a VLM: rows right-padded to the longest and concatenated,
    per-image tensors concatenated in batch order.

    `labels` -100 and `attention_mask` 0 on the padding (a mask is made only when some batch has one:
    right padding is invisible to every real token under causal attention); `position_ids` (2-D, or 3-D
    `[K, B, S]` precomputed by a collator) continue each row's last id; `PER_TOKEN_KEYS` pad with 0.

    Raises:
        ValueError: a batch key outside `BATCH_KEYS`, or a key present in some batches and not in others
            where filling it in would change the result (`position_ids`, `mm_token_type_ids`: an image
            typed as text in one batch would take another batch's grid), or images without their grid where
            another batch has one, or per-image tensors whose shapes differ beyond their first dimension.
    """
    unknown = sorted({k for b in batches for k in b} - set(BATCH_KEYS))
    if unknown:
        raise ValueError(f"batch keys {unknown} are not sharded (known: {list(BATCH_KEYS)})")
    for key in ("position_ids", *PER_TOKEN_KEYS):
        have = [key in b and b[key] is not None for b in batches]
        if any(have) and not all(have):
            raise ValueError(f"{key} is in some batches of the group and not in others")
    for pv, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        gridded = any(b.get(grid) is not None for b in batches)  # a grid family (Qwen-VL); LLaVA & co. have none
        if gridded and any((b.get(pv) is None) != (b.get(grid) is None) for b in batches):
            raise ValueError(f"a batch has {pv} without {grid} (or the reverse)")
    length = max(int(b["input_ids"].shape[1]) for b in batches)
    with_mask = any(b.get("attention_mask") is not None for b in batches)
    out: dict[str, list[torch.Tensor]] = {}

    def add(key: str, t: torch.Tensor) -> None:
        out.setdefault(key, []).append(t)

    for b in batches:
        ids = b["input_ids"]
        rows, s = ids.shape[:2]
        add("input_ids", _pad_right(ids, length, pad_token_id))
        add("labels", _pad_right(b["labels"], length, IGNORE_INDEX))
        if with_mask:
            mask = b.get("attention_mask")
            mask = torch.ones(rows, s, dtype=torch.long, device=ids.device) if mask is None else mask.long()
            add("attention_mask", _pad_right(mask, length, 0))
        pos = b.get("position_ids")
        if pos is not None:
            pos = pos.expand(*pos.shape[:-2], rows, s)
            tail = pos[..., -1:] + torch.arange(1, length - s + 1, device=pos.device, dtype=pos.dtype)
            add("position_ids", torch.cat([pos, tail], -1))
        for key in PER_TOKEN_KEYS:
            if b.get(key) is not None:
                add(key, _pad_right(b[key], length, 0))
        for key in PER_ITEM_KEYS:
            if b.get(key) is not None:
                add(key, b[key])
    merged = {}
    for k, v in out.items():
        dim = 1 if k == "position_ids" and v[0].dim() == 3 else 0
        if len({tuple(t.shape[:dim]) + tuple(t.shape[dim + 1:]) for t in v}) > 1:  # e.g. Idefics3's images per row
            raise ValueError(f"{k} of shapes {[tuple(t.shape) for t in v]} cannot be concatenated over the group's "
                             "batches")
        merged[k] = torch.cat(v, dim)
    return merged


class VisionSequenceSharding:
    """The decoder hook and the sharded forward of one VLM under sequence parallelism (module docstring).

    Args:
        model: the model being trained (any wrapper; the HF model inside is hooked).
        family: from `vision_sequence_parallel_support`.
        group: the SP process group.

    Guarantees (tests/scripts/sp_parity.py "vlm/*"): the SP group's summed loss and gradients, vision LoRA
    included, equal one process on the full sequence to <= 1e-5, for image, text-only and mixed batches.
    """

    def __init__(self, model: nn.Module, family: VisionSequenceParallelFamily, group: Any = None) -> None:
        hf = unwrap_model(model)
        lm = _decoder(hf)
        tower = vision_tower(hf)
        if lm is None or tower is None:
            raise ValueError(f"{type(hf).__name__}: no text decoder / vision tower for family {family.name}")
        self.family, self.group, self.language_model, self.tower, self.root = family, group, lm, tower, hf
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.text_from_3_rows = bool(reads_text_positions_from_rotary_rows(lm))
        self._expect: tuple[int, int] | None = None  # (length, padded length) of the pending sharded call
        self._undo: list[Callable[[], None]] = []

    def attach(self) -> VisionSequenceSharding:
        """Hook the decoder, keep the tower's attention on the full sequence (idempotent)."""
        if not self._undo:
            handle = self.language_model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
            # everything outside the text decoder sees whole images / the whole sequence (the tower, and a
            # connector with its own attention: Idefics2's perceiver resampler)
            decoder = {id(m) for m in self.language_model.modules()}
            outside = [m for m in self.root.modules() if id(m) not in decoder]
            self._undo = [handle.remove, keep_full_sequence(outside)]
        return self

    def remove(self) -> None:
        """Undo `attach` (idempotent)."""
        for undo in self._undo:
            undo()
        self._undo = []
        self._expect = None

    def forward_rows(self, model: nn.Module, merged: Mapping[str, torch.Tensor],
                     pad_token_id: int = 0) -> tuple[torch.Tensor, Any]:
        """Run `model` on the whole `merged` batch with the decoder on this rank's slice.

        Returns:
            `(loss_rows, outputs)`: `[B]` this rank's summed cross-entropy per row (fp32; labels shifted on
            the full sequence) and the model's outputs (logits `[B, S_pad/N, V]`).

        Raises:
            RuntimeError: the decoder was not called on the full sequence by the model's forward.
        """
        labels = merged["labels"]
        shard = shard_batch(merged["input_ids"], sp_size=self.size, sp_rank=self.rank, labels=labels,
                            attention_mask=merged.get("attention_mask"), pad_token_id=pad_token_id)
        inputs = {k: v for k, v in merged.items() if k != "labels"}
        self._expect = (shard.length, shard.padded_length)
        try:
            outputs = model(**inputs, use_cache=False)
        finally:
            expect, self._expect = self._expect, None
        if expect is not None:
            raise RuntimeError(f"sequence parallelism: {type(unwrap_model(model)).__name__}'s forward did not call its "
                               "text decoder with the full sequence's embeddings; nothing was sharded")
        assert shard.shift_labels is not None
        return shard_loss_rows(outputs.logits, shard.shift_labels), outputs

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        expect = self._expect
        if expect is None:  # an unsharded call: evaluation, generation, a forward outside the Trainer
            return None
        self._expect = None
        embeds = kwargs.get("inputs_embeds")
        if args or embeds is None or kwargs.get("input_ids") is not None:
            raise NotImplementedError("sequence parallelism: the text decoder was called without inputs_embeds "
                                      "(keywords); its inputs cannot be cut after the image merge")
        if passed_cache(kwargs) is not None:  # `cache=` (5.24) or `past_key_values=`
            raise NotImplementedError("sequence parallelism: a decoder call with a KV cache is not sharded")
        unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in
                         (*_CUT, *_CUT_PER_TOKEN, *self.family.cut_keywords, *_PASS_KEYWORDS))
        if unknown:
            raise NotImplementedError(f"sequence parallelism: the text decoder of {self.family.name} was called with "
                                      f"{unknown}, which hf_ddpfix does not know how to cut")
        mask = kwargs.get("attention_mask")
        prepared = None  # masks the model made on the full sequence (Gemma 3: image blocks, sliding windows)
        if isinstance(mask, Mapping) or (torch.is_tensor(mask) and mask.dim() == 4):
            if not self.family.structural:
                raise NotImplementedError("sequence parallelism: the decoder got a prepared (non 2-D) attention mask")
            prepared, mask = mask, None
        elif mask is not None and not (torch.is_tensor(mask) and mask.dim() == 2):
            raise NotImplementedError("sequence parallelism: the decoder got a prepared (non 2-D) attention mask")
        if embeds.shape[1] != expect[0]:
            raise RuntimeError(f"sequence parallelism: the decoder got {embeds.shape[1]} tokens, the batch has "
                               f"{expect[0]}")
        cut = shard_language_model_inputs(
            embeds, sp_size=self.size, sp_rank=self.rank, position_ids=kwargs.get("position_ids"),
            attention_mask=mask, visual_pos_masks=kwargs.get("visual_pos_masks"),
            deepstack_visual_embeds=kwargs.get("deepstack_visual_embeds"),
            text_positions_from_2d=self.family.text_positions_from_2d or self.text_from_3_rows,
            text_positions_from_3_rows=self.text_from_3_rows)
        if cut.padded_length != expect[1]:
            raise RuntimeError(f"sequence parallelism: padded to {cut.padded_length} tokens, labels to {expect[1]}")
        own: dict[str, Any] | None = None
        if prepared is not None:
            full = {k: pad_prepared_mask(v, cut.padded_length) for k, v in
                    (prepared.items() if isinstance(prepared, Mapping) else [("", prepared)])}
            own = full if isinstance(prepared, Mapping) else full[""]
            record_amount(FEATURE, "vision_model_masks", 1)
        # stays active for a checkpointed backward
        activate_batch(cut.documents, self.group,
                       own_masks=[m for m in (own.values() if isinstance(own, dict) else [own]) if m is not None])
        new = dict(kwargs, inputs_embeds=cut.inputs_embeds, position_ids=cut.position_ids, attention_mask=own)
        if "visual_pos_masks" in kwargs:
            new["visual_pos_masks"] = cut.visual_pos_masks
        if "deepstack_visual_embeds" in kwargs:
            new["deepstack_visual_embeds"] = cut.deepstack_visual_embeds
        part = cut.padded_length // self.size
        for key in _CUT_PER_TOKEN:
            t = kwargs.get(key)
            if t is not None:
                if tuple(t.shape) != tuple(embeds.shape[:2]):
                    raise NotImplementedError(f"sequence parallelism: the decoder got {key} of shape {tuple(t.shape)}")
                t = torch.cat([t, t.new_zeros(t.shape[0], cut.padded_length - t.shape[1])], 1)
                new[key] = t[:, self.rank * part:(self.rank + 1) * part]
        record_amount(FEATURE, "vision_sharded_forwards", 1)
        return args, new
