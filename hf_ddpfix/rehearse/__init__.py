"""`hf-ddpfix rehearse`: run a user's own multi-GPU launch line on a machine without GPUs, with the model shrunk.

    hf-ddpfix rehearse -- accelerate launch --config_file fsdp.yaml train.py --my-args
    hf-ddpfix rehearse --skew --stock -- torchrun --nproc_per_node=8 train.py

The pieces, one concept per module (docs/rehearse.md):
    launch_line.py   parse the launch line: launcher, script, processes, nodes, parallel mode (pure)
    shrink.py        the shrunk model: a checkpoint's config with layers and widths cut, keeping what decides
                     the collectives (pure on a config object)
    inject.py        what runs inside every launched rank (from ``shim/sitecustomize.py``): ``from_pretrained``
                     shrunk, ``TrainingArguments`` capped, rank-skewed batches, per-rank records, the watchdog
    watchdog.py      hang detection inside a rank: a collective that does not return in time dumps its stack
    sandbox.py       every write outside the rehearsal folder redirected into it and listed (your files untouched)
    saves.py         the sandbox's first layer: the HF / PEFT / accelerate / torch / safetensors save entry points
    memory.py        the projected per-rank memory of the real model at the real world size
    report.py        the report a user reads in a minute
    run.py           the command: launch, watch, collect, report
    device/          the FSDP device (accelerate's FSDP2 path on CPU/gloo), a ``sitecustomize`` folder
    shim/            the rehearsal's ``sitecustomize`` folder (calls :mod:`inject`)

Importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def device_dir() -> Path:
    """The folder to put on ``PYTHONPATH`` for accelerate's FSDP2 path on a CPU (``device/sitecustomize.py``)."""
    return _HERE / "device"


def shim_dir() -> Path:
    """The folder the rehearsal puts first on ``PYTHONPATH`` of every launched process (``shim/sitecustomize.py``)."""
    return _HERE / "shim"


__all__ = ["device_dir", "shim_dir"]
