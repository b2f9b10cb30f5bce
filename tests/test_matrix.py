"""The DDP compatibility matrix (2 CPU processes, gloo) inside the test suite.

Every cell of `../shared/acceptance/matrix.sh` runs with `patch_trainer()` and must train, stay in sync
across ranks and reach the stock loss of its group; one stock cell per failure kind shows the failure
is real (so these tests can fail). The fixed cells of one model run in one launch (:func:`batched_cell`);
the stock cells one per launch, as the acceptance harness runs them.
"""

import json

import pytest
import transformers
from launch import torchrun

pytestmark = pytest.mark.multiprocess

# stock losses of the deterministic harness (taken where stock works) with transformers 5.23; other releases
# initialise the tiny models differently, so there the reference is a stock run of the same group
STOCK_LOSS = {("text", 1): 5.54689, ("vlm", 1): 5.5429, ("text", 2): 5.54442, ("vlm", 2): 5.5342}
STOCK_LOSS_TRANSFORMERS = (5, 23)
_stock_runs: dict[tuple[str, int], float] = {}


def stock_loss(model: str, ga: int) -> float:
    """The stock loss of `model`'s group (no checkpointing, stock find_unused, `ga` accumulation steps)."""
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) == STOCK_LOSS_TRANSFORMERS:
        return STOCK_LOSS[(model, ga)]
    if (model, ga) not in _stock_runs:
        res, out = run_cell(model, "--ckpt", "off", "--find-unused", "auto", *(("--ga", str(ga)) if ga > 1 else ()),
                            fix=0)
        # the reference is only its loss: stock torch 2.13 + gloo itself aborts at exit now and then ("terminate
        # called without an active exception", seen once in a stock cell that destroyed its group), which is
        # not what this reference measures; hf_ddpfix's own cells still must exit 0
        assert res["ok"] and res["in_sync"], f"stock reference cell failed: {res}\n{out[-4000:]}"
        _stock_runs[(model, ga)] = res["loss"]
    return _stock_runs[(model, ga)]


def matrix_cells():
    cells = []
    for model in ("text", "vlm"):
        for ckpt in ("off", "nonreentrant", "reentrant"):
            for fu in ("auto", "1", "0"):
                cells.append((model, "--ckpt", ckpt, "--find-unused", fu))
            if ckpt != "off":
                cells.append((model, "--ckpt", ckpt, "--static", "1"))
        cells.append((model, "--ckpt", "nonreentrant", "--offload", "1"))
        cells.append((model, "--ckpt", "reentrant", "--offload", "1"))
        cells.append((model, "--ckpt", "nonreentrant", "--static", "1", "--ga", "2"))
        cells.append((model, "--ckpt", "nonreentrant", "--ga", "2"))
    return cells


def run_cell(model, *args, fix, env=None):
    """One cell, one launch (the acceptance harness's form: the stock references and stock failures)."""
    # never re-run: a cell that aborts at exit (exit status != 0 after its CELL line) fails; a stock reference
    # cell is judged by its CELL line only (its loss, or the stock error), so stock's own exit abort does not count
    done = torchrun("matrix_cell.py", "--fix", str(fix), "--model", model, *args, timeout=150, env=env, check=False)
    out = done.stdout
    lines = [line for line in out.splitlines() if line.startswith("CELL ")]
    assert lines, f"no CELL line (crash or hang):\n{out[-6000:]}"
    res = json.loads(lines[0][5:])
    # the CELL line is rank 0's; the exit status is every rank's (torchrun fails when any rank does)
    res["exit_status"] = done.returncode
    return res, out


#: per-cell watchdog inside a batched launch (tests/scripts/matrix_cell.py): a hang fails within this many seconds
CELL_TIMEOUT_S = 120
#: (test function, model) -> (each cell's result and output, the launch's whole output)
_batches: dict[tuple[str, str], tuple[dict[tuple[str, ...], tuple[dict, str]], str]] = {}


