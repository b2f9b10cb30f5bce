"""Ulysses attention inside a transformers model: the model's entry in `ALL_ATTENTION_FUNCTIONS` (the
public attention interface every transformers 5 decoder calls) is wrapped so that, while a
`SequenceParallelBatch` is active, the attention of a sequence-sharded forward runs
`hf_ddpfix.ops.sequence_parallel.ulysses_attention` with a mask built on the *full* sequence.

Outside an active batch (evaluation without SP, another model in the process) the wrapper calls the
function it replaced, unchanged, and counts a fallback with its reason (feature "sequence_parallel").

The mask the model builds from its local slice is ignored: it describes `s` tokens, not the `S` tokens
attention now sees; the full-sequence mask (`attention_mask_from_documents`) replaces it.

Guarantees: `install_ulysses_attention` is idempotent (one wrapper per key, counted) and undone by its
handle's `remove()` (the previous local mapping restored); the wrapped function is called unchanged
whenever no batch is active (tests/test_sequence_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...ops.feature_counts import record_amount, record_fallback, record_ran
from ...ops.sequence_parallel.inputs import attention_mask_from_documents
from ...ops.sequence_parallel.ulysses import ulysses_attention

__all__ = ["FEATURE", "SUPPORTED_IMPLEMENTATIONS", "UlyssesAttentionHandle", "activate_batch", "active_batch",
           "deactivate_batch", "install_ulysses_attention", "keep_full_sequence", "sequence_parallel_batch",
           "shards_attention"]

FEATURE = "sequence_parallel"
#: attention implementations the wrapper reaches: eager is called directly by the models (never through the
#: interface) and flex / paged need their own block masks.
SUPPORTED_IMPLEMENTATIONS = ("sdpa",)

class _State:
    """The active batch, process-wide. Not thread-local: on CUDA the autograd engine runs the backward (and so
    the recomputation of a checkpointed layer) on its own device thread, which must see the batch the
    forward ran with (a thread-local batch left the recomputed attention unsharded: CheckpointError)."""

    batch: _Batch | None = None
    #: several batches alive together (the gathered loss route forwards each batch of the group before one
    #: backward): id(position_ids tensor the forward was given) -> (batch, that tensor, kept alive)
    keyed: dict[int, tuple[_Batch, torch.Tensor]] = {}


_state = _State()
#: ids of modules whose attention always runs as given (a VLM's vision tower: it sees whole images, never a
#: slice of the text sequence), even while a batch is active (a checkpointed backward recomputes them then).
_FULL_SEQUENCE: set[int] = set()


def keep_full_sequence(modules: Iterable[torch.nn.Module]) -> Callable[[], None]:
    """Attention called by any of `modules` runs the wrapped function unchanged (counted as the amount
    `full_sequence_attention_calls`, not as a fallback). Returns the undo."""
    ids = {id(m) for m in modules} - _FULL_SEQUENCE
    _FULL_SEQUENCE.update(ids)
    return lambda: _FULL_SEQUENCE.difference_update(ids)


@dataclass
class _Batch:
    group: dist.ProcessGroup | None
    mask: torch.Tensor | None  # [B, 1, S, S] bool on the full sequence, None: causal
    length: int = 0  # S, the full (padded) length
    #: id -> full-sequence mask the model was handed to pass to its attention (a VLM's own masks, vision.py):
    #: used as given where the model passes that very tensor
    own: dict[int, torch.Tensor] | None = None

    def windowed(self, window: int) -> torch.Tensor:
        """The mask with transformers' sliding window on top (a key at most `window - 1` tokens back:
        `masking_utils.sliding_window_overlay`)."""
        pos = torch.arange(self.length, device=self.mask.device if self.mask is not None else None)
        band = (pos[:, None] - pos[None, :] < window) & (pos[None, :] <= pos[:, None])
        band = band | torch.eye(self.length, dtype=torch.bool, device=band.device)
        return band[None, None] if self.mask is None else self.mask & band


def active_batch() -> _Batch | None:
    """The sequence-parallel batch being run (process-wide), or `None`."""
    return _state.batch


def activate_batch(documents: torch.Tensor, group: dist.ProcessGroup | None = None,
                   key: torch.Tensor | None = None, own_masks: list[torch.Tensor] | None = None) -> None:
    """Make wrapped attention run Ulysses for this batch until `deactivate_batch()` (or the next batch).

    Unlike `sequence_parallel_batch`, the batch stays active after the forward returns, so the backward's
    recomputation under non-reentrant checkpointing runs the same sharded attention as the forward.

    `key`: the `position_ids` tensor the forward is given. Keyed batches stay active together (each
    `activate_batch(..., key=...)` adds one): an attention call takes the batch of the `position_ids` it
    receives (transformers passes the model's `position_ids` object through to every attention call, also
    when a checkpointed layer is recomputed); a call whose `position_ids` is none of them raises.

    `own_masks`: full-sequence `[B|1, 1, S, S]` boolean masks the model was handed (a VLM's own masks,
    `vision.pad_prepared_mask`); an attention call given one of these very tensors uses it instead of the
    documents' mask (it already holds the model's image blocks and sliding window)."""
    b = _Batch(group, attention_mask_from_documents(documents), int(documents.shape[1]),
               {id(m): m for m in own_masks} if own_masks else None)
    if key is None:
        _state.batch = b
    else:
        _state.keyed[id(key)] = (b, key)


def deactivate_batch() -> None:
    """No sequence-parallel batch active: wrapped attention calls the function it replaced."""
    _state.batch = None
    _state.keyed.clear()


def _batch_for(kwargs: dict[str, Any]) -> _Batch | None:
    if not _state.keyed:
        return _state.batch
    pos = kwargs.get("position_ids")
    hit = _state.keyed.get(id(pos)) if pos is not None else None
    if hit is None or hit[1] is not pos:
        raise RuntimeError("sequence parallelism: an attention call whose position_ids are not those of any active "
                           "sequence-parallel batch (the model does not pass position_ids to its attention, or made "
                           "new ones); the gathered loss route cannot tell which batch it belongs to: train this "
                           "trainer without sequence_parallel")
    return hit[0]


@contextmanager
def sequence_parallel_batch(documents: torch.Tensor, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Within this block, wrapped attention runs Ulysses over `group` with the full-sequence mask built
    from `documents` (`[B, S]`, `SequenceShard.documents`). Builds the mask once for all layers. With
    checkpointing, run the backward inside the block too (its recomputation calls attention again)."""
    previous = active_batch()
    _state.batch = _Batch(group, attention_mask_from_documents(documents), int(documents.shape[1]))
    try:
        yield
    finally:
        _state.batch = previous


