"""What hf_ddpfix adds to a training step and an evaluation step, counted exactly on every engine
(benchmarks/step_overhead.py, 2 gloo ranks, stock Trainer vs the patched Trainer, steady state): DDP, FSDP2 through
the Trainer (accelerate launch with fsdp.yaml and the FSDP test device; the plan's units, and tower units with the
dummy image for the VLM), ZeRO-2 and ZeRO-3 (DeepSpeed on the CPU), and ``evaluate()`` / ``predict()`` under each.
Counts only: the times are the benchmark's, never a test's. One launch per engine family (DDP, FSDP2, ZeRO-2 and
ZeRO-3 together), several cases inside; the table in docs/fast-path.md is rendered from what this run measured
(scripts/fast_path_table.py, tests/results/engine_overhead.json).

DDP: no host read per micro-batch, at most one per optimizer step and only on a rank that left a parameter unused
(none for text LoRA), where stock's reducer makes the same read of its used map (counted from torch's rule,
``benchmarks/step_overhead.py: Counts.reducer_waits``; with it left uncounted the DDP VLM row shows +1 read), and no
collective beyond the one it replaces (stock's find_unused_parameters used-map
all-reduce becomes the usage agreement, one byte per trainable tensor). The trainable-set watch (issue 28,
``integrations/usage/trainable_set.py``) adds nothing either: its "my trainable set changed" flag rides in the usage
agreement's all-reduce (two more bytes) and is read at the step only by a rank that changed its set or has a
parameter to reset; every other rank reads those two bytes from host memory at ``on_step_end`` (no device read;
asserted from the agreement's own counters), so it too raises where another rank changed its set.

Issue 48 (the other engines at the floor): FSDP2 added 3 host reads + 2 collectives per optimizer step (text LoRA;
5 + 3 at GA 2: the trainable-set check's one-byte all-gather before every forward, read at once, and the agreement
read at once), ZeRO-2/3 1 all-gather + 2 host reads per micro-batch (the same check), ``evaluate()`` 8 host reads +
1 ``all_gather_object`` per evaluation step (the output-field exchange). Now: FSDP2 text adds the usage agreement's
all-reduce (stock FSDP2 has no used map to replace: the one collective it needs to reset what no rank used) and no
read, with tower units and the dummy the dummy's image flag in the same all-reduce (one byte more); ZeRO one
two-byte all-reduce per optimizer step (the trainable-set flag, read late); evaluation no collective and no host
read (hf_ddpfix's ``pad_across_processes`` reads each tensor's gathered sizes once from the host copy stock's
``.cpu()`` made: a host-copy read, counted apart). Each engine's assertion below names what it measured on 2410770
(before this work), where it fails."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
from launch import ROOT, accelerate_launch, fsdp_device_env, torchrun

BENCH = ROOT / "benchmarks" / "step_overhead.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
sys.path.insert(0, str(ROOT / "scripts"))
import fast_path_table  # noqa: E402

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
#: FSDP2 with the dummy vs stock DDP on mixed ranks, largest |weight difference| after 5 steps (measured 2026-12-02:
#: 3.0e-8 rank 0, 6.0e-8 rank 1; 2026-12-03 on another CPU the ranks swapped): the table's class bound
TOL_FSDP_DDP = fast_path_table.TOL_VS_OTHER_ENGINE


def _collectives(added: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in added.items() if k.startswith("collective:")}


def _reads(added: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in added.items() if k.startswith("read:")}


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict:
    """Every engine's counts, keyed ``engine/case`` (one launch per engine family)."""
    tmp = tmp_path_factory.mktemp("counts")
    merged: dict = {}
    out, ref = tmp / "ddp.json", tmp / "reference"  # stock DDP's VLM weights: the FSDP2 VLM's reference
    torchrun(BENCH, "--worker", "--pairs", "0", "--count-steps", "5", "--cases", "text,text_ga2,vlm,eval",
             "--save-reference", str(ref), "--out", str(out), timeout=420)
    merged.update({f"ddp/{k}": v for k, v in json.loads(out.read_text())["counts"].items()})
    out = tmp / "fsdp.json"
    done = accelerate_launch("fsdp.yaml", BENCH, "--worker", "--engine", "fsdp", "--pairs", "0", "--count-steps", "5",
                             "--cases", "text,text_ga2,vlm,eval", "--reference", str(ref), "--out", str(out), timeout=420,
                             env=fsdp_device_env(OFFLINE), extra=("--mixed_precision", "no"))
    assert "[fsdp_device]" in done.stdout + done.stderr, done.stdout[-2000:]
    merged.update(json.loads(out.read_text())["counts"])
    if HAS_DEEPSPEED:
        from fixtures import build_deepspeed_shm_op

        build_deepspeed_shm_op()  # cached; outside the launch's hard timeout
        out = tmp / "zero.json"
        torchrun(BENCH, "--worker", "--engine", "zero2,zero3", "--pairs", "0", "--count-steps", "5",
                 "--cases", "text,text_ga2,eval", "--out", str(out), timeout=420,
                 env={"DS_ACCELERATOR": "cpu", **OFFLINE})
        merged.update(json.loads(out.read_text())["counts"])
    return merged


