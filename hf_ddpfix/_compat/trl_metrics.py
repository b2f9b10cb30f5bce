"""TRL's private metric state, by name (part of :mod:`hf_ddpfix._compat`).

TRL's trainers log statistics they compute inside ``compute_loss`` into private instance attributes: ``_metrics``
(``{"train" | "eval": {name: [values]}}``, every trainer), ``_stored_metrics`` (DPO / KTO / CPO / ORPO through
``store_metrics``) and ``_total_train_tokens`` (SFT's ``num_tokens``). The sequence-parallel metric replay
(``integrations/sequence_parallel/metrics.py``) snapshots and restores them around its extra ``compute_loss``
calls; it reads them only here, by the names :data:`TRL_METRIC_STATE` lists for the installed TRL release.

Guarantees: :func:`trl_metric_state` returns only the attributes :func:`trl_metric_names` names that the trainer has,
and :func:`restore_trl_metric_state` writes only those (dicts and lists in place); on every TRL release CI installs,
a TRL trainer's ``compute_loss`` changes no private attribute of the trainer outside that list
(tests/test_upstream_contracts.py::test_trl_metric_state_is_the_named_list).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TRL_METRIC_STATE", "put_back", "restore_trl_metric_state", "trl_metric_names", "trl_metric_state"]

#: TRL release (major, minor) from which the names apply -> the private attributes its trainers log metrics in
#: from ``compute_loss`` (read in trl/trainer/*.py and trl/experimental/*/*.py of each release).
TRL_METRIC_STATE: dict[tuple[int, int], tuple[str, ...]] = {
    (0, 24): ("_metrics", "_stored_metrics", "_total_train_tokens"),  # the oldest supported (constraints-oldest.txt)
    (1, 16): ("_metrics", "_stored_metrics", "_total_train_tokens"),  # pinned and newest (constraints.txt)
}


def trl_metric_names(version: str | None = None) -> tuple[str, ...]:
    """The names for TRL ``version`` (default: the installed one; none installed: ``()``): the entry of the newest
    listed release at or below it (an older one: the oldest entry's)."""
    if version is None:
        try:
            from importlib.metadata import PackageNotFoundError
            from importlib.metadata import version as installed
        except ImportError:  # pragma: no cover
            return ()
        try:
            version = installed("trl")
        except PackageNotFoundError:
            return ()
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:2]]
    key = (parts[0], parts[1] if len(parts) > 1 else 0)
    listed = sorted(TRL_METRIC_STATE)
    at_or_below = [v for v in listed if v <= key]
    return TRL_METRIC_STATE[at_or_below[-1] if at_or_below else listed[0]]


def trl_metric_state(trainer: Any) -> dict[str, Any]:
    """The named private metric attributes ``trainer`` has (the objects themselves, not copies)."""
    own = vars(trainer) if hasattr(trainer, "__dict__") else {}
    return {name: own[name] for name in trl_metric_names() if name in own}


def restore_trl_metric_state(trainer: Any, saved: dict[str, Any]) -> None:
    """Put back the named attributes from ``saved`` (dicts and lists in place, so a reference TRL holds stays valid);
    any other name in ``saved`` is refused (ValueError)."""
    names = set(trl_metric_names())
    unknown = set(saved) - names
    if unknown:
        raise ValueError(f"restore_trl_metric_state: {sorted(unknown)} are not TRL metric state ({sorted(names)})")
    for name, value in saved.items():
        put_back(trainer, name, value)


def put_back(obj: Any, name: str, value: Any) -> None:
    """Set ``obj.name`` to ``value``; a dict or list already there is refilled in place, so a reference the
    trainer (or TRL) holds to it stays valid."""
    current = vars(obj).get(name)
    if isinstance(current, dict) and isinstance(value, dict):
        current.clear()
        current.update(value)
    elif isinstance(current, list) and isinstance(value, list):
        current[:] = value
    else:
        setattr(obj, name, value)
