"""A launch that hangs: rank 0 all-reduces alone while rank 1 works on (tests/test_rehearse.py: the rehearsal's
watchdog names rank 0's collective and frame, and rank 1's frame)."""

import time

import torch
import torch.distributed as dist


def rank_zero_only_sync():
    dist.all_reduce(torch.ones(4))


dist.init_process_group("gloo")
if dist.get_rank() == 0:
    rank_zero_only_sync()
else:
    time.sleep(300)
