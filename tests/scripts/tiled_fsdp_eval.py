"""Two gloo processes: after FSDP2 training with a synced tiled MLP, rank 0 alone evaluates and generates.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/tiled_fsdp_eval.py --out /tmp/tiled_fsdp_eval.json

Every rank builds the same tiny LoRA Llama, tiles its MLPs with the shard count all-reduced across ranks
(``sync=True``, "auto" forced on with 8 tokens per shard), applies ``fully_shard`` per MLP (so the count is
all-reduced: an MLP inside its layer's unit keeps its own, ``ops.tiled.holds_fsdp_unit``), per decoder layer and
to the root, and trains 2 AdamW steps (weight decay, clipping) on its own sequence length. Then all ranks
unshard the parameters (a collective, as a user would before a rank-0-only evaluation) and keep them
unsharded, and rank 0 alone runs a ``no_grad`` evaluation forward and a short ``generate`` while rank 1
waits without any collective. Before the fix the tiled MLP all-reduced its shard count under ``no_grad``
too and rank 0 waited forever for rank 1. A watchdog ends rank 0 with "HANG" after 60 s. Checks: rank 0
finished, its evaluation logits equal an untiled single-process copy of the trained weights bit for bit,
and the training forwards did run tiled (the same number of chunks on both ranks).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import init_gloo, lora_llama, shard_decoder, teardown, tiled_stats  # noqa: E402

from hf_ddpfix.integrations.long_context.tiled_mlp import apply_tiled_mlp  # noqa: E402

STEPS = 2


def build():
    return lora_llama(vocab_size=128, attn_implementation="eager")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rank, world = init_gloo()
    flag = a.out + ".rank0_done"

    model = build()
    handle = apply_tiled_mlp(model, shards="auto", min_tokens=0, tokens_per_shard=8, sync=True)
    stats = tiled_stats(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_base_model().model.layers:  # each MLP a unit: its chunks gather, so its count is synced
        fully_shard(layer.mlp)
    shard_decoder(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(5 + rank)
    for step in range(STEPS):
        ids = torch.randint(0, 128, (2, 20 + 7 * rank - step), generator=gen)  # 5 vs 7 shards before sync
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    chunks = [None] * world
    dist.all_gather_object(chunks, stats.get("forward_chunks", 0))

    # a full copy of the trained weights (collective), for the untiled reference on rank 0
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}
    # keep every parameter unsharded (collective), then only rank 0 evaluates
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
    dist.barrier()

    result = {"rank": rank, "tiled_modules": len(handle.patched), "train_chunks_per_rank": chunks}
    if rank == 0:
        done = threading.Event()

        limit = float(os.environ.get("EVAL_WATCHDOG_S", "60"))

        def watchdog() -> None:
            if not done.wait(limit):
                print(f"HANG: rank-0-only evaluation did not finish in {limit:.0f} s; stacks:", flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(3)

        threading.Thread(target=watchdog, daemon=True).start()
        ids = torch.randint(0, 128, (1, 33), generator=torch.Generator().manual_seed(9))
        before = stats.get("forward_chunks", 0)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
            # synced_gpus=False: transformers turns it on for FSDP-managed models and then all-reduces a
            # "finished" flag each token (stock behaviour; a rank-0-only generation must switch it off)
            generated = model.generate(input_ids=ids[:, :5], max_new_tokens=4, do_sample=False, synced_gpus=False)
        done.set()
        ref = build()
        ref.load_state_dict(full)
        ref.eval()
        with torch.no_grad():
            ref_logits = ref(input_ids=ids).logits
        result.update({
            "finished": True,
            "eval_chunks": stats.get("forward_chunks", 0) - before,
            "logits_equal_untiled_reference": bool(torch.equal(logits, ref_logits)),
            "generated_tokens": int(generated.shape[1]),
        })
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(flag, "w") as f:
            f.write("1")
        print("TILED_FSDP_EVAL", json.dumps(result), flush=True)
    else:
        deadline = time.time() + 90
        while not os.path.exists(flag) and time.time() < deadline:  # no collective while rank 0 works
            time.sleep(0.2)
    teardown()


if __name__ == "__main__":
    main()
