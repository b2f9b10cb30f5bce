"""Sequence parallelism inside the stock `Trainer` loop under DDP or DeepSpeed ZeRO (`attach_sequence_parallel`).

Per training micro-batch (the Trainer's `compute_loss`, on the instance):
  1. the N ranks of an SP group (ranks `k*N .. k*N+N-1`) exchange their batches (tensor collectives,
     `ops.sequence_parallel.exchange`; a VLM's batches with `all_gather_object`):
     every batch the data loader gave the group is trained on, each by all N ranks ("SP over DP", as
     DeepSpeed's `UlyssesSPDataLoaderAdapter`), so the data, the number of optimizer steps and the
     Trainer's `num_items_in_batch` are exactly stock DDP's;
  2. the batches are right-padded to one length (attention_mask 0, labels -100) and concatenated;
  3. `sharded_causal_lm_loss`: labels shifted and position ids / documents taken on the full sequence,
     this rank's 1/N slice forwarded with Ulysses attention, its token-sum cross-entropy computed by the
     model's own loss (so hf_ddpfix's tiled loss head, when on, runs on the shard);
  4. the loss is normalised as stock's: by the Trainer's global `num_items_in_batch` (times the number of
     processes, as stock's `compute_loss`, which turns DDP's mean into the exact sum), or, where the Trainer
     gives no count, by each batch's own valid-token count (stock's per-batch mean; this needs per-row
     sums, so a tiled loss head stands down there, counted as its fallback).

The batch stays active after the forward (until the next micro-batch or the end of training), so the
backward's recomputation under non-reentrant checkpointing runs the same sharded attention.

Evaluation / prediction (`model.training` False, the Trainer's `prediction_step` -> `compute_loss`) is
sharded too (a 100K-token evaluation fits where the training step fits): the group exchanges its batches
as in training, every rank forwards its slice of all of them under `no_grad`, the per-row token sums are
summed over the group (one `all_reduce` of `[rows]` floats), and each rank returns the loss of *its own*
batch exactly as stock `compute_loss` computes it (the Trainer's `num_items_in_batch` and scale, or the
batch's mean). When the caller wants logits (`prediction_loss_only=False`), the slices' logits are gathered
over the group and each rank returns its own rows at its own length: equal to stock at every real token
(a padding position's logits are those of a pad token that attends to itself only; stock's attend to the
real tokens before them; neither carries a label). Counted as `sequence_parallel/eval_sharded_batches`. Any other
output the caller receives that holds a tensor, however nested (`hidden_states`, `attentions`, a KV cache, a dict,
Qwen-VL's `rope_deltas`: `ops.sequence_parallel.outputs.held_tensors`), would be this rank's slice of the group's
padded batch: that call runs stock `compute_loss` unsharded, counted as a fallback naming the outputs.

Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, and any VLM whose image features enter the text
decoder's `inputs_embeds`: `vision.vision_sequence_parallel_support`): step 2 also concatenates the images
(`vision.merge_vision_batches`) and step 3 runs the model on the whole batch with only its text decoder
on this rank's slice (`vision.VisionSequenceSharding`: the tower, image merge and position ids see
the full sequence), in training and in evaluation alike.

The route of the loss (docs/sequence-parallel-losses.md) is decided once per run from what it shows
(`facts.sequence_parallel_loss_route`): the stock `Trainer.compute_loss` with the model's causal-LM token sum
runs as above ("sharded"); any other loss (a subclass's or TRL's `compute_loss`, `compute_loss_func`, label
smoothing, `average_tokens_across_devices=False`) runs the trainer's own `compute_loss` on each batch of the
group with the model's outputs made whole across it ("gathered", `whole.py`), counted as
`sequence_parallel/gathered_batches`; a model without an LM head (sequence classification, reward) runs the same
loop with only its decoder sharded and the last hidden state gathered under its head ("head-whole", `head.py`),
counted as `sequence_parallel/head_whole_batches`; a loss that cannot be made exact is refused (the plan's
`PlanError`). On both, the metrics the trainer logs are made stock DDP's by `metrics.MetricReplay`.

On the sharded route, batches with other keys and batches without labels run stock `compute_loss` unsharded:
counted as a fallback with its reason (feature "sequence_parallel") and logged once. Under DDP with
`find_unused_parameters=False` each sharded training forward is counted (`sequence_parallel/ddp_find_unused_false`).

Guarantees (tests/scripts/sp_trainer.py): logged losses, evaluation loss, prediction logits and trained
LoRA weights equal the same run without sequence parallelism and one process (world 2: N=2; world 4:
DP2 x SP2 with gradient accumulation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..._compat import (
    deepspeed_engine_sequence_parallel_size,
    model_attn_implementation,
    stand_down_accelerate_sequence_parallel,
    unwrap_parallel,
)
from ...ops.feature_counts import record_amount, record_fallback
from ...ops.sequence_parallel.exchange import exchange_batches, exchange_text_batches
from ...ops.sequence_parallel.inputs import PACKED_ROWS, shard_batch
from ...ops.sequence_parallel.outputs import held_tensors
from .attention import (
    FEATURE,
    activate_batch,
    deactivate_batch,
    install_ulysses_attention,
    keep_full_sequence,
)
from .facts import (
    gather_sequence_parallel_facts,
    is_stock_prediction_step,
    prediction_ignored_outputs,
    sequence_parallel_loss_route,
)
from .head import decoder_sharded
from .metrics import MetricReplay
from .model import sharded_causal_lm_loss
from .vision import BATCH_KEYS, VisionSequenceSharding, merge_vision_batches, vision_sequence_parallel_support
from .whole import exchange, other_models, whole_outputs_forward

__all__ = ["SequenceParallelGroups", "attach_sequence_parallel", "merge_batches"]

logger = logging.getLogger("hf_ddpfix")
_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


class SequenceParallelGroups:
    """The SP group of this rank (consecutive ranks) and its index; every rank creates every group."""

    def __init__(self, sp_size: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % sp_size:
            raise ValueError(f"world size {world} is not a multiple of sequence_parallel={sp_size}")
        self.size, self.dp_size = sp_size, world // sp_size
        self.group: Any = None
        for k in range(self.dp_size):
            g = dist.new_group(list(range(k * sp_size, (k + 1) * sp_size)))
            if rank // sp_size == k:
                self.group = g
        self.rank = dist.get_rank(self.group)


def merge_batches(batches: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad `[B_i, S_i]` batches to the longest and concatenate them along the batch: `attention_mask`
    0 and `labels` -100 on the padding, `position_ids` continuing each row's last id. `PACKED_ROWS` marks
    the rows of batches given without an `attention_mask` (transformers reads packed documents from their
    position ids; with a mask it does not): `shard_batch` keeps each row's own rule."""
    length = max(int(b["input_ids"].shape[1]) for b in batches)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in _KEYS}
    packed = [torch.full((int(b["input_ids"].shape[0]),), b.get("attention_mask") is None, dtype=torch.bool)
              for b in batches]
    for b in batches:
        ids = b["input_ids"]
        rows, s = ids.shape[:2]
        pad = length - s
        mask = b.get("attention_mask")
        mask = torch.ones(rows, s, dtype=torch.long, device=ids.device) if mask is None else mask.long()
        pos = b.get("position_ids")
        pos = torch.arange(s, device=ids.device).expand(rows, s) if pos is None else pos.expand(rows, s)
        labels = b["labels"]
        if pad:
            tail = torch.arange(1, pad + 1, device=ids.device)
            ids = torch.cat([ids, ids.new_zeros(rows, pad)], 1)
            mask = torch.cat([mask, mask.new_zeros(rows, pad)], 1)
            pos = torch.cat([pos, pos[:, -1:] + tail], 1)
            labels = torch.cat([labels, labels.new_full((rows, pad), -100)], 1)
        for k, v in zip(_KEYS, (ids, labels, mask, pos), strict=True):
            out[k].append(v)
    merged = {k: torch.cat(v, 0) for k, v in out.items()}
    merged[PACKED_ROWS] = torch.cat(packed).to(merged["input_ids"].device)
    return merged


