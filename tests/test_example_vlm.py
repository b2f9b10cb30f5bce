"""The headline example, examples/qwen_vl_lora.py, on 2 gloo processes: it trains, beats chance, saves the
adapter, and `--resume` continues from the saved checkpoint to a larger `--max-steps`.

Offline by construction (tiny random Qwen2.5-VL, word-level tokenizer, synthetic shapes); ~1.5 min on 2 cores.
"""

from __future__ import annotations

import json
import re

import pytest
from launch import ROOT, torchrun

EXAMPLE = ROOT / "examples" / "qwen_vl_lora.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
STEPS, MORE_STEPS = 60, 80  # checkpoints every 30 steps, so the first run leaves checkpoint-60


def run_example(*args: str, timeout: float = 150):
    done = torchrun(EXAMPLE, *args, "--save-steps", "30", timeout=timeout, env=OFFLINE)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, f"expected one RESULT line (rank 0 only)\n{done.stdout[-6000:]}"
    return json.loads(lines[0][len("RESULT "):]), done.stdout


@pytest.mark.multiprocess
def test_example_trains_beats_chance_saves_and_resumes(tmp_path):
    out_dir = tmp_path / "run"
    result, log = run_example("--output-dir", str(out_dir), "--max-steps", str(STEPS))

    assert result["global_step"] == STEPS, log[-4000:]
    chance = result["chance"]
    assert 0 < chance < 0.5
    assert result["caption_accuracy"] >= max(2 * chance, chance + 0.25), (result, log[-4000:])
    assert result["colour_accuracy"] >= 0.75, result  # colour is the easy half: near-perfect when it works
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out_dir / name).is_file(), sorted(p.name for p in out_dir.iterdir())
    assert (out_dir / f"checkpoint-{STEPS}").is_dir(), sorted(p.name for p in out_dir.iterdir())
    assert "[hf_ddpfix]" in log, "the plan log should be printed"

    result2, log2 = run_example("--output-dir", str(out_dir), "--max-steps", str(MORE_STEPS), "--resume")
    started = re.findall(r"resumed from step (\d+)", log2)
    assert started == [str(STEPS)], log2[-4000:]  # printed once, by rank 0, with the checkpoint's step
    assert result2["global_step"] == MORE_STEPS, (result2, log2[-4000:])
    assert result2["caption_accuracy"] >= max(2 * chance, chance + 0.25), result2
    assert (out_dir / f"checkpoint-{MORE_STEPS}").is_dir()
