"""Shared test fixtures: tiny random-weight models, LoRA, batches, collators, gloo set-up.

Every test and test script builds its models here (nothing is downloaded; each model builds in < 1 s).
Import it as ``from fixtures import ...``: pytest puts ``tests/`` on ``sys.path`` (conftest.py), and the
scripts under ``tests/scripts`` insert it themselves (``sys.path.insert(0, <tests dir>)``).

- Text: :func:`tiny_llama_config`, :func:`tiny_llama`, :func:`lora`, :func:`padded_collate`,
  :func:`variable_length_ids`; the multi-process scripts' LoRA Llama :func:`lora_llama` (shape
  :data:`SMALL_TEXT`, shared with the VLM text towers and ``tests/zoo.py``) and :func:`masked_labels`.
- VLMs (Qwen family, the stabiliser's adapters): :data:`BUILDERS`, :data:`PATCH_DIM`, :func:`add_lora`,
  :func:`make_batch`, :func:`image_collate`; the Qwen-VL configs once, :func:`qwen_vl` (``tests/zoo.py``
  builds its Qwen entries with it). The wider model zoo of the usage tests is ``tests/zoo.py``.
- Processes: :func:`init_gloo`, :func:`rank_log`, :func:`teardown`, DeepSpeed's CPU op
  :func:`build_deepspeed_shm_op` and config :func:`zero_config`; a Trainer with samples in order
  :func:`in_order`; a multi-case script's end :func:`finish_suite`; comparing ranks and references:
  :func:`trainable_weights`, :func:`flat_trainable`, :func:`weights_digest`, :func:`max_diff_across_ranks`,
  :func:`assert_same_across_ranks`, :func:`assert_weights_equal`, :func:`prediction_diff`;
  FSDP2 and tiling: :func:`shard_decoder`, :func:`tiled_stats`; DDP micro-batches: :func:`accumulate`;
  a script's verdict: :class:`Verdicts`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# --------------------------------------------------------------------------------------------- text

TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1)


def tiny_llama_config(**overrides: Any) -> Any:
    """A tiny ``LlamaConfig`` (vocab 64, hidden 32, 2 layers, GQA 2:1) with ``overrides`` applied."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **overrides})


def tiny_llama(seed: int = 0, **overrides: Any) -> nn.Module:
    """A ``LlamaForCausalLM`` from :func:`tiny_llama_config`, weights drawn after ``torch.manual_seed(seed)``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides))


def lora(model: nn.Module, targets: Sequence[str] = ("q_proj", "v_proj"), r: int = 2, **kwargs: Any) -> nn.Module:
    """``get_peft_model(model, LoraConfig(r, target_modules=targets, **kwargs))``."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), **kwargs))


# The shape every small text config shares: the multi-process scripts' Llama, the VLM text towers below
# and tests/zoo.py's text configs (hidden 64, 2 layers, GQA 4:2).
SMALL_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
DECODER_TARGETS = ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")


