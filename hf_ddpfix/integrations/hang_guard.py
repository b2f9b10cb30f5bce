"""Moved to :mod:`hf_ddpfix.integrations.usage.hang_guard`; this path stays importable as an alias of that module
(the same module object: attributes, private names and monkeypatches are shared)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module(".usage.hang_guard", __package__)
