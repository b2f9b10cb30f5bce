"""Moved to :mod:`hf_ddpfix.integrations.usage.hang_guard`; this name stays so existing imports keep working."""

from .usage.hang_guard import *  # noqa: F403
from .usage.hang_guard import HangGuard, UnusedParametersError, __all__, _usage_error  # noqa: F401