def lora_llama(*, targets: Sequence[str] | str = DECODER_TARGETS, random_lora: bool = True, dtype: Any = None,
               checkpointing: str | None = None, seed: int = 0, **config: Any) -> nn.Module:
    """The multi-process scripts' LoRA Llama, in train mode.

    Args:
        targets: LoRA ``target_modules`` (r=4, alpha 8, no dropout); a string such as ``"all-linear"`` too.
        random_lora: random A and B (``init_lora_weights=False``) so every adapter trains from step 1;
            False: peft's default init (B = 0).
        dtype: e.g. ``torch.float64`` (float summation order, which DDP changes, stays far below 1e-6).
        checkpointing: ``"non_reentrant"`` / ``"reentrant"`` through HF's ``gradient_checkpointing_enable``
            (reentrant also ``enable_input_require_grads``); None: off.
        seed: weights and adapters drawn after ``torch.manual_seed(seed)``.
        config: ``LlamaConfig`` overrides of :data:`SMALL_TEXT` with ``max_position_embeddings=128``.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**SMALL_TEXT, "max_position_embeddings": 128, **config})
    target_modules = targets if isinstance(targets, str) else list(targets)
    adapters = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=target_modules,
                          **({"init_lora_weights": False} if random_lora else {}))
    model = get_peft_model(LlamaForCausalLM(cfg), adapters)
    if dtype is not None:
        model = model.to(dtype)
    if checkpointing is not None:
        if checkpointing not in ("non_reentrant", "reentrant"):
            raise ValueError(f"checkpointing must be 'non_reentrant', 'reentrant' or None, got {checkpointing!r}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        if checkpointing == "reentrant":
            model.enable_input_require_grads()
    model.train()
    return model


def masked_labels(ids: torch.Tensor, gen: torch.Generator, fraction: float = 0.3) -> torch.Tensor:
    """``ids`` as labels with about ``fraction`` of the positions set to -100 (drawn from ``gen``)."""
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=gen) < fraction] = -100
    return labels


def variable_length_ids(n: int, vocab: int = 60, lengths: Sequence[int] = (6, 9, 12, 7), seed: int = 0) -> list[list[int]]:
    """``n`` token-id lists whose lengths cycle through ``lengths`` (variable lengths across batches)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def padded_collate(batch: Sequence[dict[str, Any]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids`` to the longest row; ``attention_mask`` marks real tokens and ``labels``
    are ``-100`` on padding (so the loss counts real tokens only)."""
    rows = [list(b["input_ids"]) for b in batch]
    n = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (n - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


# --------------------------------------------------------------------------------------------- processes


def init_gloo() -> tuple[int, int]:
    """Initialise the default process group on gloo (under torchrun); returns ``(rank, world_size)``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def build_deepspeed_shm_op(timeout: float = 900) -> None:
    """Build DeepSpeed's CPU shared-memory op once (cached in ``~/.cache/torch_extensions``; 45-210 s the first
    time), outside any launch's hard timeout. A build over ``timeout`` fails the test, saying what to delete
    (a killed build leaves a stale ``lock`` file in ``.../deepspeed_shm_comm/``)."""
    import subprocess
    import sys

    import pytest

    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    try:
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "DS_ACCELERATOR": "cpu"}, check=True,
                       timeout=timeout, capture_output=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f"building deepspeed_shm_comm took > {timeout:.0f} s: a killed earlier build leaves a stale "
                    "'lock' file in ~/.cache/torch_extensions/*/deepspeed_shm_comm/ - delete it")


def rank_log(rank: int | None = None) -> Callable[[str], None]:
    """A ``print`` that prefixes ``[rank R   S.Ss]`` (seconds since this call) and flushes; ``rank``
    defaults to this process's rank in the default group."""
    rank = dist.get_rank() if rank is None else rank
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[rank {rank} {time.time() - t0:5.1f}s] {msg}", flush=True)

    return log


