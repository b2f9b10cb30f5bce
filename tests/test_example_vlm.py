"""The headline example, examples/qwen_vl_lora.py, launched as the README tells a user to (2 gloo processes on
the CPU, a hard timeout each), train + evaluate:

- `accelerate launch --config_file accelerate_configs/ddp_cpu.yaml`: trains, beats chance, saves the
  adapter; `--resume` (here through `torchrun`, the example's other launch line) continues from the saved
  checkpoint to a larger `--max-steps`;
- `zero2.yaml` / `zero3.yaml` and `--qlora`, and a short run of every launch config on every CI stack:
  tests/test_examples_launched.py;
- `fsdp.yaml` through the FSDP test device (hf_ddpfix/rehearse/device/, docs/fsdp.md: accelerate's own FSDP2 path on the
  CPU, bf16 as the yaml asks): trains to the accuracy bar of the DDP run, evaluates (the evaluation set mixes
  image and text-only batches: stock FSDP fails there), saves the adapter; the model is FSDP2-wrapped;
- `fsdp.yaml` on a machine without an accelerator and without the device: accelerate 1.15 makes every CPU launch
  plain DDP; the example says so and exits instead of silently training something else.

Every run must also end cleanly: exit code 0 on every rank (a process group left to interpreter shutdown
could abort a finished run: `terminate called without an active exception`).
Offline by construction (tiny random Qwen2.5-VL, word-level tokenizer, synthetic shapes).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from launch import ROOT, accelerate_launch, fsdp_device_env, torchrun

EXAMPLE = ROOT / "examples" / "qwen_vl_lora.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
STEPS, MORE_STEPS = 60, 80  # checkpoints every 30 steps, so the first run leaves checkpoint-60
SHORT = ("--max-steps", "4", "--train-size", "64", "--save-steps", "1000")  # the full 120-sample eval set
ABORT = "terminate called"


def result_of(done, what: str) -> dict:
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, f"{what}: expected one RESULT line (rank 0 only)\n{done.stdout[-6000:]}"
    assert ABORT not in done.stdout, f"{what}: a rank aborted at exit\n{done.stdout[-4000:]}"
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.multiprocess
def test_example_trains_beats_chance_saves_and_resumes(tmp_path):
    out_dir = tmp_path / "run"
    done = accelerate_launch("ddp_cpu.yaml", EXAMPLE, "--output-dir", str(out_dir), "--max-steps", str(STEPS),
                             "--save-steps", "30", timeout=240, env=OFFLINE)
    result, log = result_of(done, "ddp_cpu.yaml"), done.stdout

    assert result["global_step"] == STEPS, log[-4000:]
    chance = result["chance"]
    assert 0 < chance < 0.5
    assert result["caption_accuracy"] >= max(2 * chance, chance + 0.25), (result, log[-4000:])
    assert result["colour_accuracy"] >= 0.75, result  # colour is the easy half: near-perfect when it works
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out_dir / name).is_file(), sorted(p.name for p in out_dir.iterdir())
    assert (out_dir / f"checkpoint-{STEPS}").is_dir(), sorted(p.name for p in out_dir.iterdir())
    assert "[hf_ddpfix]" in log and "(ddp, world size 2)" in log, "the plan log should be printed"
    warned = [ln for ln in log.splitlines() if "[hf_ddpfix] WARNING" in ln or "[hf_ddpfix] ERROR" in ln]
    assert not warned, f"a plain LoRA run of the README example logged {len(warned)} hf_ddpfix warnings: {warned[:5]}"
    # a first run is clean: what the user asked for is what runs (no `corrected:`), and nothing but the example's
    # own lines is printed (upstream noise: docs/examples.md, "What a first run prints")
    assert "corrected:" not in log and plan_value(log, "checkpointing") == "non_reentrant", log[-4000:]
    other = unexpected_lines(log)
    assert not other, f"README command 1 printed {len(other)} lines besides its own:\n" + "\n".join(other[:20])
    sample = _plan_log_sample()  # docs/plan.md shows what this command prints
    assert sample.page_block((ROOT / "docs" / "plan.md").read_text()) == sample.extract(log), \
        "docs/plan.md's plan log differs from what README command 1 printed: python scripts/plan_log_sample.py --readme"

    done2 = torchrun(EXAMPLE, "--output-dir", str(out_dir), "--max-steps", str(MORE_STEPS), "--resume",
                     "--save-steps", "30", timeout=150, env=OFFLINE)
    result2, log2 = result_of(done2, "torchrun --resume"), done2.stdout
    started = re.findall(r"resumed from step (\d+)", log2)
    assert started == [str(STEPS)], log2[-4000:]  # printed once, by rank 0, with the checkpoint's step
    assert result2["global_step"] == MORE_STEPS, (result2, log2[-4000:])
    assert result2["caption_accuracy"] >= max(2 * chance, chance + 0.25), result2
    assert (out_dir / f"checkpoint-{MORE_STEPS}").is_dir()


def unexpected_lines(log: str) -> list[str]:
    """The lines of a run of the example that are none of its own: progress bars (the last segment of each
    carriage-return-updated line), Trainer metric dicts, the eval metrics block, the plan block and the
    example's `trainable params` / `output dir` / `resumed from` / `RESULT` lines."""
    own = re.compile(r"^(\s*$|\{'|\*\*\*\*\* \w+ metrics \*\*\*\*\*|  \w+\s+=\s|\[hf_ddpfix\] hf_ddpfix plan |"
                     r" [ *!] \w+\s+= |   corrected: |   settings: |trainable params: |output dir: |resumed from |RESULT )")
    shown = [ln.split("\r")[-1] for ln in log.splitlines()]
    bar = re.compile(r"^\s*\d+%\|[^|]*\|\s*\d+/\d+ \[[^\]]*\](\s*|\s+\{'.*)$")  # a bar, or a bar and metrics
    return [ln for ln in shown if not own.match(ln) and not bar.match(ln)]


