"""What a rank sees at start (tests/test_forklaunch.py compares the fork launcher with torchrun and with `accelerate
launch`): one JSON file per rank under $PROBE_OUT; `--fail` makes rank 1 raise after the group is up; `--accelerate`
adds what accelerate made of the launch (its environment, the Accelerator's engine and precision, the start-up hook
that ran)."""

import json
import os
import random
import sys

import torch
import torch.distributed as dist

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "PROBE_ENV")

dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
probe = {
    "env": {k: os.environ.get(k) for k in KEYS}, "argv": sys.argv[1:], "path0": sys.path[0], "name": __name__,
    "cwd": os.getcwd(), "sum": total.item(), "torch_rand": torch.rand(2).tolist(), "py_random": random.random(),
    "initial_seed": torch.initial_seed()}
if "--accelerate" in sys.argv:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)  # as TrainingArguments(use_cpu=True): MULTI_CPU, which the FSDP device makes FSDP
    hook = sys.modules.get("sitecustomize")
    probe["accelerate"] = {
        "env": {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "FSDP_"))},
        "type": str(acc.distributed_type), "mixed_precision": acc.mixed_precision,
        "fsdp_version": getattr(getattr(acc.state, "fsdp_plugin", None), "fsdp_version", None),
        "sitecustomize": os.path.relpath(hook.__file__) if getattr(hook, "__file__", None) else None,
        "path": [os.path.relpath(p) for p in sys.path[1:4] if p]}
probe = json.dumps(probe)
with open(os.path.join(os.environ["PROBE_OUT"], f"rank{dist.get_rank()}.json"), "w") as f:
    f.write(probe)
if "--fail" in sys.argv and dist.get_rank() == 1:
    raise RuntimeError("probe failure on rank 1")
dist.barrier()
dist.destroy_process_group()