def teardown(*objects: Any) -> None:
    """Drop DDP/FSDP state before destroying the process group (avoids a rare abort at process exit)."""
    for obj in objects:
        del obj
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class Verdicts:
    """The records a multi-process script judges (one dict per setting, each with a bool ``"ok"``).

    Args:
        tag: printed before each record on rank 0 (``TAG {json}``), as it is judged.
        out: where rank 0 writes every record as JSON at :meth:`finish` (None: nowhere).
    """

    def __init__(self, tag: str, out: str | None) -> None:
        self.tag, self.out = tag, out
        self.records: list[dict[str, Any]] = []

    def add(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        if dist.get_rank() == 0:
            print(self.tag, json.dumps(rec), flush=True)

    def finish(self) -> None:
        """Write the records (rank 0), let the process group go (:func:`teardown`), and exit non-zero on
        every rank naming the records whose ``"ok"`` is False."""
        if dist.get_rank() == 0 and self.out:
            with open(self.out, "w") as f:
                json.dump(self.records, f, indent=1)
        teardown()
        bad = [r for r in self.records if not r["ok"]]
        if bad:
            raise SystemExit(f"{self.tag} mismatch: {bad}")



class RankItems(torch.utils.data.Dataset):
    """Item ``k * world + r`` is rank ``r``'s ``k``-th micro-batch, ``make(k, r)`` (one row with its batch
    dimension): with an in-order sampler and :func:`single_collate`, every rank trains on its own rows."""

    def __init__(self, n_batches: int, world: int, make: Callable[[int, int], dict[str, Any]]):
        self.rows = [make(k, r) for k in range(n_batches) for r in range(world)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def single_collate(features: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Batch size 1 of :class:`RankItems`: each item already has its batch dimension."""
    assert len(features) == 1, "batch size 1: each item already has its batch dimension"
    return dict(features[0])

def in_order(cls: type) -> type:
    """A subclass of the Trainer class ``cls`` whose training sampler is a ``SequentialSampler`` (stock's
    shuffles): the samples in dataset order, so which rank and step gets which sample is fixed."""
    from torch.utils.data import SequentialSampler

    def _get_train_sampler(self: Any, *args: Any, **kwargs: Any) -> Any:
        return SequentialSampler(self.train_dataset)

    return type(f"InOrder{cls.__name__}", (cls,), {"_get_train_sampler": _get_train_sampler})


def finish_suite(out: str, summary: dict[str, Any], failures: list[str], tag: str) -> None:
    """The end of a multi-case script: rank 0 writes ``summary`` with ``failures`` as JSON to ``out``; then
    every rank exits non-zero with ``<tag>_FAIL`` and the failures, or prints ``<tag>_OK`` and lets the
    process group go."""
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({**summary, "failures": failures}, f, indent=1, default=str)
    if failures:
        raise SystemExit(f"{tag}_FAIL " + "; ".join(failures))
    print(f"{tag}_OK", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def accumulate(ddp: nn.Module, batches: Iterable[dict[str, torch.Tensor]], ga: int) -> None:
    """Forward and backward ``ga`` micro-batches (each loss divided by ``ga``), every one but the last
    under ``ddp.no_sync()``: one gradient synchronisation per optimizer step, as the Trainer does."""
    for micro, batch in enumerate(batches):
        with ddp.no_sync() if micro < ga - 1 else contextlib.nullcontext():
            (ddp(**batch).loss / ga).backward()


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # an FSDP2 DTensor: gathered (a collective)


def trainable_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> a copy of every trainable parameter (FSDP2 shards and DeepSpeed ZeRO-3 partitions
    gathered: call it on every rank)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") for _, p in params):  # ZeRO-3 partitions: gather them (a collective)
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}
    return {n: _full(p).clone() for n, p in params}


def zero_config(stage: int, shard_small: bool = True) -> dict[str, Any]:
    """The smallest DeepSpeed ZeRO config the Trainer fills in ("auto"); ZeRO-3 with ``shard_small``: threshold
    0 so that it shards the tiny test parameters too (else, DeepSpeed's default threshold, it keeps them whole
    and shards nothing)."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3 and shard_small:
        zero.update(stage3_param_persistence_threshold=0)
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": zero}


def flat_trainable(model: nn.Module) -> torch.Tensor:
    """Every trainable parameter, sorted by name, flattened into one tensor (FSDP2 shards gathered)."""
    return torch.cat([_full(p).flatten() for _, p in sorted(model.named_parameters()) if p.requires_grad])


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """16 hex digits of the SHA-256 over names and float32 bytes, in name order (equal iff bitwise equal)."""
    h = hashlib.sha256()
    for n in sorted(weights):
        h.update(n.encode())
        h.update(weights[n].float().numpy().tobytes())
    return h.hexdigest()[:16]


def assert_same_across_ranks(weights: dict[str, torch.Tensor], what: str) -> None:
    """Every rank holds bitwise the same ``weights`` (compares :func:`weights_digest`; a collective)."""
    out: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, weights_digest(weights))
    assert len(set(out)) == 1, f"{what}: replicas differ: {out}"


def prediction_diff(got, ref) -> float:
    """The largest ``|got - ref|`` of two ``Trainer.predict()`` outputs (the gathered, padded logits: numpy arrays
    or tensors, nested tuples compared element-wise). Shapes must match (a rank's rows missing or doubled is an
    ``AssertionError``, not a small difference)."""
    import numpy as np

    if isinstance(got, (tuple, list)):
        assert isinstance(ref, (tuple, list)) and len(got) == len(ref), (type(got), type(ref))
        return max((prediction_diff(a, b) for a, b in zip(got, ref, strict=True)), default=0.0)
    a, b = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max()) if a.size else 0.0


def assert_weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str,
                         atol: float = 0.0) -> None:
    """The same names, and every tensor bitwise equal (``atol`` 0) or within ``atol``; the message names
    up to three that differ with their largest difference."""
    assert a.keys() == b.keys(), what
    bad = []
    for n in a:
        if atol == 0.0:
            if not torch.equal(a[n], b[n]):
                bad.append((n, (a[n] - b[n]).abs().max().item()))
        elif not torch.allclose(a[n], b[n], atol=atol, rtol=0):
            bad.append((n, (a[n] - b[n]).abs().max().item()))
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def max_diff_across_ranks(flat: torch.Tensor) -> float:
    """The largest ``|x_rank - x_rank0|`` over the ranks (a collective)."""
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return float(max((g - gathered[0]).abs().max() for g in gathered))


