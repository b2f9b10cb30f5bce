"""2-process DDP parity for the VLM stabiliser: stabiliser + find_unused_parameters=False (and
static_graph=True) ends with weights bit-identical to stock DDP(find_unused_parameters=True).

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/vlm_ddp.py
Prints ``VLM_DDP_OK`` on every rank when every scenario passes. Also the shared tiny-model builders
for tests/test_vlm.py and the other vlm_* scripts.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from hf_ddpfix.integrations.families import vision_param_names  # noqa: E402
from hf_ddpfix.integrations.stabilizer import VisionStabilizer  # noqa: E402

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

_TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
    eos_token_id=0,
    bos_token_id=0,
)
_TOKENS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND
)


def build_qwen2_5_vl(seed: int = 0) -> nn.Module:
    """Tiny Qwen2.5-VL (cell.py's config): window attention with one full-attention block."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2_5_VLConfig(
        text_config=_TEXT,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            fullatt_block_indexes=[1],
            window_size=56,
        ),
        **_TOKENS,
    )
    return Qwen2_5_VLForConditionalGeneration(cfg)


def build_qwen2_vl(seed: int = 0) -> nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2VLConfig(
        text_config=_TEXT,
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        **_TOKENS,
    )
    return Qwen2VLForConditionalGeneration(cfg)


def _qwen3_text(moe: bool) -> dict:
    t = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_id=0,
        bos_token_id=0,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
    )
    if moe:
        t.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    return t


_QWEN3_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0],
)


def build_qwen3_vl(seed: int = 0) -> nn.Module | None:
    try:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    except ImportError:
        return None
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(text_config=_qwen3_text(False), vision_config=_QWEN3_VISION, **_TOKENS)
    )


def build_qwen3_vl_moe(seed: int = 0) -> nn.Module | None:
    try:
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    except ImportError:
        return None
    torch.manual_seed(seed)
    return Qwen3VLMoeForConditionalGeneration(
        Qwen3VLMoeConfig(text_config=_qwen3_text(True), vision_config=_QWEN3_VISION, **_TOKENS)
    )


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


Pattern = Callable[[int, int, int], bool]  # (step, micro, rank) -> has image


