"""Split one batch of full sequences into the `N` slices of a sequence-parallel group, with everything that
must be computed on the full sequence computed before the split.

On the full sequence, before sharding:
  - labels are shifted (`shift_labels[t] = labels[t + 1]`, the last token -100), so the token that
    predicts the first token of the next slice keeps its label;
  - `position_ids` are taken as given (packed documents: restarting ids) or `0 .. S-1`;
  - document ids follow transformers' packed-sequence rule (a new document wherever the position id
    does not grow by exactly 1), applied where transformers applies it: only to a batch given without an
    `attention_mask` (`masking_utils.create_causal_mask`, 5.0-5.24; with a mask, stock attends across
    restarting position ids, and so does this); key validity comes from `attention_mask`; attention then
    respects both (`attention_mask_from_documents`);
  - the length is padded up to a multiple of `N` (pad tokens: label -100, never attended to as keys).

Guarantees (tests/test_sequence_parallel.py): concatenating the N shards' `input_ids`,
`position_ids` and `shift_labels` gives the padded full-sequence tensors; a pad / prompt-only shard has
only -100 labels (its token-sum loss is 0, never NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Key `merge_batches` adds to a merged batch: `[B]` bool, the rows whose source batch had no attention_mask.
PACKED_ROWS = "hf_ddpfix_packed_rows"

__all__ = ["IGNORE_INDEX", "PACKED_ROWS", "SequenceShard", "attention_mask_from_documents", "document_ids",
           "shard_batch"]

IGNORE_INDEX = -100


@dataclass
class SequenceShard:
    """One rank's slice of a batch plus what attention needs about the full sequence.

    Attributes:
        input_ids: `[B, S_pad/N]` this rank's tokens (or `inputs_embeds` `[B, S_pad/N, E]`, whichever was given).
        position_ids: `[B, S_pad/N]`, computed on the full sequence.
        shift_labels: `[B, S_pad/N]` labels already shifted on the full sequence (-100: no loss), or `None`.
        documents: `[B, S_pad]` document id of every token of the full sequence; -1 marks padding.
        padded_length / length: the full length after / before padding to a multiple of N.
        rank, size: this slice's index and the number of slices.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor | None
    documents: torch.Tensor
    padded_length: int
    length: int
    rank: int
    size: int

    def local_slice(self) -> slice:
        """The positions of the full (padded) sequence this shard holds."""
        s = self.padded_length // self.size
        return slice(self.rank * s, (self.rank + 1) * s)


def document_ids(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 packed_rows: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, S]` document index per token (transformers' packed-sequence rule: a new document wherever the
    position id does not grow by 1); -1 where `attention_mask` is 0. `packed_rows` (`[B]` bool): only those
    rows are split into documents, the others are one document (default: every row)."""
    first = position_ids[:, :1] - 1
    docs = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    if packed_rows is not None:
        docs = torch.where(packed_rows.to(docs.device)[:, None], docs, docs.new_zeros(()))
    if attention_mask is not None:
        docs = docs.masked_fill(attention_mask == 0, -1)
    return docs


def attention_mask_from_documents(documents: torch.Tensor) -> torch.Tensor | None:
    """Boolean `[B, 1, S, S]` mask (True: may attend) for the full sequence: causal, within one document,
    keys that are not padding; every token may attend to itself (so a pad row is never all-masked and SDPA
    never returns NaN). `None` when that is plain causal attention (one document, no padding)."""
    if bool((documents == documents[:, :1]).all()) and bool((documents >= 0).all()):
        return None
    s = documents.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=documents.device).tril()
    same = documents[:, :, None] == documents[:, None, :]
    valid_key = (documents >= 0)[:, None, :]
    eye = torch.eye(s, dtype=torch.bool, device=documents.device)
    return ((causal & same & valid_key) | eye)[:, None]


def shard_batch(input_ids: torch.Tensor, *, sp_size: int, sp_rank: int, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                pad_token_id: int = 0, pad_to_multiple: bool = True,
                packed_rows: torch.Tensor | None = None) -> SequenceShard:
    """This rank's slice of a batch of full sequences.

    Args:
        input_ids: `[B, S]` token ids (or `[B, S, E]` embeddings: padded with zeros).
        sp_size, sp_rank: the group size N and this rank's index in it.
        labels: `[B, S]` unshifted labels (-100: no loss), or `None`.
        attention_mask: `[B, S]` 1 = real token, 0 = padding (keys masked, labels forced to -100).
        position_ids: `[B, S]`; `None`: `0 .. S-1` per row.
        pad_token_id: the id written into the padding that makes `S` a multiple of N.
        pad_to_multiple: False raises instead of padding.
        packed_rows: `[B]` bool, the rows whose restarting position ids mark packed documents. Default:
            transformers' rule, every row when no `attention_mask` is given, none when one is.

    Raises:
        ValueError: `S % N != 0` and `pad_to_multiple` is False; `sp_rank` outside `0 .. N-1`.
    """
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} is outside 0..{sp_size - 1}")
    b, s = input_ids.shape[:2]
    dev = input_ids.device
    if packed_rows is None:
        packed_rows = torch.full((b,), attention_mask is None, dtype=torch.bool, device=dev)
    if position_ids is None:
        position_ids = torch.arange(s, device=dev).expand(b, s)
    valid = torch.ones(b, s, dtype=torch.long, device=dev) if attention_mask is None else attention_mask.long()
    shift = None
    if labels is not None:
        shift = torch.full_like(labels, IGNORE_INDEX)
        shift[:, :-1] = labels[:, 1:]
        if attention_mask is not None:  # a padded token is never a target, whatever its label says
            shift[:, :-1] = shift[:, :-1].masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)
    pad = (-s) % sp_size
    if pad and not pad_to_multiple:
        raise ValueError(f"sequence length {s} is not divisible by sequence_parallel={sp_size} and padding is "
                         "off; pad the batch to a multiple of it or let hf_ddpfix pad")
    if pad:
        fill = input_ids.new_full((b, pad, *input_ids.shape[2:]), pad_token_id if input_ids.dim() == 2 else 0)
        input_ids = torch.cat([input_ids, fill], dim=1)
        last = position_ids[:, -1:]
        position_ids = torch.cat([position_ids, last + torch.arange(1, pad + 1, device=dev)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(b, pad)], dim=1)
        if shift is not None:
            shift = torch.cat([shift, shift.new_full((b, pad), IGNORE_INDEX)], dim=1)
    docs = document_ids(position_ids, valid, packed_rows)
    total = s + pad
    part = total // sp_size
    cut = slice(sp_rank * part, (sp_rank + 1) * part)
    return SequenceShard(
        input_ids=input_ids[:, cut], position_ids=position_ids[:, cut],
        shift_labels=None if shift is None else shift[:, cut], documents=docs,
        padded_length=total, length=s, rank=sp_rank, size=sp_size,
    )
