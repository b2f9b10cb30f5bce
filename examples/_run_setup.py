"""Run bookkeeping of examples/qwen_vl_lora.py: one output folder per set-up (and the refusal of another
set-up's folder), the seeded offline base kept beside a `--qlora` adapter, and torch's collective deprecation
warnings shown once. Kept apart so the example reads as a training script."""

from __future__ import annotations

import json
import os


def rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


SETUP_FILE = "example_setup.json"


def setup_of(args) -> dict:
    """What decides whether a checkpoint or adapter of one run loads into another: the base model (the
    offline base is rebuilt from `--seed`, with hidden size 128 under `--qlora` and 96 otherwise), the 4-bit
    base, the LoRA rank, and the engine that wrote the checkpoints (DeepSpeed's differ from DDP's)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        launch = "zero" + os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
    elif os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        launch = "fsdp"
    else:
        launch = "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single"
    model = args.model or f"offline-seed{args.seed}"
    return {"model": model, "base": "4bit-nf4" if args.qlora else "full", "lora_r": args.lora_r, "launch": launch}


def refuse(message: str) -> None:
    """Stop the run with ``message``: `SystemExit` (the message on stderr, exit status 1), and under torchrun /
    `accelerate launch` the message as the launcher's "Root Cause", so it is the last thing printed."""
    from hf_ddpfix import report_to_launcher

    error = SystemExit(message)
    report_to_launcher(error)
    raise error


def output_dir_for(args) -> str:
    """`--output-dir`, or `outputs/qwen_vl_lora/<set-up>` when it is not given, so runs of different set-ups
    never share checkpoints (a `--resume` after a `--qlora` run in one folder failed with a size mismatch).
    A folder that holds another set-up's run is refused with the reason, before anything is loaded."""
    setup = setup_of(args)
    if args.output_dir is None:
        name = "-".join([setup["model"].replace("/", "--"), "qlora" if args.qlora else "lora", f"r{args.lora_r}",
                         setup["launch"]])
        return os.path.join("outputs", "qwen_vl_lora", name)
    path = os.path.join(args.output_dir, SETUP_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            before = json.load(f)
        if before != setup:
            diff = ", ".join(f"{k}: {before.get(k)!r} there, {v!r} now" for k, v in setup.items() if before.get(k) != v)
            refuse(f"--output-dir {args.output_dir} holds a run of another set-up ({diff}); its "
                             "checkpoints and adapter do not fit this model (e.g. a --qlora run's base has hidden "
                             "size 128, the LoRA base 96: a size mismatch at --resume). Give another --output-dir, or "
                             "leave it out: each set-up gets its own folder under outputs/qwen_vl_lora/.")
    return args.output_dir


def record_setup(args, output_dir: str) -> None:
    """Rank 0 writes the set-up beside the checkpoints (read by `output_dir_for` on the next run)."""
    if rank0():
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, SETUP_FILE), "w") as f:
            json.dump(setup_of(args), f, indent=1)


def saved_base(model, args) -> str:
    """The offline base saved in `<output dir>/base_model` (kept: the adapter's `base_model_name_or_path`
    points to it, so `PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(path), out)`
    works after the run). Every rank saves into its own temporary folder and renames it into place; the
    base is the same on every rank (seeded), so the first rename wins and the others are dropped."""
    import shutil
    import tempfile

    path = os.path.abspath(os.path.join(args.output_dir, "base_model"))
    if not os.path.isfile(os.path.join(path, "config.json")):
        os.makedirs(args.output_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".base_model-", dir=args.output_dir)
        model.save_pretrained(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another rank (or an earlier run of the same set-up) was first
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def quiet_repeated_upstream_warnings() -> None:
    """Show each of torch's collective deprecation warnings once per process. DeepSpeed 0.19.8 calls
    `torch.distributed.reduce_scatter_tensor` / `all_gather_into_tensor`, which torch 2.13 deprecates, and a
    ZeRO-3 run of this example printed ~4,800 identical lines: Python's once-per-location rule (and the "once"
    filter action) is reset whenever any code changes the warning filters, which torch and transformers do
    inside their own calls (`warnings.catch_warnings`). So the display itself is deduplicated, for these
    messages only; every other warning is shown as before."""
    import re
    import warnings

    pattern = re.compile(r"`torch\.distributed\.\w+` is deprecated")
    shown: set[str] = set()
    show = warnings.showwarning

    def show_once(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if pattern.match(text):
            if text in shown:
                return
            shown.add(text)
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_once


class _DropMessage:
    """A `logging` filter dropping the records whose message starts with `prefix` (one known line, nothing else)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_known_upstream_notices() -> None:
    """Keep two upstream start-up lines out of a CPU run, each harmless by construction (docs/examples.md,
    "What a first run prints"); call it before peft / transformers / deepspeed are imported.

    - bitsandbytes 0.50 (imported by peft whenever it is installed) logs "Failed to load CPU gemm_4bit_forward
      from kernels-community ..." when the optional `kernels` package is missing: its own CPU kernel is used
      then. Only that message of that logger is dropped.
    - DeepSpeed (imported by accelerate's `unwrap_model` whenever it is installed, also in plain DDP) warns
      "Setting accelerator to CPU" when it detects no accelerator. Without an accelerator `DS_ACCELERATOR=cpu`
      names the accelerator it would pick itself, so it does not warn; a value already set is kept.
    """
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        _DropMessage("Failed to load CPU gemm_4bit_forward from kernels-community"))
    import torch

    if not torch.accelerator.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
