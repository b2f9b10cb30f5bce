"""Tiled MLP and tiled loss head: exact peak tensor bytes and step-time ratios on CPU.

Run:  OMP_NUM_THREADS=1 python benchmarks/tiled.py --out benchmarks/results/tiled_cpu.json \
          --png benchmarks/results/tiled_cpu.png [--quick]

What is measured (all in one run, CPU only; no GPU numbers are claimed):
1. MLP peak bytes: exact live-tensor bytes allocated during one MLP forward+backward (a
   TorchDispatchMode that follows every storage an op creates until it is freed; pre-existing
   weights, input and upstream gradient excluded), Llama-8B MLP dims (hidden 4096, intermediate 14336,
   bf16, frozen weights as under LoRA, input requires grad) at 2K-32K tokens. These run under
   FakeTensorMode (same allocations, no compute); a real-tensor run at a scaled size checks that fake and
   real byte counts are identical.
2. Loss head peak bytes: real tensors, vocab 32000, hidden 256, fp32, trainable lm_head weight, HF
   ``ForCausalLMLoss`` path vs ``tiled_causal_lm_loss`` (same loss to 1e-5 relative is checked).
3. Step time with non-reentrant checkpointing: one Llama decoder layer (scaled: hidden 256,
   intermediate 896, 4 heads) and the MLP block alone (norm + MLP + residual, worst case: no attention
   to dilute the overhead), untiled vs tiled ("auto"), interleaved repeats, min taken. One thread, timed
   as process CPU time (the machine is shared: wall time also counts waiting for a core); wall times
   are in the JSON too.
Writes JSON (with date, device, versions), a PNG chart and a markdown table next to the JSON
(``tiled_cpu.md``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_ddpfix.integrations.long_context.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp  # noqa: E402
from hf_ddpfix.ops.tiled import (  # noqa: E402
    DEFAULT_MIN_TOKENS,
    DEFAULT_TOKENS_PER_SHARD,
    choose_shards,
    tiled_call,
)
from hf_ddpfix.ops.tiled_loss import chunk_len, tiled_causal_lm_loss  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Exact live bytes of storages created by ops inside the context (peak and current)."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, Any] = {}
        self._keep = [t.untyped_storage() for t in existing]  # baseline: never counted
        self._ignore = {id(s) for s in self._keep}

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._ignore or (key in self._refs and self._refs[key]() is st):
            return
        n = st.nbytes()

        def fin(_r: Any, key: int = key, n: int = n) -> None:
            self.live -= n
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(st, fin)
        self.live += n
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


def build_mlp(hidden: int, inter: int, dtype: torch.dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter))
    finally:
        torch.set_default_dtype(old)
    for p in mlp.parameters():
        p.requires_grad_(False)
    return mlp


def mlp_peak(hidden: int, inter: int, tokens: int, shards: int, dtype: torch.dtype, fake: bool) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode() if fake else None
    if mode is not None:
        mode.__enter__()
    try:
        mlp = build_mlp(hidden, inter, dtype)
        x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
        g = torch.randn(1, tokens, hidden, dtype=dtype)
        with LiveBytes(x, g, *mlp.parameters()) as lb:
            y = mlp(x) if shards == 1 else tiled_call(mlp, x, shards)
            y.backward(g)
            del y
        return lb.peak
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)


def loss_head(tokens: int, hidden: int, vocab: int, tiled: bool) -> tuple[int, float, float]:
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    h = torch.randn(1, tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens))
    labels[:, : tokens // 8] = -100  # a masked prompt
    t0 = time.process_time()
    with LiveBytes(h, w, labels) as lb:
        if tiled:
            loss = tiled_causal_lm_loss(h, w, labels)
        else:
            loss = ForCausalLMLoss(torch.nn.functional.linear(h, w), labels, vocab_size=vocab)
        loss.backward()
        value = loss.detach().item()
        del loss
    return lb.peak, value, time.process_time() - t0


def decoder_layer(hidden: int, inter: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    return LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)


def step_times(tokens: int, hidden: int, inter: int, repeats: int, block: str) -> dict[str, Any]:
    layer, rope = decoder_layer(hidden, inter)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    pos = torch.arange(tokens)[None]
    pe = rope(x, pos)

    def fn(h: torch.Tensor) -> torch.Tensor:
        if block == "mlp":
            return h + layer.mlp(layer.post_attention_layernorm(h))
        out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        return out[0] if isinstance(out, tuple) else out

    samples: dict[str, list[float]] = {"untiled": [], "tiled": []}
    cpu: dict[str, list[float]] = {"untiled": [], "tiled": []}
    shards = choose_shards(tokens, hidden, inter)
    for _ in range(repeats):
        for mode in ("untiled", "tiled"):
            if mode == "tiled":
                apply_tiled_mlp(layer)
            else:
                remove_tiled_mlp(layer)
            x.grad = None
            t0, c0 = time.perf_counter(), time.process_time()
            checkpoint(fn, x, use_reentrant=False).sum().backward()
            samples[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
    remove_tiled_mlp(layer)
    best = {k: min(v) for k, v in cpu.items()}
    return {"tokens": tokens, "block": block, "shards": shards, "wall_samples_s": samples, "cpu_samples_s": cpu,
            "min_s": best, "ratio_tiled_over_untiled": best["tiled"] / best["untiled"],
            "wall_ratio": min(samples["tiled"]) / min(samples["untiled"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/tiled_cpu.json")
    ap.add_argument("--png", default="benchmarks/results/tiled_cpu.png")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats (~1 min)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t_start = time.perf_counter()

    H8B, I8B, DT = 4096, 14336, torch.bfloat16
    tokens_list = [2048, 4096, 8192, 16384, 32768]
    mlp_rows = []
    for t in tokens_list:
        auto = choose_shards(t, H8B, I8B)
        arctic = choose_shards(t, H8B, I8B, "arctic")
        forced = max(2, math.ceil(t / DEFAULT_TOKENS_PER_SHARD))  # the tokens-per-shard rule without min_tokens
        untiled = mlp_peak(H8B, I8B, t, 1, DT, fake=True)
        row = {"tokens": t, "untiled_bytes": untiled, "auto_shards": auto, "arctic_shards": arctic,
               "forced_shards": forced,
               "auto_bytes": mlp_peak(H8B, I8B, t, auto, DT, fake=True),
               "arctic_bytes": mlp_peak(H8B, I8B, t, arctic, DT, fake=True),
               "forced_bytes": mlp_peak(H8B, I8B, t, forced, DT, fake=True)}
        row["auto_reduction"] = untiled / row["auto_bytes"]
        row["forced_reduction"] = untiled / row["forced_bytes"]
        # intermediate bytes per token in units of intermediate x dtype bytes (the "target" rule's F)
        row["intermediate_factor"] = (untiled - 3 * t * H8B * 2) / (t * I8B * 2)
        mlp_rows.append(row)
        print("mlp", json.dumps(row), flush=True)
    fake_real = {s: (mlp_peak(256, 896, 4096, s, torch.float32, fake=True),
                     mlp_peak(256, 896, 4096, s, torch.float32, fake=False)) for s in (1, 4)}
    fake_equals_real = all(a == b for a, b in fake_real.values())

    vocab, hid = 32000, 256  # the logits dominate; hidden barely matters for the loss head peak
    loss_tokens = [2048, 4096] if args.quick else [2048, 4096, 8192, 16384]
    loss_rows = []
    for t in loss_tokens:
        u_peak, u_loss, u_s = loss_head(t, hid, vocab, tiled=False)
        t_peak, t_loss, t_s = loss_head(t, hid, vocab, tiled=True)
        row = {"tokens": t, "untiled_bytes": u_peak, "tiled_bytes": t_peak, "reduction": u_peak / t_peak,
               "loss_untiled": u_loss, "loss_tiled": t_loss, "loss_rel_diff": abs(t_loss - u_loss) / abs(u_loss),
               "chunk_tokens": chunk_len(vocab, None), "untiled_s": u_s, "tiled_s": t_s}
        loss_rows.append(row)
        print("loss", json.dumps(row), flush=True)

    time_rows = []
    hs, is_ = 256, 896
    plan = [(8192, "layer", 1), (8192, "mlp", 2)] if args.quick else [
        (8192, "mlp", 3), (16384, "mlp", 3), (8192, "layer", 3), (16384, "layer", 3)]
    for t, block, reps in plan:
        row = step_times(t, hs, is_, reps, block)
        time_rows.append(row)
        print("time", json.dumps(row), flush=True)

    result = {
        "benchmark": "tiled", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} thread(s), shared",
        "versions": _versions(), "quick": args.quick,
        "policy": {"min_tokens": DEFAULT_MIN_TOKENS, "tokens_per_shard": DEFAULT_TOKENS_PER_SHARD},
        "mlp_peak": {"model": "Llama-8B MLP dims (hidden 4096, intermediate 14336), bf16, frozen weights, "
                              "FakeTensorMode exact allocation bytes", "rows": mlp_rows,
                     "fake_vs_real_check_bytes": {str(k): v for k, v in fake_real.items()},
                     "fake_equals_real": fake_equals_real},
        "loss_peak": {"model": f"hidden {hid}, vocab {vocab}, fp32, trainable weight, 1/8 of labels masked",
                      "rows": loss_rows},
        "step_time": {"model": f"Llama decoder layer scaled: hidden {hs}, intermediate {is_}, 4 heads, fp32, "
                               "non-reentrant checkpointing, sdpa", "rows": time_rows},
        "runtime_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    if args.png:
        chart(result, Path(args.png))
    print(f"wrote {out}, {out.with_suffix('.md')}, {args.png} in {result['runtime_s']:.0f}s")


def _versions() -> dict[str, str]:
    import accelerate
    import peft
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__, "accelerate": accelerate.__version__}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def markdown(r: dict[str, Any]) -> str:
    v = r["versions"]
    lines = [
        "# Tiled MLP / tiled loss head (CPU)", "",
        f"{r['date']} - {r['device']} - torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}."
        f"{' (--quick)' if r['quick'] else ''} Produced by `python benchmarks/tiled.py`.", "",
        f"## MLP peak bytes, one forward+backward ({r['mlp_peak']['model']})", "",
        f"Fake and real byte counts identical at a scaled size: {r['mlp_peak']['fake_equals_real']}.", "",
        "| tokens | untiled | auto (shards) | x lower | 2K/shard forced (shards) | x lower | arctic ceil(S/H) (shards) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["mlp_peak"]["rows"]:
        lines.append(
            f"| {row['tokens']:,} | {_mib(row['untiled_bytes'])} | {_mib(row['auto_bytes'])} ({row['auto_shards']}) | "
            f"{row['auto_reduction']:.1f} | {_mib(row['forced_bytes'])} ({row['forced_shards']}) | "
            f"{row['forced_reduction']:.1f} | {_mib(row['arctic_bytes'])} ({row['arctic_shards']}) |")
    lines += ["", f"## Loss head peak bytes ({r['loss_peak']['model']})", "",
              "| tokens | untiled | tiled | x lower | loss rel. diff | untiled CPU s | tiled CPU s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["loss_peak"]["rows"]:
        lines.append(f"| {row['tokens']:,} | {_mib(row['untiled_bytes'])} | {_mib(row['tiled_bytes'])} | "
                     f"{row['reduction']:.1f} | {row['loss_rel_diff']:.1e} | {row['untiled_s']:.2f} | {row['tiled_s']:.2f} |")
    lines += ["", f"## Step time with checkpointing ({r['step_time']['model']})", "",
              "| tokens | block | shards | untiled CPU s (min) | tiled CPU s (min) | tiled / untiled | wall ratio |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for row in r["step_time"]["rows"]:
        lines.append(f"| {row['tokens']:,} | {row['block']} | {row['shards']} | {row['min_s']['untiled']:.2f} | "
                     f"{row['min_s']['tiled']:.2f} | {row['ratio_tiled_over_untiled']:.2f} | {row['wall_ratio']:.2f} |")
    lines += ["", "Timings are CPU (one thread, process CPU time, min of interleaved repeats); they show the "
              "compute overhead of tiling, not GPU speed. Peak bytes are exact tensor bytes, device-independent.", ""]
    return "\n".join(lines)


def _token_ticks(ax: Any, tokens: list[int]) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xticks(tokens, [f"{t // 1024}K" for t in tokens])
    ax.xaxis.set_minor_locator(NullLocator())


def chart(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    rows = r["mlp_peak"]["rows"]
    t = [row["tokens"] for row in rows]
    ax = axes[0]
    for key, label in (("untiled_bytes", "untiled"), ("auto_bytes", "tiled auto"), ("forced_bytes", "2K tokens/shard"),
                       ("arctic_bytes", "arctic ceil(S/H)")):
        ax.plot(t, [row[key] / 2**30 for row in rows], marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="GiB", title="MLP fwd+bwd peak (Llama-8B dims, bf16)")
    _token_ticks(ax, t)
    ax.legend()
    rows = r["loss_peak"]["rows"]
    ax = axes[1]
    t = [row["tokens"] for row in rows]
    ax.plot(t, [row["untiled_bytes"] / 2**30 for row in rows], marker="o", label="HF loss (full logits)")
    ax.plot(t, [row["tiled_bytes"] / 2**30 for row in rows], marker="o", label="tiled loss head")
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="GiB", title="Loss head peak (vocab 32K)")
    _token_ticks(ax, t)
    ax.legend()
    ax = axes[2]
    rows = r["step_time"]["rows"]
    labels = [f"{row['block']}\n{row['tokens'] // 1024}K" for row in rows]
    ax.bar(labels, [row["ratio_tiled_over_untiled"] for row in rows], color="tab:orange")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.1, color="r", lw=0.8, ls="--", label="1.10x")
    ax.set(ylabel="tiled / untiled step time", title="Step time, non-reentrant ckpt (CPU)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