def shard_decoder(model: nn.Module) -> nn.Module:
    """``fully_shard`` each decoder layer of a PEFT-wrapped Llama, then the root (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    return fully_shard(model)


def tiled_stats(model: nn.Module) -> dict[str, int]:
    """One dict that every tiled MLP forward under ``model`` counts into (chunks, tokens)."""
    stats: dict[str, int] = {}
    for m in model.modules():
        fwd = m.__dict__.get("forward")
        if fwd is not None and hasattr(fwd, "stats"):
            fwd.stats = stats
    return stats


# --------------------------------------------------------------------------------------------- VLMs

IMAGE, VIDEO, VSTART, VEND = 250, 251, 252, 253
# cell.py's targets, plus Qwen3-VL's vision MLP / merger names (linear_fc1/2)
LORA_TARGETS = [
    "q_proj",
    "v_proj",
    "qkv",
    "proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "linear_fc1",
    "linear_fc2",
]
SEQ = 16

_TEXT = dict(SMALL_TEXT, max_position_embeddings=512, eos_token_id=0, bos_token_id=0)
_TOKENS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND
)

_QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                     spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                     deepstack_visual_indexes=[0])
# The tiny vision towers of the Qwen-VL families (cell.py's Qwen2.5-VL: window attention, one full block).
QWEN_VISION: dict[str, dict[str, Any]] = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1],
                       window_size=56),
    "qwen3_vl": _QWEN3_VISION,
    "qwen3_vl_moe": _QWEN3_VISION,
}
_QWEN_CLASSES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
}


def qwen_text(name: str, base: dict[str, Any]) -> dict[str, Any]:
    """The text config of Qwen-VL family ``name`` over ``base``: M-RoPE sections to fit head_dim 16, and
    Qwen3's interleaved M-RoPE / MoE experts."""
    if name in ("qwen2_vl", "qwen2_5_vl"):
        return dict(base, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]})
    t = dict(base, head_dim=16,
             rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    if name == "qwen3_vl_moe":  # pad_token_id: transformers 5.0.0's text config lacks it (its model reads it)
        t.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, pad_token_id=None)
    return t


def qwen_vl(name: str, seed: int = 0, *, text: dict[str, Any] | None = None,
            tokens: dict[str, int] | None = None) -> nn.Module:
    """A tiny Qwen-VL family model (``name`` a key of :data:`QWEN_VISION`), weights drawn after
    ``torch.manual_seed(seed)``.

    Args:
        text: the text config before :func:`qwen_text` (default: :data:`SMALL_TEXT`, 512 positions,
            eos/bos 0).
        tokens: image / video / vision-start / vision-end token ids (default 250..253).

    Raises:
        ImportError: the installed transformers has no such family.
    """
    import transformers

    try:
        config_cls, model_cls = (getattr(transformers, n) for n in _QWEN_CLASSES[name])
    except AttributeError as exc:
        raise ImportError(f"transformers {transformers.__version__} has no {name}") from exc
    torch.manual_seed(seed)
    cfg = config_cls(text_config=qwen_text(name, _TEXT if text is None else text), vision_config=QWEN_VISION[name],
                     **(_TOKENS if tokens is None else tokens))
    return model_cls(cfg)


