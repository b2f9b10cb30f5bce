"""The group's text batches exchanged with tensor collectives (no pickling): every rank of a sequence-parallel
group gets every rank's `input_ids`, `labels` and, where given, `attention_mask` / `position_ids`, in rank order.

One `all_gather` of a small `[4]` int64 header per rank (rows, length, which keys it has), then one `all_gather`
per key of the batches right-padded to the group's largest `[rows, length]`, each cut back to its owner's shape
(a key a rank did not give stays absent from its batch: `merge_batches` reads a missing mask as packed rows).
Keys travel as int64 and come back in this rank's own dtype (the same collator made them); this rank's own
batch is returned as given.

Guarantees (tests/test_sequence_parallel.py, the Trainer launches): the batches equal `all_gather_object`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TEXT_KEYS", "exchange_text_batches"]

TEXT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def exchange_text_batches(inputs: Mapping[str, torch.Tensor], group: Any, size: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's text batch (`[B_r, S_r]` tensors of `TEXT_KEYS`; `input_ids` and `labels` required), in rank
    order, on this rank's device."""
    ids = inputs["input_ids"]
    rows, length = int(ids.shape[0]), int(ids.shape[1])
    # per optional key: 0 absent, 1 integer, 2 bool (a rank without the key still returns its owner's dtype)
    has = [0 if inputs.get(k) is None else 2 if inputs[k].dtype == torch.bool else 1 for k in TEXT_KEYS[2:]]
    header = torch.tensor([rows, length, *has], dtype=torch.long, device=ids.device)
    headers = [torch.empty_like(header) for _ in range(size)]
    dist.all_gather(headers, header, group=group)
    shapes = [(int(h[0]), int(h[1])) for h in headers]
    top_rows, top_len = max(r for r, _ in shapes), max(s for _, s in shapes)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for i, key in enumerate(TEXT_KEYS):
        present = [i < 2 or bool(h[i]) for h in headers]  # header: rows, length, has mask, has positions
        if not any(present):
            continue
        mine = inputs.get(key)
        buf = torch.zeros(top_rows, top_len, dtype=torch.long, device=ids.device)
        if mine is not None:
            buf[:rows, :length] = mine.expand(rows, length).long()
        parts = [torch.empty_like(buf) for _ in range(size)]
        dist.all_gather(parts, buf, group=group)
        me = dist.get_rank(group)
        for r, (part, (n, s)) in enumerate(zip(parts, shapes, strict=True)):
            if r == me and mine is not None:
                out[r][key] = mine  # this rank's own, as given
            elif present[r]:
                dtype = torch.bool if i >= 2 and int(headers[r][i]) == 2 else mine.dtype if mine is not None else torch.long
                out[r][key] = part[:n, :s].to(dtype)
    return out
