"""``hf-ddpfix plan`` against the plan a real run prints (issue 36 item 4): the CLI builds its facts through the
run's own functions (a meta-device model from the config, the plugin ``accelerate launch`` builds from the yaml),
so for the same model and launch its plan block must be the run's, line for line.

Used by tests/test_fsdp_trainer.py, whose FSDP2 launches save one plan per family next to the family's results
(rank 0, ``trainer.hf_ddpfix_plan.report()`` at ``on_train_begin``: the block ``PlanReportCallback`` logs then).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from launch import ROOT

PLAN_HEAD = "hf_ddpfix plan ("


def run_plans(out: Path, mode: str = "fixed") -> dict[str, str]:
    """Each family's plan block as its run logged it, keyed by family: the ``plan-<mode>-<name>.txt`` files
    tests/scripts/fsdp_trainer.py writes on rank 0 at the start of training (not parsed from stdout, where several
    processes' lines may interleave). Runs with another wrap (``plan-<mode>-<wrap>-<name>.txt``) would be keyed
    ``<wrap>-<name>``."""
    prefix = f"plan-{mode}-"
    return {f.stem.removeprefix(prefix): f.read_text() for f in sorted(out.glob(f"{prefix}*.txt"))}


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
