"""The "head-whole" loss route under sequence parallelism: a model without a language-model head (a sequence-
classification / reward model: `LlamaForSequenceClassification`, `Qwen2ForSequenceClassification`, any
`AutoModelForSequenceClassification` built as decoder + score head), trained by the plain Trainer or by a trainer with
its own loss (TRL's RewardTrainer).

Such a model pools its score at one token of the whole sequence (the last non-pad token, found from the full
`input_ids`), which a rank holding a slice cannot compute. Here the model's own forward runs on the WHOLE batch on
every rank of the group; only its decoder (found structurally: `getattr(model, model.base_model_prefix)`, the
transformer under the head) is replaced for the call by `DecoderShardedForward`: the decoder runs on this rank's slice
of the sequence with Ulysses attention (the full-sequence mask from the whole `attention_mask`), and its
`last_hidden_state` (and `hidden_states`, when asked) are all-gathered along the sequence
(`ops.sequence_parallel.gather_sequence`) and cut to the batch's length. The head, the pooling and the model's own loss
(labels `[B]`) then run unchanged on the whole hidden state, and the trainer's `compute_loss` (RewardTrainer's pairwise
loss, its margin and `center_rewards_coefficient`) runs unchanged on the pooled outputs.

Gradient: as the gathered route (`whole.py`): every rank of the group computes the identical loss L_b of each batch b
of the group; the loss backpropagated is `sum_b L_b / N`. The gather's backward hands each rank N x its own slice of
dL/d(hidden) (no reduction: the N copies are identical), so each decoder slice gets exactly dL_b/d(slice), and the
head (run on every rank on the whole hidden state) gets dL_b/dW / N on each of the N ranks: summed over the group,
exactly one process's gradient; DDP then averages over the world as stock.

Cost: every rank holds the whole gathered last hidden state `[B, S, hidden]` of each batch of the group (bf16, 128K
tokens x 4096 hidden: 1 GiB per batch, held until backward) and runs the head on it; the decoder's activations stay
at `1/N` of the sequence.

Refused: by the plan, a model whose decoder cannot be found under the head or whose attention is not causal (a BERT-
like encoder: hf_ddpfix's Ulysses mask is causal); at the first micro-batch (RuntimeError, named, before any step), a
decoder call with `inputs_embeds` instead of `input_ids`, a KV cache, attention weights asked for, a
sequence-shaped tensor argument it cannot shard, or a forward that never called the decoder.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..._compat import CACHE_KEYWORDS, passed_cache
from ...ops.sequence_parallel.gather import gather_sequence
from ...ops.sequence_parallel.inputs import shard_batch
from .attention import activate_batch
from .whole import instance_forward

__all__ = ["DecoderShardedForward", "decoder_sharded", "pooled_head_structure"]

_DROPPED = ("use_cache", "return_dict", "cache_position")


def _head_model(model: nn.Module) -> nn.Module | None:
    """The first `PreTrainedModel` in `model` (a PEFT wrapper's base model, else itself) that names its decoder by
    `base_model_prefix`."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return None
    for m in model.modules():
        prefix = getattr(m, "base_model_prefix", None)
        if isinstance(m, PreTrainedModel) and prefix and isinstance(getattr(m, prefix, None), nn.Module):
            return m
    return None


def pooled_head_structure(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None, str]:
    """`(head model, its decoder, description)` of a model without an LM head, or `(None, None, refusal)`: the
    decoder is `getattr(head_model, head_model.base_model_prefix)`, a transformer whose attention modules all say
    `is_causal=True`."""
    head = _head_model(model)
    if head is None:
        return None, None, (f"{type(model).__name__}: no decoder found under its head (no transformers model naming "
                            "its transformer by base_model_prefix)")
    decoder = getattr(head, head.base_model_prefix)
    causal = [m.is_causal for m in decoder.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    if not causal or not all(causal):
        return None, None, (f"{type(head).__name__}: its decoder {type(decoder).__name__} has attention that is not "
                            "causal (or says nothing about it): hf_ddpfix's Ulysses mask is causal")
    others = [name for name, child in head.named_children() if child is not decoder]
    return head, decoder, (f"{type(head).__name__}: decoder {head.base_model_prefix!r} ({type(decoder).__name__}) "
                           f"sharded, {'/'.join(others) or 'its head'} and pooling on the whole sequence")


class DecoderShardedForward:
    """Stands in for the decoder's `forward` (see the module docstring): shards the call's `input_ids` /
    `attention_mask` / `position_ids` over `group`, runs `original` on this rank's slice, returns its output with
    `last_hidden_state` (and `hidden_states`) gathered along the sequence and cut to the whole length."""

    def __init__(self, original: Callable[..., Any], group: Any, pad_token_id: int, who: str = "the trainer"):
        self.original, self.group, self.pad_token_id, self.who = original, group, pad_token_id, who
        self.calls = 0

    def _fail(self, what: str) -> RuntimeError:
        return RuntimeError(f"sequence parallelism ({self.who}, head-whole route): the model calls its decoder "
                            f"{what}; the decoder's sequence cannot be sharded exactly: train it without "
                            "sequence_parallel")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            try:
                bound = inspect.signature(self.original).bind_partial(*args, **kwargs)
            except (TypeError, ValueError) as err:
                raise self._fail(f"with positional arguments its forward does not name ({err})") from err
            kwargs = dict(bound.arguments)
            for name, param in bound.signature.parameters.items():
                if param.kind is param.VAR_KEYWORD and name in kwargs:
                    kwargs.update(kwargs.pop(name))
        ids = kwargs.pop("input_ids", None)
        if kwargs.pop("inputs_embeds", None) is not None or ids is None or ids.dim() != 2:
            raise self._fail("without input_ids [batch, sequence] (inputs_embeds: the padding cannot be told)")
        if passed_cache(kwargs) is not None:  # `cache=` (transformers 5.24) or `past_key_values=`
            raise self._fail("with a KV cache")
        for k in CACHE_KEYWORDS:  # None: not passed on (the slice runs with use_cache=False)
            kwargs.pop(k, None)
        if kwargs.get("output_attentions"):
            raise self._fail("asking for attention weights (sdpa under Ulysses returns none)")
        mask, pos = kwargs.pop("attention_mask", None), kwargs.pop("position_ids", None)
        for k in _DROPPED:
            kwargs.pop(k, None)
        rows, length = int(ids.shape[0]), int(ids.shape[1])
        shaped = sorted(k for k, v in kwargs.items() if torch.is_tensor(v) and v.dim() >= 2
                        and tuple(v.shape[:2]) == (rows, length))
        if shaped:
            raise self._fail(f"with sequence-shaped {shaped}")
        n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        shard = shard_batch(ids, sp_size=n, sp_rank=r, attention_mask=mask, position_ids=pos,
                            pad_token_id=self.pad_token_id)
        position_ids = shard.position_ids.clone()  # the key of this batch for Ulysses (kept until backward)
        activate_batch(shard.documents, self.group, key=position_ids)
        out = self.original(input_ids=shard.input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        self.calls += 1
        s = int(shard.input_ids.shape[1])
        out["last_hidden_state"] = self._whole(out["last_hidden_state"], rows, s, length)
        if out.get("hidden_states") is not None:
            out["hidden_states"] = tuple(self._whole(h, rows, s, length) for h in out["hidden_states"])
        return out

    def _whole(self, value: torch.Tensor, rows: int, s: int, length: int) -> torch.Tensor:
        if not (torch.is_tensor(value) and value.dim() == 3 and tuple(value.shape[:2]) == (rows, s)):
            raise self._fail(f"and gets a hidden state of shape {tuple(getattr(value, 'shape', ()))}, not "
                             f"[{rows}, {s}, hidden]")
        return gather_sequence(value, 1, self.group)[:, :length]


@contextmanager
def decoder_sharded(model: nn.Module, group: Any, pad_token_id: int,
                    who: str = "the trainer") -> Iterator[DecoderShardedForward]:
    """Inside the block the decoder of `model` (`pooled_head_structure`) runs as a `DecoderShardedForward` (an
    instance `forward` the block sets and restores).

    Raises:
        RuntimeError: no decoder found (the plan refuses it first).
    """
    _, decoder, why = pooled_head_structure(model)
    if decoder is None:
        raise RuntimeError(f"sequence parallelism ({who}): {why}")
    with instance_forward(decoder, DecoderShardedForward(decoder.forward, group, pad_token_id, who)) as hook:
        yield hook
