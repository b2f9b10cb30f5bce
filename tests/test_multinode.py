"""Multi-node as users launch it: 2 localhost "nodes" x 1 process (one torch.distributed.run launcher per node,
c10d rendezvous on 127.0.0.1), under hf_ddpfix: weights equal to a `--standalone` 2-process run, the plan
logged once (by the world's process zero). A text LoRA run (tests/scripts/train_text.py) and a tiny Qwen2.5-VL
with LoRA on every linear incl. the vision tower, rank 0 always with an image, rank 1 never
(tests/scripts/train_vlm.py, 3 steps, AdamW with weight decay, clipping: parameter_usage ties the vision
parameters the text rank does not reach into its loss and agrees usage over the world, across the nodes)."""

from __future__ import annotations

import re

import pytest
import torch
from launch import torchrun, torchrun_nodes

ABORT = "terminate called"  # gloo threads outliving their group at interpreter exit (SIGABRT)


@pytest.mark.multiprocess
def test_two_nodes_of_one_process_train_like_standalone_and_log_the_plan_once(tmp_path):
    nodes, standalone = tmp_path / "nodes.pt", tmp_path / "standalone.pt"
    done = torchrun_nodes("train_text.py", "--entry", "subclass", "--out", str(nodes), timeout=300)
    torchrun("train_text.py", "--entry", "subclass", "--out", str(standalone), nproc=2, timeout=300)
    got, ref = torch.load(nodes, weights_only=False), torch.load(standalone, weights_only=False)
    assert got["weights"].keys() == ref["weights"].keys()
    for name, w in ref["weights"].items():
        assert torch.equal(got["weights"][name], w), name
    logs = "".join(d.stdout for d in done)
    assert logs.count("hf_ddpfix plan (ddp, world size 2)") == 1, logs[-4000:]
    assert ABORT not in logs, logs[-4000:]  # real launchers: an abort at exit would show here (forked runs hide it)
    assert sum("SAVED" in d.stdout for d in done) == 1  # global rank 0 only, on one node


@pytest.mark.multiprocess
def test_two_nodes_of_one_process_train_a_vlm_with_mixed_ranks_like_standalone(tmp_path):
    nodes, standalone = tmp_path / "nodes.pt", tmp_path / "standalone.pt"
    args = ("--entry", "patch", "--layout", "mixed", "--steps", "3")
    done = torchrun_nodes("train_vlm.py", *args, "--out", str(nodes), timeout=240)
    torchrun("train_vlm.py", *args, "--out", str(standalone), nproc=2, timeout=240)
    got, ref = torch.load(nodes, weights_only=False), torch.load(standalone, weights_only=False)
    assert got["weights"].keys() == ref["weights"].keys()
    assert any("visual" in name for name in ref["weights"])  # LoRA on the vision tower too
    for name, w in ref["weights"].items():
        assert torch.equal(got["weights"][name], w), name
    logs = "".join(d.stdout for d in done)
    assert logs.count("hf_ddpfix plan (ddp, world size 2)") == 1, logs[-4000:]
    assert re.search(r"parameter_usage\s+= on", logs), logs[-4000:]  # the mixed-rank machinery ran
    assert ABORT not in logs, logs[-4000:]  # real launchers: an abort at exit would show here
    assert sum("SAVED" in d.stdout for d in done) == 1  # global rank 0 only, on one node
