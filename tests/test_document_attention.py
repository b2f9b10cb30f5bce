"""ops/document_attention.py: masks read into blocks exactly, anything else refused; outputs equal sdpa."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_ddpfix.ops.document_attention import document_attention, mask_blocks


def _causal(s):
    return torch.ones(s, s, dtype=torch.bool).tril()


def _packed(lengths):
    s = sum(lengths)
    m = torch.zeros(s, s, dtype=torch.bool)
    start = 0
    for n in lengths:
        m[start:start + n, start:start + n] = _causal(n)
        start += n
    return m


def _right_padded(s, real):
    m = _causal(s)
    m[:, real:] = False
    return m


def test_packed_and_right_padded_rows_become_blocks_and_equal_masked_sdpa():
    s = 12
    mask = torch.stack([_packed([5, 7]), _right_padded(s, 8)])[:, None]
    blocks = mask_blocks(mask)
    assert blocks == [[(0, 5, 0, 5, True), (5, 12, 5, 12, True)], [(0, 8, 0, 8, True), (8, 12, 0, 8, False)]]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    got = document_attention(q, k, v, blocks, scale=0.3)
    torch.testing.assert_close(got, ref)
    w = torch.randn_like(ref)
    gr = torch.autograd.grad((ref * w).sum(), (q, k, v))
    gg = torch.autograd.grad((got * w).sum(), (q, k, v))
    for a, b in zip(gg, gr, strict=True):
        torch.testing.assert_close(a, b)


def test_other_masks_are_refused_and_windows_stay_exact():
    s = 10
    left = _causal(s)
    left[:3, :] = False  # left padding as a query that sees nothing
    holes = _causal(s)
    holes[7, 2] = False  # a query whose keys are not one interval
    assert mask_blocks(left[None, None]) is None
    assert mask_blocks(holes[None, None]) is None
    assert mask_blocks(_causal(s)[None, None].float()) is None  # additive float masks: not read
    # A sliding window (3 keys): each query's keys are still one interval, one block per query; exact.
    window = (_causal(s) & ~torch.ones(s, s, dtype=torch.bool).tril(-3))[None, None]
    blocks = mask_blocks(window)
    assert blocks is not None and len(blocks[0]) == s - 2
    q, k, v = (torch.randn(1, 2, s, 4, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(document_attention(q, k, v, blocks, scale=0.5),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=window, scale=0.5))
    # Past MAX_BLOCKS_PER_ROW blocks a row is refused (one kernel call per block would cost too much).
    n = 300
    long_window = (_causal(n) & ~torch.ones(n, n, dtype=torch.bool).tril(-3))[None, None]
    assert mask_blocks(long_window) is None
