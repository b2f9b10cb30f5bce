"""The trainer zoo (TRL's trainers, the plain Trainer with losses of its own), one 2-process launch (tests/scripts/trainer_zoo.py, started the zero-code way: ``patches/``
first on PYTHONPATH): hf_ddpfix vs stock on the same data under DDP through ``patches/`` (every case) and
``patch_trainer()`` (one case per trainer class), under DeepSpeed ZeRO-2/3 against stock DDP, and what an FSDP2
request becomes without an accelerator. The "Trainers" table (docs/trainers.md) is rendered from the results
(tests/results/trainer_zoo.json, scripts/trainers_table.py), which a run of this module rewrites on the pinned
stack when a cell's class changed (``scripts/readme_blocks.refresh_results``, ``trainers_table.what_reproduces``:
the last bits of a difference move with the CPU): the table must be what stands after this run, and every cell
must stay in the class of the file as it stood before the run.

Why one launch through ``patches/`` and not one per entry point: the hook in ``patches/sitecustomize.py`` calls
the same ``patch_trainer()``; what differs is when (at the first import of ``transformers.trainer``, before
TRL's trainer classes exist, with no call in the script) — so every case runs through the hook, and the
explicit call (after TRL's classes exist) is run for one case per trainer class and for every ZeRO run, in the
same process: one interpreter start, one TRL / DeepSpeed import.

What each case is and why stock's setting is the reference: the script's docstring (the plain ``Trainer``
cases: tests/scripts/trainer_heads.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from launch import ROOT, torchrun

RESULTS = ROOT / "tests" / "results" / "trainer_zoo.json"
CASES = ("sft_vlm", "sft_text", "sft_text_unfused", "sft_packing", "sft_reenable", "dpo_text", "dpo_vlm",
         "reward_text", "grpo_text", "head_in_forward", "head_in_compute_loss", "some_outputs")
# the stock setting that trains: find_unused_parameters=True, except a head called in compute_loss (outside the
# forward), where stock fu=True fails ("ready only once") and fu=False trains
ZERO_CASES = ("sft_text", "sft_vlm", "dpo_text", "dpo_vlm", "reward_text")


def _table():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import trainers_table

    return trainers_table


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict:
    """Run the zoo once for the module; the records rank 0 wrote, by (case, column, route)."""
    import importlib.util

    zero: list[str] = []
    if importlib.util.find_spec("deepspeed") is not None:  # a test extra: without it the ZeRO tests skip
        from fixtures import build_deepspeed_shm_op

        build_deepspeed_shm_op()
        zero = ["--zero", "2,3"]
    out = tmp_path_factory.mktemp("zoo") / "zoo.json"
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "patches"), str(ROOT)]), "DS_ACCELERATOR": "cpu"}
    done = torchrun("trainer_zoo.py", "--route", "patches", "--fsdp-probe", *zero, "--out", str(out),
                    timeout=900, env=env)
    assert done.stdout.count("TRAINER_ZOO_OK") == 2, done.stdout[-4000:]
    assert done.stdout.count("Trainer patched at import by") == 2, done.stdout[-4000:]  # the hook, no call
    fresh = json.loads(out.read_text())
    # this run's measurement goes to the results file (pinned stack, when it changed): the README table is checked
    # against it below; `stored` is the file as it stood before, for the cell classes
    table = _table()
    shown, stored, written = table.readme_blocks.refresh_results(str(RESULTS), fresh, fresh["versions"],
                                                                 reproduces=table.what_reproduces)
    print(f"trainer zoo results: {'written to ' + str(RESULTS) if written else 'unchanged'}")
    return {"results": fresh, "shown": shown, "stored": stored,
            "by": {(r["case"], r["column"], r["route"]): r for r in fresh["records"]}}


@pytest.mark.multiprocess
def test_every_trl_trainer_trains_bit_equal_to_stock_through_patches_and_patch_trainer(zoo) -> None:
    by = zoo["by"]
    explicit = [c for c in CASES if (c, "DDP", "patch_trainer") in by]
    # one per trainer class: SFT, DPO, Reward, GRPO, the plain Trainer
    assert {"sft_vlm", "dpo_vlm", "reward_text", "grpo_text", "head_in_compute_loss"} <= set(explicit), explicit
    for case in CASES:
        for route in ("patches", "patch_trainer") if case in explicit else ("patches",):
            rec = by[(case, "DDP", route)]
            # the script asserted stock fu=True, hf_ddpfix fu=False and the parameter_usage counts on each rank
            # every trainable tensor moved, but lm_head's LoRA A and B in head_in_forward (the loss never
            # reaches them: stock leaves them, so must hf_ddpfix)
            assert rec["max_diff"] == 0.0 and rec["moved"] == rec["tensors"] - 2 * (case == "head_in_forward"), rec
            assert rec["stock_fu"] is (case != "head_in_compute_loss") and rec["fixed_fu"] is False, rec
    # the text-only rank tied every vision LoRA tensor into the loss given to backward, every step (SFT: TRL's
    # fused head computes the loss from hidden states; DPO: from log-probs), counted on rank 1 (rank 0: none)
    for case in ("sft_vlm", "dpo_vlm"):
        rec = by[(case, "DDP", "patches")]
        assert rec["vision_tensors"] > 0 and rec["vision_ties_in_loss"] == 3 * rec["vision_tensors"], rec
    # a trainer that re-enables checkpointing with the user's (reentrant) arguments every step: the plan's
    # function is put back before each step's training forward, through either entry point
    assert by[("sft_reenable", "DDP", "patches")]["reinstalled"] == 3
    # lm_head's LoRA (A and B), which the head loss never reaches, tied at the loss every step (4 steps); a
    # head outside the forward and a loss from part of the logits need no tie (trainer_heads.check_counts)
    assert by[("head_in_forward", "DDP", "patches")]["ties_at_loss"] == 2 * 4
    assert by[("head_in_compute_loss", "DDP", "patches")]["ties_at_loss"] == 0


@pytest.mark.multiprocess
def test_sft_dpo_and_reward_under_zero2_and_zero3_match_stock_ddp(zoo) -> None:
    by = zoo["by"]
    if not any(k[1].startswith("ZeRO") for k in by):
        pytest.skip("deepspeed not installed (test extra)")
    for case in ZERO_CASES:
        for stage in (2, 3):
            rec = by[(case, f"ZeRO-{stage}", "patch_trainer")]
            assert rec["moved"] == rec["tensors"] and rec["plan"]["checkpointing"] == "reentrant", rec
            if "sgd_max_diff" in rec:  # AdamW near-zero-gradient elements: trainer_zoo.ADAM_TOL
                assert rec["max_diff"] <= 5e-5 and rec["sgd_max_diff"] <= 1e-7, rec
            else:
                assert rec["max_diff"] <= 1e-5, rec
            if case in ("sft_vlm", "dpo_vlm"):  # the ZeRO dummy image ran on the text-only rank every step
                assert rec["plan"]["vlm_stabilizer"] is True and rec["dummies_rank1"] == 3, rec


@pytest.mark.multiprocess
def test_an_fsdp2_request_without_an_accelerator_trains_plain_ddp(zoo) -> None:
    """Why the table's FSDP2 column cannot be filled on a CPU machine: accelerate never selects FSDP there."""
    rec = zoo["by"][("fsdp2_request", "FSDP2", "stock")]
    assert rec["accelerator"] is False and rec["fsdp_enabled"] is False, rec
    assert rec["distributed_type"] == "MULTI_CPU" and rec["wrapper"] == "DistributedDataParallel", rec


