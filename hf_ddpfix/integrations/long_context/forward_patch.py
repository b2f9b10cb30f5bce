"""Undoing a forward patch of the long-context features: :func:`restore_forward`.

The long-context patches (long_context.py's layer and norm forwards, tiled_mlp.py's tiled MLP forward,
loss_patch.py's tiled-loss forward) install a callable wrapper as the module's *instance* attribute
``forward``; each wrapper keeps the instance attribute it replaced in ``prev`` (``None`` when the module had
none and its class's ``forward`` ran).

Guarantees: after :func:`restore_forward` returns True the module's instance ``forward`` is exactly what it
was before the wrapper (absent when it was absent) and its ``marker`` attribute is gone; a module whose
``forward`` is not one of ``wrappers`` is left untouched (False).
"""

from __future__ import annotations

from torch import nn

__all__ = ["restore_forward"]


def restore_forward(module: nn.Module, wrappers: type | tuple[type, ...], marker: str | None = None) -> bool:
    """Put back the forward that a wrapper of type ``wrappers`` replaced on ``module`` (and drop the
    ``marker`` instance attribute the patch set); returns whether there was one to remove."""
    fwd = module.__dict__.get("forward")
    if not isinstance(fwd, wrappers):
        return False
    if fwd.prev is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = fwd.prev
    if marker is not None:
        module.__dict__.pop(marker, None)
    return True
