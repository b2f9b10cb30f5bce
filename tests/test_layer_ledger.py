"""The CPU ledger of a Llama-8B-shaped decoder layer: hf_ddpfix's per-token working set vs stock.

Fake tensors (no data): each measurement of the 4096-hidden layer takes seconds. The per-token figure
is the slope between 8K and 16K tokens, so constant terms (LoRA grads, one tile) cancel.
"""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from fixtures import on_pinned_stack  # noqa: E402
from test_long_context_families import not_claimed  # noqa: E402

from hf_ddpfix.integrations.long_context.layer_ledger import LayerShape, flash_bwd_workspace, ledger_slope  # noqa: E402

# The target (issue 14): <= 100 KiB/token for one Llama-8B layer with every feature on.
TARGET_KIB_PER_TOKEN = 100
# test_ledger_peak_is_within_10_percent_of_the_real_allocator checks the ledger against torch's CPU
# allocator; the figure CI asserts is the ledger's plus that tolerance.
CHECKED_TOLERANCE = 0.10


# The README's headline (Features table, "345 -> 53 KiB/token per Llama-8B layer") and the ceiling it states for the
# other families ("<= 55.6"), asserted at those values. The spread of the measurement itself is zero: the ledger
# counts bytes of fake tensors, and two runs gave the same bytes per token (stock 353128, hf_ddpfix 53888 for
# Llama-8B; 2026-11-28, pinned stack). So the only tolerance is the rounding of the stated figure: half a unit of
# its last digit (0.5 KiB for "345" and "53", 0.05 KiB for "55.6").
README_LLAMA8B_KIB = {"stock": (345, 0.5), "hf_ddpfix": (53, 0.5)}
README_FAMILIES_CEILING_KIB = (55.6, 0.05)


def _as_stated(kib: float, stated: tuple[float, float]) -> bool:
    value, half_unit = stated
    return abs(kib - value) <= half_unit


def test_llama8b_layer_hf_ddpfix_is_at_most_100_kib_per_token_and_below_stock():
    stock = ledger_slope("stock")
    ours = ledger_slope("hf_ddpfix")
    assert ours["kib_per_token"] * (1 + CHECKED_TOLERANCE) <= TARGET_KIB_PER_TOKEN, ours["breakdown"][:8]
    assert stock["kib_per_token"] > 3 * ours["kib_per_token"], (stock["kib_per_token"], ours["kib_per_token"])
    if on_pinned_stack():  # the README states the pinned stack's figures
        for name, got in (("stock", stock), ("hf_ddpfix", ours)):
            assert _as_stated(got["kib_per_token"], README_LLAMA8B_KIB[name]), (
                f"{name}: {got['kib_per_token']:.2f} KiB/token, the README states {README_LLAMA8B_KIB[name][0]}")
    # Both include the modelled FlashAttention-2 backward workspace; ours runs it per KV-head group.
    assert 0 < ours["modelled_workspace_bytes"] < stock["modelled_workspace_bytes"]
    # Checkpointing still holds with the patched layer: nothing per token survives from the forward
    # to the backward but the layer input (a bypassed checkpoint would keep q/k/v/out: 28 KiB/token).
    assert stock["retained_bytes_per_token"] == 0
    assert ours["retained_bytes_per_token"] == 0


def test_each_feature_alone_never_costs_memory():
    small = LayerShape(hidden=256, intermediate=896, heads=8, kv_heads=2, lora_r=4)
    stock = ledger_slope("stock", seqs=(256, 512), shape=small, tokens_per_tile=128)["bytes_per_token"]
    for feature in ("rms_norm", "attention", "tiled_layer", "hf_ddpfix"):
        got = ledger_slope(feature, seqs=(256, 512), shape=small, tokens_per_tile=128)["bytes_per_token"]
        assert got <= stock, feature


def test_retained_bytes_detect_a_layer_that_is_not_checkpointed():
    small = LayerShape(hidden=256, intermediate=896, heads=8, kv_heads=2, lora_r=4)
    kw = dict(seqs=(256, 512), shape=small, tokens_per_tile=128)
    assert ledger_slope("hf_ddpfix", **kw)["retained_bytes_per_token"] == 0
    # Without checkpointing the layer keeps x's norm input, q, k, v and the attention output: > 0.
    assert ledger_slope("hf_ddpfix", checkpointing=False, **kw)["retained_bytes_per_token"] >= 2 * 256 * 2