@pytest.mark.multiprocess
def test_fresh_results_land_every_table_cell_in_the_committed_class(zoo) -> None:
    table = _table()
    assert zoo["stored"] is not None, f"{RESULTS} missing"
    fresh, committed = table.cell_classes(zoo["results"]), table.cell_classes(zoo["stored"])
    if not any(k[1].startswith("ZeRO") for k in zoo["by"]):
        committed = {k: v for k, v in committed.items() if "ZeRO" not in k}
        fresh = {k: v for k, v in fresh.items() if "ZeRO" not in k}
    moved = {k: (committed[k], fresh[k]) for k in committed if committed[k] != fresh[k]}
    assert not moved, f"cells moved (committed, fresh): {moved}; if intended: commit the rewritten " \
                      "tests/results/trainer_zoo.json and run python scripts/trainers_table.py --readme"
    assert "FAILED" not in fresh.values()


@pytest.mark.multiprocess
def test_readme_trainers_table_is_what_this_run_measured(zoo) -> None:
    """The table in the README is the rendering of the records that stand after THIS run: its own where a cell's
    class moved (then the file was rewritten and the table is stale until rendered again), else the stored ones."""
    table = _table()
    if not table.readme_blocks.on_pinned_stack(zoo["results"]["versions"]):
        pytest.skip(f"the README documents the pinned stack (constraints.txt), this is {zoo['results']['versions']}")
    block = table.readme_blocks.file_block(table.README, table.BEGIN, table.END)
    assert block == table.render(zoo["shown"]), ("README Trainers table differs from what this run measured: commit "
                                                 "tests/results/trainer_zoo.json and run scripts/trainers_table.py --readme")


