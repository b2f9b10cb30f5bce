"""Benchmark: Ulysses sequence parallelism (hf_ddpfix) — one rank's memory and step time at L/N tokens, and the
projection of the longest sequence for N = 1, 2, 4, 8 GPUs.

GPU (N gloo ranks sharing ONE GPU: every rank `LOCAL_RANK=0`, backend gloo; NCCL refuses two ranks on one GPU).
Llama-8B shape, random bf16 weights, LoRA r=16 on every linear, one sequence of `--seq` tokens split over
`--sp` ranks, non-reentrant checkpointing + tiled MLP + tiled loss + activation offload::

    python benchmarks/sequence_parallel.py --gpu                      # SP 2, L = 65536 (32768 tokens/rank)
    python benchmarks/sequence_parallel.py --gpu --sp 2 --seq 131072 --no-offload

  writes `benchmarks/results/sequence_parallel_gpu.json`: per rank `torch.cuda.max_memory_allocated`, the
  step times, the loss and what ran (feature counts). Both ranks share the GPU: each rank's figure is its own
  allocator's, and the step time includes the other rank's kernels on the same GPU (slower than N GPUs).

CPU smoke test of the same code path (toy shape, bf16, 2 gloo ranks)::

    OMP_NUM_THREADS=1 python benchmarks/sequence_parallel.py --tiny

Projection (pure arithmetic: the CPU ledger's per-token working set of one Llama-8B layer, the offload budget
planner, plus the all-to-all buffers; `hf_ddpfix.ops.sequence_parallel.memory`)::

    python benchmarks/sequence_parallel.py --project [--host-gib 128]

  writes `benchmarks/results/sequence_parallel_projection.{json,md}`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

GIB = 1 << 30
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                num_hidden_layers=32, vocab_size=128256, max_position_embeddings=1 << 22, rope_theta=500000.0)
TOY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
           vocab_size=256, max_position_embeddings=4096)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _env(device: str) -> dict[str, Any]:
    import torch
    import transformers

    return {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": device, "host": platform.node(), "python": platform.python_version()}


# ------------------------------------------------------------------------------------------------ one rank


def _rank_main(args: argparse.Namespace) -> None:
    """One rank: every rank of the world is one SP group (DP = 1); rank 0 writes the JSON."""
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_ddpfix.integrations.checkpointing import apply_checkpointing
    from hf_ddpfix.integrations.long_context.loss_patch import patch_model_loss
    from hf_ddpfix.integrations.long_context.tiled_mlp import apply_tiled_mlp
    from hf_ddpfix.integrations.sequence_parallel import install_ulysses_attention, sharded_causal_lm_loss
    from hf_ddpfix.integrations.sequence_parallel.attention import deactivate_batch
    from hf_ddpfix.ops import feature_counts
    from hf_ddpfix.ops.offload import ActivationOffload
    from hf_ddpfix.ops.sequence_parallel import ddp_loss_scale, valid_target_count

    gpu = not args.tiny
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")  # every rank on GPU 0 (LOCAL_RANK=0)
    if gpu:
        torch.cuda.set_device(0)
    torch.manual_seed(0)  # the same weights and LoRA on every rank (DDP also broadcasts rank 0's)
    cfg = LlamaConfig(**(TOY if args.tiny else LLAMA_8B), attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS))
    model.train()
    offload = ActivationOffload(module=model, keep_on_device="auto") if args.offload else None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_checkpointing(model, use_reentrant=False, offload=offload)
    tiled = apply_tiled_mlp(model, shards=2, min_tokens=1) if args.tiny else apply_tiled_mlp(model, shards="auto")
    loss_head = patch_model_loss(model)
    attention = install_ulysses_attention("sdpa")
    ddp = DDP(model, device_ids=[0] if gpu else None, find_unused_parameters=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}
    count = valid_target_count(ids)
    times, losses = [], []
    feature_counts.reset()
    for step in range(args.steps):
        if step == args.warmup and gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        t0 = time.perf_counter()
        ctx = offload.step() if offload is not None else _null()
        with ctx:
            loss_sum, _ = sharded_causal_lm_loss(ddp, batch, keep_active=True, model_loss=True)
            loss = loss_sum / count * ddp_loss_scale(world)  # DDP's mean over the ranks becomes the sum
            loss.backward()
        deactivate_batch()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        total = loss_sum.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total / count))
    rec: dict[str, Any] = {
        "rank": rank, "sp": world, "seq": args.seq, "tokens_per_rank": args.seq // world,
        "step_seconds": [round(t, 3) for t in times], "loss": losses,
        "counts": {k: c.as_dict() for k, c in feature_counts.snapshot().items()},
        "tiled_mlp_modules": len(tiled.patched), "tiled_loss_calls": loss_head.calls,
    }
    if gpu:
        rec.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                   max_memory_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 2),
                   max_memory_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 2))
    if offload is not None:
        st = offload.stats
        rec["offload"] = {"offloaded_bytes": st.offloaded_bytes, "pool_bytes": st.pool_bytes, "steps": st.steps}
    records: list[Any] = [None] * world
    dist.all_gather_object(records, rec)
    attention.remove()
    loss_head.remove()
    tiled.remove()
    if rank == 0:
        name = "NVIDIA " + torch.cuda.get_device_name(0) if gpu else "CPU"
        out = {"env": _env(name), "mode": "tiny" if args.tiny else "gpu", "shape": TOY if args.tiny else LLAMA_8B,
               "lora_r": 16, "sp": world, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
               "offload": args.offload, "ranks_share_one_gpu": gpu, "ranks": records}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _launch(args: argparse.Namespace) -> dict[str, Any]:
    """Start `--sp` ranks of this script (every one LOCAL_RANK=0: they share GPU 0 over gloo) and wait."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--rank", "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--out", args.out] + (["--tiny"] if args.tiny else ["--gpu"]) + \
        ([] if args.offload else ["--no-offload"])
    procs = []
    for r in range(args.sp):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(args.sp), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        if args.gpu:
            env.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
        procs.append(subprocess.Popen(cmd, env=env))
    deadline = time.monotonic() + args.timeout
    codes: list[int | None] = [None] * len(procs)
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            codes[i] = p.poll()
        if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            raise SystemExit(f"sequence_parallel benchmark failed: exit codes {[p.wait() for p in procs]}"
                             f"{' (timeout)' if time.monotonic() > deadline else ''}")
        time.sleep(0.5)
    return json.loads(Path(args.out).read_text())


