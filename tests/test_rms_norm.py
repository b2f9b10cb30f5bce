"""rms_norm equals Llama's RMSNorm bit for bit (output, input grad), saves only input + fp32 rstd."""

from __future__ import annotations

import pytest
import torch

from hf_ddpfix.ops.rms_norm import rms_norm


class _StockRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm forward, verbatim (no transformers import in ops tests)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _run(fn, x, g):
    x = x.detach().requires_grad_()
    y = fn(x)
    y.backward(g)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [1, 5, 4096])
@pytest.mark.parametrize("weight_grad", [False, True])
def test_bit_identical_to_stock(dtype, chunk, weight_grad):
    torch.manual_seed(0)
    m = _StockRMSNorm(48, 1e-6).to(dtype)
    m.weight.requires_grad_(weight_grad)
    x = (torch.randn(3, 17, 48) * 4).to(dtype)
    g = torch.randn(3, 17, 48).to(dtype)
    y0, gx0 = _run(m, x, g)
    gw0 = m.weight.grad
    m.weight.grad = None
    y1, gx1 = _run(lambda t: rms_norm(t, m.weight, m.variance_epsilon, chunk_tokens=chunk), x, g)
    assert y0.dtype == y1.dtype and torch.equal(y0, y1)
    assert torch.equal(gx0, gx1)
    if weight_grad:
        if chunk >= 51:  # one chunk: the same single reduction as stock
            assert torch.equal(gw0, m.weight.grad)
        else:
            torch.testing.assert_close(m.weight.grad.float(), gw0.float(), rtol=1e-2, atol=1e-2)


class _StockGemmaRMSNorm(torch.nn.Module):
    """transformers' Gemma3RMSNorm forward, verbatim: (1 + w) multiplied in fp32 before the cast."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.randn(hidden) * 0.3)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk", [5, 4096])
def test_unit_offset_form_is_bit_identical_to_gemma(dtype, chunk):
    torch.manual_seed(0)
    m = _StockGemmaRMSNorm(48, 1e-6).to(dtype)
    x = (torch.randn(3, 17, 48) * 4).to(dtype)
    g = torch.randn(3, 17, 48).to(dtype)
    y0, gx0 = _run(m, x, g)
    gw0 = m.weight.grad
    m.weight.grad = None
    y1, gx1 = _run(lambda t: rms_norm(t, m.weight, m.eps, chunk_tokens=chunk, unit_offset=True), x, g)
    assert y0.dtype == y1.dtype and torch.equal(y0, y1)
    assert torch.equal(gx0, gx1)
    if chunk >= 51:  # one chunk: the same single fp32 reduction as stock
        assert torch.equal(gw0, m.weight.grad)
    else:
        torch.testing.assert_close(m.weight.grad.float(), gw0.float(), rtol=1e-2, atol=1e-2)
    # Llama's form is not Gemma's: the check that tells the two apart can fail
    assert not torch.equal(rms_norm(x, m.weight, m.eps), y0)


def test_weight_grad_in_fp64_across_chunks():
    torch.manual_seed(1)
    m = _StockRMSNorm(32, 1e-5).double()
    x, g = torch.randn(2, 29, 32, dtype=torch.float64), torch.randn(2, 29, 32, dtype=torch.float64)
    _run(m, x, g)
    gw0 = m.weight.grad
    m.weight.grad = None
    _run(lambda t: rms_norm(t, m.weight, m.variance_epsilon, chunk_tokens=7), x, g)
    torch.testing.assert_close(m.weight.grad, gw0, rtol=1e-12, atol=1e-12)


def test_saves_the_input_and_a_per_token_fp32_scale_only():
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(64, dtype=torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rms_norm(x, w, 1e-6)
    kinds = sorted((tuple(t.shape), t.dtype) for t in saved)
    assert kinds == sorted([((4, 64), torch.bfloat16), ((64,), torch.bfloat16), ((4, 1), torch.float32)])
    assert any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved)


def test_bad_arguments():
    with pytest.raises(ValueError, match="chunk_tokens"):
        rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6, chunk_tokens=0)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.randn(2, 4), torch.ones(5), 1e-6)