def fresh_results(counts: dict) -> dict:
    """What tests/results/engine_overhead.json records of this run (scripts/fast_path_table.py renders it)."""
    import accelerate
    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "accelerate": accelerate.__version__}
    if HAS_DEEPSPEED:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    cases = {}
    for key, per in counts.items():
        # FSDP2's VLM: stock FSDP2 cannot train mixed image / text ranks; its weights are compared with stock DDP's
        cases[key] = {"added_by_rank": per["added_by_rank"], "weights_vs": per["weights_vs"],
                      "weights_max_diff_by_rank": [w["max_diff"] for w in per["weights_by_rank"]]}
    from datetime import date

    return {"date": str(date.today()), "device": "CPU, 2 gloo processes", "versions": versions,
            "steady": "optimizer steps 4-5 of 5, every evaluation step after a loop's first", "cases": cases}


@pytest.mark.multiprocess
def test_ddp_adds_no_host_read_per_micro_batch_and_no_collective(counts):
    for case in ("text", "text_ga2", "vlm"):
        per = counts[f"ddp/{case}"]
        assert per["stock"]["ddp"]["find_unused_parameters"] is True, case
        assert per["patched"]["ddp"]["find_unused_parameters"] is False, case  # the DDP plan ran
        for rank, added in enumerate(per["added_by_rank"]):
            # the same collectives, kind by kind, and no more bytes (the agreement's one byte per trainable tensor
            # and the watch's two replace stock's used map of 4 bytes per tensor)
            assert _collectives(added) == {}, (case, rank, added)
            assert all(v <= 0 for k, v in added.items() if k.startswith("bytes:")), (case, rank, added)
            # text LoRA: nothing tied, nothing read; the VLM's text-only rank (1) reads the agreed mask once per
            # optimizer step (it has vision parameters to reset) where stock's reducer reads its all-reduced used
            # map (the same wait, in C++: ``Counts.reducer_waits``); the image rank (0) reads nothing, in either
            expected = {"read:tolist": 1, "read:reducer_used_map": -1} if (case == "vlm" and rank == 1) else {}
            assert _reads(added) == expected, (case, rank, added)
            assert fast_path_table.reads_total(added) == 0, (case, rank, added)
        # every agreement is read once on every rank: at the step (a rank with something to reset) or, on the
        # others, its two trainable-set flag bytes late, from host memory (on_step_end, outside the window above:
        # no device read; on a GPU a completed event's pinned copy), so a rank that changed nothing still learns
        # that another did and raises before its next collective (tests/test_trainable_set.py)
        for rank, agreement in enumerate(per["patched"]["ddp_by_rank"]):
            assert agreement["agreement_late_waits"] == 0, (case, rank, agreement)
            assert agreement["agreement_reads"] + agreement["agreement_late_reads"] == agreement["agreement_issued"] > 0, (
                case, rank, agreement)
        assert all(w["max_diff"] == 0.0 for w in per["weights_by_rank"]), (case, per["weights_by_rank"])


