"""The FSDP device: accelerate's FSDP2 path on a CPU-only machine (gloo). A supported part of hf_ddpfix: put this
folder on ``PYTHONPATH`` (``hf-ddpfix rehearse`` does, for launches that ask for FSDP; the test suite does through
tests/launch.py's ``fsdp_device_env()``). hf_ddpfix itself never imports this module.

Why (REFERENCES.md §12): accelerate 1.15 never selects FSDP without an accelerator. ``accelerate launch
--config_file accelerate_configs/fsdp.yaml`` exports the yaml as environment (``ACCELERATE_USE_FSDP=true``,
``FSDP_VERSION=2``, ``FSDP_AUTO_WRAP_POLICY``, ``FSDP_RESHARD_AFTER_FORWARD``, ``FSDP_STATE_DICT_TYPE``,
``FSDP_CPU_RAM_EFFICIENT_LOADING``, ``ACCELERATE_MIXED_PRECISION``...), ``Accelerator.__init__`` builds the
``FullyShardedDataParallelPlugin`` from it, and ``AcceleratorState.__init__`` then drops the plugin because its
FSDP branch lists only multi-accelerator types: ``MULTI_CPU`` stays, and the Trainer trains plain DDP.

What this does: with this folder on ``PYTHONPATH`` (``hf_ddpfix.rehearse.device_dir()``), Python imports this
``sitecustomize`` at start-up in every process of the launch. When ``accelerate.state`` is imported (not before:
nothing is imported eagerly), ``AcceleratorState.__init__`` is wrapped: after the stock ``__init__``, a state that
stayed ``MULTI_CPU`` although FSDP was asked for (``ACCELERATE_USE_FSDP=true`` or an explicit plugin) becomes
``DistributedType.FSDP`` with *that* plugin (the one accelerate built from the yaml, unchanged) and its mixed
precision set as accelerate sets it on a GPU (``plugin.set_mixed_precision``). Everything after that is
accelerate's and the Trainer's own code: ``prepare`` → ``fsdp2_prepare_model`` (the wrap policy, the carved
embedding and head units, ``cpu_ram_efficient_loading``'s broadcast from rank 0), the ``FSDP<Class>`` model,
gradient clipping through DTensors, ``save_state`` / ``load_state`` with sharded or full state dicts.

Mixed precision (``mixed_precision: bf16`` in fsdp.yaml): kept as the user's launch asks. accelerate then runs
bf16 autocast on the CPU and FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` (bf16 all-gathers and
reduce-scatters on gloo). That is the path a GPU run takes, so the example test runs it; tests that compare
weights with fp32 DDP pass ``--mixed_precision no`` to ``accelerate launch`` (the yaml's own switch), because
bf16 rounding (~4e-3 relative) would hide the differences those tests look for.

What it cannot show: NCCL's behaviour (a collective mismatch is a gloo error here, a hang on NCCL; timing and
overlap of the all-gathers), real GPU memory, CUDA streams. Where an accelerator exists the shim does nothing
(accelerate runs FSDP itself).

Each process that forces FSDP prints one line ``[fsdp_device] ...`` (rank 0 only) so a test can assert that it
ran; the test must still check the model is ``FSDPModule`` (DDP would otherwise train silently).

If another ``sitecustomize`` is on the path after this folder (``patches/sitecustomize.py``, hf_ddpfix's
zero-code entry), it is run too.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "accelerate.state"
_MARK = "_hf_ddpfix_fsdp_device_wrapped"


def _asked_for_fsdp(fsdp_plugin) -> bool:
    return fsdp_plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _patch(state_module) -> None:
    cls = state_module.AcceleratorState
    if getattr(cls.__init__, _MARK, False):
        return
    inner = cls.__init__

    def __init__(self, *args, **kwargs):
        inner(self, *args, **kwargs)
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        plugin = kwargs.get("fsdp_plugin")
        if self.distributed_type != DistributedType.MULTI_CPU or not _asked_for_fsdp(plugin):
            return
        import torch

        if torch.accelerator.is_available():  # accelerate runs FSDP itself there
            return
        plugin = plugin if plugin is not None else FullyShardedDataParallelPlugin()
        if self._mixed_precision != "no":
            plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = plugin
        self.distributed_type = DistributedType.FSDP
        state_module.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if int(os.environ.get("RANK", "0")) == 0 and not os.environ.get("_FSDP_DEVICE_SAID"):
            os.environ["_FSDP_DEVICE_SAID"] = "1"
            print(f"[fsdp_device] accelerate FSDP{plugin.fsdp_version} on CPU/gloo: wrap "
                  f"{getattr(plugin.auto_wrap_policy, '__name__', plugin.auto_wrap_policy)}, reshard_after_forward="
                  f"{plugin.reshard_after_forward}, state_dict {plugin.state_dict_type}, cpu_ram_efficient_loading="
                  f"{plugin.cpu_ram_efficient_loading}, mixed_precision {self._mixed_precision}", flush=True)

    setattr(__init__, _MARK, True)
    __init__.__wrapped__ = inner
    cls.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    """Patches ``accelerate.state`` right after it is executed (the first import, in any process)."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


def _install() -> None:
    if _TARGET in sys.modules:
        _patch(sys.modules[_TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _chain_next_sitecustomize() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` after this folder (Python imports only the first one it
    finds); once per process, so two start-up hooks that chain each other cannot loop."""
    if getattr(sys, "_hf_ddpfix_fsdp_device_chained", False):
        return
    sys._hf_ddpfix_fsdp_device_chained = True
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(e) if e else "" for e in sys.path]
    after = entries[entries.index(here) + 1:] if here in entries else entries
    for entry in after:
        if not entry or entry == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_install()
_chain_next_sitecustomize()
