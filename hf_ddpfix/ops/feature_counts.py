"""What each hf_ddpfix feature actually did in this process: calls that ran patched, fallbacks with their
reason, and amounts (bytes, ties, dummies).

Contract:
- One process-wide table, keyed by feature name (``"long_context"``, ``"tiled_mlp"``, ``"tiled_loss"``,
  ``"offload"``, ``"parameter_usage"``, ``"stabilizer"``, ``"sequence_parallel"``, ...). Writers call
  :func:`record_ran`, :func:`record_fallback` and :func:`record_amount` at the point where the feature
  really ran or stood down (inside the patched forward, not where the patch was installed).
- Readers take :func:`snapshot` (a deep copy) or :func:`as_metrics` (flat ``hf_ddpfix/<feature>/<key>``
  integers, the form the Trainer's metrics carry). :func:`reset` clears the table (tests, a new ``train()``).
- Pure Python, thread-safe (one lock); no torch, no transformers. Counting never changes what a feature
  computes. :func:`add_fallback_listener` lets the run operator see each fallback as it is recorded (to
  warn once, or raise in strict mode); a listener's exception propagates to the feature's call site.

Guarantees: ``snapshot()[f]["ran"]`` is the number of :func:`record_ran` calls' ``n`` since the last reset;
``snapshot()[f]["fallbacks"][reason]`` likewise per reason (tested in ``tests/test_feature_counts.py``).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FeatureCount", "add_fallback_listener", "as_metrics", "record_amount", "record_fallback", "record_ran",
           "reset", "snapshot"]


@dataclass
class FeatureCount:
    """Counters of one feature: ``ran`` patched calls, ``fallbacks`` per reason, named ``amounts``."""

    ran: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    amounts: dict[str, int] = field(default_factory=dict)

    @property
    def fell_back(self) -> int:
        """All fallbacks, whatever the reason."""
        return sum(self.fallbacks.values())

    def as_dict(self) -> dict[str, Any]:
        return {"ran": self.ran, "fell_back": self.fell_back, "fallbacks": dict(self.fallbacks),
                "amounts": dict(self.amounts)}


_LOCK = threading.Lock()
_TABLE: dict[str, FeatureCount] = {}
_LISTENERS: list[Callable[[str, str], None]] = []


def _entry(feature: str) -> FeatureCount:
    got = _TABLE.get(feature)
    if got is None:
        got = _TABLE[feature] = FeatureCount()
    return got


def record_ran(feature: str, n: int = 1) -> None:
    """``feature`` ran its own (patched) code ``n`` more times."""
    with _LOCK:
        _entry(feature).ran += n


def record_fallback(feature: str, reason: str, n: int = 1) -> None:
    """``feature`` was asked for but ran stock code ``n`` more times, because of ``reason`` (a short,
    stable sentence: the same cause must give the same string, so counts add up per cause)."""
    with _LOCK:
        fb = _entry(feature).fallbacks
        fb[reason] = fb.get(reason, 0) + n
        listeners = list(_LISTENERS)
    for listener in listeners:  # outside the lock: a listener may read the table, log or raise
        listener(feature, reason)


def add_fallback_listener(listener: Callable[[str, str], None]) -> Callable[[], None]:
    """Call ``listener(feature, reason)`` after every :func:`record_fallback`; returns its remover
    (safe to call twice). Listeners are not cleared by :func:`reset`."""
    with _LOCK:
        _LISTENERS.append(listener)

    def remove() -> None:
        with _LOCK:
            if listener in _LISTENERS:
                _LISTENERS.remove(listener)

    return remove


def record_amount(feature: str, name: str, n: int) -> None:
    """Add ``n`` to the named amount of ``feature`` (bytes copied, ties made, dummies run...)."""
    with _LOCK:
        am = _entry(feature).amounts
        am[name] = am.get(name, 0) + int(n)


def snapshot() -> dict[str, FeatureCount]:
    """A deep copy of the table (safe to keep while features go on counting)."""
    with _LOCK:
        return copy.deepcopy(_TABLE)


def reset() -> None:
    """Forget every count."""
    with _LOCK:
        _TABLE.clear()


def as_metrics(prefix: str = "hf_ddpfix/", counts: dict[str, FeatureCount] | None = None) -> dict[str, int]:
    """Flat integer metrics: ``<prefix><feature>/ran``, ``<prefix><feature>/fell_back`` and
    ``<prefix><feature>/<amount>`` for every counted feature (sorted), from ``counts`` or the live table."""
    table = snapshot() if counts is None else counts
    out: dict[str, int] = {}
    for feature in sorted(table):
        c = table[feature]
        out[f"{prefix}{feature}/ran"] = c.ran
        out[f"{prefix}{feature}/fell_back"] = c.fell_back
        for name in sorted(c.amounts):
            out[f"{prefix}{feature}/{name}"] = c.amounts[name]
    return out