@pytest.mark.multiprocess
def test_fsdp2_adds_one_all_reduce_per_optimizer_step_and_no_host_read(counts):
    """FSDP2 through the Trainer with the plan's units (text LoRA, GA 1 and 2): the usage agreement's all-reduce (one
    byte per trainable tensor and two flag bytes; stock FSDP2 has no used map it could replace) and nothing else; no
    host read (its flags read late, from host memory, at ``on_step_end``); weights bit-equal to stock FSDP2. On
    2410770: +1 ``allgather_`` and +2 ``tolist`` per micro-batch (the trainable-set check) and +1 ``tolist`` per
    step (the flags read at once)."""
    for case in ("text", "text_ga2"):
        per = counts[f"fsdp/{case}"]
        assert all(i["fsdp"] and i["wrapped"].startswith("FSDP") for m in ("stock", "patched")
                   for i in per[m]["ddp_by_rank"]), per["patched"]["ddp_by_rank"]
        for rank, added in enumerate(per["added_by_rank"]):
            assert _collectives(added) == {"collective:allreduce_": 1}, (case, rank, added)
            assert added["bytes:allreduce_"] == 8 + 2, (case, rank, added)  # 8 LoRA tensors + the two flag bytes
            assert _reads(added) == {}, (case, rank, added)
        for rank, agreement in enumerate(per["patched"]["ddp_by_rank"]):
            assert agreement["agreement_late_reads"] == agreement["agreement_issued"] > 0, (case, rank, agreement)
            assert agreement["agreement_late_waits"] == 0, (case, rank, agreement)
        assert all(w["max_diff"] == 0.0 for w in per["weights_by_rank"]), (case, per["weights_by_rank"])


@pytest.mark.multiprocess
def test_fsdp2_tower_units_with_the_dummy_add_one_all_reduce_and_no_read_on_the_image_rank(counts):
    """The VLM under FSDP2 with the tower in units of its own and the dummy image on the text rank (rank 1): the
    dummy's "some rank saw an image" rides in the usage agreement (one byte; ``StepImages.fold_into``), so the step
    adds that one all-reduce and nothing else; the image rank (0) knows the answer and reads nothing; the text rank
    reads the agreement once per optimizer step (it must know before clipping whether another rank saw an image: no
    rank did -> its tower gradients become ``None``, as stock DDP leaves them), in place of the dummy's ``item``.
    Stock FSDP2 fails on mixed ranks: the counts' reference has images on both ranks (rank 1's reads compare a text
    rank with an image rank), the weights' is stock DDP (``find_unused_parameters=True``) on the same mixed ranks.
    Fails without the fold (shown 2026-12-02: the same benchmark on 0c9bdba, before it, gave +2 ``allreduce_`` (48
    bytes) on both ranks and rank 0 +1 ``item``)."""
    per = counts["fsdp/vlm"]
    for rank, added in enumerate(per["added_by_rank"]):
        assert _collectives(added) == {"collective:allreduce_": 1}, (rank, added)
    assert _reads(per["added_by_rank"][0]) == {}, per["added_by_rank"]
    assert fast_path_table.reads_total(per["added_by_rank"][1]) <= 0, per["added_by_rank"]
    issued = [a["agreement_issued"] for a in per["patched"]["ddp_by_rank"]]
    assert [a["agreement_reads"] for a in per["patched"]["ddp_by_rank"]] == [0, issued[1]] and issued[0] > 0, (
        per["patched"]["ddp_by_rank"])
    # FSDP2 (reduce-scatter, sharded clipping norm) vs DDP (all-reduce, whole-tensor norm): the same sums, divided by
    # 2 either way; the clipping norm's order of summation differs in the last bits. Measured 2026-12-02: TOL_FSDP_DDP
    assert per["weights_vs"] == "stock DDP", per["weights_vs"]
    assert all(w["same_names"] and w["tensors"] > 0 and w["max_diff"] <= TOL_FSDP_DDP
               for w in per["weights_by_rank"]), per["weights_by_rank"]