def test_unexpected_lines_keeps_only_what_is_not_the_examples_own():
    log = ("trainable params: 1\noutput dir: x\n[hf_ddpfix] hf_ddpfix plan (ddp, world size 2):\n"
           " * checkpointing           = non_reentrant  why\n  0%|  | 0/4 [00:00<?, ?it/s]\r100%|##| 4/4 [00:01<00:00]\n"
           "{'loss': '1.0'}\n***** eval metrics *****\n  eval_loss   =   1.0\nRESULT {}\n"
           "Failed to load CPU gemm_4bit_forward from kernels-community\n"
           "  0%|  | 0/4 [00:00<?, ?it/s][transformers] `use_cache=True` is incompatible\n")
    assert unexpected_lines(log) == ["Failed to load CPU gemm_4bit_forward from kernels-community",
                                     "  0%|  | 0/4 [00:00<?, ?it/s][transformers] `use_cache=True` is incompatible"]


def _plan_log_sample():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_log_sample", ROOT / "scripts" / "plan_log_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_log_sample_reads_the_plan_block_of_a_log():
    sample = _plan_log_sample()
    log = ("noise\n[hf_ddpfix] hf_ddpfix plan (ddp, world size 2):\n * checkpointing           = non_reentrant  why\n"
           "   tiled_mlp               = off            not requested\n   corrected: a -> b\n  0%|  | 0/4\nmore\n")
    assert sample.extract(log) == ("```\n[hf_ddpfix] hf_ddpfix plan (ddp, world size 2):\n * checkpointing           "
                                   "= non_reentrant  why\n   tiled_mlp               = off            not requested\n"
                                   "   corrected: a -> b\n```\n")
    with pytest.raises(ValueError, match="no '\\[hf_ddpfix\\] hf_ddpfix plan"):
        sample.extract("nothing here")


def plan_value(log: str, name: str) -> str:
    found = re.findall(rf"^ [ *] {name}\s+= (\S+)", log, flags=re.M)
    assert found, f"no '{name}' line in the plan log\n{log[-4000:]}"
    return found[0]


