"""Two gloo processes: DDP + non-reentrant checkpointing + ActivationOffload gives stock weights.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/offload_ddp.py --out /tmp/offload_ddp.json

Each rank trains a tiny LoRA Llama for 4 steps on its own data three times (stock checkpointing,
offload in CPU accounting mode, offload with simulated copies) and checks the final weights are
bit-identical across modes and across ranks. Rank 0 writes the verdict as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_ddpfix.integrations.checkpointing import apply_checkpointing
from hf_ddpfix.ops.offload import ActivationOffload

STEPS, BATCH, SEQ = 4, 2, 32


def build():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = get_peft_model(
        LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    model.train()
    return model


def train(offload: ActivationOffload | None) -> tuple[torch.Tensor, int]:
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_checkpointing(model, use_reentrant=False, offload=offload)
    ddp = DDP(model)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # different data per rank
    moved = 0
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
        if offload is not None:
            with offload.step():
                ddp(input_ids=ids, labels=ids).loss.backward()
            moved += offload.stats.would_offload_bytes
            assert offload.stats.in_flight == 0
        else:
            ddp(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, moved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        stock, _ = train(None)
        accounting, moved = train(ActivationOffload(min_bytes=0))
        simulate, _ = train(ActivationOffload(min_bytes=0, simulate=True))
        same = {"accounting": torch.equal(stock, accounting), "simulate": torch.equal(stock, simulate)}
        gathered = [torch.empty_like(stock) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, stock)
        ranks_equal = all(torch.equal(gathered[0], g) for g in gathered)
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, same)
        if dist.get_rank() == 0:
            result = {
                "offload_equals_stock": {k: all(v[k] for v in verdicts) for k in same},
                "ranks_equal": ranks_equal,
                "would_offload_bytes": moved,
                "world_size": dist.get_world_size(),
            }
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
            print(json.dumps(result))
    finally:
        gc.collect()  # free DDP/FSDP state before the process group goes
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