@pytest.mark.multiprocess
def test_evaluation_adds_no_collective_and_no_host_read_per_step_on_every_engine(counts):
    """``evaluate()`` and ``predict()`` with predictions gathered: after a loop's first step (the one exchange of the
    output fields) no collective and no host read per evaluation step. hf_ddpfix's ``pad_across_processes`` reads
    each tensor's gathered sizes once (``tolist``) from the host copy stock's own ``.cpu()`` made (stock compares
    them element by element: two ``__bool__``); reads of a host copy wait for nothing and are counted apart
    (``copyread:``, benchmarks/step_overhead.py). On 2410770: +1 ``allgather`` (``all_gather_object``) and +8 host
    reads per step; with host copies counted as reads (the counting of 0c9bdba) +2 ``tolist``, -4 ``__bool__``:
    this assertion fails there."""
    engines = ["ddp", "fsdp"] + (["zero2", "zero3"] if HAS_DEEPSPEED else [])
    for engine in engines:
        per = counts[f"{engine}/eval"]
        for rank, added in enumerate(per["added_by_rank"]):
            assert _collectives(added) == {}, (engine, rank, added)
            assert _reads(added) == {}, (engine, rank, added)
        for rank, info in enumerate(per["patched"]["ddp_by_rank"]):
            assert info["eval_exchanges"] == 1 and info["eval_forwards"] > 1, (engine, rank, info)


@pytest.mark.multiprocess
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed (test extra)")
def test_zero_adds_at_most_one_collective_per_optimizer_step_and_no_host_read(counts):
    """ZeRO-2 and ZeRO-3, text LoRA GA 1 and 2: the trainable-set flag's two-byte all-reduce once per optimizer step
    (the engine reduces inside backward: the check must come before the first forward; read late, from host memory),
    no host read, weights bit-equal to stock. On 2410770: +1 ``allgather_`` and +2 ``tolist`` per micro-batch."""
    for engine in ("zero2", "zero3"):
        for case in ("text", "text_ga2"):
            per = counts[f"{engine}/{case}"]
            assert all(i["deepspeed"] for i in per["patched"]["ddp_by_rank"]), per["patched"]["ddp_by_rank"]
            for rank, added in enumerate(per["added_by_rank"]):
                assert _collectives(added) == {"collective:allreduce_": 1}, (engine, case, rank, added)
                assert _reads(added) == {}, (engine, case, rank, added)
            assert all(w["max_diff"] == 0.0 for w in per["weights_by_rank"]), (engine, case, per["weights_by_rank"])


@pytest.mark.multiprocess
def test_fast_path_table_is_what_this_run_measured(counts):
    """docs/fast-path.md's engine table is the rendering of the results that stand after THIS run (the file
    rewritten when a count or a difference's class changed)."""
    readme_blocks = fast_path_table.readme_blocks
    fresh = fresh_results(counts)
    shown, _, written = readme_blocks.refresh_results(fast_path_table.RESULTS, fresh, fresh["versions"],
                                                      reproduces=fast_path_table.what_reproduces)
    print(f"engine counts: {'written to ' + fast_path_table.RESULTS if written else 'unchanged'}")
    if not readme_blocks.on_pinned_stack(fresh["versions"]):
        pytest.skip(f"docs/fast-path.md documents the pinned stack (constraints.txt), this is {fresh['versions']}")
    block = readme_blocks.file_block(fast_path_table.README, fast_path_table.BEGIN, fast_path_table.END)
    assert block == fast_path_table.render(shown), (
        "docs/fast-path.md engine table differs from what this run measured: commit tests/results/engine_overhead.json "
        "and run python scripts/fast_path_table.py --readme")


def test_fast_path_table_is_rendered_from_the_committed_results():
    results = fast_path_table.load()
    block = fast_path_table.readme_blocks.file_block(fast_path_table.README, fast_path_table.BEGIN, fast_path_table.END)
    assert block == fast_path_table.render(results), "docs/fast-path.md engine table is stale: python " \
                                                     "scripts/fast_path_table.py --readme"
    # the floor, as committed: no engine adds a host read per step (the VLM's text-only rank under DDP reads the
    # agreement where stock's reducer reads its used map: +1 and -1, docs/fast-path.md), at most one collective per
    # optimizer step, none per evaluation step; every case's weights compared
    for engine, case, rank, added, diff in fast_path_table.rows_of(results):
        assert fast_path_table.collectives_total(added) <= (0 if case == "eval" else 1), (engine, case, rank, added)
        assert fast_path_table.reads_total(added) <= 0, (engine, case, rank, added)
        if added.get("read:reducer_used_map", 0) == 0:
            assert not any(v > 0 for k, v in added.items() if k.startswith("read:")), (engine, case, rank, added)
        assert diff is not None, (engine, case, rank)
    assert os.path.exists(fast_path_table.RESULTS)