@pytest.mark.multiprocess
def test_example_trains_evaluates_and_resumes_under_fsdp_yaml_through_the_test_device(tmp_path):
    done = accelerate_launch("fsdp.yaml", EXAMPLE, "--output-dir", str(tmp_path), "--max-steps", str(STEPS),
                             "--save-steps", "30", timeout=300, env=fsdp_device_env(OFFLINE))
    result, log = result_of(done, "fsdp.yaml"), done.stdout
    assert "[fsdp_device] accelerate FSDP2 on CPU/gloo" in log or torch.accelerator.is_available(), log[-4000:]
    assert "(fsdp, world size 2)" in log, log[-4000:]
    assert re.search(r"fsdp: accelerate made \d+ FSDP2 units", log), log[-4000:]  # FSDPModule instances counted
    assert plan_value(log, "fsdp_units") == "Qwen2_5_VLDecoderLayer", log[-4000:]
    assert plan_value(log, "vlm_stabilizer") == "off" and plan_value(log, "parameter_usage") == "on"
    assert result["global_step"] == STEPS, log[-4000:]
    chance = result["chance"]
    assert result["caption_accuracy"] >= max(2 * chance, chance + 0.25), (result, log[-4000:])  # the DDP bar
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / name).is_file(), sorted(p.name for p in tmp_path.iterdir())
    assert (tmp_path / f"checkpoint-{STEPS}" / "pytorch_model_fsdp_0").is_dir()  # SHARDED_STATE_DICT checkpoint
    # resume from the sharded checkpoint (model, optimizer, scheduler, RNG through accelerate's load_state)
    again = accelerate_launch("fsdp.yaml", EXAMPLE, "--output-dir", str(tmp_path), "--max-steps", str(STEPS + 4),
                              "--resume", "--save-steps", "1000", timeout=300, env=fsdp_device_env(OFFLINE))
    result2, log2 = result_of(again, "fsdp.yaml --resume"), again.stdout
    assert re.findall(r"resumed from step (\d+)", log2) == [str(STEPS)], log2[-4000:]
    assert result2["global_step"] == STEPS + 4, (result2, log2[-4000:])
    assert result2["caption_accuracy"] >= max(2 * chance, chance + 0.25), result2


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.accelerator.is_available(), reason="the CPU-only refusal; with an accelerator FSDP runs")
def test_example_under_fsdp_yaml_on_cpu_says_fsdp_cannot_run(tmp_path):
    done = accelerate_launch("fsdp.yaml", EXAMPLE, "--output-dir", str(tmp_path), *SHORT, timeout=180,
                             env=OFFLINE, check=False, launcher="accelerate")  # its summary is read below
    assert done.returncode != 0, done.stdout[-4000:]  # stock accelerate: trains plain DDP, saying nothing
    assert "RESULT " not in done.stdout
    assert "FSDP needs an accelerator" in done.stdout, done.stdout[-4000:]
    assert "hf-ddpfix rehearse -- accelerate launch" in done.stdout  # the CPU route for an FSDP launch
    assert ABORT not in done.stdout, done.stdout[-4000:]
    # the refusal is the launcher summary's Root Cause, said once there (not only "exitcode: 1")
    summary = done.stdout[done.stdout.rindex("Failures:"):]
    assert "Root Cause" in summary and summary.count("FSDP needs an accelerator") == 1, summary


def _example_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("qwen_vl_lora_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_setup_gets_its_own_output_dir_and_another_setups_folder_is_refused(tmp_path, monkeypatch):
    """Issue 29: every run wrote to one outputs/qwen_vl_lora, so `--resume` after a `--qlora` run failed with a
    size mismatch. One process, no training: the folder names and the refusal."""
    ex = _example_module()
    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    lora, qlora = ex.parse_args([]), ex.parse_args(["--qlora"])
    assert ex.output_dir_for(lora) == "outputs/qwen_vl_lora/offline-seed0-lora-r16-ddp"
    assert ex.output_dir_for(qlora) == "outputs/qwen_vl_lora/offline-seed0-qlora-r16-ddp"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert ex.output_dir_for(lora) == "outputs/qwen_vl_lora/offline-seed0-lora-r16-zero3"
    hub = ex.parse_args(["--model", "Qwen/Qwen2.5-VL-3B-Instruct", "--lora-r", "8"])
    assert ex.output_dir_for(hub) == "outputs/qwen_vl_lora/Qwen--Qwen2.5-VL-3B-Instruct-lora-r8-zero3"

    monkeypatch.setenv("RANK", "0")
    qlora_here = ex.parse_args(["--qlora", "--output-dir", str(tmp_path)])
    ex.record_setup(qlora_here, ex.output_dir_for(qlora_here))
    assert ex.output_dir_for(qlora_here) == str(tmp_path)  # the same set-up may resume there
    with pytest.raises(SystemExit, match=r"holds a run of another set-up \(base: '4bit-nf4' there, 'full' now\)"):
        ex.output_dir_for(ex.parse_args(["--resume", "--output-dir", str(tmp_path)]))
