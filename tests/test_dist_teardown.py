"""hf_ddpfix.ops.dist teardown: the default process group is destroyed at interpreter exit (a gloo group left
to the interpreter's final clean-up can abort a finished run with SIGABRT), never earlier, once, only in the
process that asked, and without raising.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
from launch import ROOT

from hf_ddpfix.ops import dist as dist_ops

# A real gloo group of one rank. `probe` is registered with atexit BEFORE hf_ddpfix's handler, so it runs
# after it (atexit is last-in, first-out) and prints what hf_ddpfix's handler left.
SCRIPT = textwrap.dedent("""
    import atexit, os, sys, tempfile
    import torch, torch.distributed as dist

    def probe():
        print("AT_EXIT initialised=%s" % dist.is_initialized(), flush=True)

    atexit.register(probe)
    from hf_ddpfix.ops.dist import destroy_default_group_at_exit
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if sys.argv[1] == "register":
        print("FIRST", destroy_default_group_at_exit(), "SECOND", destroy_default_group_at_exit(), flush=True)
    t = torch.ones(3)
    dist.all_reduce(t)  # registering destroys nothing: the group is still usable afterwards
    print("USABLE", t.tolist() == [1.0, 1.0, 1.0], flush=True)
""")


def run_script(mode: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, env=env,
                       cwd=str(ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_default_group_destroyed_at_exit_once_and_usable_until_then():
    out = run_script("register")
    assert "FIRST True SECOND False" in out, out  # idempotent: one handler per process
    assert "USABLE True" in out, out
    assert "AT_EXIT initialised=False" in out, out


def test_without_registration_the_group_outlives_the_script():
    # the control: the probe sees the group alive when nobody destroys it (so the test above can fail)
    assert "AT_EXIT initialised=True" in run_script("none")


def test_inherited_handler_does_nothing_in_a_forked_child(monkeypatch):
    calls = []
    monkeypatch.setattr(dist_ops, "destroy_default_group", lambda: calls.append(1) or True)
    monkeypatch.setattr(dist_ops, "_exit_teardown_pid", os.getpid() + 1)  # registered by the parent
    dist_ops._destroy_at_exit()
    assert calls == []
    monkeypatch.setattr(dist_ops, "_exit_teardown_pid", os.getpid())
    dist_ops._destroy_at_exit()
    assert calls == [1]


def test_a_failing_destroy_at_exit_is_logged_not_raised(monkeypatch, caplog):
    def boom() -> bool:
        raise RuntimeError("backend already gone")

    monkeypatch.setattr(dist_ops, "destroy_default_group", boom)
    monkeypatch.setattr(dist_ops, "_exit_teardown_pid", os.getpid())
    with caplog.at_level(logging.WARNING, logger="hf_ddpfix"):
        dist_ops._destroy_at_exit()
    assert "could not destroy the process group at exit: RuntimeError: backend already gone" in caplog.text


def test_destroy_default_group_without_a_group_is_a_no_op():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this test process has a process group")  # pytest runs without one
    assert dist_ops.destroy_default_group() is False


def test_patch_trainer_asks_for_the_exit_teardown(monkeypatch):
    from hf_ddpfix import patch_trainer, unpatch_trainer

    registered = []
    monkeypatch.setattr(dist_ops, "_exit_teardown_pid", None)
    monkeypatch.setattr(dist_ops.atexit, "register", lambda fn: registered.append(fn))
    try:
        patch_trainer()
    finally:
        unpatch_trainer()
    assert registered == [dist_ops._destroy_at_exit]


def _unregistered(monkeypatch) -> list[int]:
    """Forget this process's registration and record new ones instead of adding real atexit handlers."""
    registered: list[int] = []
    monkeypatch.setattr(dist_ops, "_exit_teardown_pid", None)
    monkeypatch.setattr(dist_ops.atexit, "register", lambda fn: registered.append(1))
    return registered


def test_every_entry_point_registers_the_exit_teardown_before_it_is_used(monkeypatch, tmp_path):
    """An evaluate-only script (DDPFixTrainer or a patched Trainer, no train()) and an accelerate loop end the
    group too: CI caught `terminate called without an active exception` on an evaluate-only 2-process launch
    (tests/scripts/eval_outputs.py, torch 2.15) when only train() and patch_trainer() registered it."""
    from accelerate import Accelerator
    from fixtures import tiny_llama
    from transformers import Trainer, TrainingArguments

    from hf_ddpfix import trainer as trainer_mod
    from hf_ddpfix.accelerate_loop import prepare_accelerate_loop

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    registered = _unregistered(monkeypatch)
    trainer_mod.DDPFixTrainer(model=tiny_llama(), args=args)
    assert registered == [1] and dist_ops._exit_teardown_pid == os.getpid()

    registered = _unregistered(monkeypatch)
    stock = Trainer(model=tiny_llama(), args=args)
    monkeypatch.setattr(trainer_mod, "_evaluate_under_plan", lambda trainer, loop, *a, **k: loop(*a, **k))
    assert trainer_mod.run_evaluation_with_plan(stock, lambda: "evaluated") == "evaluated"
    assert registered == [1]

    registered = _unregistered(monkeypatch)
    prepare_accelerate_loop(Accelerator(cpu=True), tiny_llama()).close()
    assert registered == [1]
