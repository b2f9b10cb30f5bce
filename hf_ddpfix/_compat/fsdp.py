"""accelerate's FSDP2 plugin as the Trainer holds it: which wrap policy it runs and which classes it wraps.

Read against accelerate 1.15 (``utils/fsdp_utils.py``: ``fsdp2_prepare_model``,
``fsdp2_prepare_auto_wrap_policy``; ``utils/dataclasses.py``: ``FullyShardedDataParallelPlugin``):

- the plugin lives at ``trainer.accelerator.state.fsdp_plugin`` from ``Trainer.__init__`` on; the model is
  wrapped later, inside ``train()`` (or the first ``evaluate()``), by ``accelerator.prepare``;
- ``auto_wrap_policy`` is torch's ``transformer_auto_wrap_policy`` / ``size_based_auto_wrap_policy`` function
  (a ``functools.partial`` of it once ``set_auto_wrap_policy`` ran) or ``None`` (no wrap);
- under the transformer policy, ``fsdp2_prepare_auto_wrap_policy`` wraps every module whose class is named in
  ``plugin.transformer_cls_names_to_wrap`` (``None`` until prepare fills it from ``_no_split_modules``; set from
  ``fsdp_transformer_layer_cls_to_wrap`` / ``FSDP_TRANSFORMER_CLS_TO_WRAP`` by the user), and raises
  ``ValueError("Could not find the transformer layer class X in the model.")`` for a name the model lacks;
- it then carves the input embedding (untied) and ``[final norm, output embedding]`` into units of their own and
  shards the root last; every unit is then an instance of ``torch.distributed.fsdp.FSDPModule``.

- a parameter held by several modules (a tied tensor) must be managed by ONE FSDP group: torch 2.13's lazy init
  raises ``Parameter '...' is shared with a parameter already managed by another FSDP group`` otherwise. accelerate
  1.15 keeps the tied input / output embedding together (``[final norm, input embedding, output embedding]``), but
  every other module holding that tensor (BART / T5's ``encoder.embed_tokens`` and ``decoder.embed_tokens``
  beside ``shared``) stays in the root: a second group. ``fsdp2_prepare_model`` imports ``fully_shard`` from
  ``torch.distributed.fsdp`` at call time, so :func:`join_shared_holders` wraps that attribute while accelerate
  prepares: each ``fully_shard(modules)`` call also takes every not yet sharded module that holds one of the
  group's parameters (torch >= 2.13 runs a group of several modules with one all-gather and one reduce-scatter,
  ``_register_group_forward_hooks``).

Fallbacks: no plugin (not an FSDP run) → ``None`` / nothing changed.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["LAUNCH_FSDP_ENV", "fake_process_group", "fsdp_groups", "fsdp_module_units", "fsdp_plugin",
           "fsdp_plugin_from_launch", "fsdp_wrap_classes", "fsdp_wrap_policy", "join_shared_holders",
           "prepare_like_accelerate", "set_fsdp_wrap_classes", "shared_parameter_holders"]

_OURS = "_hf_ddpfix_wrap_classes"  # the class names hf_ddpfix set on the plugin (so they are not "the user's")


def fsdp_plugin(trainer: Any) -> Any | None:
    """The Trainer's ``FullyShardedDataParallelPlugin``, or ``None`` (not an FSDP run)."""
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    return getattr(state, "fsdp_plugin", None)


def fsdp_wrap_policy(plugin: Any) -> str:
    """``"transformer_based_wrap"``, ``"size_based_wrap"``, ``"no_wrap"`` or the policy's own name."""
    import functools

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    fn = getattr(plugin, "auto_wrap_policy", None)
    if isinstance(fn, functools.partial):
        fn = fn.func
    if fn is None:
        return "no_wrap"
    if fn is transformer_auto_wrap_policy:
        return "transformer_based_wrap"
    if fn is size_based_auto_wrap_policy:
        return "size_based_wrap"
    return getattr(fn, "__name__", type(fn).__name__)


