"""grouped_flash_attention: the same outputs and gradients as one sdpa call, per KV-head group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_ddpfix.ops.grouped_attention import grouped_flash_attention, kv_groups_for


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("groups", ["auto", 1, 2, 3])
def test_equals_sdpa_exactly(dtype, groups):
    torch.manual_seed(0)
    b, s, hq, hk, d = 2, 41, 8, 4, 16
    q = torch.randn(b, s, hq, d, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hk, d, dtype=dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(b, s, hk, d, dtype=dtype).transpose(1, 2).requires_grad_()
    g = torch.randn(b, hq, s, d, dtype=dtype)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=True)
    ref_g = torch.autograd.grad(ref, (q, k, v), g)
    out = grouped_flash_attention(q, k, v, scale=d**-0.5, groups=groups)
    assert out is not None and torch.equal(out, ref)
    got_g = torch.autograd.grad(out, (q, k, v), g)
    for a, r in zip(got_g, ref_g, strict=True):
        assert torch.equal(a, r)
    # The output is a [B, S, H, D]-contiguous view: the o projection reads it without a copy.
    assert out.transpose(1, 2).is_contiguous()


def test_declines_what_it_does_not_handle():
    q = torch.randn(1, 6, 5, 8)
    assert grouped_flash_attention(q, torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8), scale=1.0) is None  # 6 % 4
    assert grouped_flash_attention(q, torch.randn(1, 3, 7, 8), torch.randn(1, 3, 7, 8), scale=1.0) is None  # lengths


def test_group_count_rule():
    assert kv_groups_for(8) == 8 and kv_groups_for(8, 3) == 2 and kv_groups_for(8, 100) == 8
    with pytest.raises(ValueError, match="groups"):
        kv_groups_for(8, 0)


def test_self_check_adds_nothing_to_the_callers_graph():
    """The one-time kernel self-check runs inside the first (checkpointed, offloaded) layer forward. Found
    on an H100 (2026-11-25): run in the caller's thread its saved tensors went into the checkpoint, the
    recompute (check cached) saved 7 fewer and torch raised CheckpointError. It must pack nothing there."""
    from hf_ddpfix.ops import grouped_attention as ga

    ga._CUDA_OK.clear()
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    packed: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        assert ga._cuda_checked(q, k, 2) is True  # the same check the CUDA path runs; exact on CPU
    assert packed == []
    ga._CUDA_OK.clear()
