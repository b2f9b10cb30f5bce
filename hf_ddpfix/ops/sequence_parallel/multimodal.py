"""One rank's slice of what a vision-language model hands its language model, cut *after* everything that
needs the full sequence has run on it.

A VLM's forward embeds the tokens, runs the vision tower, scatters the image features into the
embeddings at the image tokens and computes the 3-D (M-RoPE) position ids, all on the full sequence;
only then does it call its text decoder with `inputs_embeds` `[B, S, E]` and `position_ids`. Cutting
there means an image's tokens are never split from its features (each rank's tokens already carry
them) and the position ids are the model's own full-sequence ids. This module does the cut:

  - the length is padded up to a multiple of N (zero embeddings; position ids continue each row's last
    id; the padding is never a key and carries no loss);
  - `position_ids` `None` (the decoder's own default) becomes `0 .. S-1` per row (what the decoder would
    compute on the full sequence), `[B, S]` and `[K, B, S]` (K = 3: temporal / height / width, K = 4:
    text row first) are cut along the last dimension;
  - per-token side inputs (`visual_pos_masks` `[B, S]`) are cut, and per-visual-token features
    (Qwen3-VL's deepstack features, `[n_visual, E]` in row-major token order) keep the rows of the
    visual tokens this rank holds;
  - the document of every token (for the full-sequence attention mask) follows the decoder's own rule
    (transformers' masking utilities, 5.x): packed documents are read from the text position ids only
    when no 2-D `attention_mask` is given; with one, every row is one document and `attention_mask == 0`
    marks padding.

Guarantees (tests/test_sequence_parallel_vision.py): concatenating the N shards' embeddings, position ids,
visual masks and deepstack rows gives the padded full-sequence tensors; the documents match
`find_packed_sequence_indices` / the 2-D mask rule above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .inputs import document_ids

__all__ = ["LanguageModelShard", "language_model_documents", "shard_language_model_inputs"]


@dataclass
class LanguageModelShard:
    """This rank's language-model inputs and the full-sequence documents attention needs.

    Attributes:
        inputs_embeds: `[B, S_pad/N, E]`.
        position_ids: `[B, S_pad/N]` (the decoder's default or the given 2-D ids) or `[K, B, S_pad/N]`.
        visual_pos_masks: `[B, S_pad/N]` or None.
        deepstack_visual_embeds: the rows of each deepstack feature for this rank's visual tokens, or None.
        documents: `[B, S_pad]`, document id per token of the full sequence, -1 for padding.
        length / padded_length: the full length before / after padding to a multiple of N.
    """

    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor
    visual_pos_masks: torch.Tensor | None
    deepstack_visual_embeds: list[torch.Tensor] | None
    documents: torch.Tensor
    length: int
    padded_length: int


def language_model_documents(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, *,
                             batch: int, length: int, text_positions_from_2d: bool,
                             text_positions_from_3_rows: bool = False,
                             device: torch.device | None = None) -> torch.Tensor:
    """`[B, S]` document id per token, as the decoder's mask builder separates them (see module docstring).

    Args:
        position_ids: what the decoder is called with: None, `[B, S]` or `[K, B, S]` (K = 4: row 0 holds
            the text positions the decoder reads packed documents from).
        attention_mask: the decoder's 2-D mask `[B, S]` (0: padding), or None.
        text_positions_from_2d: the decoder treats 2-D `position_ids` as text positions (Qwen3-VL expands
            them to 4 rows, text first); False: it expands them to 3 rotary rows and reads no documents
            (Qwen2-VL, Qwen2.5-VL).
        text_positions_from_3_rows: the decoder also reads row 0 of 3-row M-RoPE ids as text positions
            (transformers 5.0's Qwen3-VL: image tokens sharing a temporal position then start new documents).
    """
    arange = torch.arange(length, device=device).expand(batch, length)
    if attention_mask is not None:  # packed detection runs only without a 2-D mask
        return document_ids(arange, attention_mask)
    text = None
    if position_ids is not None and position_ids.dim() == 3 and (position_ids.shape[0] == 4
                                                                 or text_positions_from_3_rows):
        text = position_ids[0]
    elif position_ids is not None and position_ids.dim() == 2 and text_positions_from_2d:
        text = position_ids
    return document_ids(arange if text is None else text.expand(batch, length))


def _pad_last(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Position ids `[..., S]` continued by `last + 1 .. last + pad`."""
    if not pad:
        return x
    tail = x[..., -1:] + torch.arange(1, pad + 1, device=x.device, dtype=x.dtype)
    return torch.cat([x, tail], dim=-1)


def shard_language_model_inputs(inputs_embeds: torch.Tensor, *, sp_size: int, sp_rank: int,
                                position_ids: torch.Tensor | None = None,
                                attention_mask: torch.Tensor | None = None,
                                visual_pos_masks: torch.Tensor | None = None,
                                deepstack_visual_embeds: list[torch.Tensor] | None = None,
                                text_positions_from_2d: bool = False,
                                text_positions_from_3_rows: bool = False) -> LanguageModelShard:
    """Cut a decoder call on the full sequence into this rank's slice (module docstring).

    Args:
        inputs_embeds: `[B, S, E]`, image features already merged.
        sp_size, sp_rank: N and this rank's index.
        position_ids, attention_mask, visual_pos_masks, deepstack_visual_embeds: as the VLM passes them.
        text_positions_from_2d, text_positions_from_3_rows: see `language_model_documents`.

    Raises:
        ValueError: a shape that does not match `inputs_embeds`, or a deepstack feature whose rows are not
            the number of visual tokens.
    """
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} is outside 0..{sp_size - 1}")
    b, s = inputs_embeds.shape[:2]
    dev = inputs_embeds.device
    if position_ids is not None and (position_ids.shape[-1] != s or position_ids.shape[-2] not in (1, b)):
        raise ValueError(f"position_ids {tuple(position_ids.shape)} do not end in (batch, length) = {(b, s)}")
    docs = language_model_documents(position_ids, attention_mask, batch=b, length=s,
                                    text_positions_from_2d=text_positions_from_2d,
                                    text_positions_from_3_rows=text_positions_from_3_rows, device=dev)
    pad = (-s) % sp_size
    total = s + pad
    part = total // sp_size
    cut = slice(sp_rank * part, (sp_rank + 1) * part)
    embeds = torch.cat([inputs_embeds, inputs_embeds.new_zeros(b, pad, *inputs_embeds.shape[2:])], 1) if pad \
        else inputs_embeds
    pos = torch.arange(s, device=dev).expand(b, s) if position_ids is None else position_ids
    pos = pos.expand(*pos.shape[:-2], b, s)  # [1, S] / [K, 1, S] as some callers unsqueeze them
    pos = _pad_last(pos, pad)[..., cut]
    if pad:
        docs = torch.cat([docs, docs.new_full((b, pad), -1)], 1)
    vis, deep = None, None
    if visual_pos_masks is not None:
        full_mask = visual_pos_masks.to(torch.bool)
        if tuple(full_mask.shape) != (b, s):
            raise ValueError(f"visual_pos_masks {tuple(full_mask.shape)} is not (batch, length) = {(b, s)}")
        if pad:
            full_mask = torch.cat([full_mask, full_mask.new_zeros(b, pad)], 1)
        vis = full_mask[:, cut]
        if deepstack_visual_embeds is not None:
            n_visual = int(full_mask.sum())
            # index of each visual token in the row-major list of visual features
            order = (full_mask.reshape(-1).cumsum(0) - 1).reshape(b, total)
            rows = order[:, cut][vis]
            deep = []
            for feat in deepstack_visual_embeds:
                if feat.shape[0] != n_visual:
                    raise ValueError(f"a deepstack feature has {feat.shape[0]} rows for {n_visual} visual tokens")
                deep.append(feat[rows.to(feat.device)])
    elif deepstack_visual_embeds is not None:
        raise ValueError("deepstack_visual_embeds without visual_pos_masks cannot be sharded")
    return LanguageModelShard(inputs_embeds=embeds[:, cut], position_ids=pos, visual_pos_masks=vis,
                              deepstack_visual_embeds=deep, documents=docs, length=s, padded_length=total)
