"""Sequence parallelism under DeepSpeed ZeRO through the stock Trainer (tests/scripts/sp_deepspeed.py): hf_ddpfix's
Ulysses, switched on by `TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2))` or by
`patch_trainer(sequence_parallel=2)`, equals one process on the same data; stock DeepSpeed SP beside it, its
gaps predicted to the number (updates sp_size x too large, a mean of per-micro-batch means).

Two launches: DP 2 x SP 2 (4 processes) runs hf_ddpfix on ZeRO-2 and ZeRO-3 with both `reduce_scatter` settings,
SGD and AdamW with clipping, and stock's failure to start with `sp_size` alone; SP 2 (2 processes) runs stock
DeepSpeed SP on the same three ZeRO settings. Stock cannot run DP 2 x SP 2 on gloo at all: with
`dp_replicate_size=2` its loss's differentiable `all_gather` fails in backward on the ranks of the second SP group
("Global rank 0 is not part of group": torch's gloo all_gather backward uses global ranks).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from fixtures import build_deepspeed_shm_op
from launch import torchrun

DS_ENV = {"DS_ACCELERATOR": "cpu"}
TOL = 1e-5


@pytest.fixture(scope="module")
def _shm_op():
    pytest.importorskip("deepspeed", reason="test extra: DS_BUILD_OPS=0 pip install deepspeed==0.19.8")
    try:
        build_deepspeed_shm_op()
    except subprocess.TimeoutExpired:
        pytest.fail("building deepspeed_shm_comm took > 900 s: a killed earlier build leaves a stale 'lock' file "
                    "in ~/.cache/torch_extensions/*/deepspeed_shm_comm/ - delete it")


@pytest.mark.multiprocess
def test_dp2_sp2_zero2_zero3_both_reduce_scatter_settings_equal_one_process(tmp_path, _shm_op):
    """4 processes, gradient accumulation 3, micro-batches with different valid-token counts, 2 optimizer steps:
    weights and logged losses within 1e-5 of one process on the whole batch, under SGD without clipping and
    AdamW with clipping, on ZeRO-2 and ZeRO-3 (reduce_scatter true and false). DeepSpeed sees plain data
    parallelism (its engine's sequence_parallel_size is 1); the sharded attention really ran. After training,
    `evaluate()` sharded over the SP group equals stock's unsharded evaluation on the same engine."""
    out = tmp_path / "spds4.json"
    torchrun("sp_deepspeed.py", str(out), "--ga", "3", "--stock", "zero2", nproc=4, timeout=480, env=DS_ENV)
    records = {r["case"]: r for r in json.loads(out.read_text())}
    ours = {f"hf_ddpfix/{z}/{o}" for z in ("zero2", "zero3_rs", "zero3_no_rs") for o in ("sgd", "adamw_clip")}
    assert ours <= set(records)
    for name in ours:
        r = records[name]
        assert r["ok"] and r["weight_diff"] <= TOL and r["loss_diff"] <= TOL, r
        assert r["plan"].startswith("N=2 DP=2") and r["engine_sp"] == 1
        assert r["attention_calls"] > 0 and r["sharded_batches"] == 2 * 2 * 3 and not r["fallbacks"]
        if name.endswith("/sgd"):  # evaluate() on the trained engine: sharded (hf_ddpfix) = unsharded (stock)
            assert r["eval_diff"] <= TOL and r["eval_sharded_batches"] > 0, r
    assert {records[n]["via"] for n in ours} == {"pc", "arg"}  # both switches
    assert records["hf_ddpfix/zero3_rs/sgd"]["plan"] == "N=2 DP=2 via parallelism_config"
    # stock with ParallelismConfig(sp_size=2) alone on 4 processes: DeepSpeed refuses accelerate's batch size
    stock = records["stock/zero2/sp_size_alone"]
    assert stock["ok"] and "train_batch_size is not equal to micro_batch_per_gpu" in stock["error"], stock


@pytest.mark.multiprocess
def test_stock_deepspeed_sp_updates_are_sp_size_times_too_large_and_its_loss_a_mean_of_means(tmp_path, _shm_op):
    """Stock DeepSpeed SP (2 processes, SP 2, gradient accumulation 3, SGD): its weights land within 1e-5 on its own
    formula (the mean over micro-batches of each one's token mean, gradients x2 on ZeRO-2 and ZeRO-3 without
    reduce-scatter, x1 with it) and far from the token mean of the same data; its logged loss is the mean of
    means."""
    out = tmp_path / "spds2.json"
    torchrun("sp_deepspeed.py", str(out), "--ga", "3", "--zero", "", "--check-leftover-mpu", nproc=2, timeout=300,
             env=DS_ENV)
    records = {r["case"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"stock/zero2/sgd", "stock/zero3_rs/sgd", "stock/zero3_no_rs/sgd",
                            "hf_ddpfix/zero2/leftover_sp_engine"}
    # hf_ddpfix's run-time check: an engine that kept DeepSpeed's SP groups would scale the loss wrongly: refused
    leftover = records.pop("hf_ddpfix/zero2/leftover_sp_engine")
    assert leftover["ok"] and "sequence_parallel_size=2" in leftover["error"], leftover
    for r in records.values():
        assert r["ok"] and r["engine_sp"] == 2, r
        assert r["diff_to_stock_formula"] <= TOL and r["logged_loss_diff_to_mean_of_means"] <= TOL
        assert r["diff_to_token_mean"] > 1e-3  # 100x the tolerance our runs meet
        assert abs(r["mean_of_means_losses"][0] - r["token_mean_losses"][0]) > 1e-3  # the logged loss too
    assert records["stock/zero2/sgd"]["factor"] == records["stock/zero3_no_rs/sgd"]["factor"] == 2.0
    assert records["stock/zero3_rs/sgd"]["factor"] == 1.0
    # the x2 shows in the size of the update: ~1.8 x the token-mean update (2 x, less the mean-of-means part)
    assert records["stock/zero2/sgd"]["update_ratio_to_token_mean"] > 1.5
    assert 0.9 < records["stock/zero3_rs/sgd"]["update_ratio_to_token_mean"] < 1.1