def train_ddp(
    pattern: Pattern,
    *,
    fix: bool,
    steps: int,
    ga: int = 1,
    static_graph: bool = False,
    find_unused: bool | None = None,
    dropout: float = 0.1,
    snapshot_after: int | None = None,
    family: str = "qwen2_5_vl",
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Train a LoRA VLM (``BUILDERS[family]``) under DDP; ``fix`` = stabiliser + fu=False, else stock
    fu=True. Returns (final trainable weights, vision weights after ``snapshot_after`` steps)."""
    rank = dist.get_rank()
    model = add_lora(BUILDERS[family](0), dropout)
    stab = VisionStabilizer(model).attach() if fix else None
    fu = (not fix) if find_unused is None else find_unused
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=fu, static_graph=static_graph)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    vis = set(vision_param_names(model))
    snap: dict[str, torch.Tensor] = {}
    torch.manual_seed(1234 + rank)  # LoRA dropout stream, identical in stock and fixed runs
    for step in range(steps):
        if snapshot_after == step:
            snap = {n: p.detach().clone() for n, p in model.named_parameters() if n in vis}
        for micro in range(ga):
            batch = make_batch(pattern(step, micro, rank), 1000 * step + 10 * micro + rank, PATCH_DIM[family])
            ctx = ddp.no_sync() if micro < ga - 1 else contextlib.nullcontext()
            with ctx:
                (ddp(**batch).loss / ga).backward()
        if stab is not None:
            stab.finalize_vision_grads()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if snapshot_after == steps:
        snap = {n: p.detach().clone() for n, p in model.named_parameters() if n in vis}
    if stab is not None:
        stab.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, snap


def digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for n in sorted(weights):
        h.update(n.encode())
        h.update(weights[n].float().numpy().tobytes())
    return h.hexdigest()[:16]


def assert_same_across_ranks(weights: dict[str, torch.Tensor], what: str) -> None:
    out: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, digest(weights))
    assert len(set(out)) == 1, f"{what}: replicas differ: {out}"


def assert_equal(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, atol: float = 0.0
) -> None:
    assert a.keys() == b.keys(), what
    bad = []
    for n in a:
        if atol == 0.0:
            if not torch.equal(a[n], b[n]):
                bad.append((n, (a[n] - b[n]).abs().max().item()))
        elif not torch.allclose(a[n], b[n], atol=atol, rtol=0):
            bad.append((n, (a[n] - b[n]).abs().max().item()))
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[rank {rank} {time.time() - t0:5.1f}s] {msg}", flush=True)

    # (a) rank 0 always has images, rank 1 never.
    mixed: Pattern = lambda s, m, r: r == 0  # noqa: E731
    stock, _ = train_ddp(mixed, fix=False, steps=4)
    fixed, _ = train_ddp(mixed, fix=True, steps=4)
    assert_equal(stock, fixed, "(a) mixed ranks: stabiliser+fu=False vs stock fu=True")
    assert_same_across_ranks(fixed, "(a)")
    log("(a) mixed ranks: bit-equal to stock fu=True, replicas in sync")

    # (b) no rank has images for 3 steps, then images (rank 0 at step 3, both at step 4).
    late: Pattern = lambda s, m, r: s >= 4 or (s == 3 and r == 0)  # noqa: E731
    stock_b, stock_snap = train_ddp(late, fix=False, steps=5, snapshot_after=3)
    fixed_b, fixed_snap = train_ddp(late, fix=True, steps=5, snapshot_after=3)
    init = {
        n: p.detach().clone() for n, p in add_lora(build_qwen2_5_vl(0)).named_parameters() if n in fixed_snap
    }
    assert_equal(init, fixed_snap, "(b) vision params untouched while no rank saw an image")
    assert_equal(stock_snap, fixed_snap, "(b) snapshot vs stock")
    assert_equal(stock_b, fixed_b, "(b) images late: stabiliser vs stock fu=True")
    assert_same_across_ranks(fixed_b, "(b)")
    log("(b) images late: vision untouched while imageless, bit-equal to stock")

    # (c) static_graph=True + stabiliser, same two data patterns.
    static_a, _ = train_ddp(mixed, fix=True, steps=4, static_graph=True)
    assert_equal(stock, static_a, "(c) static_graph mixed vs stock fu=True")
    static_b, _ = train_ddp(late, fix=True, steps=5, static_graph=True)
    assert_equal(stock_b, static_b, "(c) static_graph images-late vs stock fu=True")
    assert_same_across_ranks(static_b, "(c)")
    log("(c) static_graph=True: bit-equal to stock fu=True")

    # (ga) gradient accumulation (no_sync): images in a no_sync micro-batch only, steps with none.
    table = {  # step -> {rank: [micro0, micro1]}
        0: {0: [True, False], 1: [False, False]},
        1: {0: [False, False], 1: [False, False]},
        2: {0: [False, True], 1: [True, False]},
        3: {0: [False, False], 1: [True, True]},
    }
    ga_pat: Pattern = lambda s, m, r: table[s][r][m]  # noqa: E731
    stock_ga, _ = train_ddp(ga_pat, fix=False, steps=4, ga=2)
    fixed_ga, _ = train_ddp(ga_pat, fix=True, steps=4, ga=2)
    assert_equal(stock_ga, fixed_ga, "(ga) grad accumulation vs stock fu=True")
    assert_same_across_ranks(fixed_ga, "(ga)")
    log("(ga) gradient accumulation with no_sync: bit-equal to stock fu=True")

    # (qwen3) Qwen3-VL: deepstack features tied to decoder layers; mixed ranks and an imageless step.
    if BUILDERS["qwen3_vl"](0) is not None:
        q3: Pattern = lambda s, m, r: {0: r == 0, 1: False, 2: r == 1}[s]  # noqa: E731
        stock_q3, _ = train_ddp(q3, fix=False, steps=3, family="qwen3_vl")
        fixed_q3, _ = train_ddp(q3, fix=True, steps=3, family="qwen3_vl")
        assert_equal(stock_q3, fixed_q3, "(qwen3) Qwen3-VL vs stock fu=True")
        assert_same_across_ranks(fixed_q3, "(qwen3)")
        log("(qwen3) Qwen3-VL mixed/imageless: bit-equal to stock fu=True")

    dist.barrier()
    log("VLM_DDP_OK")
    gc.collect()  # free DDP/FSDP state before the process group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
