"""The group's text batches exchanged with tensor collectives (no pickling): every rank of a sequence-parallel
group gets every rank's `input_ids`, `labels` and, where given, `attention_mask` / `position_ids`, in rank order.

One `all_gather` of a small `[4]` int64 header per rank (rows, length, which keys it has), then one `all_gather`
per key of the batches right-padded to the group's largest `[rows, length]`, each cut back to its owner's shape
(a key a rank did not give stays absent from its batch: `merge_batches` reads a missing mask as packed rows).
Keys travel as int64 and come back in this rank's own dtype (the same collator made them); this rank's own
batch is returned as given.

`exchange_batches` is the general form, for any batch (TRL's `chosen_input_ids` / `rejected_*`, a VLM's
`pixel_values` / `image_grid_thw` / `token_type_ids` ...): each rank's dict of tensors of any keys, dtypes, ranks and
shapes (a key on some ranks only), with tensor collectives: one `all_gather` of each rank's metadata length, one of
its int64 metadata (per key in its own order: the name's UTF-8 bytes, a kind (a dtype code, None, a Python
int / bool with its value), ndim, shape), one of every rank's tensors packed as bytes (each at a 16-byte aligned
offset) right-padded to the group's largest; each comes back with its owner's dtype and shape, on this rank's
device, bit for bit. Any other value (strings, lists, nested tensors, a tensor subclass or a dtype without a code)
goes by one `all_gather_object` of those values only, run only when some rank of the group has one.

Guarantees (tests/test_sequence_parallel.py, tests/test_sequence_parallel_losses.py `exchange_tensors_equal_objects`,
2 and 4 processes, and the Trainer launches): the batches equal `all_gather_object`'s, value, dtype and device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TEXT_KEYS", "exchange_batches", "exchange_text_batches"]

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


#: dtypes that travel as bytes, by code (the same torch on every rank); any other goes as an object
_DTYPES = tuple(getattr(torch, n) for n in (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
    "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_NONE, _INT, _BOOL, _OBJECT = -1, -2, -3, -4  # kinds of the values that are not tensors
_ALIGN = 16


def _kind(value: Any) -> int:
    if type(value) is torch.Tensor and value.layout == torch.strided and value.dtype in _CODE and not value.is_meta:
        return _CODE[value.dtype]
    if value is None:
        return _NONE
    if type(value) is bool:
        return _BOOL
    if type(value) is int and -(2 ** 63) <= value < 2 ** 63:
        return _INT
    return _OBJECT


def _metadata(batch: Mapping[str, Any]) -> list[int]:
    """`[n_keys, per key: len(name), *name bytes, kind, ndim, *shape]` (an int / bool: ndim 1, its value)."""
    meta = [len(batch)]
    for key, value in batch.items():
        if not isinstance(key, str):
            raise TypeError(f"sequence parallelism: the batch key {key!r} is not a string; exchange_batches "
                            "exchanges batches with string keys")
        name = key.encode()
        kind = _kind(value)
        shape = list(value.shape) if kind >= 0 else [int(value)] if kind in (_INT, _BOOL) else []
        meta += [len(name), *name, kind, len(shape), *shape]
    return meta


def _parse(meta: list[int]) -> list[tuple[str, int, tuple[int, ...]]]:
    out, i = [], 1
    for _ in range(meta[0]):
        n = meta[i]
        name = bytes(meta[i + 1:i + 1 + n]).decode()
        kind, ndim = meta[i + 1 + n], meta[i + 2 + n]
        shape = tuple(meta[i + 3 + n:i + 3 + n + ndim])
        out.append((name, kind, shape))
        i += 3 + n + ndim
    return out


def _nbytes(kind: int, shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * _DTYPES[kind].itemsize


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def exchange_batches(batch: Mapping[str, Any], group: Any, size: int,
                     device: torch.device | None = None) -> list[dict[str, Any]]:
    """Every rank's `batch` (string keys), in rank order, each in its owner's key order, on `device` (default: the
    batch's first tensor's, else the CPU), as `all_gather_object` then `.to(device)` gives it: tensors with their
    owner's dtype, shape and bytes; None, Python ints and bools as given; other values (strings, lists, ...)
    through `all_gather_object` (those values only, when some rank has one). This rank's own tensors are returned
    as given (the same objects; moved only when on another device). Every rank of `group` must call it."""
    if device is None:
        device = next((v.device for v in batch.values() if torch.is_tensor(v)), torch.device("cpu"))
    meta = torch.tensor(_metadata(batch), dtype=torch.long, device=device)
    lengths = [torch.empty(1, dtype=torch.long, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([meta.numel()], dtype=torch.long, device=device), group=group)
    longest = max(int(n) for n in lengths)
    metas = [torch.empty(longest, dtype=torch.long, device=device) for _ in range(size)]
    dist.all_gather(metas, torch.cat([meta, meta.new_zeros(longest - meta.numel())]), group=group)
    ranks = [_parse(m) for m in torch.stack(metas).tolist()]  # one host sync: the shapes decide the buffers
    totals = [sum(_aligned(_nbytes(kind, shape)) for _, kind, shape in keys if kind >= 0) for keys in ranks]
    me = dist.get_rank(group)
    out: list[dict[str, Any]] = [{} for _ in range(size)]
    parts: list[torch.Tensor] = []
    if max(totals) > 0:
        packed = torch.zeros(max(totals), dtype=torch.uint8, device=device)
        offset = 0
        for _, value in batch.items():
            if _kind(value) >= 0:
                flat = value.detach().reshape(-1).view(torch.uint8) if value.numel() else value.new_empty(0, dtype=torch.uint8)
                packed[offset:offset + flat.numel()] = flat.to(device)
                offset += _aligned(flat.numel())
        parts = [torch.empty_like(packed) for _ in range(size)]
        dist.all_gather(parts, packed, group=group)
    objects: list[Any] = [None] * size
    if any(kind == _OBJECT for keys in ranks for _, kind, _ in keys):
        mine_obj = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in batch.items() if _kind(v) == _OBJECT}
        dist.all_gather_object(objects, mine_obj, group=group)
    for r, keys in enumerate(ranks):
        offset = 0
        for name, kind, shape in keys:
            if kind >= 0:
                n = _nbytes(kind, shape)
                if r == me:
                    mine = batch[name]
                    out[r][name] = mine if mine.device == device else mine.to(device)
                else:
                    raw = parts[r][offset:offset + n]
                    out[r][name] = (raw.view(_DTYPES[kind]) if n else torch.empty(0, dtype=_DTYPES[kind],
                                                                                    device=device)).reshape(shape)
                offset += _aligned(n)
            elif kind == _OBJECT:
                value = objects[r][name]
                out[r][name] = value.to(device) if torch.is_tensor(value) else value
            else:
                out[r][name] = None if kind == _NONE else bool(shape[0]) if kind == _BOOL else shape[0]
    return out
