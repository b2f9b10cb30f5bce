"""tiled_token_map: several inputs/outputs, explicit parameters, one gradient per parameter, RNG replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_ddpfix.ops.token_tiles import tiled_token_map, tiles_for


class _Block(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 6)
        self.frozen = nn.Linear(6, 3)
        self.frozen.requires_grad_(False)
        self.drop = nn.Dropout(dropout)

    def fn(self, x, c):
        h = self.drop(torch.tanh(self.a(x))) * c[:, :1]
        return self.b(h) + x, self.frozen(x)


def _grads(block, x, c, g1, g2, tiles):
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    if tiles is None:
        y1, y2 = block.fn(x, c)
    else:
        y1, y2 = tiled_token_map(block.fn, (x, c), block, tiles=tiles)
    ((y1 * g1).sum() + (y2 * g2).sum()).backward()
    return (y1.detach(), y2.detach(), x.grad, *[p.grad for p in block.parameters() if p.requires_grad])


@pytest.mark.parametrize("tiles", [1, 2, 4, 7, 100])
def test_matches_untiled_in_fp64(tiles):
    torch.manual_seed(0)
    block = _Block().double()
    x, c = torch.randn(23, 6, dtype=torch.float64), torch.rand(23, 2, dtype=torch.float64)
    g1, g2 = torch.randn(23, 6, dtype=torch.float64), torch.randn(23, 3, dtype=torch.float64)
    ref = _grads(block, x, c, g1, g2, None)
    got = _grads(block, x, c, g1, g2, tiles)
    for a, r in zip(got, ref, strict=True):
        if tiles == 1:
            assert torch.equal(a, r)
        else:
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_one_accumulate_grad_per_parameter_and_none_grad_output():
    block = _Block()
    calls = []
    for p in block.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda t: calls.append(t))
    x = torch.randn(9, 6, requires_grad=True)
    y1, _ = tiled_token_map(block.fn, (x, torch.rand(9, 2)), block, tiles=4)
    y1.sum().backward()  # the second output gets no gradient
    assert len(calls) == 4  # a.weight, a.bias, b.weight, b.bias: once each


def test_dropout_masks_replayed():
    torch.manual_seed(3)
    block = _Block(dropout=0.5)
    x, c = torch.randn(16, 6), torch.rand(16, 2)
    g1, g2 = torch.randn(16, 6), torch.randn(16, 3)
    torch.manual_seed(7)
    one = _grads(block, x, c, g1, g2, 1)
    torch.manual_seed(7)
    ref = _grads(block, x, c, g1, g2, None)  # one tile consumes the RNG as the untiled call does
    for a, r in zip(one, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-6)
    # Four tiles: the backward must reuse the forward's masks. Reference: the same four slices run
    # one after another under plain autograd from the same seed (the same RNG consumption).
    torch.manual_seed(7)
    four = _grads(block, x, c, g1, g2, 4)
    block.zero_grad(set_to_none=True)
    xr = x.detach().requires_grad_()
    torch.manual_seed(7)
    outs = [block.fn(xr[s:s + 4], c[s:s + 4]) for s in range(0, 16, 4)]
    y1 = torch.cat([o[0] for o in outs])
    y2 = torch.cat([o[1] for o in outs])
    ((y1 * g1).sum() + (y2 * g2).sum()).backward()
    ref4 = (y1.detach(), y2.detach(), xr.grad, *[p.grad for p in block.parameters() if p.requires_grad])
    for a, r in zip(four, ref4, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    torch.manual_seed(8)
    other = _grads(block, x, c, g1, g2, 4)
    assert not torch.allclose(other[2], four[2])  # dropout is active: a replay with other masks would fail


def test_autocast_replayed_in_backward():
    block = _Block()
    x = torch.randn(8, 6, requires_grad=True)
    seen = []
    orig = block.fn

    def fn(x, c):
        seen.append(torch.is_autocast_enabled("cpu"))
        return orig(x, c)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = tiled_token_map(fn, (x, torch.rand(8, 2)), block, tiles=2)
    assert y2.dtype == torch.bfloat16  # a Linear under autocast
    y1.float().sum().backward()
    assert seen == [True] * 4  # 2 forward tiles, 2 backward tiles


def test_bad_arguments():
    block = _Block()
    with pytest.raises(ValueError, match="token counts"):
        tiled_token_map(block.fn, (torch.randn(3, 6), torch.rand(4, 2)), block, tiles=1)
    with pytest.raises(ValueError, match="tiles"):
        tiled_token_map(block.fn, (torch.randn(3, 6), torch.rand(3, 2)), block, tiles=0)
    with pytest.raises(ValueError, match="tokens_per_tile"):
        tiles_for(10, 0)
    assert tiles_for(10, 4) == 3 and tiles_for(0, 4) == 1