def build_qwen2_5_vl(seed: int = 0) -> nn.Module:
    """Tiny Qwen2.5-VL (cell.py's config): window attention with one full-attention block."""
    return qwen_vl("qwen2_5_vl", seed)


def build_qwen2_vl(seed: int = 0) -> nn.Module:
    return qwen_vl("qwen2_vl", seed)


def build_qwen3_vl(seed: int = 0) -> nn.Module | None:
    """None where the installed transformers has no Qwen3-VL."""
    try:
        return qwen_vl("qwen3_vl", seed)
    except ImportError:
        return None


def build_qwen3_vl_moe(seed: int = 0) -> nn.Module | None:
    """None where the installed transformers has no Qwen3-VL-MoE."""
    try:
        return qwen_vl("qwen3_vl_moe", seed)
    except ImportError:
        return None


BUILDERS: dict[str, Callable[[int], nn.Module | None]] = {
    "qwen2_vl": build_qwen2_vl,
    "qwen2_5_vl": build_qwen2_5_vl,
    "qwen3_vl": build_qwen3_vl,
    "qwen3_vl_moe": build_qwen3_vl_moe,
}
PATCH_DIM = {"qwen2_vl": 1176, "qwen2_5_vl": 1176, "qwen3_vl": 1536, "qwen3_vl_moe": 1536}  # C*tp*p*p


def add_lora(model: nn.Module, dropout: float = 0.0) -> nn.Module:
    """LoRA on every linear layer, vision tower included (what "all-linear" users do). Random A and B
    (init_lora_weights=False) so every adapter gets a non-zero gradient from the first step."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=LORA_TARGETS, init_lora_weights=False
    )
    return get_peft_model(model, cfg)


def make_batch(has_image: bool, seed: int, patch_dim: int = 1176) -> dict[str, torch.Tensor]:
    """One sample; with an image: a 4x4-patch image -> 4 merged image tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 240, (1, SEQ), generator=g)
    batch: dict[str, torch.Tensor] = {}
    if has_image:
        ids[0, 3] = VSTART
        ids[0, 4:8] = IMAGE
        ids[0, 8] = VEND
        batch["pixel_values"] = torch.randn(16, patch_dim, generator=g)
        batch["image_grid_thw"] = torch.tensor([[1, 4, 4]])
        batch["mm_token_type_ids"] = (ids == IMAGE).long()
    batch["input_ids"] = ids
    batch["labels"] = ids.clone()
    return batch


