"""What hf_ddpfix adds to a DDP training step, counted exactly (benchmarks/step_overhead.py, 2 gloo ranks,
stock Trainer vs the patched Trainer, steady-state optimizer steps): no host read per micro-batch, at most one
per optimizer step and only on a rank that left a parameter unused (none for text LoRA), and no collective
beyond the one it replaces (stock's find_unused_parameters used-map all-reduce becomes the usage agreement,
one byte per trainable tensor). Counts only: the times are the benchmark's, never a test's.

The trainable-set watch (issue 28, ``integrations/trainable_set.py``: a parameter unfrozen after wrapping is
reduced or refused at that step, never a silent drift) adds nothing either: its "my trainable set changed" flag
rides in the usage agreement's all-reduce (two more bytes) and is read at the step only by a rank that changed its
set or has a parameter to reset; every other rank reads those two bytes from host memory at ``on_step_end`` (no
device read; asserted from the agreement's own counters), so it too raises where another rank changed its set."""

from __future__ import annotations

import json

import pytest
from launch import ROOT, torchrun

BENCH = ROOT / "benchmarks" / "step_overhead.py"


@pytest.mark.multiprocess
def test_hf_ddpfix_adds_no_host_read_per_micro_batch_and_no_collective(tmp_path):
    out = tmp_path / "counts.json"
    torchrun(BENCH, "--worker", "--pairs", "0", "--count-steps", "5", "--out", str(out), timeout=420)
    counts = json.loads(out.read_text())["counts"]
    assert set(counts) == {"text", "text_ga2", "vlm"}
    for case, per in counts.items():
        assert per["stock"]["ddp"]["find_unused_parameters"] is True, case
        assert per["patched"]["ddp"]["find_unused_parameters"] is False, case  # the DDP plan ran
        for rank, added in enumerate(per["added_by_rank"]):
            reads = {k: v for k, v in added.items() if k.startswith("read:")}
            collectives = {k: v for k, v in added.items() if k.startswith("collective:")}
            # the same collectives, kind by kind, and no more bytes (the agreement's one byte per trainable tensor
            # and the watch's two replace stock's used map of 4 bytes per tensor)
            assert collectives == {}, (case, rank, added)
            assert all(v <= 0 for k, v in added.items() if k.startswith("bytes:")), (case, rank, added)
            # text LoRA: nothing tied, nothing read; the VLM's text-only rank (1) reads the agreed mask once per
            # optimizer step (it has vision parameters to reset), the image rank (0) nothing
            expected = {"read:tolist": 1} if (case == "vlm" and rank == 1) else {}
            assert reads == expected, (case, rank, added)
        # every agreement is read once on every rank: at the step (a rank with something to reset) or, on the
        # others, its two trainable-set flag bytes late, from host memory (on_step_end, outside the window above:
        # no device read; on a GPU a completed event's pinned copy), so a rank that changed nothing still learns
        # that another did and raises before its next collective (tests/test_trainable_set.py)
        for rank, agreement in enumerate(per["patched"]["ddp_by_rank"]):
            assert agreement["agreement_late_waits"] == 0, (case, rank, agreement)
            assert agreement["agreement_reads"] + agreement["agreement_late_reads"] == agreement["agreement_issued"] > 0, (
                case, rank, agreement)