def batched_cell(request, cell: tuple[str, ...], env: dict[str, str] | None = None) -> tuple[dict, str]:
    """``cell``'s result from one launch per (test function, model) that runs every cell of that function this
    session selected (tests/scripts/matrix_cell.py ``--cells``: each cell seeds and builds afresh): ~2 s of
    training per cell instead of ~8 s of process start-up each. Returns the cell's result (``exit_status``: the
    launch's, every rank's) and the output between the previous cell's ``CELL`` line and its own."""
    key = (request.function.__name__, cell[0])
    if key not in _batches:
        cells = [item.callspec.params["cell"] for item in request.session.items
                 if getattr(item, "originalname", "") == key[0] and item.module is request.module
                 and item.callspec.params["cell"][0] == cell[0]]
        tmp = request.getfixturevalue("tmp_path") / "cells.json"
        tmp.write_text(json.dumps([["--model", c[0], *c[1:]] for c in cells]))
        done = torchrun("matrix_cell.py", "--fix", "1", "--cells", str(tmp), timeout=60 + CELL_TIMEOUT_S * len(cells),
                        env={**(env or {}), "MATRIX_CELL_TIMEOUT_S": str(CELL_TIMEOUT_S)}, check=False)
        results, part = {}, []
        for line in done.stdout.splitlines():
            if line.startswith("CELL "):
                res = json.loads(line[5:])
                res["exit_status"] = done.returncode
                results[cells[res["cell"]]] = (res, "\n".join(part))
                part = []
            else:
                part.append(line)
        _batches[key] = results, done.stdout
    results, whole = _batches[key]
    assert cell in results, f"no CELL line for {cell} (crash or hang):\n{whole[-6000:]}"
    return results[cell]


@pytest.mark.parametrize("cell", matrix_cells(), ids=lambda c: "-".join(c).replace("--", ""))
def test_cell_trains_in_sync_with_stock_loss(cell, request):
    model, *args = cell
    res, out = batched_cell(request, cell)
    assert res["ok"] and res["exit_status"] == 0, f"{res}\n{out[-4000:]}"
    assert res["in_sync"] is True
    assert res["loss"] == pytest.approx(stock_loss(model, res["ga"]), abs=1e-4)
    if model == "vlm":  # every trainable parameter is used by construction: no unused-parameter search ...
        opts = dict(zip(args[::2], args[1::2], strict=True))
        # ... except that an explicit ddp_find_unused_parameters=True is kept: it works once the plan has
        # made checkpointing non-reentrant, and hf_ddpfix never overrides a working explicit setting
        assert res["find_unused"] is (opts.get("--find-unused") == "1"), res


TILED_CELLS = [c for c in matrix_cells() if "--ga" in c or c[1:] in (
    ("--ckpt", "off", "--find-unused", "1"), ("--ckpt", "reentrant", "--find-unused", "auto"),
    ("--ckpt", "nonreentrant", "--static", "1"), ("--ckpt", "nonreentrant", "--offload", "1"))]


@pytest.mark.parametrize("cell", TILED_CELLS, ids=lambda c: "-".join(c).replace("--", ""))
def test_cell_with_tiling_forced_keeps_the_stock_loss(cell, request):
    """4 shards per MLP call (so the 32-token cells really tile) and the chunked loss head."""
    model, *args = cell
    res, out = batched_cell(request, cell, env={"HF_DDPFIX_TILED_MLP": "4", "HF_DDPFIX_TILED_LOSS": "on"})
    assert res["ok"] and res["in_sync"] and res["exit_status"] == 0, f"{res}\n{out[-4000:]}"
    assert "MLP modules tiled (4)" in out and "computes its loss in chunks" in out
    assert res["loss"] == pytest.approx(stock_loss(model, res["ga"]), abs=1e-4)


STOCK_FAILURES = [
    (("text", "--ckpt", "reentrant"), "Expected to mark a variable ready only once"),
    (("vlm", "--ckpt", "nonreentrant", "--find-unused", "0"), "Expected to have finished reduction"),
    (("text", "--ckpt", "nonreentrant", "--static", "1", "--ga", "2"), "expect_autograd_hooks_"),
    (("text", "--ckpt", "nonreentrant", "--offload", "1"), "pin_memory"),
    # README's "static_graph + a changing graph" row on the VLM (image/text ranks change step to step); the
    # LayerDrop form ("Your training graph has changed in this iteration") is in tests/test_usage.py
    (("vlm", "--ckpt", "nonreentrant", "--static", "1"), "Expected to have finished reduction in the prior iteration "
     "before starting a new one. This error indicates that your training graph has changed"),
]


@pytest.mark.parametrize("cell,error", STOCK_FAILURES, ids=lambda x: x if isinstance(x, str) else "-".join(x))
def test_stock_fails_where_the_fix_trains(cell, error):
    res, out = run_cell(*cell, fix=0)
    assert not res["ok"] and error in res["error"], res
