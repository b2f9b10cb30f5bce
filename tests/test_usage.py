"""Tests for hf_ddpfix.integrations.usage (ParameterUsage): observation, exact-zero ties, finalize, the
guard, and the plan oracle from the model zoo. Single-process tests build tiny random-weight models
(tests/zoo.py); the multi-process tests run tests/scripts/usage_*.py as 2 gloo processes on CPU, one
launch per mode looping over every family."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "scripts"))

from launch import torchrun  # noqa: E402
from zoo import ZOO  # noqa: E402

from hf_ddpfix import DDPFixConfig, RunFacts, resolve_plan  # noqa: E402
from hf_ddpfix.facts.gather import has_conditional_params  # noqa: E402
from hf_ddpfix.integrations.checkpointing import apply_checkpointing  # noqa: E402
from hf_ddpfix.integrations.usage import ParameterUsage, UnusedParametersError, reachable_leaf_ids  # noqa: E402

torch.set_num_threads(1)


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


# --- observation ------------------------------------------------------------------------------------


def test_graph_walk_skips_a_module_whose_output_is_discarded() -> None:
    used, discarded = nn.Linear(3, 3), nn.Linear(3, 3)
    x = torch.randn(2, 3)
    discarded(x)  # ran, output thrown away
    loss = used(x).sum()
    ids = reachable_leaf_ids([loss])
    assert {id(used.weight), id(used.bias)} <= ids
    assert id(discarded.weight) not in ids and id(discarded.bias) not in ids


def test_gemma3_text_step_ties_the_tower_and_the_unused_siglip_head_bit_exactly() -> None:
    """Gemma 3 runs SigLIP's pooling head but never uses its output: forward hooks would call it used;
    the graph walk ties it in. Loss and every used gradient are bit-identical to the untouched model."""
    entry = ZOO["gemma3"]
    for has_image in (True, False):
        batch = entry.batch(has_image, 3, 16)
        ref = entry.model(0)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        model = entry.model(0)
        usage = ParameterUsage(model).attach()
        loss = model(**batch).loss
        loss.backward()
        assert torch.equal(loss, ref_loss)
        g, g_ref = grads(model), grads(ref)
        tied = set(usage.last.tied)
        assert any(".head." in n for n in tied)  # SigLIP's head: ran, never reached the loss
        assert has_image or any("vision_tower." in n and ".encoder." in n for n in tied)  # < 5.23: .vision_model.
        for n, v in g.items():
            if n in tied:
                assert g_ref[n] is None and v is not None and not v.any(), n  # exact zeros
            else:
                assert torch.equal(v, g_ref[n]), n
        assert usage.finalize() == len(tied)  # single process: no rank used them -> None again
        assert all(p.grad is None for n, p in model.named_parameters() if n in tied)
        usage.remove()


def test_reentrant_layers_are_observed_without_ties_or_double_use() -> None:
    entry = ZOO["qwen3_moe"]  # LoRA on q/v and on the fused expert tensors (peft target_parameters)
    model = entry.model(0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    apply_checkpointing(model, use_reentrant=True)
    usage = ParameterUsage(model, allow_region_reuse=False).attach()
    model(**entry.batch(False, 1, 16)).loss.backward()
    assert usage.last.tied == [] and usage.last.region_used, usage.last
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_eval_and_no_grad_forwards_are_not_observed() -> None:
    entry = ZOO["llava"]
    model = entry.model(0)
    usage = ParameterUsage(model).attach()
    with torch.no_grad():
        model(**entry.batch(False, 1, 12))
    model.eval()
    model(**entry.batch(False, 1, 12))
    assert usage.forwards == 0 and usage.finalize() is None
    usage.remove()
    assert not usage.attached


def test_guard_without_a_process_group_raises_naming_the_module() -> None:
    entry = ZOO["llava"]
    model = entry.model(0)
    ParameterUsage(model, tie=False, guard=True).attach()
    with pytest.raises(UnusedParametersError, match=r"vision_tower.*ddp_find_unused_parameters=True"):
        model(**entry.batch(False, 1, 12))


# --- the zoo as the plan's oracle -------------------------------------------------------------------


def observed_unused(name: str) -> set[str]:
    entry = ZOO[name]
    model = entry.model(0)
    usage = ParameterUsage(model, tie=False, guard=False).attach()
    model(**entry.batch(False, 7, 16))
    return {n for n, p in model.named_parameters() if p.requires_grad} - set(usage.last.used)


@pytest.mark.parametrize("name", list(ZOO))
def test_plan_is_safe_for_what_the_zoo_leaves_unused(name: str) -> None:
    """Oracle: the parameters a text-only forward leaves without a gradient, observed. Where any go
    unused, the default DDP plan must tie them in (parameter_usage) and the plan without the mechanism
    must keep stock's find_unused_parameters=True; fused MoE experts are never reported conditional."""
    unused = observed_unused(name)
    model = ZOO[name].model(0)
    facts = RunFacts(parallel="ddp", world_size=2, is_peft=True, checkpointing="non_reentrant",
                     conditional_params=has_conditional_params(model))
    plan = resolve_plan(facts)
    assert plan.parameter_usage.value is True and plan.ddp_kwargs()["find_unused_parameters"] is False
    off = resolve_plan(facts, DDPFixConfig.from_env({"HF_DDPFIX_PARAMETER_USAGE": "0"}))
    assert off.ddp_kwargs() == {"find_unused_parameters": True, "static_graph": False}
    if name == "qwen3_moe":
        assert not unused and not facts.conditional_params  # fused expert tensors: always a gradient
    expected_unused = ZOO[name].vlm or name == "bart_layerdrop"
    assert bool(unused) == expected_unused, (name, sorted(unused)[:4])


