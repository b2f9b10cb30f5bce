"""bitsandbytes' in-place CPU repack of 4-bit weights, switched off where FSDP2 regathers the weight each forward.

Read against bitsandbytes 0.50.2 (``nn/modules.py``, ``Linear4bit.forward``): on a CPU with AVX512-BF16
(``module.support_avx512bf16_for_cpu``, set in ``__init__`` from ``has_avx512bf16()``, an int), a forward in eval mode
with an input that needs no grad replaces ``weight.data`` by a repacked layout (``_convert_weight_packed_for_cpu``)
and marks the weight's ``quant_state.packing_format_for_cpu = True``; later forwards skip the repack and read the
weight in that layout. Under FSDP2 the weight the forward sees is the all-gathered copy, rebuilt from the
unchanged shards before every forward, while the flag stays on the shared ``quant_state``: from the second
evaluation forward on, the packed kernel reads a weight in the original layout (measured, tiny Llama QLoRA, 2 gloo
ranks through accelerate's FSDP2: evaluation loss 5.496 against 5.524 under DDP; training, which never repacks,
equal to DDP to 3e-8). CUDA never repacks. With the switch off the forward runs bitsandbytes' ordinary dequantize
path, the one training uses.

Reversible: the undo puts each module's own value back, once (a second call does nothing), and only on a module
whose switch is still the ``False`` we set (a value another library set since is kept: patches chain). hf_ddpfix
undoes it when ``train()`` ends, and turns it off again around each evaluation outside ``train()``
(``eval_setup.cpu_repack_off``).

Fallbacks: bitsandbytes not loaded, or a ``Linear4bit`` without the attribute (another release) → nothing changed
(0 modules); the contract test in tests/test_upstream_contracts.py fails if the attribute or its use goes away.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["disable_cpu_repack"]

_SWITCH = "support_avx512bf16_for_cpu"


def disable_cpu_repack(model: nn.Module) -> tuple[int, Callable[[], None]]:
    """Turn bitsandbytes' in-place CPU repack off on every ``Linear4bit`` of ``model``.

    Returns:
        ``(n, undo)``: how many modules had it on (now off), and a function that turns them back on.

    Guarantees: idempotent (a second call while the first is in force finds nothing on: ``n == 0``); ``undo``
    restores each module's own value once, and leaves a module alone whose switch was changed after this call.
    """
    import sys

    bnb = sys.modules.get("bitsandbytes")  # never imported here: a model holds its layers only once it is loaded
    cls = getattr(getattr(bnb, "nn", None), "Linear4bit", None) if bnb is not None else None
    if cls is None:
        return 0, lambda: None
    switched = [(m, getattr(m, _SWITCH)) for m in model.modules() if isinstance(m, cls) and getattr(m, _SWITCH, False)]
    for m, _ in switched:
        setattr(m, _SWITCH, False)

    def undo() -> None:
        while switched:
            m, was = switched.pop()
            if getattr(m, _SWITCH, None) is False:  # still ours: another library's later value is kept
                setattr(m, _SWITCH, was)

    return len(switched), undo
