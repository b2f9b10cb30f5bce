"""The attach-time proof that a dummy image contributes exactly zero (issue 45), for
:meth:`~hf_ddpfix.integrations.vision.adapter.VisionAdapter.verify`: the dummy's features tied into a probe with
:class:`~hf_ddpfix.ops.zero_tie.ZeroTie` as the stabilisers tie them, back-propagated with ``torch.autograd.grad``
(never into ``.grad``), every trainable gradient exactly zero. Takes the adapter as its argument (no import of it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...ops.zero_tie import ZeroTie

__all__ = ["eval_mode", "prove_zero"]


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _input_embedding(root: nn.Module) -> nn.Module | None:
    get_emb = getattr(root, "get_input_embeddings", None)
    try:
        emb = get_emb() if callable(get_emb) else None
    except (AttributeError, NotImplementedError):
        return None
    return emb if isinstance(emb, nn.Module) else None


@contextlib.contextmanager
def eval_mode(modules: list[nn.Module]) -> Iterator[None]:
    """Every module of ``modules`` (and below) in eval mode for the block; each one's own flag restored after."""
    flags = [(m, m.training) for top in modules for m in top.modules()]
    for m, _ in flags:
        m.training = False
    try:
        yield
    finally:
        for m, was in flags:
            m.training = was


def prove_zero(adapter: Any) -> str:
    """The zero proof of :meth:`~hf_ddpfix.integrations.vision.adapter.VisionAdapter.verify` for ``adapter`` (a
    ``VisionAdapter`` whose parameters are materialized): ``""`` when it holds, else why not. Sets
    :attr:`unreached` and :attr:`reached` (a module outside the tower and the projector whose trainable
    parameters the dummy reaches: its ancestor at the tower's depth, e.g. a projector named ``projector``, joins
    :meth:`parts`, so the step-end reset covers it; one holding the tower or the input embedding refuses)."""
    inside = {id(p) for _, m in adapter.parts() for p in m.parameters()}
    named = [(n, p) for n, p in adapter.root.named_parameters() if p.requires_grad]
    if not any(id(p) in inside for _, p in named):
        return ""
    with eval_mode([adapter.root]), torch.enable_grad():
        out = adapter.run_dummy()
        feats = [t for _, ts in adapter.tie_points(out) for t in ts if t.requires_grad]
        if not feats:
            return (f"{adapter.family.name}: the dummy's image features carry no gradient to the tower's trainable "
                    "tensors")
        probe = torch.linspace(-1.0, 1.0, 7, device=feats[0].device).requires_grad_(True)
        tied = ZeroTie.apply(probe, *feats)
        grads = torch.autograd.grad(tied, [p for _, p in named], grad_outputs=torch.ones_like(tied),
                                    allow_unused=True)
    if not torch.equal(tied.detach(), probe.detach()):
        return f"{adapter.family.name}: the tie changed the value it carries"
    bad = [n for (n, _), g in zip(named, grads, strict=True) if g is not None and bool((g != 0).any())]
    if bad:
        return (f"{adapter.family.name}: the dummy's gradients are not exactly zero ({len(bad)} tensors, e.g. "
                f"{bad[0]}: NaN or a non-zero term): no dummy")
    adapter.unreached = tuple(n for (n, p), g in zip(named, grads, strict=True) if g is None and id(p) in inside)
    depth = adapter.tower_name.count(".") + 1
    blocked = [adapter.tower] + [m for m in (_input_embedding(adapter.root),) if m is not None]
    for (n, p), g in zip(named, grads, strict=True):
        if g is None or id(p) in inside:
            continue
        path = ".".join(n.split(".")[:depth])
        mod = _submodule(adapter.root, path)
        if mod is None or path == n or any(b is mod or any(b is x for x in mod.modules()) for b in blocked):
            return (f"{adapter.family.name}: the dummy reaches {n}, outside the tower, in a module holding the "
                    "tower or the input embedding: no dummy")
        if all(mod is not m for _, m in adapter.parts()):
            adapter.reached.append((path, mod))
        inside |= {id(q) for q in mod.parameters()}
    return ""