def fsdp_wrap_classes(plugin: Any) -> tuple[tuple[str, ...] | None, bool]:
    """(the class names the plugin will wrap, or ``None`` when prepare will take ``_no_split_modules``;
    whether hf_ddpfix set them). Names the user gave (``fsdp_transformer_layer_cls_to_wrap``) come back with
    ``False``; after accelerate's prepare filled them in from ``_no_split_modules`` they read as the user's
    too, but the model is wrapped by then and prepare does not wrap it again."""
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if names is None:
        return None, False
    ours = getattr(plugin, _OURS, None)
    return tuple(names), ours is not None and tuple(ours) == tuple(names)


def set_fsdp_wrap_classes(plugin: Any, names: tuple[str, ...]) -> None:
    """Make accelerate's transformer policy wrap exactly the modules of these classes (before prepare)."""
    plugin.transformer_cls_names_to_wrap = list(names)
    setattr(plugin, _OURS, tuple(names))


def fsdp_module_units(model: nn.Module) -> list[nn.Module]:
    """Every FSDP2 unit in ``model`` (modules ``fully_shard`` was applied to, the root included), in
    ``named_modules`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def shared_parameter_holders(model: nn.Module) -> list[tuple[str, ...]]:
    """For every parameter tensor that several modules hold directly (a tie), the names of those modules, in
    ``named_modules`` order; ties are listed in the order their first holder appears."""
    holders: dict[int, list[str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            names = holders.setdefault(id(p), [])
            if name not in names:
                names.append(name)
    return [tuple(n) for n in holders.values() if len(n) > 1]


def _co_holders(root: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
    """The group ``fully_shard(modules)`` must be so that no tied tensor is left in two groups:

    - a member whose parameters an earlier group already shards (accelerate 1.15 puts the input embedding in its
      tail group when only a unit around it was sharded, e.g. BLIP's ``BlipTextEmbeddings``: torch then takes
      the sharded tensor for a tensor-parallel one and fails) leaves the group;
    - every module of ``root``, not yet in an FSDP group, that holds a parameter the group would manage joins
      it (repeated until no more join);
    - such a holder that encloses a member (BLIP's ``cls.predictions`` holds the ``bias`` tied to its own
      ``decoder``'s) takes that member's place: the group holds the enclosing module whole. The root never joins.

    Returns the new group (empty when every member is already sharded)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    parent: dict[int, nn.Module] = {}
    holders: dict[int, list[nn.Module]] = {}
    for mod in root.modules():
        for child in mod.children():
            parent.setdefault(id(child), mod)
        for p in mod.parameters(recurse=False):
            holders.setdefault(id(p), []).append(mod)

    def managed(group: list[nn.Module]) -> dict[int, nn.Module]:
        out: dict[int, nn.Module] = {}
        todo = list(group)
        while todo:
            mod = todo.pop()
            if id(mod) not in out:
                out[id(mod)] = mod
                todo.extend(c for c in mod.children() if not isinstance(c, FSDPModule))
        return out

    def encloses(mod: nn.Module, member: nn.Module) -> bool:
        up = parent.get(id(member))
        while up is not None:
            if up is mod:
                return True
            up = parent.get(id(up))
        return False

    def sharded(mod: nn.Module) -> bool:
        params = list(mod.parameters())
        return bool(params) and all(isinstance(p, DTensor) for p in params)

    group = [m for m in modules if not sharded(m)]
    while group:
        inside = managed(group)
        extra: list[nn.Module] = []
        for mod in inside.values():
            for p in mod.parameters(recurse=False):
                for h in holders.get(id(p), ()):
                    if (id(h) in inside or isinstance(h, FSDPModule) or h is root
                            or any(h is e for e in extra)):
                        continue
                    extra.append(h)
        if not extra:
            return group
        for h in extra:  # an enclosing holder replaces the members it encloses
            group = [m for m in group if not encloses(h, m)] + [h]
    return group


class _JoinSharedHolders:
    """The context :func:`join_shared_holders` returns (idempotent exit: the attribute is put back only while it
    is still ours)."""

    def __init__(self, root: nn.Module) -> None:
        self.root, self.joined = root, []
        self._original: Any = None
        self._ours: Any = None

    def __enter__(self) -> list[tuple[str, ...]]:
        import torch.distributed.fsdp as fsdp

        original, root, joined = fsdp.fully_shard, self.root, self.joined
        names = {id(m): n for n, m in root.named_modules()}

        def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
            group = list(module) if isinstance(module, (list, tuple)) else [module]
            if any(m is root for m in group):
                return original(module, *args, **kwargs)
            wider = _co_holders(root, group)
            if len(wider) == len(group) and all(a is b for a, b in zip(wider, group, strict=True)):
                return original(module, *args, **kwargs)
            old = {id(m) for m in group}
            added = tuple(names.get(id(m), type(m).__name__) for m in wider if id(m) not in old)
            if added:
                joined.append(added)
            if wider:  # empty: every member already sharded by an earlier group
                original(wider, *args, **kwargs)
            return module  # sharded in place (FSDP2 swaps the classes); accelerate ignores what it returns

        self._original, self._ours = original, fully_shard
        fsdp.fully_shard = fully_shard
        return joined

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed.fsdp as fsdp

        if self._ours is not None and fsdp.fully_shard is self._ours:
            fsdp.fully_shard = self._original
        self._ours = None


def join_shared_holders(root: nn.Module) -> _JoinSharedHolders:
    """A context: while open, ``torch.distributed.fsdp.fully_shard`` (as accelerate 1.15's ``fsdp2_prepare_model``
    imports it) puts every module of ``root`` that holds one of a new group's parameters into that group (an
    enclosing holder in place of the member it encloses; a member already sharded left out: ``_co_holders``). Entering
    gives the list it appends to: for each call it widened, the names of the modules that joined. A call on
    ``root`` itself, or one whose parameters no outside module holds, is passed through unchanged. Undone on exit."""
    return _JoinSharedHolders(root)


# ----------------------------------------------------------------------------------------------------
# Offline: the plugin a launch builds, and the units accelerate makes, without a launch (meta device)
# ----------------------------------------------------------------------------------------------------

#: ``accelerate launch`` exports a yaml's ``fsdp_config`` as these variables (accelerate 1.15
#: ``utils/launch.py: prepare_multi_gpu_env``), which ``FullyShardedDataParallelPlugin.__post_init__`` reads.
LAUNCH_FSDP_ENV = {
    "fsdp_version": "FSDP_VERSION",
    "fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_min_num_params": "FSDP_MIN_NUM_PARAMS",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "fsdp_state_dict_type": "FSDP_STATE_DICT_TYPE",
}


def fsdp_plugin_from_launch(fsdp_config: dict[str, Any]) -> Any:
    """The ``FullyShardedDataParallelPlugin`` ``Accelerator()`` builds in a process that ``accelerate launch`` started
    with a yaml whose ``fsdp_config`` is ``fsdp_config``: its keys are exported as ``FSDP_*`` variables
    (:data:`LAUNCH_FSDP_ENV`; booleans lower-cased, lists comma-joined, as the launcher writes them) and the plugin
    is built from that environment. The process environment is restored afterwards (the plugin's own writes too).
    Keys the plan does not read (sharding of optimizer state, prefetch...) are ignored."""
    import os

    from accelerate.utils import FullyShardedDataParallelPlugin

    env = {"FSDP_VERSION": "1"}
    for key, value in fsdp_config.items():
        var = LAUNCH_FSDP_ENV.get(key)
        if var is None or value is None:
            continue
        if isinstance(value, bool):
            value = str(value).lower()
        elif isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        env[var] = str(value)
    saved = dict(os.environ)
    try:
        for var in LAUNCH_FSDP_ENV.values():
            os.environ.pop(var, None)
        os.environ.update(env)
        return FullyShardedDataParallelPlugin()
    finally:
        os.environ.clear()
        os.environ.update(saved)


class fake_process_group:  # noqa: N801 - a context manager used like a function
    """``with fake_process_group(world_size, rank):`` a default process group of ``world_size`` ranks in this one
    process, whose collectives do nothing (torch's testing ``FakeStore`` + the ``"fake"`` backend, torch 2.13:
    ``torch/testing/_internal/distributed/fake_pg.py``). Lets ``fully_shard`` shard a meta-device model as rank
    ``rank`` of ``world_size`` would. Refuses to run where a process group already exists (a real run); the group
    is destroyed on exit."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"world_size must be >= 1 and 0 <= rank < world_size, got {world_size}, {rank}")
        self.world_size, self.rank = world_size, rank

    def __enter__(self) -> Any:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists: the fake one is for offline "
                               "planning only")
        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)
        return dist.group.WORLD

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def prepare_like_accelerate(model: nn.Module, plugin: Any, mixed_precision: str = "no") -> nn.Module:
    """Shard ``model`` (on the meta device, inside a process group) with accelerate's own ``fsdp2_prepare_model``
    (accelerate 1.15: the plugin's wrap policy over ``get_module_children_bottom_up``, the carved input embedding
    and ``[final norm, head]`` units, the root last), through a stand-in accelerator: the launch's
    ``mixed_precision`` (other than ``"no"``, accelerate stores trainable parameters in float32), no device mesh,
    and ``cpu_ram_efficient_loading`` off for the call (its rank-0 broadcast needs real weights; the units do not
    depend on it). Returns the sharded model."""
    from types import SimpleNamespace

    import torch
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision=mixed_precision,
                                  is_main_process=False, device=torch.device("meta"), torch_device_mesh=None)
    ram = getattr(plugin, "cpu_ram_efficient_loading", False)
    plugin.cpu_ram_efficient_loading = False
    try:
        return fsdp2_prepare_model(accelerator, model)
    finally:
        plugin.cpu_ram_efficient_loading = ram


def fsdp_groups(model: nn.Module) -> list[tuple[tuple[nn.Module, ...], list[tuple[int, int, int]], bool]]:
    """Every FSDP2 parameter group of ``model`` (one per ``fully_shard`` call that manages parameters), in
    ``named_modules`` order: ``(modules, [(full numel, local numel incl. padding, element size, requires grad)] per
    parameter, reshards after forward)``. Reads torch 2.13's ``FSDPModule._get_fsdp_state()._fsdp_param_group``
    (``fsdp_params[i]._orig_size`` / ``_sharded_param_data``, ``post_forward_mesh_info``: ``None`` when the group
    stays gathered from its forward to its backward). The root's group, sharded without a
    ``reshard_after_forward`` (accelerate 1.15 leaves it to torch), stays gathered too: torch's lazy init sets its
    ``post_forward_mesh_info`` to ``None`` at the first forward when ``_auto_reshard_after_forward`` is set
    (``FSDPState._lazy_init``), which has not run on a model that never ran a forward."""
    from torch.distributed.fsdp import FSDPModule

    root = model._get_fsdp_state() if isinstance(model, FSDPModule) else None
    seen: set[int] = set()
    out = []
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        state = mod._get_fsdp_state()
        group = state._fsdp_param_group
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        params = [(fp._orig_size.numel(), fp._sharded_param_data.numel(), fp.sharded_param.element_size(),
                   bool(fp.sharded_param.requires_grad)) for fp in group.fsdp_params]
        held = group.post_forward_mesh_info is None or (state is root and bool(state._auto_reshard_after_forward))
        out.append((tuple(group.modules), params, not held))
    return out
