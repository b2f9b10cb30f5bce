"""torch internals: storage identity, view base, parameter slots, checkpoint-recompute probes,
flash-attention kernels and fake tensors (long context).

Part of the contract layer (:mod:`hf_ddpfix._compat`): torch-only at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._pytree import tree_flatten as tree_flatten

#: ``torch.utils._python_dispatch.TorchDispatchMode`` (torch 2.0-2.13): the base class of a mode whose
#: ``__torch_dispatch__(func, types, args, kwargs)`` sees every aten op (the memory ledger subclasses it).
#: ``tree_flatten`` (``torch.utils._pytree``): ``(leaves, spec)`` of nested lists / tuples / dicts.

# --------------------------------------------------------------------------------------------------
# torch internals
# --------------------------------------------------------------------------------------------------


def storage_weak_ref(t: torch.Tensor) -> Any:
    """A weak reference to ``t``'s storage that compares equal for every view of it
    (``torch.multiprocessing.reductions.StorageWeakRef``, torch 2.0-2.13)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``Tensor._base``), or ``None``."""
    return t._base


def module_parameter_slots(module: nn.Module) -> dict[str, Any]:
    """The dict that holds ``module``'s own parameters (``nn.Module._parameters``): writing a plain
    tensor there makes ``module.<name>`` return it without registering a new parameter."""
    return module._parameters


def checkpoint_recompute_is_last(n_saved: int) -> bool:
    """True inside a non-reentrant checkpoint recompute (early stop on) when the next ``n_saved`` saved
    tensors are the last the recompute needs: it stops right after them, so the value of the current
    op's output is never read.

    Reads ``torch._C._autograd._top_saved_tensors_default_hooks`` and the closure of
    ``torch.utils.checkpoint``'s ``_recomputation_hook`` (``target_frame_ref``, ``gid``, the frame's
    ``early_stop``, ``recomp_counter``, ``weak_holders``): torch 2.4-2.13. Any surprise returns False,
    which callers treat as "compute as usual" (always correct, just slower).
    """
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if not hooks:
            return False
        fn = hooks[0]
        fn = getattr(fn, "__wrapped__", fn)
        if "_recomputation_hook" not in getattr(fn, "__qualname__", ""):
            return False
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))
        frame = cells["target_frame_ref"]()
        gid = cells["gid"]
        if frame is None or not frame.early_stop:
            return False
        return int(frame.recomp_counter[gid]) + n_saved == len(frame.weak_holders)
    except Exception:  # noqa: BLE001 - private internals changed: fall back to the always-correct path
        return False


# --------------------------------------------------------------------------------------------------
# long context (issue 14): checkpoint wrapper, flash kernels, fake tensors, buffers
# --------------------------------------------------------------------------------------------------


def in_checkpoint_recompute() -> bool:
    """True inside a non-reentrant checkpoint recompute (the top saved-tensor hook is
    ``torch.utils.checkpoint``'s ``_recomputation_hook``; torch 2.4-2.13)."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except Exception:  # noqa: BLE001 - moved: labels only
        return False
    if not hooks:
        return False
    fn = getattr(hooks[0], "__wrapped__", hooks[0])
    return "_recomputation_hook" in getattr(fn, "__qualname__", "")


def class_checkpoint_inner_forward(cls_forward: Any) -> Callable[..., Any] | None:
    """The forward inside transformers' class-level checkpoint wrapper, or ``None`` when ``cls_forward``
    is not that wrapper (always, before 5.23: 5.0-5.22 checkpoint the whole call in
    ``GradientCheckpointingLayer.__call__``, module hooks included, so an instance-level forward already
    runs inside the checkpoint). transformers 5.23 wraps ``cls.forward`` in ``forward_with_checkpointing``
    (``modeling_layers.GradientCheckpointingLayer.__init_subclass__``, ``functools.wraps``), which calls
    ``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)`` when the layer
    checkpoints in training; an instance-level forward replaces that wrapper and so bypasses it."""
    code = getattr(cls_forward, "__code__", None)
    if code is None or code.co_name != "forward_with_checkpointing":
        return None
    return getattr(cls_forward, "__wrapped__", None)


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[Any, Any, Any]:
    """Causal, dropout-free fused flash attention: ``(out, logsumexp, state_for_backward)``.

    CUDA: ``aten._scaled_dot_product_flash_attention`` (returns cum-seq/max-len/philox state, kept
    for the backward); CPU and meta: ``aten._scaled_dot_product_flash_attention_for_cpu``. These are the
    kernels ``F.scaled_dot_product_attention`` dispatches to (torch 2.5-2.13); K/V may have fewer heads.
    """
    if q.device.type == "cuda":
        o, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)
        return o, lse, (cq, ck, mq, mk, seed, offset)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return o, lse, None


