"""Pre-flight memory budget for checkpointed training with offloaded layer inputs (pure arithmetic).

With non-reentrant checkpointing a decoder stack keeps one input per layer, ``tokens x hidden x
dtype_bytes`` each (8 KiB per token for Llama-8B in bf16). :func:`plan_offload_budget` decides how
many of them stay on the device (the **last** ones: the backward needs them first, and they are never
copied) and how many go to host memory, from a device budget and a host budget, and fails early with
:class:`OffloadBudgetError` naming the budget that is short, by how much, and the longest sequence
that would fit. :func:`max_tokens` solves the same inequalities for the sequence length.

The model of device memory (all bytes):

    device = fixed + working_per_token x tokens + kept x layer_bytes
    host   = pool(offloaded x layer_bytes)        (pool(n) = n rounded up to max(granule, pow2floor(n)/64),
                                                   what ``HostPool`` holds for a need of n: <= 1.6% over)

``fixed`` is what does not grow with tokens (weights, optimizer state, LoRA gradients, allocator
slack); ``working_per_token`` is the per-token working set of the step outside the stored layer
inputs: one layer's forward/recompute/backward (the ledger, ``benchmarks/long_context.py --ledger``),
the prefetched next input and the loss head's chunk. ``min_keep`` inputs always stay on the device
(the offload keeps at least the last one). The defaults describe ``ActivationOffload(keep_on_device=
"auto")``, what the Trainer integration runs: as many inputs as the device allows stay there
(``max_keep=None``), the host pool holds the offloaded ones at their exact size (rounded to its granule).

Guarantees: pure (no torch, no device query); returns a budget that satisfies both inequalities or
raises; ``max_tokens`` returns the largest token count for which ``plan_offload_budget`` does not raise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["OffloadBudget", "OffloadBudgetError", "max_tokens", "plan_offload_budget", "pool_bytes"]

GIB = 1 << 30


def pool_bytes(need: int, granule: int = 1 << 20) -> int:
    """The host bytes ``HostPool`` holds for a need of ``need`` bytes: ``need`` rounded up to
    ``max(granule, pow2floor(need) / 64)`` (the pool's growth rule; ``tests/test_offload_budget.py``
    checks the two agree)."""
    if need <= 0:
        return 0
    q = max(int(granule), 1 << max(0, int(need).bit_length() - 1 - 6))
    return -(-int(need) // q) * q


class OffloadBudgetError(ValueError):
    """The run cannot fit the device or host memory budget (message: which, needed, budget, fix).

    Attributes:
        which: ``"device"`` or ``"host"``.
        needed: bytes the run needs there.
        budget: bytes allowed there.
        max_tokens: the longest token count that fits both budgets (0 when none does).
    """

    def __init__(self, message: str, *, which: str, needed: int, budget: int, max_tokens: int) -> None:
        super().__init__(message)
        self.which = which
        self.needed = needed
        self.budget = budget
        self.max_tokens = max_tokens


@dataclass(frozen=True)
class OffloadBudget:
    """How many layer inputs stay on the device, and the bytes each side needs."""

    layers: int
    tokens: int
    layer_bytes: int  # one stored layer input
    keep_on_device: int  # the last ``keep_on_device`` layers' inputs stay on the device
    offloaded: int
    device_bytes: int
    host_bytes: int
    device_budget: int
    host_budget: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.tokens} tokens: {self.keep_on_device}/{self.layers} layer inputs on the device, "
                f"{self.offloaded} offloaded; device {self.device_bytes / GIB:.1f} of {self.device_budget / GIB:.1f} GiB, "
                f"host {self.host_bytes / GIB:.1f} of {self.host_budget / GIB:.1f} GiB")


def _check(name: str, value: int | float, low: float = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
        raise ValueError(f"{name}={value!r}: must be a number >= {low}")


def _host(offloaded: int, layer_bytes: int, granule: int) -> int:
    return pool_bytes(offloaded * layer_bytes, granule)


def max_tokens(
    *,
    layers: int,
    bytes_per_token_per_layer: int,
    device_budget_bytes: int,
    host_budget_bytes: int,
    fixed_device_bytes: int = 0,
    working_bytes_per_token: float = 0,
    min_keep: int = 1,
    max_keep: int | None = None,
    host_granule_bytes: int = 1 << 20,
) -> int:
    """The largest token count ``plan_offload_budget`` accepts with these budgets (0 if none).

    Same arguments as :func:`plan_offload_budget` with ``bytes_per_token_per_layer`` = ``hidden x
    dtype_bytes`` (one token of one stored layer input).
    """
    def fits(t: int) -> bool:
        try:
            plan_offload_budget(layers=layers, tokens=t, layer_bytes=t * bytes_per_token_per_layer,
                                device_budget_bytes=device_budget_bytes, host_budget_bytes=host_budget_bytes,
                                fixed_device_bytes=fixed_device_bytes, working_bytes_per_token=working_bytes_per_token,
                                min_keep=min_keep, max_keep=max_keep, host_granule_bytes=host_granule_bytes, _search=False)
            return True
        except OffloadBudgetError:
            return False

    # Feasibility is not monotonic in tokens (the power-of-two slab, the integer count of kept inputs),
    # so solve per kept count k: the device allows T <= (D - fixed) / (w + k x b); the host allows
    # pool((layers - k) x b x T) <= H, so (layers - k) x b x T <= H. The plan keeps
    # the most inputs the device allows, which needs the least host memory, so the answer is the
    # largest min(device bound, host bound) over k; then nudge down until the plan agrees.
    b = int(bytes_per_token_per_layer)
    host_cap = host_budget_bytes
    best = 0
    top = int(layers) if max_keep is None else max(min(int(max_keep), int(layers)), min(int(min_keep), int(layers)))
    for k in range(min(int(min_keep), int(layers)), top + 1):
        denom = working_bytes_per_token + k * b
        t_dev = int((device_budget_bytes - fixed_device_bytes) // denom) if denom > 0 else 1 << 40
        t_host = int(host_cap // ((int(layers) - k) * b)) if k < layers and b > 0 else 1 << 40
        best = max(best, min(t_dev, t_host, 1 << 40))
    t = best
    while t > 0 and not fits(t):
        t -= 1
    return t


def plan_offload_budget(
    *,
    layers: int,
    tokens: int,
    layer_bytes: int,
    device_budget_bytes: int,
    host_budget_bytes: int,
    fixed_device_bytes: int = 0,
    working_bytes_per_token: float = 0,
    min_keep: int = 1,
    max_keep: int | None = None,
    host_granule_bytes: int = 1 << 20,
    _search: bool = True,
) -> OffloadBudget:
    """Decide how many layer inputs stay on the device; fail early when a budget cannot hold the run.

    Args:
        layers: checkpointed layers (one stored input each).
        tokens: tokens per step on this device (batch x sequence length).
        layer_bytes: bytes of one stored layer input (``tokens x hidden x dtype_bytes``).
        device_budget_bytes: device memory the run may use (e.g. 0.95 x total).
        host_budget_bytes: host memory the offload may pin (the host pool's cap).
        fixed_device_bytes: device bytes that do not grow with tokens (weights, optimizer, slack).
        working_bytes_per_token: per-token device working set besides the stored layer inputs.
        min_keep: layer inputs that stay on the device whatever the budget (default 1: the last).
        max_keep: at most this many stay on the device (``None``: as many as fit, what
            ``ActivationOffload(keep_on_device="auto")`` does; ``max_keep=N`` models ``keep_on_device=N``).
        host_granule_bytes: the host pool's growth granule (default 1 MiB: the offload's ``min_bytes``);
            host bytes are counted as ``pool_bytes(offloaded x layer_bytes, host_granule_bytes)``.

    Returns:
        ``OffloadBudget``: the most layer inputs the device budget (and ``max_keep``) allows stay on the
        device (fewest copies), the rest are offloaded.

    Raises:
        OffloadBudgetError: the device cannot hold the working set plus ``min_keep`` inputs, or the
            host cannot hold the inputs that do not fit on the device. The message names the budget,
            the bytes needed and allowed, and the longest sequence that fits.
        ValueError: a negative or non-numeric argument, naming it.
    """
    for name, value in (("layers", layers), ("tokens", tokens), ("layer_bytes", layer_bytes),
                        ("device_budget_bytes", device_budget_bytes), ("host_budget_bytes", host_budget_bytes),
                        ("fixed_device_bytes", fixed_device_bytes), ("working_bytes_per_token", working_bytes_per_token),
                        ("min_keep", min_keep)):
        _check(name, value)
    min_keep = min(int(min_keep), int(layers))
    working = int(fixed_device_bytes + working_bytes_per_token * tokens)
    per_tok_layer = layer_bytes // max(1, tokens)

    def longest() -> int:
        if not _search or per_tok_layer <= 0:
            return 0
        return max_tokens(layers=layers, bytes_per_token_per_layer=per_tok_layer,
                          device_budget_bytes=device_budget_bytes, host_budget_bytes=host_budget_bytes,
                          fixed_device_bytes=fixed_device_bytes, working_bytes_per_token=working_bytes_per_token,
                          min_keep=min_keep, max_keep=max_keep, host_granule_bytes=host_granule_bytes)

    need_dev = working + min_keep * layer_bytes
    if need_dev > device_budget_bytes:
        t = longest()
        raise OffloadBudgetError(
            f"device memory budget too small for {tokens} tokens: needs {need_dev / GIB:.2f} GiB "
            f"(fixed {fixed_device_bytes / GIB:.2f} + working set {(working - fixed_device_bytes) / GIB:.2f} + "
            f"{min_keep} layer input(s) {min_keep * layer_bytes / GIB:.2f}), budget {device_budget_bytes / GIB:.2f} GiB. "
            f"Longest sequence that fits both budgets: {t} tokens. Fix: fewer tokens per step, a larger "
            "device budget, or lower the working set (HF_DDPFIX_LONG_CONTEXT=all, tiled loss).",
            which="device", needed=need_dev, budget=int(device_budget_bytes), max_tokens=t,
        )
    spare = device_budget_bytes - working
    keep = int(min(layers, spare // layer_bytes)) if layer_bytes else int(layers)
    if max_keep is not None:
        keep = min(keep, int(max_keep))
    keep = max(keep, min_keep)
    offloaded = int(layers) - keep
    host = _host(offloaded, layer_bytes, host_granule_bytes)
    if host > host_budget_bytes:
        t = longest()
        raise OffloadBudgetError(
            f"host memory budget too small for {tokens} tokens: {offloaded} of {layers} layer inputs "
            f"({layer_bytes / GIB:.2f} GiB each) do not fit on the device and need {host / GIB:.2f} GiB of pinned "
            f"host memory (the pool's granule included), budget {host_budget_bytes / GIB:.2f} GiB. "
            f"Longest sequence that fits both budgets: {t} tokens. Fix: fewer tokens per step or a larger host "
            "budget (the host pool's cap).",
            which="host", needed=host, budget=int(host_budget_bytes), max_tokens=t,
        )
    return OffloadBudget(int(layers), int(tokens), int(layer_bytes), keep, offloaded,
                         working + keep * int(layer_bytes), host, int(device_budget_bytes), int(host_budget_bytes))
