"""TrainableSetWatch's refusals on 2 gloo ranks, without a Trainer (accelerate cannot run FSDP on a CPU):
FSDP, a parameter unfrozen after wrapping -> TrainableSetChangedError naming it and the step, on both ranks;
DDP, ranks that unfroze different parameters -> the same error on both ranks; DDP, nothing changed -> nothing.
Prints ``REFUSED rank=<r> case=<case>`` / ``QUIET rank=<r>``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hf_ddpfix.integrations.trainable_set import TrainableSetChangedError, TrainableSetWatch

dist.init_process_group("gloo")
rank = dist.get_rank()


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m[1].weight.requires_grad_(False)
    return m


m = model()
watch = TrainableSetWatch(m, "ddp", step=lambda: 1)
m(torch.randn(3, 4)).sum().backward()
watch.finalize()
print(f"QUIET rank={rank} reduced={watch.reduced}", flush=True)

for case in ("fsdp", "ddp_mismatch"):
    m = model()
    watch = TrainableSetWatch(m, "fsdp" if case == "fsdp" else "ddp", step=lambda: 2)
    if case == "fsdp" or rank == 1:
        m[1].weight.requires_grad_(True)
    m(torch.randn(3, 4)).sum().backward()
    try:
        watch.finalize()
        print(f"NOT_REFUSED rank={rank} case={case}", flush=True)
    except TrainableSetChangedError as err:
        ok = "step 2" in str(err) and (case != "fsdp" or "1.weight" in str(err))
        print(f"REFUSED rank={rank} case={case} ok={ok}", flush=True)
dist.barrier()
dist.destroy_process_group()