def _wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
    def ulysses_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                  value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any,
                                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        if id(module) in _FULL_SEQUENCE:
            record_amount(FEATURE, "full_sequence_attention_calls", 1)
            return inner(module, query, key, value, attention_mask, *args, **kwargs)
        batch = _batch_for(kwargs)
        if batch is None:
            record_fallback(FEATURE, "no sequence-parallel batch active (unsharded forward)")
            return inner(module, query, key, value, attention_mask, *args, **kwargs)
        mask = batch.mask
        own = batch.own.get(id(attention_mask)) if batch.own and attention_mask is not None else None
        if own is not None and own is attention_mask:
            mask = own  # the model's own full-sequence mask (its sliding window included)
        elif kwargs.get("sliding_window") is not None:
            mask = batch.windowed(int(kwargs["sliding_window"]))
        for unsupported in ("softcap", "s_aux"):
            if kwargs.get(unsupported) is not None:
                raise NotImplementedError(
                    f"sequence parallelism: attention with {unsupported}={kwargs[unsupported]!r} is not supported "
                    f"by hf_ddpfix's Ulysses attention ({type(module).__name__}); run without sequence_parallel")
        if args:
            raise TypeError(f"sequence parallelism: unexpected positional attention arguments {len(args)}")
        if query.shape[2] != key.shape[2]:
            raise NotImplementedError("sequence parallelism: attention with a KV cache (generation) is not sharded")
        out = ulysses_attention(query, key, value, group=batch.group, mask=mask,
                                scale=kwargs.get("scaling"), dropout=float(kwargs.get("dropout", 0.0) or 0.0))
        record_ran(FEATURE)
        return out.transpose(1, 2).contiguous(), None

    ulysses_attention_forward.__wrapped__ = inner  # type: ignore[attr-defined]
    ulysses_attention_forward.hf_ddpfix_ulysses = True  # type: ignore[attr-defined]
    return ulysses_attention_forward


def shards_attention(fn: Callable[..., Any] | None) -> bool:
    """``fn`` is this module's Ulysses wrapper and a sequence-parallel batch is active: a call of ``fn``
    by a decoder layer runs sharded attention over the full sequence (the long-context layer hands it its
    q/k/v, :mod:`hf_ddpfix.integrations.long_context.long_context`)."""
    return bool(getattr(fn, "hf_ddpfix_ulysses", False)) and (_state.batch is not None or bool(_state.keyed))


@dataclass
class UlyssesAttentionHandle:
    """Undo handle of `install_ulysses_attention`."""

    implementation: str
    previous: Callable[..., Any] | None
    removed: bool = False

    def remove(self) -> None:
        """Restore the function that was installed (drop our local override; put a previous one back)."""
        if self.removed:
            return
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        try:
            del ALL_ATTENTION_FUNCTIONS[self.implementation]  # our local override
        except KeyError:
            pass
        if ALL_ATTENTION_FUNCTIONS.get(self.implementation) is not self.previous:  # someone's local override
            ALL_ATTENTION_FUNCTIONS[self.implementation] = self.previous
        self.removed = True


def install_ulysses_attention(implementation: str = "sdpa") -> UlyssesAttentionHandle:
    """Wrap `ALL_ATTENTION_FUNCTIONS[implementation]` (a local override on the shared interface; the
    class-wide registry is left alone) so sequence-sharded forwards run Ulysses attention.

    Raises:
        ValueError: `implementation` is not one of `SUPPORTED_IMPLEMENTATIONS`.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation not in SUPPORTED_IMPLEMENTATIONS:
        raise ValueError(f"sequence parallelism needs attn_implementation in {SUPPORTED_IMPLEMENTATIONS}, got "
                         f"{implementation!r}; load the model with attn_implementation='sdpa'")
    current = ALL_ATTENTION_FUNCTIONS[implementation]
    if getattr(current, "__name__", "") == "ulysses_attention_forward":  # already wrapped: nothing to undo
        return UlyssesAttentionHandle(implementation, None, removed=True)
    ALL_ATTENTION_FUNCTIONS[implementation] = _wrap(current)
    return UlyssesAttentionHandle(implementation, current)