# --- multi-process ----------------------------------------------------------------------------------


# What hf_ddpfix's old plan (DDP fu=False + static graph, no tie) does to the families that can leave parameters
# unused, per rank (usage_zoo.py --old-plan): the error itself, or a hang (a collective timed out).
OLD_PLAN_OUTCOMES = {
    "bart_layerdrop": {
        0: r"RuntimeError after \d+s: Your training graph has changed in this iteration, e\.g\., one parameter is "
           r"unused in first iteration, but then got used in the second iteration\. this is not compatible with "
           r"static_graph set to True\.",
        1: r"RuntimeError after \d+s: Your training graph has changed in this iteration, e\.g\., one parameter is "
           r"unused in first iteration, but then got used in the second iteration\.",
    },
    "mllama": {  # rank 0 (image at step 1) finds its reduction unfinished; rank 1 waits in its all-reduce
        # under load rank 0 can reach its timed-out wait first (CI, 2026-12-02): both are the old plan failing
        0: r"(RuntimeError after \d+s: Expected to have finished reduction in the prior iteration before starting "
           r"a new one\. This error indicates that your training graph has changed|hang after \d+s: .*Timed out)",
        # rank 1 either waits out its 15 s collective timeout, or (on a quiet machine, rank 0 having failed
        # first) its wait ends at once with an error from the group: both are the old plan failing, never training
        1: r"(hang after \d+s: .*Timed out waiting 15000ms|RuntimeError after \d+s: )",
    },
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("ga", [1, 2])
def test_zoo_trains_like_stock_find_unused_under_reentrant_checkpointing(ga: int, tmp_path) -> None:
    """Every family, hf_ddpfix (fu=False, ties) vs stock fu=True; at ga 1 the old plan beside the fix for
    LayerDrop (README row "Your training graph has changed": static graph + a changing graph) and Mllama."""
    report = tmp_path / "zoo.json"
    old = ["--old-plan", ",".join(OLD_PLAN_OUTCOMES)] if ga == 1 else []
    done = torchrun("usage_zoo.py", "--ga", str(ga), "--report", str(report), *old, timeout=420)
    assert done.stdout.count("USAGE_ZOO_OK") == 2, done.stdout[-3000:]
    for name, ranks in OLD_PLAN_OUTCOMES.items() if ga == 1 else ():
        for rank, outcome in ranks.items():
            line = re.search(rf"\[rank {rank} .*\] {name} old plan \(fu=False \+ static graph, no tie\): (.*)",
                             done.stdout)
            assert line, (name, rank, done.stdout[-3000:])
            assert re.match(outcome, line.group(1)), (name, rank, line.group(1))
    data = json.loads(report.read_text())
    assert set(data) == set(ZOO)
    for name, row in data.items():
        assert row["max_diff"] <= 1e-6 and row["moved"] >= row["n"] - 6, (name, row)
        assert bool(row["text_step_unused"]) == (ZOO[name].vlm or name == "bart_layerdrop"), name


@pytest.mark.multiprocess
def test_a_disconnected_module_raises_on_both_ranks_within_30s() -> None:
    done = torchrun("usage_guard.py", "--case", "guard", timeout=120, check=False)
    assert done.returncode != 0
    for rank in (0, 1):
        found = re.search(rf"\[rank {rank}\] UnusedParametersError after ([0-9.]+)s", done.stdout)
        assert found, done.stdout[-3000:]
        assert float(found.group(1)) < 30  # from the model's build to the error, every rank
    assert "probe" in done.stdout and "ddp_find_unused_parameters=True" in done.stdout


@pytest.mark.multiprocess
def test_a_disconnected_module_is_tied_in_and_trains_like_stock() -> None:
    done = torchrun("usage_guard.py", "--case", "tie", timeout=180)
    assert done.stdout.count("USAGE_TIE_OK") == 2


#: family -> the named stock failure that makes its FSDP2 verdict "fail" expected (stock FSDP2 fails the same way,
#: said in docs/models.md). Empty: every VLM of the zoo must pass; a "fail" verdict anywhere else fails the test.
FSDP2_EXPECTED_FAILURES: dict[str, str] = {}

FSDP2_RESULTS = os.path.join(os.path.dirname(HERE), "tests", "results", "fsdp2_parity.json")


def _supported_models():
    """scripts/supported_models.py as a module."""
    import importlib.util

    path = os.path.join(os.path.dirname(HERE), "scripts", "supported_models.py")
    spec = importlib.util.spec_from_file_location("supported_models", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.mark.multiprocess
def test_fsdp2_mixed_batches_match_stock_ddp_with_the_committed_verdicts(tmp_path) -> None:
    """fully_shard on gloo, no dummy image: folded skippable subtrees + per-unit ties, against stock DDP
    (find_unused_parameters=True, non-reentrant checkpointing) on the same data, every VLM in one process
    group. The fresh per-family verdicts (max |dW| <= tol) must be the ones the results file held; the run
    rewrites the file when a verdict changed (pinned stack) and docs/models.md's FSDP2 column must be what stands
    after THIS run."""
    report = tmp_path / "fsdp2.json"
    done = torchrun("usage_fsdp.py", "--report", str(report), timeout=300)
    assert done.stdout.count("USAGE_FSDP_OK") == 2, done.stdout[-3000:]
    sm = _supported_models()
    measured = json.loads(report.read_text())
    shown, stored, _ = sm.readme_blocks.refresh_results(FSDP2_RESULTS, measured, measured["measured_on"],
                                                        sort_keys=True, reproduces=sm.fsdp2_reproduces)
    fresh, committed = measured["families"], stored["families"]
    vlms = {name for name, entry in ZOO.items() if entry.vlm}
    assert set(fresh) == set(committed) == vlms
    for name in sorted(vlms):
        got, want = fresh[name], committed[name]
        assert (got["setup"], got["tol"], got["pass"]) == (want["setup"], want["tol"], want["pass"]), (
            f"{name}: fresh {got} vs committed {want}: rerun usage_fsdp.py --report {FSDP2_RESULTS} and "
            "scripts/supported_models.py --readme")
        assert got["max_dw"] <= got["tol"] if got["pass"] else got["max_dw"] > got["tol"], got
        # a "fail" verdict (fresh or committed) fails here unless it is an expected, named stock failure
        for verdict in (got, want):
            assert verdict["pass"] or name in FSDP2_EXPECTED_FAILURES, (
                f"{name}: FSDP2 verdict 'fail' ({verdict}), which FSDP2_EXPECTED_FAILURES does not name")
        for rank in (0, 1):
            assert re.search(rf"\[rank {rank} .*\] {name}: FSDP2 \d+ units, \d+ ties", done.stdout), (name, rank)
    if sm.readme_blocks.on_pinned_stack(measured["measured_on"]):  # the README documents the pinned stack
        with open(sm.README) as f:
            assert sm.readme_block(f.read()) == sm.table(fsdp2=shown), (
                "README's supported-models table differs from what this run measured: commit "
                "tests/results/fsdp2_parity.json and run scripts/supported_models.py --readme")


def test_no_committed_fsdp2_verdict_fails_unless_it_is_an_expected_stock_failure() -> None:
    """The committed verdicts themselves (the fast tier sees them; the launch above checks the fresh ones)."""
    with open(FSDP2_RESULTS) as f:
        families = json.load(f)["families"]
    failing = {n for n, v in families.items() if not v["pass"]}
    assert failing <= set(FSDP2_EXPECTED_FAILURES), f"FSDP2 verdict 'fail' for {sorted(failing)}: not expected"
    assert set(FSDP2_EXPECTED_FAILURES) <= failing, "an expected failure no longer fails: drop it from the list"


def test_readme_supported_models_table_is_rendered_from_the_committed_results() -> None:
    """The docs/models.md block between the markers is exactly what scripts/supported_models.py renders from
    tests/zoo.py and the committed tests/results/fsdp2_parity.json (no hand-written cell)."""
    sm = _supported_models()
    with open(sm.README) as f:
        block = sm.readme_block(f.read())
    assert block == sm.table(), "docs/models.md's supported-models table is stale: run scripts/supported_models.py --readme"


def test_the_fsdp2_column_shows_each_family_verdict_and_number_from_the_results_file() -> None:
    sm = _supported_models()
    results = {"families": {"llava": {"setup": "s", "max_dw": 3e-8, "tol": 2e-7, "pass": True},
                            "gemma3": {"setup": "s", "max_dw": 4e-4, "tol": 2e-7, "pass": False},
                            "qwen2_vl": {"setup": "s", "max_dw": 0.0, "tol": 2e-7, "pass": True}}}
    assert sm.fsdp2_cell("llava", True, results) == "weights equal stock DDP: max diff 3.0e-08 (tol 2e-07)"
    assert sm.fsdp2_cell("gemma3", True, results).startswith("FAILS: weights differ from stock DDP: max diff 4.0e-04")
    assert sm.fsdp2_cell("qwen2_vl", True, results) == "weights equal stock DDP: bit-equal (tol 2e-07)"
    assert sm.fsdp2_cell("mllama", True, results).startswith("not measured")
    assert sm.fsdp2_cell("llama", False, results) == "—"


@pytest.mark.multiprocess
def test_trainer_runs_mllama_and_layerdrop_with_fu_false_like_stock(tmp_path) -> None:
    """The issue's headline: stock's old plan picked fu=False + static graph for LoRA Mllama (text-only
    steps skip the cross-attention layers) and LayerDrop models, which DDP cannot train (shown failing in
    the ga 1 zoo test above); under patch_trainer they train with fu=False to the stock Trainer's weights.

    The same launch (``--no-walk``, issue 38): the "no walk once established" check and its retry through the
    Trainer's ``accelerator.backward``: TRL SFT on OPT and a LLaVA with an OPT language model, gradient
    accumulation 1 and 2, 7 steps; from step 5 rank 1's decoder drops its layers (same batch signature). The check
    decided micro-batches on both ranks before that, failed on rank 1 at the change, the retry ran, and the weights
    are bit-equal to the stock Trainer's (find_unused_parameters=True)."""
    done = torchrun("usage_trainer.py", "--families", "mllama,bart_layerdrop", "--no-walk", "--out", str(tmp_path),
                    timeout=600)
    assert done.stdout.count("USAGE_TRAINER_OK") == 2, done.stdout[-3000:]
    assert done.stdout.count("USAGE_NO_WALK_OK") == 2, done.stdout[-3000:]
    for case in ("sft_opt", "llava_opt"):
        for ga in (1, 2):
            for rank in (0, 1):
                line = re.search(rf"\[rank {rank}\] no-walk {case} ga={ga}: fu stock=True fixed=False "
                                 rf"checks=(\d+) failed=(\d+) bit-equal=True", done.stdout)
                assert line, (case, ga, rank, done.stdout[-3000:])
                checks, failed = int(line.group(1)), int(line.group(2))
                # the check took over on both ranks; on rank 1 (its layers dropped) it failed and the retry ran
                assert checks > 0 and (failed > 0 if rank == 1 else failed == 0), (case, ga, rank, checks, failed)