# ------------------------------------------------------------------------------------------------ projection


def project(args: argparse.Namespace) -> dict[str, Any]:
    """Per-GPU tokens at N = 1, 2, 4, 8 from the stored CPU ledger (benchmarks/long_context.py --ledger)."""
    from hf_ddpfix.ops.sequence_parallel.memory import project_sequence_parallel

    ledger = json.loads(Path(args.ledger).read_text())
    h, i, hk, layers = 4096, 14336, 1024, 32
    weights = 2 * (layers * (h * h * 2 + h * hk * 2 + 3 * h * i + 2 * h) + 2 * 128256 * h + h)  # bf16, untied head
    rows = {}
    # as benchmarks/long_context.py's projection: the ledger row + prefetched next input + embedding output +
    # the tiled loss head's input and gradient (4 bf16 hidden vectors per token); fixed = weights + slack + constant
    for setup in ("hf_ddpfix", "tiled_mlp"):
        row = ledger["rows"][setup]
        per_tok = row["bytes_per_token"] + 4 * h * 2
        fixed = weights + int(args.fixed_slack_gib * GIB) + int(row["constant_bytes"])
        rows[setup] = [project_sequence_parallel(sp=n, layers=layers, hidden=h, heads=32, kv_heads=8,
                                                 working_bytes_per_token=per_tok, fixed_device_bytes=fixed,
                                                 device_budget_bytes=int(args.device_gib * GIB),
                                                 host_budget_bytes=int(args.host_gib * GIB)).as_dict()
                       for n in (1, 2, 4, 8)]
    return {"env": _env("projection (no device)"), "ledger": {"file": str(Path(args.ledger).relative_to(ROOT)),
                                                               "date": ledger["env"]["date"]},
            "assumptions": {"device_gib_per_gpu": args.device_gib, "host_gib_per_gpu": args.host_gib,
                            "weights_gib": round(weights / GIB, 2), "fixed_slack_gib": args.fixed_slack_gib,
                            "batch": "one unpadded sequence (plain causal attention, no [L, L] mask)",
                            "model": "Llama-8B shape, bf16, LoRA r=16, DDP (weights replicated per GPU)"},
            "rows": rows}


