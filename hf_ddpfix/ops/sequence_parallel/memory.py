"""How many tokens one sequence can have when N GPUs share it (Ulysses), from the one-GPU memory model of
`hf_ddpfix.ops.offload.budget` (pure arithmetic: a projection, never a measurement).

Under Ulysses every rank holds `L/N` tokens of everything outside attention (layer inputs, MLP, norms, the
loss head's chunk) and, inside attention, `H/N` heads of all `L` tokens: the same bytes as `L/N` tokens of
every head. So one rank's memory at sequence `L` is one GPU's at `L/N` tokens, plus the all-to-all buffers:

    extra per local token = 2 x (q + f x k + f x v + out) bytes
        (send copy + received tensor of each exchange, counted as if all were alive at once: an upper
        bound; f = KV-head replication, `ulysses.kv_replication`)

The stored layer inputs of the `L/N` local tokens are what the offload moves to host memory: the host pool
of *each rank* holds its own offloaded inputs, so a node with G GPUs needs G x the per-rank host budget.

Not modelled (the caller states them): a padded or packed batch builds a boolean `[B, 1, L, L]` mask over
the full sequence (`attention_mask_from_documents`, O(L^2) bytes): the projection holds for one unpadded
document per row (plain causal attention, no mask); the model weights are replicated on every rank (DDP).

Guarantees (tests/test_sequence_parallel.py): `sp=1` gives `budget.max_tokens` unchanged; the sequence
length is `sp x` the per-rank token count; every input is checked (a bad one raises naming it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..offload.budget import max_tokens, plan_offload_budget
from .ulysses import kv_replication

__all__ = ["SequenceParallelProjection", "project_sequence_parallel", "ulysses_buffer_bytes_per_token"]


def ulysses_buffer_bytes_per_token(*, hidden: int, heads: int, kv_heads: int, sp: int, dtype_bytes: int = 2) -> int:
    """Upper bound of the all-to-all buffers of one layer's attention, per local token (bytes); 0 when `sp == 1`.

    Raises:
        ValueError: heads not divisible by `sp` (as `kv_replication`), or a non-positive size.
    """
    for name, value in (("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads), ("sp", sp),
                        ("dtype_bytes", dtype_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    if sp == 1:
        return 0
    f = kv_replication(heads, kv_heads, sp)
    head_dim = hidden // heads
    q = out = heads * head_dim * dtype_bytes
    kv = kv_heads * f * head_dim * dtype_bytes
    return 2 * (q + 2 * kv + out)


@dataclass(frozen=True)
class SequenceParallelProjection:
    """One row of the projection: N ranks share one sequence of `sequence_tokens` tokens."""

    sp: int
    tokens_per_rank: int  # L / N: the longest local slice that fits one rank's device and host budgets
    sequence_tokens: int  # L = N x tokens_per_rank
    buffer_bytes_per_token: int  # the all-to-all buffers added to the working set, per local token
    device_gib_per_rank: float  # the budget planner's device bytes at tokens_per_rank
    host_gib_per_rank: float  # the rank's host pool at tokens_per_rank (pinned memory)
    kept_layer_inputs: int  # layer inputs left on the device (the rest offloaded)

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def project_sequence_parallel(*, sp: int, layers: int, hidden: int, heads: int, kv_heads: int,
                              working_bytes_per_token: float, fixed_device_bytes: int, device_budget_bytes: int,
                              host_budget_bytes: int, dtype_bytes: int = 2) -> SequenceParallelProjection:
    """The longest sequence N = `sp` ranks can train, each rank under the one-GPU budget model.

    Args:
        sp: ranks sharing the sequence (1: no sequence parallelism).
        layers, hidden, heads, kv_heads: the decoder shape (one stored input of `hidden x dtype_bytes` bytes per
            token and layer).
        working_bytes_per_token: one GPU's per-token working set besides the stored layer inputs (the ledger's
            row plus prefetch / loss-head terms, as `benchmarks/long_context.py --ledger` adds them).
        fixed_device_bytes: bytes that do not grow with tokens on each rank (weights: replicated under DDP).
        device_budget_bytes / host_budget_bytes: per rank (a node with G GPUs needs G x the host budget).

    Raises:
        ValueError: as `ulysses_buffer_bytes_per_token`, or a negative budget.
    """
    extra = ulysses_buffer_bytes_per_token(hidden=hidden, heads=heads, kv_heads=kv_heads, sp=sp, dtype_bytes=dtype_bytes)
    layer_in = hidden * dtype_bytes
    working = working_bytes_per_token + extra
    t = max_tokens(layers=layers, bytes_per_token_per_layer=layer_in, device_budget_bytes=device_budget_bytes,
                   host_budget_bytes=host_budget_bytes, fixed_device_bytes=fixed_device_bytes,
                   working_bytes_per_token=working)
    kept, device, host = 0, 0, 0
    if t > 0:
        b = plan_offload_budget(layers=layers, tokens=t, layer_bytes=t * layer_in, device_budget_bytes=device_budget_bytes,
                                host_budget_bytes=host_budget_bytes, fixed_device_bytes=fixed_device_bytes,
                                working_bytes_per_token=working)
        kept, device, host = b.keep_on_device, b.device_bytes, b.host_bytes
    return SequenceParallelProjection(sp=sp, tokens_per_rank=t, sequence_tokens=sp * t, buffer_bytes_per_token=extra,
                                      device_gib_per_rank=round(device / 2**30, 2), host_gib_per_rank=round(host / 2**30, 2),
                                      kept_layer_inputs=kept)
