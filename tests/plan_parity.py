"""``hf-ddpfix plan`` against the plan a real run prints (issue 36 item 4): the CLI builds its facts through the
run's own functions (a meta-device model from the config, the plugin ``accelerate launch`` builds from the yaml),
so for the same model and launch its plan block must be the run's, line for line.

Used by tests/test_fsdp_trainer.py, whose FSDP2 launches print one plan per family (rank 0's ``[hf_ddpfix]`` log
lines) before the family's ``[fixed] <name>:`` line.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from launch import ROOT

PLAN_HEAD = "hf_ddpfix plan ("


def run_plans(log: str) -> dict[str, str]:
    """Each family's plan block as the run printed it (``[hf_ddpfix] `` prefix removed), keyed by the family named
    by the next ``[fixed] <name>:`` line."""
    out: dict[str, str] = {}
    block: list[str] | None = None
    done: str | None = None
    for raw in log.splitlines():
        line = raw.removeprefix("[hf_ddpfix] ")
        if line.startswith(PLAN_HEAD):
            block = [line]
            continue
        if block is not None and (line.startswith(("   ", " * ", " ! ")) and " = " in line
                                  or line.startswith("   corrected:") or line.startswith("   settings:")):
            block.append(line)
            continue
        if block is not None and len(block) > 1:
            done, block = "\n".join(block), None
        named = re.match(r"\[fixed\] (\w+):", line)
        if named and done is not None:
            out[named.group(1)], done = done, None
    return out


def cli_plan(entry, ga: int, ckpt: str, tmp: Path, *, world: int = 2, eager: bool = False) -> str:  # noqa: ANN001
    """The plan block ``hf-ddpfix plan`` prints for ``entry`` (tests/zoo.py) launched as tests/scripts/fsdp_trainer.py
    launches it: its config saved, ``--accelerate-config accelerate_configs/fsdp.yaml`` (``eager``: a copy with
    ``fsdp_cpu_ram_efficient_loading: false``), ``--mixed-precision no``, the zoo's LoRA (rank 4, its targets)."""
    from hf_ddpfix.cli import main

    folder = tmp / f"config-{entry.name}"
    entry.build(0).config.save_pretrained(folder)
    yaml = ROOT / "accelerate_configs" / "fsdp.yaml"
    if eager:
        text = yaml.read_text().replace("fsdp_cpu_ram_efficient_loading: true", "fsdp_cpu_ram_efficient_loading: false")
        yaml = tmp / "fsdp_eager.yaml"
        yaml.write_text(text)
    targets = entry.lora["target_modules"]
    argv = ["plan", "--model", str(folder), "--accelerate-config", str(yaml), "--mixed-precision", "no", "--cpu",
            "--checkpointing", ckpt, "--ga", str(ga), "--world-size", str(world), "--lora-r", "4",
            "--lora-targets", targets if isinstance(targets, str) else ",".join(targets)]
    if entry.lora.get("target_parameters"):
        argv += ["--lora-target-parameters", ",".join(entry.lora["target_parameters"])]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0, argv
    lines = buf.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(PLAN_HEAD))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
    return "\n".join(lines[start:end])
