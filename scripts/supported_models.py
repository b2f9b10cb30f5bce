"""Write the README's supported-models table from what the model zoo tests (tests/zoo.py).

Run:  OMP_NUM_THREADS=1 python scripts/supported_models.py [--out table.md] [--report zoo.json]

Every row is a zoo entry, so a model appears in the table exactly when the 2-process tests train it:
tests/scripts/usage_zoo.py (DDP, reentrant checkpointing, accumulation 1 and 2, vs stock fu=True) for
every entry, tests/scripts/usage_fsdp.py (FSDP2 mixed image/text ranks, vs DDP) for the VLMs, and
tests/test_deepspeed.py for the DeepSpeed column (which VLMs get the ZeRO dummy image is read from the
family registry: ``find_vision_adapter(model, zero=True)``; what is tested is listed in ZERO_TESTS). The
"left unused" column is observed now: one text-only training forward per model (single process,
tiny random weights, ~10 s in all), counting the trainable tensors that get no gradient. ``--report``
adds the measured max weight difference from a ``usage_zoo.py --report`` JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def observed_unused(entry) -> tuple[int, int]:
    """(trainable tensors left without a gradient by a text-only training forward, trainable tensors)."""
    from hf_ddpfix.integrations.usage import ParameterUsage

    model = entry.model(0)
    usage = ParameterUsage(model, tie=False, guard=False).attach()
    model(**entry.batch(False, 7, 16))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    used = set(usage.last.used) if usage.last is not None else set()
    return sum(n not in used for n in trainable), len(trainable)


# What tests/test_deepspeed.py checks per family under ZeRO (2 processes: scripts/deepspeed_train.py --suite vlm).
ZERO_TESTS = {
    "qwen2_5_vl": "ZeRO-2, ZeRO-3, ZeRO-3 GA 2: weights equal DDP (1e-5)",
    "llava": "ZeRO-2, ZeRO-3: weights equal DDP (1e-5)",
    "qwen3_vl": "1 process: loss and LM gradients bit-equal, vision gradients zero",
    "gemma3": "1 process: loss and LM gradients bit-equal, vision gradients zero",
    # --suite discovered (the dummy built from the config, no hand-written family)
    "internvl": "ZeRO-3: weights equal DDP (1e-5)",
    "mistral3": "ZeRO-2: weights equal DDP (1e-5)",
}


def zero_cell(entry) -> str:
    """The DeepSpeed column: the ZeRO dummy image if the family has a (ZeRO-view) adapter, and its tests."""
    if not entry.vlm:
        return "—"
    from hf_ddpfix.integrations.vision.families import find_vision_adapter

    adapter = find_vision_adapter(entry.build(0), zero=True)
    if adapter is None:
        return "stock (no dummy image: the plan says why): give every micro-batch an image"
    kind = "dummy image built from the config" if adapter.family.discovered else "dummy image"
    return f"{kind}; {ZERO_TESTS.get(entry.name, 'adapter not run under ZeRO in the tests')}"


def table(report: dict | None = None) -> str:
    from zoo import ZOO

    head = ["Model (tiny config in tests/zoo.py)", "What can go unused in a step",
            "Left unused by a text-only step (observed)", "DDP: reentrant ckpt, GA 1 & 2, vs stock fu=True",
            "FSDP2 mixed image/text ranks", "DeepSpeed ZeRO-2/3 mixed image/text ranks"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, e in ZOO.items():
        unused, total = observed_unused(e)
        ddp = "weights equal (1e-6; bit-equal non-reentrant)"
        if report and name in report:
            ddp = f"max diff {report[name]['max_diff']:.0e} (bit-equal non-reentrant)"
        fsdp = "weights equal DDP (1e-5)" if e.vlm else "—"
        rows.append(f"| {e.title} | {e.can_go_unused} | {unused} of {total} LoRA tensors | {ddp} | {fsdp} "
                    f"| {zero_cell(e)} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--report", default="", help="JSON written by tests/scripts/usage_zoo.py --report")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    report = json.load(open(a.report)) if a.report else None
    text = table(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