def test_flash_workspace_model():
    import torch

    q = torch.empty(1, 32, 1024, 128, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 8, 1024, 128, device="meta", dtype=torch.bfloat16)
    per_token = flash_bwd_workspace(q, q, k) / 1024
    assert per_token == 32 * 128 * 4 + 32 * 4 + 2 * 32 * 128 * 2  # dq_accum fp32 + softmax_d + dk/dv expanded
    assert flash_bwd_workspace(q, q, q) / 1024 == 32 * 128 * 4 + 32 * 4


def test_benchmark_gpu_trial_code_path_runs_on_a_toy_shape():
    """benchmarks/long_context.py's GPU trial (patching, offload, budget, training loop) on a CPU toy shape."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "long_context.py"
    spec = importlib.util.spec_from_file_location("bench_long_context", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stock = bench._trial("stock", 48, 2, 1.0, tiny=True)
    ours = bench._trial("hf_ddpfix", 48, 2, 1.0, tiny=True)
    assert stock["ok"] and ours["ok"] and stock["via"] == ours["via"] == "Trainer"
    assert ours["long_context_patched"] == 7
    assert ours["long_context_calls"] == 2 * 2 * 2  # layers x steps x (forward + recompute)
    # CPU: the plan turns the offload off (CUDA/ROCm only), so no offload ran -- and the counts say so
    assert "offload" not in ours or ours["feature_counts"].get("offload", {}).get("ran", 0) == 0
    # the toy model is built in bf16 (the benchmark's default dtype) and runs so on the CPU: measured |diff| 0.0 (bit-
    # equal, 2026-11-27, torch 2.13; each of rms_norm / attention / tiled_layer alone: 0.0 too), the logged loss being
    # fp32 cross-entropy over bf16 logits whose spacing near 5.5 is 3.1e-2 (what a reordered bf16 sum would move)
    assert abs(ours["loss"] - stock["loss"]) <= 1e-6, (ours["loss"], stock["loss"])


@pytest.mark.parametrize("features", ["stock", "rms_norm", "attention", "tiled_mlp", "tiled_layer", "hf_ddpfix"])
def test_ledger_peak_is_within_10_percent_of_the_real_allocator(features):
    """Real CPU tensors, a shape small enough to run: the ledger's peak vs torch's CPU allocator's own
    account (every allocation and free it reports, kernels' internal buffers included) over the same
    forward + backward. The allocator sees only the region; the inputs made before it (layer input,
    cos, sin, incoming gradient: all bf16) are added, as the ledger tracks them."""
    import torch

    from hf_ddpfix.integrations.long_context.layer_ledger import measure_layer
    from hf_ddpfix.ops.memory_ledger import AllocatorPeak

    shape = LayerShape(hidden=256, intermediate=640, heads=8, kv_heads=2, lora_r=4)
    seq = 512
    real = AllocatorPeak()
    torch.manual_seed(0)
    ledger = measure_layer(features, seq, shape=shape, fake=False, flash_workspace=False, tokens_per_tile=128,
                           around=lambda: real)
    inputs = 2 * seq * shape.hidden * 2 + 2 * seq * (shape.hidden // shape.heads) * 2
    measured = real.peak + inputs
    err = ledger.peak_bytes / measured - 1
    print(f"{features}: ledger {ledger.peak_bytes / seq:.0f} B/token, allocator {measured / seq:.0f} B/token "
          f"({err:+.1%})")
    assert abs(err) <= CHECKED_TOLERANCE, (features, ledger.peak_bytes, measured, ledger.peak_op)


#: Small shapes of the other families the ledger reports (same classes and options as the real shapes of
#: layer_ledger.FAMILY_LAYERS): q/k norms, M-RoPE, sandwich norms with Gemma's (1 + w) RMSNorm.
SMALL_FAMILY_SHAPES = {
    "qwen3": LayerShape(256, 640, 8, 2, 4, family="qwen3", head_dim=32),
    "qwen2_5_vl_text": LayerShape(256, 640, 8, 2, 4, family="qwen2_5_vl_text", head_dim=32, config=(
        ("rope_scaling", {"type": "mrope", "mrope_section": [4, 6, 6]}),)),
    "gemma3_text": LayerShape(256, 640, 4, 2, 4, family="gemma3_text", head_dim=64, config=(
        ("layer_types", ["full_attention"]), ("sliding_window", 1024), ("query_pre_attn_scalar", 64))),
}


@pytest.mark.parametrize("features", ["stock", "hf_ddpfix"])
@pytest.mark.parametrize("family", list(SMALL_FAMILY_SHAPES))


def test_family_ledger_is_within_10_percent_of_the_real_allocator_and_every_cut_ran(family, features):
    """The ledger of another family's layer (read by structure: first-call probe on real values) against
    torch's CPU allocator, as the Llama test above; with every feature on, the layer and all of its RMSNorms
    ran patched (Gemma's (1 + w) norms and the q/k norms included), and the cut is below stock."""
    import torch

    from hf_ddpfix.integrations.long_context.layer_ledger import measure_layer
    from hf_ddpfix.ops import feature_counts
    from hf_ddpfix.ops.memory_ledger import AllocatorPeak

    shape = SMALL_FAMILY_SHAPES[family]
    seq = 512
    real = AllocatorPeak()
    torch.manual_seed(0)
    feature_counts.reset()
    ledger = measure_layer(features, seq, shape=shape, fake=False, flash_workspace=False, tokens_per_tile=128,
                           around=lambda: real)
    counts = feature_counts.snapshot().get("long_context")
    head_dim = shape.head_dim or shape.hidden // shape.heads
    inputs = 2 * seq * shape.hidden * 2 + 2 * seq * head_dim * 2
    measured = real.peak + inputs
    err = ledger.peak_bytes / measured - 1
    print(f"{family} {features}: ledger {ledger.peak_bytes / seq:.0f} B/token, allocator {measured / seq:.0f} "
          f"B/token ({err:+.1%})")
    assert abs(err) <= CHECKED_TOLERANCE, (family, features, ledger.peak_bytes, measured, ledger.peak_op)
    unclaimed = not_claimed(family)  # the releases where the family is not claimed patched (with the reason)
    if features == "hf_ddpfix" and unclaimed is not None and counts is not None and counts.ran == 0:
        # e.g. transformers 5.0's Qwen2.5-VL (3-row M-RoPE tables): it runs stock, counted with the reason, never
        # silent; anywhere the family is claimed, zero patched calls fail below
        assert counts.fell_back > 0 and all(unclaimed[1] in r for r in counts.fallbacks), counts
    elif features == "hf_ddpfix":
        norms = {"qwen3": 4, "qwen2_5_vl_text": 2, "gemma3_text": 6}[family]  # per layer call
        assert counts is not None and counts.fell_back == 0, counts
        # probe call + forward + recompute, each a patched layer call
        assert counts.ran == 3, counts
        assert counts.amounts.get("rms_norm_calls", 0) >= 3 * norms, counts
        stock = measure_layer("stock", seq, shape=shape, fake=False, flash_workspace=False, tokens_per_tile=128)
        assert ledger.peak_bytes < stock.peak_bytes


def test_gemma3_12b_global_layer_is_the_readme_ceiling():
    """The README's "<= 55.6 KiB/token" for the other families is Gemma-3-12B's global layer (the largest in the
    committed benchmark file, which the test below holds to the README): re-measured here at that value. The three
    others (Qwen3-8B, Qwen2.5-VL-7B text, Mistral-7B) are held to it through the committed file only: re-measuring
    them costs ~3 more minutes of CI (benchmarks/long_context_families.py measures all five)."""
    from hf_ddpfix.integrations.long_context.layer_ledger import FAMILY_LAYERS

    if not on_pinned_stack():
        pytest.skip("the README states the pinned stack's ledger (constraints.txt)")
    kib = ledger_slope("hf_ddpfix", shape=FAMILY_LAYERS["Gemma-3-12B global"])["kib_per_token"]
    assert _as_stated(kib, README_FAMILIES_CEILING_KIB), kib


def test_the_readme_states_the_committed_ledger_figures():
    """The README line carries the figures the tests above assert (and the committed benchmark file holds)."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    line = next(ln for ln in (root / "README.md").read_text().splitlines() if "KiB/token per Llama-8B layer" in ln)
    found = re.search(r"\((\d+) → (\d+) KiB/token per Llama-8B layer; .* ≤ ([\d.]+):", line)
    assert found, line
    assert (int(found.group(1)), int(found.group(2))) == (README_LLAMA8B_KIB["stock"][0], README_LLAMA8B_KIB["hf_ddpfix"][0])
    assert float(found.group(3)) == README_FAMILIES_CEILING_KIB[0], line
    rows = json.loads((root / "benchmarks" / "results" / "long_context_families_ledger.json").read_text())["rows"]
    llama = rows["Llama-3.1-8B"]
    assert _as_stated(llama["stock"]["kib_per_token"], README_LLAMA8B_KIB["stock"]), llama
    assert _as_stated(llama["hf_ddpfix"]["kib_per_token"], README_LLAMA8B_KIB["hf_ddpfix"]), llama
    others = [r["hf_ddpfix"]["kib_per_token"] for n, r in rows.items() if n != "Llama-3.1-8B"]
    assert _as_stated(max(others), README_FAMILIES_CEILING_KIB), others
