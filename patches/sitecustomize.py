"""Zero-code hf_ddpfix: put this folder on `PYTHONPATH` and every `transformers.Trainer` (TRL's trainers
included) in the process runs under the hf_ddpfix plan, with no change to the training script.

    PYTHONPATH=/path/to/hf_ddpfix/patches torchrun --nproc_per_node=8 train.py
    PYTHONPATH=/path/to/hf_ddpfix/patches trl sft --model_name_or_path ... --use_peft ...

How: Python imports `sitecustomize` at start-up. This one imports nothing heavy: it adds an import hook
that calls `hf_ddpfix.patch_trainer()` right after `transformers.trainer` is first imported, so programs
that never build a Trainer never load hf_ddpfix (nor torch/transformers because of it).

- Opt out per run: `HF_DDPFIX_DISABLE=1` (1/true/yes/on); the hook is then not installed. Another value
  than those or 0/false/no/off raises `ValueError` naming the variable and the allowed values when
  `transformers.trainer` is imported.
- Another `sitecustomize` later on `sys.path` (a distro's or a virtualenv's) is still run: this module
  looks it up past its own folder and executes it, so putting `patches` first hides nothing.
- hf_ddpfix options come from `HF_DDPFIX_*` variables as usual; an invalid value raises `ValueError`
  (naming the variable) when `transformers.trainer` is imported, before any model is loaded.
- If `hf_ddpfix` is not installed (or a folder named `hf_ddpfix` beside the script, e.g. the clone, was taken
  for an empty namespace package), the repository root next to this folder is added to `sys.path`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TARGET = "transformers.trainer"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def _disabled() -> bool | str:
    """True when `HF_DDPFIX_DISABLE` asks to turn the patch off, False when it is unset or off, and the error
    message when the value is not recognised (raised when `transformers.trainer` is imported, as for every
    other invalid `HF_DDPFIX_*` value: an exception in `sitecustomize` itself would only be printed)."""
    raw = os.environ.get("HF_DDPFIX_DISABLE", "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        return (f"HF_DDPFIX_DISABLE={raw!r} is not a recognised value; allowed: 1/true/yes/on (patches/ does "
                "nothing) or 0/false/no/off (patches/ runs every Trainer under hf_ddpfix)")
    return False


def _patch() -> None:
    error = _disabled()
    if isinstance(error, str):
        raise ValueError(error)
    try:
        import hf_ddpfix

        if getattr(hf_ddpfix, "__file__", None) is None:  # a folder named hf_ddpfix (e.g. the clone) taken
            raise ImportError("hf_ddpfix is an empty namespace package here")  # for a namespace package
    except ImportError:
        root = os.path.dirname(_HERE)
        if not os.path.isfile(os.path.join(root, "hf_ddpfix", "__init__.py")):
            raise
        for name in [m for m in sys.modules if m == "hf_ddpfix" or m.startswith("hf_ddpfix.")]:
            del sys.modules[name]
        sys.path.append(root)  # a regular package on a later path entry wins over a namespace folder
        import hf_ddpfix
    hf_ddpfix.patch_trainer()


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader of `transformers.trainer`, then patches the Trainer it defined."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):  # noqa: D401 - importlib protocol
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _patch()

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._inner, name)


class _TrainerImportHook(importlib.abc.MetaPathFinder):
    """Meta-path finder that only ever answers for `transformers.trainer`, and only once."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def _install() -> None:
    if _disabled() is True:
        return
    if _TARGET in sys.modules:  # imported before us (unusual): patch now
        _patch()
        return
    if not any(isinstance(f, _TrainerImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TrainerImportHook())


def _chain_next_sitecustomize() -> None:
    """Execute the `sitecustomize` this one shadows (the next one on `sys.path`), if any."""
    here = os.path.normcase(os.path.realpath(_HERE))
    rest = [p for p in sys.path if os.path.normcase(os.path.realpath(p or os.getcwd())) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_hf_ddpfix_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


_install()
_chain_next_sitecustomize()