def _fallback_reason(trainer: Any, model: nn.Module, inputs: Mapping[str, Any], vision: bool = False) -> str | None:
    extra = sorted(set(inputs) - set(BATCH_KEYS if vision else _KEYS))
    if extra:
        return f"batch keys {extra} are not sharded (text-only batches are)"
    if inputs.get("labels") is None:
        return "the batch has no labels"
    return None


def _groups_for(trainer: Any, sp_size: int) -> SequenceParallelGroups:
    """The trainer's SP groups (made once per trainer and size: `new_group` is collective)."""
    cached = getattr(trainer, "_hf_ddpfix_sp_groups", None)
    if cached is None or cached.size != sp_size:
        cached = SequenceParallelGroups(sp_size)
        trainer._hf_ddpfix_sp_groups = cached
    return cached


def attach_sequence_parallel(trainer: Any, model: nn.Module, *, sp_size: int, stack: ExitStack,
                             stand_down_accelerate: bool = False) -> SequenceParallelGroups:
    """Make `trainer` train and evaluate `model` with Ulysses sequence parallelism over groups of `sp_size` ranks.

    Args:
        trainer: a `transformers.Trainer` about to run its training or evaluation loop under DDP or DeepSpeed
            ZeRO (which then sees plain data parallelism over the world: the same loss scale as DDP).
        model: the unwrapped model (its attention implementation is wrapped).
        sp_size: N, dividing the world size.
        stack: the undo of every change goes here (the attention wrapper, `compute_loss`, `prediction_step`,
            `training_step`, which ends the active batch once its backward is done).
        stand_down_accelerate: the run asked for SP through `ParallelismConfig(sp_size=N)`: accelerate's and
            the Trainer's DeepSpeed-SP paths stand down for this loop
            (`_compat.stand_down_accelerate_sequence_parallel`), so the batch is split once, here.
    """
    # the loss route (docs/sequence-parallel-losses.md), from what this run shows; the plan said it (and raised
    # its PlanError) first: this guards a direct call
    route, _, refusal = sequence_parallel_loss_route(gather_sequence_parallel_facts(trainer, model))
    if refusal:
        raise ValueError(f"sequence parallelism: {refusal}")
    if stand_down_accelerate:
        stack.callback(stand_down_accelerate_sequence_parallel(trainer))
    groups = _groups_for(trainer, sp_size)
    impl = model_attn_implementation(model) or "sdpa"
    stack.callback(install_ulysses_attention(impl).remove)
    stack.callback(deactivate_batch)
    stock = trainer.compute_loss
    stock_prediction_step = trainer.prediction_step
    stock_step = is_stock_prediction_step(trainer)
    warned: set[str] = set()
    checked: list[bool] = []
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
    want_logits: list[bool | None] = [None]  # set by prediction_step for its compute_loss call (None: outside it)
    ignored: list[tuple[str, ...]] = [()]  # the outputs stock prediction_step drops (its ignore_keys)
    family, refusal = vision_sequence_parallel_support(model)
    if refusal:  # the plan refuses it first (PlanError); this guards a direct call
        raise ValueError(f"sequence parallelism: {refusal}")
    vision = VisionSequenceSharding(model, family, groups.group).attach() if family is not None else None
    if vision is not None:
        stack.callback(vision.remove)

    def fall_back(reason: str, model: nn.Module, inputs: dict[str, Any], return_outputs: bool,
                  num_items_in_batch: Any) -> Any:
        record_fallback(FEATURE, reason)
        if reason not in warned and trainer.is_world_process_zero():
            warned.add(reason)
            logger.info("sequence_parallel: %s", reason)
        return stock(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def gathered_loss(model: nn.Module, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any) -> Any:
        """The trainer's own compute_loss on each batch of the group, the model's outputs made whole (whole.py)."""
        if not checked:
            _check_plain_data_parallel(trainer, sp_size)
            checked.append(True)
        training = model.training
        if training and isinstance(model, nn.parallel.DistributedDataParallel) and not model.find_unused_parameters:
            record_amount(FEATURE, "ddp_find_unused_false", 1)
        results = []
        whole = keep_full_sequence(other_models(trainer, model))  # a ref / teacher model: whole sequence, as given
        # "head-whole" (head.py): the model runs whole, its decoder on this rank's slice; else the model on the slice
        sharding = decoder_sharded if route == "head-whole" else whole_outputs_forward
        try:
            # the trainer's logged metrics: stock's (metrics.py), not the group's batches N times
            with sharding(unwrap_parallel(model), groups.group, pad_id, type(trainer).__name__) as hook, \
                    MetricReplay(trainer, groups.rank, groups.size) as replay:
                for j, (batch, items) in enumerate(exchange(inputs, num_items_in_batch, groups.group, groups.size)):
                    results.append(replay.call(j, lambda batch=batch, items=items: stock(
                        model, batch, return_outputs=return_outputs, num_items_in_batch=items)))
        finally:
            whole()
        if route == "head-whole" and hook.calls < len(results):  # every batch's decoder ran sharded
            raise RuntimeError(f"sequence parallelism ({type(trainer).__name__}, loss {route}): its compute_loss ran "
                               f"{len(results)} batches but the sharded forward only {hook.calls}; train it without "
                               "sequence_parallel")
        kind = "head_whole_batches" if route == "head-whole" else "gathered_batches"
        record_amount(FEATURE, kind if training else "eval_" + kind, len(results))
        if not training:  # this rank's own batch, as stock returns it
            return results[groups.rank]
        losses = [r[0] if isinstance(r, tuple) else r for r in results]
        loss = sum(losses) / groups.size  # every rank holds the group's whole losses: the gather's backward x N
        return (loss, results[groups.rank][1]) if return_outputs else loss

    def compute_loss(model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if route in ("gathered", "head-whole"):
            deactivate_batch()
            return gathered_loss(model, inputs, return_outputs, num_items_in_batch)
        reason = _fallback_reason(trainer, model, inputs, vision is not None)
        deactivate_batch()  # the previous micro-batch's (kept for its checkpointed backward)
        if reason is not None:
            return fall_back(reason, model, inputs, return_outputs, num_items_in_batch)
        if not checked:
            _check_plain_data_parallel(trainer, sp_size)
            checked.append(True)
        if vision is None:  # text keys only (else a fallback above): tensor collectives, no pickling
            batches = exchange_text_batches(inputs, groups.group, groups.size)
        else:  # images, grids, per-token type ids: any keys the VLM path merges, as tensors too
            batches = exchange_batches(inputs, groups.group, groups.size, inputs["input_ids"].device)
        forward: Callable[[], tuple[torch.Tensor, Any]] | None = None
        if vision is not None:  # the vision tower, image merge and 3-D positions on the full sequence
            try:
                merged = merge_vision_batches(batches, pad_id)
            except ValueError as err:  # every rank of the group holds the same batches: all fall back
                return fall_back(str(err), model, inputs, return_outputs, num_items_in_batch)
            forward = lambda: vision.forward_rows(model, merged, pad_id)  # noqa: E731
        else:
            merged = merge_batches(batches)
        normalised = num_items_in_batch is not None and bool(getattr(trainer, "model_accepts_loss_kwargs", False))
        if not model.training:
            # outputs a caller receives: stock prediction_step's beside the logits (not with prediction_loss_only);
            # any other caller's whenever it asks for them (return_outputs outside prediction_step)
            want = want_logits[0] if want_logits[0] is not None else return_outputs
            loss, outputs = _evaluate_sharded(model, merged, batches, groups, pad_id, want, forward)
            skip = ("loss", "logits", *ignored[0])  # stock prediction_step drops its ignore_keys' outputs
            held = held_tensors({k: v for k, v in outputs.items() if k not in skip})
            if want and held:  # e.g. hidden_states / attentions (tuples of this rank's slices), a KV cache, Qwen-VL
                # rope_deltas (one per row of the padded group batch): stock's are needed, the call runs unsharded
                return fall_back(f"prediction outputs {held[:4]} hold this rank's slice of the group's padded batch, "
                                 "not its own whole sequence: the prediction runs unsharded", model, inputs,
                                 return_outputs, num_items_in_batch)
            loss = loss / (num_items_in_batch if normalised else _count(batches[groups.rank]))
            if normalised and trainer.args.average_tokens_across_devices:
                loss = loss * trainer.accelerator.num_processes  # stock compute_loss's scale
            outputs["loss"] = loss
            record_amount(FEATURE, "eval_sharded_batches", len(batches))
            return (loss, outputs) if return_outputs else loss
        if isinstance(model, nn.parallel.DistributedDataParallel) and not model.find_unused_parameters:
            record_amount(FEATURE, "ddp_find_unused_false", 1)
        if forward is not None:  # the decoder on this rank's slice after the image merge (kept active for backward)
            loss_rows, outputs = forward()
            if normalised:
                loss = loss_rows.sum() / num_items_in_batch
                if trainer.args.average_tokens_across_devices:
                    loss = loss * trainer.accelerator.num_processes
            else:
                loss = _per_batch_means(loss_rows, batches)
        elif normalised:
            loss_sum, outputs = sharded_causal_lm_loss(model, merged, group=groups.group, pad_token_id=pad_id,
                                                       keep_active=True, model_loss=True)
            loss = loss_sum / num_items_in_batch
            if trainer.args.average_tokens_across_devices:
                loss = loss * trainer.accelerator.num_processes  # stock's scale: DDP's mean becomes the sum
        else:  # stock: each rank's batch mean, averaged by DDP (and divided by GA by the Trainer)
            if _has_tiled_loss(model):
                record_fallback("tiled_loss", "sequence parallelism without num_items_in_batch: the per-batch "
                                "mean needs per-row sums (logits)")
            loss_rows, outputs = _per_row_loss(model, merged, groups, pad_id, keep_active=True)
            loss = _per_batch_means(loss_rows, batches)
        record_amount(FEATURE, "sharded_batches", len(batches))
        return (loss, outputs) if return_outputs else loss

    def prediction_step(model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        # the stock step discards the outputs with prediction_loss_only; a subclass's may read them
        want_logits[0] = not prediction_loss_only or not stock_step
        ignored[0] = prediction_ignored_outputs(trainer, ignore_keys) if stock_step else ()
        try:
            return stock_prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            want_logits[0], ignored[0] = None, ()
            deactivate_batch()

    stock_training_step = trainer.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        try:
            return stock_training_step(*args, **kwargs)
        finally:  # forward and backward (with its recomputation) are done: a forward a callback runs
            deactivate_batch()  # before the next micro-batch must not go through Ulysses on unsharded input

    compute_loss._hf_ddpfix_sequence_parallel = True  # type: ignore[attr-defined]
    had_own = {name: name in vars(trainer) for name in ("compute_loss", "prediction_step", "training_step")}
    trainer.compute_loss = compute_loss
    trainer.prediction_step = prediction_step
    trainer.training_step = training_step

    def restore() -> None:
        for name, original in (("compute_loss", stock), ("prediction_step", stock_prediction_step),
                               ("training_step", stock_training_step)):
            if had_own[name]:
                setattr(trainer, name, original)
            else:
                vars(trainer).pop(name, None)

    stack.callback(restore)
    return groups


def _check_plain_data_parallel(trainer: Any, sp_size: int) -> None:
    """The loss scale (x world size) is exact only when the engine averages gradients over the whole world, as
    DDP does. A DeepSpeed engine built with sequence-parallel groups does not (it sums over each SP group):
    checked at the first sharded forward, where the engine exists.

    Raises:
        RuntimeError: the DeepSpeed engine has sequence_parallel_size > 1, naming it and the likely cause.
    """
    size = deepspeed_engine_sequence_parallel_size(getattr(trainer, "model_wrapped", None))
    if size is not None and size > 1:
        raise RuntimeError(
            f"sequence_parallel={sp_size}: the DeepSpeed engine was built with its own sequence-parallel groups "
            f"(sequence_parallel_size={size}), so it does not average gradients over the world and hf_ddpfix's "
            "token-sum loss would be off by that factor. Build the engine without an SP mpu (an engine with "
            "DeepSpeed's Ulysses made earlier in this process leaves deepspeed.utils.groups.mpu set)")


def _has_tiled_loss(model: nn.Module) -> bool:
    from ..._compat import unwrap_model
    from ..long_context.loss_patch import _TiledLossForward

    target = unwrap_model(getattr(model, "module", model))
    return isinstance(target.__dict__.get("forward"), _TiledLossForward)


def _evaluate_sharded(model: nn.Module, merged: dict[str, torch.Tensor], batches: list[Mapping[str, torch.Tensor]],
                      groups: SequenceParallelGroups, pad_id: int, want_logits: bool,
                      forward: Callable[[], tuple[torch.Tensor, Any]] | None = None) -> tuple[torch.Tensor, Any]:
    """This rank's own batch's token-sum loss (fp32 scalar) and the outputs, from a sharded forward of the
    group's `merged` batches (`forward`: a VLM's, else the text one); `outputs.logits` is this rank's own rows
    `[B_r, S_r, V]` (gathered over the group) when `want_logits`, else `None`."""
    rows = [int(b["input_ids"].shape[0]) for b in batches]
    start = sum(rows[: groups.rank])
    own = slice(start, start + rows[groups.rank])
    if forward is not None:
        try:
            loss_rows, outputs = forward()
        finally:
            deactivate_batch()
    else:
        loss_rows, outputs = _per_row_loss(model, merged, groups, pad_id, keep_active=False)
    total = loss_rows.detach().clone()
    dist.all_reduce(total, group=groups.group)  # each row's sum over every slice
    loss = total[own].sum()
    logits = None
    if want_logits:
        part = outputs.logits.detach().contiguous()
        parts = [torch.empty_like(part) for _ in range(groups.size)]
        dist.all_gather(parts, part, group=groups.group)
        length = int(batches[groups.rank]["input_ids"].shape[1])
        logits = torch.cat(parts, dim=1)[own, :length]
    outputs["logits"] = logits
    return loss, outputs


def _per_batch_means(loss_rows: torch.Tensor, batches: list[Mapping[str, torch.Tensor]]) -> torch.Tensor:
    """Sum over the group's batches of this rank's share of each batch's token mean (stock's per-rank mean,
    which DDP averages): `loss_rows` `[B]` holds the rows of `batches` in order."""
    rows = [int(b["input_ids"].shape[0]) for b in batches]
    return sum(part.sum() / max(_count(b), 1) for part, b in zip(loss_rows.split(rows), batches, strict=True))


def _count(batch: Mapping[str, torch.Tensor]) -> int:
    from ...ops.sequence_parallel.loss import valid_target_count

    return int(valid_target_count(batch["labels"], batch.get("attention_mask")))


def _per_row_loss(model: nn.Module, merged: dict[str, torch.Tensor], groups: SequenceParallelGroups,
                  pad_id: int, keep_active: bool) -> tuple[torch.Tensor, Any]:
    """This rank's token-sum cross-entropy per row of `merged` (`[B]`), from the logits of its slice;
    `keep_active`: the batch stays active for a checkpointed backward (else it ends with the forward)."""
    import torch.nn.functional as F

    shard = shard_batch(merged["input_ids"], sp_size=groups.size, sp_rank=groups.rank, labels=merged["labels"],
                        attention_mask=merged["attention_mask"], position_ids=merged["position_ids"],
                        pad_token_id=pad_id, packed_rows=merged.get(PACKED_ROWS))
    activate_batch(shard.documents, groups.group)  # stays active for a checkpointed backward
    try:
        outputs = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False)
    finally:
        if not keep_active:
            deactivate_batch()
    logits = outputs.logits.float()
    assert shard.shift_labels is not None
    per_token = F.cross_entropy(logits.transpose(1, 2), shard.shift_labels, ignore_index=-100, reduction="none")
    return per_token.sum(1), outputs
