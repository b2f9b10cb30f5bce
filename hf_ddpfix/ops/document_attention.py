"""Attention under a padding / packed-documents mask, as blocks of plain attention (``document_attention``).

A boolean ``[B, 1, S, S]`` mask (True: attend) in which every query row allows one contiguous interval of
keys is a list of blocks per batch row: a run of queries ``[a, b)`` whose interval starts at ``a`` and ends
at the query itself is causal attention of the document ``[a, b)``; a run of queries sharing one interval
``[f, l]`` (the pad tail of a right-padded row, which transformers lets see the whole real prefix) is
non-causal attention over those keys. :func:`mask_blocks` reads the blocks and checks them against the
whole mask (the mask rebuilt from the blocks must equal it), so any other pattern (a query whose keys are
not one interval, a query that sees nothing as left padding gives, more than :data:`MAX_BLOCKS_PER_ROW`
blocks in a row, e.g. a sliding window much shorter than the sequence: one block per query) is refused
with ``None``.

Causal blocks run :func:`~hf_ddpfix.ops.grouped_attention.grouped_flash_attention` (per KV-head group);
non-causal ones ``F.scaled_dot_product_attention``. Each block is attention over exactly the keys the mask
allows, so outputs and gradients equal the masked call up to the kernels' rounding.

Guarantees: ``mask_blocks`` never accepts a mask it cannot reproduce exactly; the reading costs a few
``O(S^2)`` boolean passes per distinct mask (cached on the mask object: a model's layers share one).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F

from .grouped_attention import grouped_flash_attention

__all__ = ["MAX_BLOCKS_PER_ROW", "document_attention", "mask_blocks"]

#: More blocks than this in a row (e.g. a sliding window shorter than the documents) is refused: one
#: kernel call per block would cost more than the mask saves.
MAX_BLOCKS_PER_ROW = 256

Block = tuple[int, int, int, int, bool]  # query start, query end, key start, key end, causal
_CACHE: list[Any] = [None, None]  # [weakref to the last mask read, its blocks]


def _row_blocks(first: list[int], last: list[int]) -> list[Block] | None:
    blocks: list[Block] = []
    i, s = 0, len(first)
    while i < s:
        f, l_ = first[i], last[i]
        if l_ == i and f == i:  # a document starts here: extend while the interval is [f, query]
            j = i + 1
            while j < s and first[j] == f and last[j] == j:
                j += 1
            blocks.append((i, j, f, j, True))
        else:  # a run of queries sharing one key interval
            j = i + 1
            while j < s and first[j] == f and last[j] == l_:
                j += 1
            blocks.append((i, j, f, l_ + 1, False))
        if len(blocks) > MAX_BLOCKS_PER_ROW:
            return None
        i = j
    return blocks


def mask_blocks(mask: torch.Tensor) -> list[list[Block]] | None:
    """Blocks per batch row of a boolean ``[B, 1, S, S]`` mask, or ``None`` when it is not made of them."""
    if _CACHE[0] is not None and _CACHE[0]() is mask:
        return _CACHE[1]
    blocks = _read(mask)
    _CACHE[0], _CACHE[1] = weakref.ref(mask), blocks
    return blocks


def _read(mask: torch.Tensor) -> list[list[Block]] | None:
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        return None
    m = mask[:, 0]
    s = m.shape[-1]
    if not bool(m.any(-1).all()):  # a query that sees nothing: stock's output there is not attention
        return None
    idx = torch.arange(s, device=m.device)
    first = torch.where(m, idx, s).amin(-1)
    last = torch.where(m, idx, -1).amax(-1)
    rebuilt = (idx[None, None, :] >= first[..., None]) & (idx[None, None, :] <= last[..., None])
    if not torch.equal(rebuilt, m):  # some query's keys are not one interval
        return None
    out = []
    for f_row, l_row in zip(first.tolist(), last.tolist(), strict=True):
        row = _row_blocks(f_row, l_row)
        if row is None:
            return None
        out.append(row)
    return out


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[list[Block]], *,
                       scale: float, groups: int | str = "auto", grouped: bool = True) -> torch.Tensor:
    """Attention of ``q [B, Hq, S, D]`` over ``k, v [B, Hk, S, D]`` restricted to ``blocks`` (from
    :func:`mask_blocks`); returns ``[B, Hq, S, D]`` (a view of ``[B, S, Hq, D]`` storage)."""
    b, hq, s, d = q.shape
    rows = []
    for r, row in enumerate(blocks):
        parts = []
        for qa, qb, ka, kb, causal in row:
            qs, ks, vs = q[r:r + 1, :, qa:qb], k[r:r + 1, :, ka:kb], v[r:r + 1, :, ka:kb]
            o = grouped_flash_attention(qs, ks, vs, scale=scale, groups=groups) if causal and grouped else None
            if o is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=True)
            parts.append(o.transpose(1, 2))
        rows.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
    out = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
    return out.reshape(b, s, hq, d).transpose(1, 2)
