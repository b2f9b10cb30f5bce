"""Parsers of one setting's value (an argument, an `HF_DDPFIX_*` / `UNSLOTH_*` variable): each names the setting,
the bad value and the allowed values in its error.

Guarantees: `None` means unset everywhere; a value that is not allowed raises `ValueError` naming the setting
(tests/test_config.py).
"""

from __future__ import annotations

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_BOOL_ALLOWED = "1/true/yes/on or 0/false/no/off"
_AUTO = ("", "auto")


def parse_bool(name: str, value: str | bool | None, *, allow_auto: bool = False) -> bool | None:
    """Parse a boolean setting. `None` (and "auto" when `allow_auto`) mean unset.

    Raises:
        ValueError: naming `name`, the value and the allowed spellings.
    """
    if value is None or isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if allow_auto and v in _AUTO:
        return None
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    allowed = _BOOL_ALLOWED + (" or auto" if allow_auto else "")
    raise ValueError(f"{name}={value!r} is not a recognised value; allowed: {allowed}")


def parse_choice(name: str, value: str | None, choices: tuple[str, ...]) -> str | None:
    """Parse a choice setting (case-insensitive, `-` and `_` alike). `None` means unset."""
    if value is None:
        return None
    v = str(value).strip().lower().replace("-", "_")
    if v in choices:
        return v
    raise ValueError(f"{name}={value!r} is not a recognised value; allowed: {', '.join(choices)}")


def parse_positive_int(name: str, value: str | int | None, *, allow_zero: bool = False) -> int | None:
    """Parse a non-negative (or positive) integer setting. `None` means unset."""
    if value is None:
        return None
    try:
        n = int(str(value).strip()) if not isinstance(value, int) or isinstance(value, bool) else value
    except ValueError:
        n = None
    if isinstance(value, bool) or n is None or n < (0 if allow_zero else 1):
        low = 0 if allow_zero else 1
        raise ValueError(f"{name}={value!r} is not a recognised value; allowed: an integer >= {low}")
    return n


def parse_str(name: str, value: str | None) -> str | None:
    """A free-form setting validated later by the feature that owns it (e.g. tiling specs)."""
    if value is None:
        return None
    v = str(value).strip()
    return v or None
