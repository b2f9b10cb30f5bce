"""The trainer's own loss under sequence parallelism ("gathered" route): the trainer's (or subclass's, or TRL's)
`compute_loss` runs unchanged on each batch of the SP group, while the model it calls runs on this rank's
slice of the sequence and returns its outputs made whole across the group.

Per training micro-batch: the group's N batches (and each one's `num_items_in_batch`, its owner's) are
exchanged; for each batch b in order, every rank of the group calls the trainer's own `compute_loss(model,
batch_b, num_items_in_batch=n_b)`. Its `model(...)` call reaches the unwrapped module's forward, replaced for
the duration by `WholeOutputsForward`: the batch is sharded (`shard_batch`), the original forward runs on this
rank's slice with Ulysses attention, and every sequence-shaped output (`logits`, `hidden_states`,
`last_hidden_state`, TRL's per-token `log_probs` / `entropy` / `label_mask` ...: `[B, s, ...]`) is gathered
along the sequence (`ops.sequence_parallel.gather_sequence`) and cut to the batch's length. Asked for the
loss (labels given), the model sums its own loss on the slice (labels shifted on the full sequence,
`num_items_in_batch=1`) and the sums are gathered: the whole batch's sum over `num_items_in_batch` (given)
or over its valid-token count (the model's mean). The loss backpropagated is `sum_b L_b / N` (the gather's
backward multiplies by N): exactly one process's gradient of `sum_b L_b`, which DDP then averages as stock.

Evaluation: the same loop under `no_grad`; each rank returns what its own batch's `compute_loss` returned.

Positional arguments are named by the forward's own signature (TRL ORPO / CPO call `model(ids, attention_mask=...)`);
a packed batch's padding-free kwargs (`cu_seq_lens_q/k`, `max_length_q/k`, `seq_idx`: TRL SFT `packing=True`) are
dropped when they say what its position ids say. Another model the trainer holds (a `ref_model`, a distillation
teacher: `other_models`) runs on the whole batch on every rank, its attention as given.

Refused (a `RuntimeError` at the first micro-batch, named, before any optimizer step; the plan refuses the
ones it can see first): an output that is not sequence-shaped and not the loss (it cannot be made whole, e.g.
MoE `router_logits`), a non-None `aux_loss` (MoE router loss: a per-slice load-balancing term is not the whole
sequence's), tensor arguments other than ids / mask / positions / labels, packed kwargs that disagree with the
position ids, positional arguments the forward does not name.

Cost: every rank holds the whole batch's gathered outputs, e.g. logits `B x S x vocab x bytes` (fp32 128K
tokens x 128K vocab: 64 GiB), instead of its `1/N`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..._compat import unwrap_parallel
from ...ops.sequence_parallel.exchange import TEXT_KEYS, exchange_batches, exchange_text_batches
from ...ops.sequence_parallel.gather import gather_sequence
from ...ops.sequence_parallel.inputs import shard_batch
from ...ops.sequence_parallel.loss import valid_target_count
from .attention import activate_batch

__all__ = ["WholeOutputsForward", "exchange", "other_models", "whole_outputs_forward"]

_BATCH = ("input_ids", "attention_mask", "position_ids", "labels")
_DROPPED = ("use_cache", "num_items_in_batch", "return_dict")
#: the key `exchange` sends a batch's `num_items_in_batch` under, beside the batch (no batch's own key)
_NUM_ITEMS = "\x00num_items_in_batch"
#: a packed batch's padding-free kwargs (transformers' flash-attention path), dropped when its position ids say the same
_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class WholeOutputsForward:
    """Stands in for a module's `forward`: shards the call's batch over `group`, runs `original` on this rank's
    slice, returns the outputs made whole (see the module docstring)."""

    def __init__(self, original: Callable[..., Any], group: Any, pad_token_id: int, who: str = "the trainer"):
        self.original, self.group, self.pad_token_id, self.who = original, group, pad_token_id, who
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:  # e.g. TRL ORPO / CPO: model(ids, attention_mask=...): named by the forward's own signature
            kwargs = self._named(args, kwargs)
        ids = kwargs.pop("input_ids", None)
        if ids is None or ids.dim() != 2:
            raise RuntimeError(f"sequence parallelism: {self.who}'s compute_loss called the model without `input_ids` "
                               "[batch, sequence]; its loss cannot be computed on a sharded sequence")
        mask, pos, labels = (kwargs.pop(k, None) for k in ("attention_mask", "position_ids", "labels"))
        num_items = kwargs.pop("num_items_in_batch", None)
        for k in _DROPPED:
            kwargs.pop(k, None)
        _drop_packed_kwargs(kwargs, pos, mask, self.who)
        tensors = sorted(k for k, v in kwargs.items() if torch.is_tensor(v))
        if tensors or "shift_labels" in kwargs:
            raise RuntimeError(f"sequence parallelism: {self.who}'s compute_loss passes {tensors or ['shift_labels']} "
                               "to the model; only input_ids / attention_mask / position_ids / labels are sharded, so "
                               "its loss cannot be made exact: train it without sequence_parallel")
        n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        shard = shard_batch(ids, sp_size=n, sp_rank=r, labels=labels, attention_mask=mask, position_ids=pos,
                            pad_token_id=self.pad_token_id)
        if labels is not None:  # the model sums its own loss on the slice (labels shifted on the full sequence)
            target = shard.shift_labels.contiguous()
            kwargs.update(labels=target, shift_labels=target, num_items_in_batch=1)
        # kept active (keyed by these position ids) until the training step's backward is done: a checkpointed
        # layer's recomputation finds its own batch's mask among the group's batches
        position_ids = shard.position_ids.clone()
        activate_batch(shard.documents, self.group, key=position_ids)
        out = self.original(input_ids=shard.input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        self.calls += 1
        length, rows, s = int(ids.shape[1]), int(ids.shape[0]), int(shard.input_ids.shape[1])
        if labels is not None and kwargs.get("fused_lm_head") is True:
            # TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`) scores `labels[:, 1:]` (length S - 1) but
            # pre-shifted `shift_labels` as given (length S, the last position without a label): cut to stock's
            # S - 1 so that position t is token t + 1's, as the trainer indexes it (DPO's `[:, -seq_len:]`)
            length -= 1
        fields: dict[str, Any] = {}
        for key, value in out.items():
            if key == "loss" or value is None:
                continue
            if key == "aux_loss":
                raise RuntimeError(f"sequence parallelism ({self.who}): the model returns an auxiliary loss (aux_loss, "
                                   "e.g. a MoE router load-balancing loss) computed on this rank's slice, not the whole "
                                   "sequence; train it without sequence_parallel (or without output_router_logits)")
            fields[key] = self._whole(key, value, rows, s, length)
        if labels is not None:
            total = gather_sequence(out["loss"].float().reshape(1), 0, self.group).sum()
            count = num_items if num_items is not None else valid_target_count(labels, mask).clamp(min=1)
            fields["loss"] = total / (count.to(total.device) if torch.is_tensor(count) else count)
        return type(out)(**fields)

    def _named(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            bound = inspect.signature(self.original).bind_partial(*args, **kwargs)
        except (TypeError, ValueError) as err:
            raise RuntimeError(f"sequence parallelism: {self.who}'s compute_loss called the model with positional "
                               f"arguments its forward does not name ({err}); the gathered loss route needs them by "
                               "name (input_ids=...)") from err
        named = dict(bound.arguments)
        for name, param in bound.signature.parameters.items():  # **kwargs flattened back
            if param.kind is param.VAR_KEYWORD and name in named:
                named.update(named.pop(name))
        return named

    def _whole(self, key: str, value: Any, rows: int, s: int, length: int) -> Any:
        if isinstance(value, (tuple, list)):
            return type(value)(self._whole(key, v, rows, s, length) for v in value)
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[0] == rows and value.shape[1] == s:
            if value.is_floating_point():
                return gather_sequence(value, 1, self.group)[:, :length]
            wide = value.long()  # masks / ids: no gradient; gloo has no bool collectives
            return gather_sequence(wide, 1, self.group)[:, :length].to(value.dtype)
        raise RuntimeError(f"sequence parallelism ({self.who}): the model output {key!r} (shape "
                           f"{tuple(value.shape) if torch.is_tensor(value) else type(value).__name__}) is not "
                           "[batch, sequence, ...] and cannot be made whole across the sequence-parallel group; train "
                           "this trainer without sequence_parallel")


def _drop_packed_kwargs(kwargs: dict[str, Any], pos: Any, mask: Any, who: str) -> None:
    """Drop the padding-free flash-attention kwargs of a packed batch (TRL SFT `packing=True`: `cu_seq_lens_q/k`,
    `max_length_q/k`, `seq_idx`) when they say what its `position_ids` say (each document starts at id 0, no
    attention_mask): the slice's documents are read from the whole sequence's position ids (`shard_batch`).
    Raises RuntimeError when they disagree (they could not be sharded as given)."""
    keys = [k for k in _PACKED if k in kwargs]
    if not keys:
        return
    flat = pos.reshape(-1) if torch.is_tensor(pos) else None
    agree = flat is not None and mask is None
    if agree:
        starts = torch.nonzero(flat == 0).reshape(-1)
        cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int64)
        lengths = cu.diff()
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if key in kwargs and not torch.equal(kwargs[key].reshape(-1).to(torch.int64).cpu(), cu.cpu()):
                agree = False
        for key in ("max_length_q", "max_length_k"):
            if key in kwargs and int(kwargs[key]) != int(lengths.max()):
                agree = False
        if "seq_idx" in kwargs and not torch.equal(kwargs["seq_idx"].reshape(-1).to(torch.int64).cpu(),
                                                   ((flat == 0).cumsum(0) - 1).to(torch.int64).cpu()):
            agree = False
    if not agree:
        raise RuntimeError(f"sequence parallelism: {who}'s compute_loss passes {keys} to the model, which do not "
                           "follow its position_ids (each document restarting at 0, no attention_mask): they cannot "
                           "be sharded; train it without sequence_parallel")
    for key in keys:
        kwargs.pop(key)


@contextmanager
def whole_outputs_forward(module: nn.Module, group: Any, pad_token_id: int,
                          who: str = "the trainer") -> Iterator[WholeOutputsForward]:
    """`module.forward` is a `WholeOutputsForward` inside the block (an instance attribute the block sets and
    restores, also when an instance forward was there, e.g. TRL's fused LM head)."""
    with instance_forward(module, WholeOutputsForward(module.forward, group, pad_token_id, who)) as hook:
        yield hook


@contextmanager
def instance_forward(module: nn.Module, hook: Any) -> Iterator[Any]:
    """`module.forward` is `hook` inside the block (an instance attribute), then what it was: the instance forward
    that was there before (e.g. TRL's fused LM head), or none (the class's)."""
    had = "forward" in vars(module)
    previous = vars(module).get("forward")
    module.forward = hook
    try:
        yield hook
    finally:
        if had:
            module.forward = previous
        else:
            del module.forward


def other_models(trainer: Any, model: nn.Module) -> list[nn.Module]:
    """The modules the trainer holds besides the trained model (TRL's `ref_model`, a distillation `teacher_model`,
    a reward model): called inside its `compute_loss` on a batch of the group, they run on the whole sequence on
    every rank (their attention as given, `attention.keep_full_sequence`), exactly as one process runs them."""
    own = {id(m) for m in unwrap_parallel(model).modules()}
    found: dict[int, nn.Module] = {}
    for value in vars(trainer).values():
        if isinstance(value, nn.Module) and id(value) not in own:
            for m in value.modules():
                if id(m) not in own:
                    found.setdefault(id(m), m)
    return list(found.values())


def exchange(inputs: Mapping[str, Any], num_items_in_batch: Any, group: Any, size: int) -> list[tuple[dict, Any]]:
    """Every batch of the group with its owner's `num_items_in_batch`, in rank order, on this rank's device: with
    tensor collectives: `exchange_text_batches` when the batch holds only text keys, else `exchange_batches` (any
    tensors, e.g. TRL's `chosen_input_ids`; the owner's `num_items_in_batch` as a 0-d tensor, an int or None travels
    with its batch; only values that are not tensors, None or ints (strings, lists) go by `all_gather_object`)."""
    device = next((v.device for v in inputs.values() if torch.is_tensor(v)), torch.device("cpu"))  # ORPO: no input_ids
    text = set(inputs) <= set(TEXT_KEYS) and inputs.get("labels") is not None and all(
        torch.is_tensor(v) and v.dim() == 2 for v in inputs.values()) and (
        num_items_in_batch is None or isinstance(num_items_in_batch, int) or torch.is_tensor(num_items_in_batch))
    agreed = torch.tensor([int(text)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)  # every rank of the group takes the same path
    if int(agreed):
        mine = torch.tensor([-1 if num_items_in_batch is None else int(num_items_in_batch)], device=device)
        items = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(items, mine, group=group)
        counts = [None if int(n) < 0 else n[0] for n in items]
        return list(zip(exchange_text_batches(inputs, group, size), counts, strict=True))
    if _NUM_ITEMS in inputs:
        raise RuntimeError(f"sequence parallelism: the batch holds the key {_NUM_ITEMS!r} the exchange reserves")
    batches = exchange_batches({**inputs, _NUM_ITEMS: num_items_in_batch}, group, size, device)
    return [(b, b.pop(_NUM_ITEMS)) for b in batches]
