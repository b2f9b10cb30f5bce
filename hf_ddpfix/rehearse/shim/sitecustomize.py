"""The rehearsal's start-up hook: ``hf-ddpfix rehearse`` puts this folder first on ``PYTHONPATH`` of the launch.

It installs :mod:`hf_ddpfix.rehearse.inject` (import hooks only; nothing heavy is imported here) and then runs the
next ``sitecustomize`` on ``sys.path`` (the FSDP device's, then ``patches/`` if the launch has it, then a
distribution's own), because Python imports only the first one it finds.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.normcase(os.path.realpath(os.path.dirname(os.path.abspath(__file__))))


def _install() -> None:
    try:
        from hf_ddpfix.rehearse.inject import install
    except ImportError:  # the package root is two folders up
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))
        from hf_ddpfix.rehearse.inject import install
    install()


def _chain_next_sitecustomize() -> None:
    """Once per process: a hook later on the path that chains back to this one (patches/ does) stops here."""
    if getattr(sys, "_hf_ddpfix_rehearse_chained", False):
        return
    sys._hf_ddpfix_rehearse_chained = True
    paths = [os.path.normcase(os.path.realpath(p or os.getcwd())) for p in sys.path]
    rest = sys.path[paths.index(_HERE) + 1:] if _HERE in paths else sys.path
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_hf_ddpfix_rehearse_next_sitecustomize"] = module
    spec.loader.exec_module(module)


_install()
_chain_next_sitecustomize()
