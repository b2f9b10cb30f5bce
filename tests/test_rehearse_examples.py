"""Every example under every config it documents, rehearsed (issue 46 item 6; with ``--stock`` too where stock's
verdict or handling is not the hf_ddpfix cell's: :data:`STOCK_TWINS`), plus
user scripts no issue names, written from scratch: TRL DPO (tests/scripts/rehearse_user_dpo.py) and a LLaVA script
whose rank 0 raises at step 2 (tests/scripts/rehearse_user_vlm.py).

One launch batch (``hf-ddpfix rehearse --steps 1 --no-resume``, at most three rehearsals at a time): the README
example ``examples/qwen_vl_lora.py`` under ``ddp_cpu.yaml``, ``zero2.yaml``, ``zero3.yaml`` and ``--qlora``
(``fsdp.yaml`` with and without ``--stock`` is tests/test_rehearse.py's FSDP test, with ``--skew``),
``examples/long_context_lora.py`` and ``examples/trl_sft.py`` (zero-code, ``patches/``) under ``ddp_cpu.yaml``, and
the two user scripts. For each cell: the verdict and its exit code (docs/rehearse.md "Exit codes"), which trainer ran and
whether hf_ddpfix did, steps per rank, the engine (ZeRO stage); a stock failure names its rank, steps and frame;
every script saves into a folder that holds a real run's earlier results, whose bytes are unchanged afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
from launch import ROOT
from test_rehearse import _earlier_results, _start, _tree

EXIT = {"passed": 0, "failed": 1, "cannot": 2}
VL = ["examples/qwen_vl_lora.py", "--eval-size", "8", "--train-size", "64"]


# The cells rehearsed with ``--stock`` too: the README example's base launch (``--stock`` turns hf_ddpfix off and the
# verdict is stock's), the TRL script that stock fails (reentrant checkpointing + a PeftModel under stock DDP) and the
# long-context example, whose own DDPFixTrainer ``--stock`` cannot turn off (said). The README example's other configs
# (``zero2.yaml``, ``zero3.yaml``, ``--qlora``) without ``--skew`` pass under stock as under hf_ddpfix (measured
# 2026-12-02): their stock twins rehearsed DeepSpeed and bitsandbytes, not hf_ddpfix (3 launches: the file went from
# 661 to 547 idle CPU-s), and are not run (``--stock --skew`` where stock fails: tests/test_rehearse.py's FSDP rehearsal, docs/rehearse.md's table).
STOCK_TWINS = ("vl-ddp", "longctx", "sft")


def _cells(out: Path) -> dict[str, tuple[list[str], list[str], dict[str, str] | None]]:
    """name -> (rehearse options, launch line, extra environment)."""
    acc = ["accelerate", "launch", "--config_file"]
    vl = [*VL, "--output-dir", str(out)]
    patches = {"PYTHONPATH": os.pathsep.join([str(ROOT / "patches"), str(ROOT)])}
    base = {
        "vl-ddp": ([], [*acc, "accelerate_configs/ddp_cpu.yaml", *vl], None),
        "vl-qlora": ([], [*acc, "accelerate_configs/ddp_cpu.yaml", *vl, "--qlora"], None),
        "longctx": ([], [*acc, "accelerate_configs/ddp_cpu.yaml", "examples/long_context_lora.py", "--tiny", "--seq",
                         "256", "--output-dir", str(out)], None),
        "sft": ([], [*acc, "accelerate_configs/ddp_cpu.yaml", "examples/trl_sft.py", "--output-dir", str(out)],
                patches),
        "dpo": ([], [*acc, "accelerate_configs/ddp_cpu.yaml", "tests/scripts/rehearse_user_dpo.py", "--out", str(out)],
                None),
        "vlm-crash": (["--steps", "3"], [*acc, "accelerate_configs/ddp_cpu.yaml", "tests/scripts/rehearse_user_vlm.py",
                                         "--out", str(out), "--crash-at", "2"], None),
    }
    if importlib.util.find_spec("deepspeed") is not None:  # a test extra: without it those cells are left out, said
        base["vl-zero2"] = ([], [*acc, "accelerate_configs/zero2.yaml", *vl], None)
        base["vl-zero3"] = ([], [*acc, "accelerate_configs/zero3.yaml", *vl], None)
    cells = {}
    for name, (opts, line, env) in base.items():
        cells[name] = (["--steps", "1", "--no-resume", "--timeout", "400", *opts], line, env)
        if name in STOCK_TWINS:
            cells[name + "-stock"] = (["--stock", "--steps", "1", "--no-resume", "--timeout", "400", *opts], line,
                                      env)
    return cells


def _pooled(tmp: Path, cells, parallel: int, timeout: float) -> dict[str, tuple[int, dict, str, float]]:
    """Run the rehearsals ``parallel`` at a time; every one ends within ``timeout`` seconds of the first start."""
    import json

    todo, running, done = list(cells.items()), [], {}
    deadline = time.monotonic() + timeout
    while todo or running:
        while todo and len(running) < parallel:
            name, (opts, line, env) = todo.pop(0)
            running.append(_start(tmp, name, opts, line, env))
        for run in list(running):
            name, proc, report, t0 = run
            if proc.poll() is None:
                continue
            text = proc.stdout.read()
            data = json.loads(report.read_text()) if report.exists() else {}
            done[name] = (proc.returncode, data, text, time.monotonic() - t0)
            running.remove(run)
            print(f"[rehearse] {name}: exit {proc.returncode}, {done[name][3]:.0f} s wall", file=sys.stderr)
        if time.monotonic() > deadline:
            for _, p, _, _ in running:
                os.killpg(p.pid, 9)
            pytest.fail(f"rehearsals {[r[0] for r in running]}: no result after {timeout:.0f} s")
        time.sleep(0.5)  # the report is printed at the end (a few KiB): the pipe does not fill before
    return done


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)  # 11 rehearsals, 3 at a time: ~270 s on an idle 2-core box, 10+ min at load 10
def test_every_example_under_every_config_it_documents_with_and_without_stock(tmp_path):
    """The verdicts of docs/rehearse.md's table, one cell per example x config (and its stock twin), and two user
    scripts written from scratch: TRL DPO (passes, its saves redirected) and a LLaVA script whose rank 0 raises at
    step 2 (FAILED, exit 1, rank 0's frame). Shown failing (2026-12-02, that cell run alone before rehearse/run.py's
    ``crashed`` check): the report read "HANG" (rank 1, left waiting in the loss all_gather, taken for the cause).
    The byte-identical check's own failure is shown by tests/test_rehearse.py's sandbox test."""
    out = tmp_path / "user-out"
    earlier = _earlier_results(out)  # a real run's results: no rehearsal may change a byte of them
    cells = _cells(out)
    done = _pooled(tmp_path, cells, parallel=3, timeout=1500)
    # trl_sft.py asks for reentrant checkpointing: stock DDP + a PeftModel (find_unused_parameters=True) breaks on
    # it ("Expected to mark a variable ready only once"); the others stock trains (measured 2026-12-02: qlora's
    # prepare_model_for_kbit_training and the DPO script's gradient_checkpointing=True run non-reentrant here)
    expect_fail = {"sft-stock", "vlm-crash"}  # and the user VLM script's rank-0-only bug at step 2
    for name, (code, rep, text, _) in sorted(done.items()):
        want = "failed" if name in expect_fail else "passed"
        assert rep.get("status") == want and code == EXIT[want], (name, code, rep.get("status"), text[-3000:])
        phase = rep["phases"][0]
        if name == "longctx-stock":  # the example's own DDPFixTrainer: --stock cannot turn it off, and says so
            assert phase["hf_ddpfix"] is True and "not a stock run" in text.splitlines()[0], text[:600]
            assert "stock passes" not in text, text[-600:]
        else:
            assert phase["hf_ddpfix"] is (not name.endswith("-stock")), (name, phase.get("hf_ddpfix"))
        if want == "passed":
            assert phase["steps"] == {"0": 1, "1": 1}, (name, phase["steps"])
            if "zero" not in name and not name.endswith("-stock"):  # DDP under hf_ddpfix: the checksums compared
                assert phase["replicas"].startswith("in sync"), (name, phase["replicas"])
            continue
        failures = [f for f in phase["failures"] if f.get("kind") == "error"]
        assert failures and not any(f.get("cannot") for f in failures), (name, phase["failures"])
        assert all(f["frames"] and "steps" in f and f["rank"] in (0, 1) for f in failures), (name, failures)
        assert "FAILED" in text and "frame:" in text, (name, text[-3000:])
    trainers = {n: done[n][1]["phases"][0]["trainer"] for n in done}
    assert trainers["sft"] == trainers["sft-stock"] == "SFTTrainer", trainers
    assert trainers["dpo"] == "DPOTrainer" and trainers["longctx"] == "DDPFixTrainer", trainers
    for n in ("vl-zero2", "vl-zero3"):
        if n in done:
            assert done[n][1]["mode"] == n[3:], (n, done[n][1]["mode"])
    crash = {f["rank"]: f for f in done["vlm-crash"][1]["phases"][0]["failures"]}[0]  # rank 0's bug, not rank 1's wait
    assert "my logging bug at step 2" in crash["error"] and crash["steps"] >= 1, crash
    assert any("rehearse_user_vlm.py" in fr and "on_step_end" in fr for fr in crash["frames"]), crash
    assert "rehearse: FAILED (exit 1" in done["vlm-crash"][2], done["vlm-crash"][2][:2000]
    asked = {(e["asked"], e["how"]) for e in done["vlm-crash"][1]["phases"][0]["sandbox"]}
    assert (str(out / "latest"), "PeftModel.save_pretrained") in asked, asked
    saves = {e["how"] for e in done["dpo"][1]["phases"][0]["sandbox"]}
    assert {"Trainer.save_model", "tokenizer.save_pretrained", "torch.save"} <= saves, saves
    assert _tree(out) == earlier, "a rehearsal changed the user's earlier results"
    if "vl-zero2" not in done:
        pytest.skip("zero2 / zero3 cells need DeepSpeed (a test extra, not installed); the other cells passed")
