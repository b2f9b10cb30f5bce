"""TrainableSetWatch's refusals on 2 gloo ranks, without a Trainer (accelerate cannot run FSDP on a CPU):
FSDP, a parameter unfrozen after wrapping -> TrainableSetChangedError naming it and the step, on both ranks;
DDP, ranks that unfroze different parameters -> the same error on both ranks; DDP, nothing changed -> nothing;
DDP through the usage agreement, rank 0 unfreezes and rank 1 does not -> the same error on both ranks, rank 1's
before its next collective (no hang).
Prints ``REFUSED rank=<r> case=<case>`` / ``QUIET rank=<r>``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hf_ddpfix.integrations.usage import ParameterUsage
from hf_ddpfix.integrations.usage.trainable_set import TrainableSetChangedError, TrainableSetWatch
from hf_ddpfix.runtime.attach import _watch_finalize, _WatchLate

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

# DDP as the Trainer wires it: the watch's flag rides in the usage agreement, read at the step only by a rank that
# changed its set (rank 0 here); rank 1 changed nothing and reads it at the step's end (the Trainer's on_step_end),
# before its next collective (the Trainer's next token-count gather, here an all_reduce). Every rank must raise;
# a rank that does not reaches the all_reduce alone (a hang, or an error when the other rank's process is gone).
m = model()
usage = ParameterUsage(m).attach()
watch = TrainableSetWatch(m, "ddp", step=lambda: 3)
finalize, late = _watch_finalize(usage, watch), _WatchLate(usage, watch)
if rank == 0:
    m[1].weight.requires_grad_(True)
m.train()
m(torch.randn(3, 4)).sum().backward()
try:
    finalize()  # before clipping
    late.on_step_end(None, None, None)
    print(f"NOT_REFUSED rank={rank} case=ddp_one_rank", flush=True)
    dist.all_reduce(torch.ones(1))  # the next collective: only a rank that was not told goes on to it
except TrainableSetChangedError as err:
    print(f"REFUSED rank={rank} case=ddp_one_rank ok={'step 3' in str(err) and 'differently' in str(err)}", flush=True)
dist.destroy_process_group()  # as a failed run ends: no further collective
