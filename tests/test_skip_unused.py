"""Stock DDP's optimizer semantics over flat partitions (hf_ddpfix/ops/skip_unused.py), one process: a flat
AdamW over concatenated parameters with :class:`SkipUnusedSteps` against per-parameter ``torch.optim.AdamW``
whose skipped parameters get ``grad=None`` (what stock DDP with find_unused_parameters=True hands it)."""

from __future__ import annotations

import pytest
import torch

from hf_ddpfix.ops.skip_unused import FlatSlice, SkipUnusedSteps, adam_update_, unsupported_reason

SHAPES = [(4, 3), (5,), (2, 2)]
# which parameters some rank used in each optimizer step: skipped steps before and after use, a parameter
# used again after two skipped steps (bias correction with its own count), one skipped at the first step
MASKS = [(0, 1), (0, 2), (0,), (0, 1, 2), (1,), (), (0, 1, 2), (2,)]


def _run(kind: str, fused: bool, decoupled: bool = True):
    """Train 8 steps; returns per-parameter weights and moments."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in MASKS]
    opt_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    kw = dict(lr=1e-2, weight_decay=0.1, fused=fused)
    if kind == "ddp":
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = opt_cls(params, **kw)
        for step, used in enumerate(MASKS):
            for i, p in enumerate(params):
                p.grad = grads[step][i].clone() if i in used else None
            opt.step()
        moments = [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) if p in opt.state else
                   (torch.zeros_like(p), torch.zeros_like(p)) for p in params]
        return [p.detach() for p in params], moments
    # two flat tensors, parameter 1 split across them (a ZeRO partition boundary)
    full = torch.cat([t.flatten() for t in init])
    cut = 12 + 2
    flats = [torch.nn.Parameter(full[:cut].clone()), torch.nn.Parameter(full[cut:].clone())]
    opt = opt_cls(flats, **kw)
    slices = [FlatSlice(0, flats[0], 0, 12), FlatSlice(1, flats[0], 12, 2), FlatSlice(1, flats[1], 0, 3),
              FlatSlice(2, flats[1], 3, 4)]
    skip = SkipUnusedSteps(opt, slices, 3) if kind == "flat_fixed" else None
    for step, used in enumerate(MASKS):
        flat_grad = torch.cat([(grads[step][i] if i in used else torch.zeros(s)).flatten()
                               for i, s in enumerate(SHAPES)])
        flats[0].grad, flats[1].grad = flat_grad[:cut].clone(), flat_grad[cut:].clone()
        if skip is not None:
            mask = torch.tensor([i in used for i in range(3)])
            skip.before_step(skip.stepped_flats(), mask)
        opt.step()
        if skip is not None:
            skip.after_step()
    whole = torch.cat([f.detach() for f in flats])
    m = torch.cat([opt.state[f]["exp_avg"] for f in flats])
    v = torch.cat([opt.state[f]["exp_avg_sq"] for f in flats])
    out, moments, at = [], [], 0
    for s in SHAPES:
        n = torch.Size(s).numel()
        out.append(whole[at:at + n].view(s))
        moments.append((m[at:at + n].view(s), v[at:at + n].view(s)))
        at += n
    return out, moments


def _gap(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("decoupled", [True, False])
def test_flat_adamw_with_restores_equals_per_parameter_adamw_skipping_unused(fused, decoupled):
    ref_w, ref_m = _run("ddp", fused, decoupled)
    got_w, got_m = _run("flat_fixed", fused, decoupled)
    assert _gap(got_w, ref_w) <= 1e-6
    assert _gap([m for m, _ in got_m], [m for m, _ in ref_m]) <= 1e-7
    assert _gap([v for _, v in got_m], [v for _, v in ref_m]) <= 1e-7
    # without it: weight decay, momentum and the shared step count move what DDP leaves (the test can fail)
    stock_w, _ = _run("flat", fused, decoupled)
    assert _gap(stock_w, ref_w) > 1e-3


def test_counts_what_it_restored_and_recomputed():
    p = torch.nn.Parameter(torch.ones(6))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.1)
    skip = SkipUnusedSteps(opt, [FlatSlice(0, p, 0, 4), FlatSlice(1, p, 4, 2)], 2)
    for used in ((True, False), (True, True)):
        p.grad = torch.ones(6)
        skip.before_step(skip.stepped_flats(), torch.tensor(used))
        opt.step()
        skip.after_step()
    assert skip.restored_elements == 2 and skip.recomputed_elements == 2 and skip.skipped.tolist() == [0, 1]
    assert skip.steps == 2


def test_optimizers_other_than_adam_are_refused_with_the_reason():
    p = torch.nn.Parameter(torch.ones(2))
    assert unsupported_reason(torch.optim.AdamW([p])) is None
    assert "SGD is not torch.optim.Adam/AdamW" in unsupported_reason(torch.optim.SGD([p], lr=1.0))
    assert "amsgrad" in unsupported_reason(torch.optim.AdamW([p], amsgrad=True))
    with pytest.raises(ValueError, match="SGD"):
        SkipUnusedSteps(torch.optim.SGD([p], lr=1.0), [], 1)


def test_adam_update_is_torch_adamw_step():
    g = torch.Generator().manual_seed(1)
    p0, grad = torch.randn(7, generator=g), torch.randn(7, generator=g)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    ref.grad = grad
    opt.step()
    got = p0.clone()
    st = opt.state[ref]
    adam_update_(got, st["exp_avg"], st["exp_avg_sq"], step=1.0, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.1, decoupled=True)
    assert torch.equal(got, ref.detach())