def write_projection(res: dict[str, Any], stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    a = res["assumptions"]
    lines = [f"Projection (not a measurement), {res['env']['date']}: Llama-8B LoRA r=16, bf16, one sequence split over "
             f"N GPUs of {a['device_gib_per_gpu']:g} GiB, {a['host_gib_per_gpu']:g} GiB pinned host memory per GPU "
             f"for the offloaded layer inputs; ledger {res['ledger']['file']} ({res['ledger']['date']}).", "",
             "| set-up | N | tokens per GPU | sequence | all-to-all KiB/token | device GiB/GPU | host GiB/GPU | "
             "layer inputs kept |", "|---|---|---|---|---|---|---|---|"]
    for setup, rows in res["rows"].items():
        for r in rows:
            lines.append(f"| {setup} | {r['sp']} | {r['tokens_per_rank']:,} | {r['sequence_tokens']:,} | "
                         f"{r['buffer_bytes_per_token'] / 1024:.0f} | {r['device_gib_per_rank']} | "
                         f"{r['host_gib_per_rank']} | {r['kept_layer_inputs']}/32 |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--gpu", action="store_true", help="N gloo ranks sharing GPU 0, Llama-8B shape")
    mode.add_argument("--tiny", action="store_true", help="the same code path on CPU, toy shape")
    mode.add_argument("--project", action="store_true", help="projection table from the CPU ledger")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sp", type=int, default=2, help="ranks sharing the sequence (default 2)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length L (default: 65536 --gpu, 64 --tiny)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (the first --warmup not in the peak)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-offload", dest="offload", action="store_false", help="keep layer inputs on the device")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ledger", default=str(RESULTS / "long_context_ledger_cpu.json"))
    ap.add_argument("--device-gib", type=float, default=80.0)
    ap.add_argument("--host-gib", type=float, default=128.0, help="pinned host memory per GPU (projection)")
    ap.add_argument("--fixed-slack-gib", type=float, default=3.0)
    args = ap.parse_args()
    if args.project:
        res = project(args)
        stem = Path(args.out).with_suffix("") if args.out else RESULTS / "sequence_parallel_projection"
        write_projection(res, stem)
        print(stem.with_suffix(".md").read_text())
        return
    if args.seq is None:
        args.seq = 64 if args.tiny else 65536
    if args.seq % args.sp:
        ap.error(f"--seq {args.seq} is not divisible by --sp {args.sp}")
    if args.out is None:
        args.out = str(RESULTS / ("sequence_parallel_tiny.json" if args.tiny else "sequence_parallel_gpu.json"))
    if args.rank:
        _rank_main(args)
        return
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA device (use --tiny on CPU)")
    res = _launch(args)
    for r in res["ranks"]:
        mem = f", max_memory_allocated {r['max_memory_allocated_gib']} GiB" if "max_memory_allocated_gib" in r else ""
        print(f"rank {r['rank']}: {r['tokens_per_rank']} of {r['seq']} tokens{mem}, step {r['step_seconds']} s, "
              f"loss {r['loss'][-1]:.4f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