def test_readme_trainers_table_is_rendered_from_the_committed_results() -> None:
    table = _table()
    block = table.readme_block(Path(table.README).read_text())  # ValueError without the markers
    assert block == table.render(table.load(str(RESULTS))), "docs/trainers.md Trainers table is stale: python " \
                                                            "scripts/trainers_table.py --readme"
    classes = table.cell_classes(table.load(str(RESULTS)))
    assert "FAILED" not in classes.values() and classes["dpo_vlm / DDP"] == "bit-equal"


def test_results_file_is_rewritten_only_when_a_run_measured_something_else(tmp_path) -> None:
    """scripts/readme_blocks.refresh_results: an unchanged run (its date aside) leaves the file; a changed one on
    the pinned stack rewrites it and the table shows the new numbers; another stack writes nothing."""
    blocks = _table().readme_blocks
    pinned = {"torch": blocks.pinned_versions()["torch"] + "+cpu", "transformers": blocks.pinned_versions()["transformers"]}
    path = tmp_path / "r.json"
    first = {"date": "2026-01-01", "versions": pinned, "records": [{"case": "a", "max_diff": 0.0}]}
    shown, stored, written = blocks.refresh_results(str(path), first, pinned)
    assert (shown, stored, written) == (first, None, True) and json.loads(path.read_text()) == first
    same = {**first, "date": "2026-02-02"}
    shown, stored, written = blocks.refresh_results(str(path), same, pinned)
    assert shown["date"] == "2026-01-01" and not written  # the numbers did not change: nor does the file
    # what a rerun must reproduce, when given, decides: a difference in its last bits, same class, keeps the file
    def classes(r: dict) -> list[bool]:
        return [rec["max_diff"] <= 1e-6 for rec in r["records"]]
    last_bits = {**same, "records": [{"case": "a", "max_diff": 3e-8}]}
    shown, _, written = blocks.refresh_results(str(path), last_bits, pinned, reproduces=classes)
    assert shown == first and not written and json.loads(path.read_text()) == first
    moved = {**same, "records": [{"case": "a", "max_diff": 1e-7}]}
    shown, stored, written = blocks.refresh_results(str(path), moved, pinned)
    assert shown == moved and stored == first and written and json.loads(path.read_text()) == moved
    other = {**pinned, "transformers": "0.0.1"}
    shown, _, written = blocks.refresh_results(str(path), {**moved, "records": []}, other)
    assert shown["records"] == [] and not written and json.loads(path.read_text()) == moved
