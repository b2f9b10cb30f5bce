"""2-process training loops on accelerate alone (no Trainer): `prepare_accelerate_loop` vs stock, same data.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 tests/scripts/accelerate_loop.py

The model: a LoRA Llama (LoRA on every linear layer and on ``lm_head``) plus a scalar head on the last hidden
state; the loss uses the head only, so ``lm_head``'s LoRA never reaches it. Reentrant checkpointing is
requested in the hf_ddpfix loop (the plan corrects it to non-reentrant); stock runs non-reentrant with
``DistributedDataParallelKwargs(find_unused_parameters=True)``, the setting that trains. Gradient
accumulation 2 (`accelerator.accumulate`: no_sync micro-batches), AdamW with weight decay, clipping,
variable lengths; 3 optimizer steps. Checks: DDP was built with find_unused_parameters=False for
hf_ddpfix, every trainable tensor equals stock within 1e-6 on every rank, the parameter_usage counts (a loss
seen per micro-batch, lm_head's LoRA tied at the loss and reset to None each step). Prints
``ACCELERATE_LOOP_OK``.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fixtures import lora_llama, teardown, trainable_weights  # noqa: E402

from hf_ddpfix import prepare_accelerate_loop  # noqa: E402
from hf_ddpfix.ops import feature_counts  # noqa: E402

STEPS, GA = 3, 2
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


class WithHead(nn.Module):
    def __init__(self, checkpointing: str) -> None:
        super().__init__()
        self.lm = lora_llama(targets=ALL, checkpointing=checkpointing)
        torch.manual_seed(7)
        self.head = nn.Linear(self.lm.config.hidden_size, 1)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lm(input_ids=input_ids, output_hidden_states=True)
        return out.logits, self.head(out.hidden_states[-1])


def batches(rank: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(STEPS * GA):
        g = torch.Generator().manual_seed(100 * rank + i)
        n = 5 + (i * 3 + rank) % 7
        out.append({"input_ids": torch.randint(1, 200, (1, n), generator=g), "target": torch.randn(1, generator=g)})
    return out


def train(fixed: bool) -> tuple[dict[str, torch.Tensor], bool]:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    handlers = [] if fixed else [DistributedDataParallelKwargs(find_unused_parameters=True)]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GA, kwargs_handlers=handlers)
    model = WithHead("reentrant" if fixed else "non_reentrant")
    run = prepare_accelerate_loop(accelerator, model) if fixed else None
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ddp, optimizer = accelerator.prepare(model, optimizer)
    for batch in batches(accelerator.process_index):
        with accelerator.accumulate(ddp):
            _, head = ddp(batch["input_ids"])
            loss = ((head[:, -1, 0] - batch["target"]) ** 2).mean()
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(ddp.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    fu = bool(ddp.find_unused_parameters)
    if run is not None:
        run.close()
        assert "backward" not in vars(accelerator) and "clip_grad_norm_" not in vars(accelerator)
    weights = trainable_weights(model)
    accelerator.free_memory()
    return weights, fu


def main() -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    stock, stock_fu = train(False)
    feature_counts.reset()
    fixed, fixed_fu = train(True)
    counts = feature_counts.snapshot()["parameter_usage"]
    diff = max((stock[k] - fixed[k]).abs().max().item() for k in stock)
    print(f"[rank {rank}] accelerate loop: stock fu={stock_fu}, hf_ddpfix fu={fixed_fu}, max |fix - stock| = "
          f"{diff:.1e}, counts={counts.as_dict()}", flush=True)
    assert stock_fu and not fixed_fu
    assert diff <= 1e-6, diff
    assert counts.ran == STEPS * GA and not counts.fallbacks, counts
    assert counts.amounts["ties_at_loss"] == 2 * STEPS * GA and counts.amounts["grads_reset"] == 2 * STEPS, counts
    print(f"[rank {rank}] ACCELERATE_LOOP_OK", flush=True)
    teardown()


if __name__ == "__main__":
    main()