def image_collate(batch: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack equal-length Qwen-VL rows (``input_ids``, optional ``pixel_values`` / ``image_grid_thw`` as
    lists, None on text rows); ``labels`` are the ids. Image tensors are concatenated over the rows that
    have one."""
    out = {"input_ids": torch.tensor([b["input_ids"] for b in batch])}
    out["labels"] = out["input_ids"].clone()
    imgs = [b for b in batch if b.get("pixel_values") is not None]
    if imgs:
        out["pixel_values"] = torch.cat([torch.tensor(b["pixel_values"]) for b in imgs])
        out["image_grid_thw"] = torch.cat([torch.tensor(b["image_grid_thw"]) for b in imgs])
    return out


def sp_vlm_batches(patch_dim: int) -> dict[str, dict[str, torch.Tensor]]:
    """Qwen-VL batches: an image whose 4 tokens straddle the middle shard border (positions 6..9 of 16), a
    text-only row, two rows with images of different grids (the grids must stay in token order), and a
    prompt-masked mixed batch of length 15 (not divisible by N) with right padding."""
    g = torch.Generator().manual_seed(11)

    def row(s: int, images: list[tuple[int, int]]) -> tuple[torch.Tensor, list[torch.Tensor], list[list[int]]]:
        ids = torch.randint(1, 240, (s,), generator=g)
        pix, grids = [], []
        for start, (h, w) in images:  # an h x w patch grid: h*w/4 merged tokens
            k = h * w // 4
            ids[start - 1], ids[start:start + k], ids[start + k] = VSTART, IMAGE, VEND
            pix.append(torch.randn(h * w, patch_dim, generator=g))
            grids.append([1, h, w])
        return ids, pix, grids

    def batch(rows: list[tuple[int, list[tuple[int, int]]]], prompt: int = 0) -> dict[str, torch.Tensor]:
        built = [row(s, im) for s, im in rows]
        length = max(s for s, _ in rows)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (r, _, _) in enumerate(built):
            ids[i, :len(r)], mask[i, :len(r)] = r, 1
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :prompt] = -100
        out = {"input_ids": ids, "labels": labels, "mm_token_type_ids": (ids == IMAGE).long()}
        if not bool(mask.all()):
            out["attention_mask"] = mask
        pix = [p for _, ps, _ in built for p in ps]
        if pix:
            out["pixel_values"] = torch.cat(pix)
            out["image_grid_thw"] = torch.tensor([gr for _, _, gs in built for gr in gs])
        return out

    return {
        "image_across_shards": batch([(16, [(6, (4, 4))])]),
        "text_only": batch([(16, [])]),
        "two_grids": batch([(16, [(2, (2, 4))]), (16, [(9, (4, 4))])]),
        "mixed_padded_prompt_masked": batch([(15, [(3, (4, 4))]), (11, [])], prompt=9),
    }


def on_pinned_stack() -> bool:
    """True on the pinned stack (constraints.txt), whose figures the results files and docs tables record."""
    import sys
    from pathlib import Path

    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from readme_blocks import on_pinned_stack as pinned

    return pinned({"torch": torch.__version__, "transformers": transformers.__version__})


_LAYER_SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)



def skip_unless_shipped(cls: str) -> None:
    """Skip where the installed transformers does not ship the family at all (the oldest stack's 5.0 predates
    Qwen3.5 and Gemma 4): nothing of hf_ddpfix is left untested there, the family does not exist."""
    import pytest
    import transformers

    if not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} ships no {cls} (the family arrived in a later release)")

def layer_family_config(name: str):  # noqa: ANN201
    """Each long-context layer family's tiny text config (Qwen3.5 / Qwen3-Next hybrids, Gemma 4 / Gemma 3 sliding +
    full attention, else Llama), from its own config class; skips where the release does not ship the class
    (tests/test_layer_kinds.py, tests/test_offline_plan_decisions.py)."""
    import transformers

    if name == "qwen3_5":
        skip_unless_shipped("Qwen3_5TextConfig")
        return transformers.Qwen3_5TextConfig(**_LAYER_SMALL, num_hidden_layers=4, linear_num_value_heads=4,
                                              linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                              layer_types=["linear_attention"] * 3 + ["full_attention"])
    if name == "qwen3_next":
        skip_unless_shipped("Qwen3NextConfig")
        return transformers.Qwen3NextConfig(**_LAYER_SMALL, num_hidden_layers=4, linear_num_value_heads=4,
                                            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=32,
                                            layer_types=["linear_attention"] * 3 + ["full_attention"])
    if name == "gemma4":
        skip_unless_shipped("Gemma4TextConfig")
        return transformers.Gemma4TextConfig(**_LAYER_SMALL, num_hidden_layers=4, global_head_dim=32, sliding_window=8,
                                             hidden_size_per_layer_input=0,
                                             layer_types=["sliding_attention"] * 3 + ["full_attention"])
    if name == "gemma3":
        return transformers.Gemma3TextConfig(**_LAYER_SMALL, num_hidden_layers=4, sliding_window=64,
                                             layer_types=["sliding_attention"] * 3 + ["full_attention"])
    return transformers.LlamaConfig(**_LAYER_SMALL, num_hidden_layers=2)


def layer_family_model(config: Any, attention: str = "sdpa", seed: int = 0) -> nn.Module:
    """A causal LM built seeded from a tiny ``config`` (:func:`layer_family_config`), in float32 and training mode,
    every weight moved off its init (Gemma's norms start at 0, its layer scalars at 1: a patch that ignored them
    would otherwise pass)."""
    import transformers

    config._attn_implementation = attention
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.train()