def flash_attention_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                             lse: torch.Tensor, state: Any, scale: float) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` of :func:`flash_attention_forward` (its ``state`` on CUDA)."""
    if q.device.type == "cuda":
        cq, ck, mq, mk, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, o, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, o, lse, 0.0, True, scale=scale)


FLASH_CPU_BACKWARD_OP = "_scaled_dot_product_flash_attention_for_cpu_backward"


def fake_tensor_mode() -> Any:
    """A new ``torch._subclasses.fake_tensor.FakeTensorMode`` (tensors with shapes, no data)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def tensor_has_values(t: torch.Tensor) -> bool:
    """False for meta and fake tensors (shapes only: nothing can be compared on them)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def fake_from_meta(fake_mode: Any, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor on ``device`` with ``t``'s (meta) metadata (``FakeTensorConverter.from_meta_and_device``)."""
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, t, device)


def module_buffer_slots(module: nn.Module) -> dict[str, Any]:
    """The dict that holds ``module``'s own buffers (``nn.Module._buffers``), persistence unchanged."""
    return module._buffers


#: The autograd node DDP puts after its forward outputs when it must see every output's gradient
#: (``find_unused_parameters=True``, or ``static_graph=True`` in its first iteration): torch 2.x
#: ``torch.nn.parallel.distributed._DDPSink``, an identity on each tensor output (output ``i`` is tensor
#: input ``i``; checked against torch 2.4-2.13).
DDP_SINK_NODE = "_DDPSinkBackward"


def is_ddp_sink_node(node: Any) -> bool:
    """True for DDP's ``_DDPSink`` autograd node: gradient of output ``i`` goes to
    ``node.next_functions[i]`` only (None for the outputs the loss does not reach)."""
    return type(node).__name__ == DDP_SINK_NODE


def autograd_function_class(node: Any) -> type | None:
    """The ``torch.autograd.Function`` subclass whose ``apply`` made the autograd ``node`` (torch 2.0-2.13:
    the node's class is a generated ``BackwardCFunction`` subclass carrying ``_forward_cls``), or ``None``
    for a built-in node (``AddBackward0``, ``AccumulateGrad``, ...)."""
    return getattr(type(node), "_forward_cls", None)


def engine_will_run_all(nodes: list[Any]) -> bool:
    """Inside a running backward (e.g. a pre-hook of its first node): True when the autograd engine will run
    every node of ``nodes`` (``AccumulateGrad`` nodes: every one of those leaves gets its gradient). Uses
    ``torch._C._will_engine_execute_node`` (torch 2.0-2.13), mapped in C: no Python loop per node."""
    return all(map(torch._C._will_engine_execute_node, nodes))


def backward_id() -> int:
    """The id of the backward pass running now (the autograd engine's graph task: one per ``backward()`` /
    ``autograd.grad`` call, a nested one for a reentrant checkpoint's recompute), ``-1`` outside backward. Uses
    ``torch._C._current_graph_task_id`` (torch 2.1-2.13; ``torch.utils.checkpoint`` uses it the same way)."""
    return int(torch._C._current_graph_task_id())


def profiler_memory_events(prof: Any) -> list[tuple[int, int]]:
    """``(start_ns, nbytes)`` of every allocator event (``[memory]``, positive for an allocation, negative
    for a free) a finished ``torch.profiler.profile(profile_memory=True)`` recorded, in time order.

    Reads ``prof.profiler.kineto_results.events()`` (the raw kineto event list of the profiler's
    ``torch.autograd.profiler.profile``; torch 2.0-2.13): ``key_averages()`` loses the event order the
    running peak needs."""
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return sorted(events, key=lambda e: e[0])


def ddp_logger_without_construction_log(dist: Any) -> bool:
    """Make ``DistributedDataParallel`` constructible under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` on gloo: replace
    ``torch.distributed.Logger`` (which DDP's ``_ddp_init_helper`` builds by name) with a subclass whose
    ``set_construction_data_and_log`` does nothing. Measured 2026-11-28, torch 2.13.0+cpu, 2 gloo ranks: any DDP
    construction with DETAIL dies with SIGSEGV in that call (DDP's usage log only; the reducer, the collective
    fingerprints and DDP's error messages are unaffected). Used by ``hf-ddpfix rehearse`` only.

    Returns True when replaced now, False when already replaced or ``dist`` has no ``Logger``.

    Guarantees: idempotent; the replacement is a subclass, so ``Reducer.set_logger`` accepts it
    (tests/test_rehearse.py::test_ddp_logger_shim_contract).
    """
    real = getattr(dist, "Logger", None)
    if real is None or getattr(real, "_hf_ddpfix_quiet", False):
        return False

    class QuietLogger(real):  # type: ignore[misc, valid-type]
        _hf_ddpfix_quiet = True

        def set_construction_data_and_log(self, *args: Any, **kwargs: Any) -> None:
            return None

    dist.Logger = QuietLogger
    return True


def thread_frame(thread_id: int | None) -> Any:
    """The frame thread ``thread_id`` is running now (CPython's ``sys._current_frames``, 3.10-3.13), ``None`` when it
    is gone. The rehearsal's hang watchdog samples the main thread with it.

    Guarantees: a thread's own id gives a frame of that thread (tests/test_rehearse.py)."""
    import sys

    return sys._current_frames().get(thread_id)
