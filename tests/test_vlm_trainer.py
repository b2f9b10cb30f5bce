"""VLM under the HF Trainer, 2 gloo processes: hf_ddpfix (stabiliser, find_unused_parameters=False)
ends with the same weights as the stock find_unused_parameters=True run, for fixed image layouts."""

import time

import pytest
import torch
from launch import torchrun

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("layout", ["mixed", "late"])
def test_stabilised_trainer_matches_stock_find_unused(tmp_path, layout):
    stock, fixed = tmp_path / "stock.pt", tmp_path / "fixed.pt"
    torchrun("train_vlm.py", "--entry", "stock", "--layout", layout, "--out", str(stock), timeout=180)
    torchrun("train_vlm.py", "--entry", "patch", "--layout", layout, "--out", str(fixed), timeout=180)
    a, b = torch.load(stock, weights_only=False), torch.load(fixed, weights_only=False)
    assert a["find_unused"] is True and b["find_unused"] is False
    assert a["weights"].keys() == b["weights"].keys()
    # the stabiliser's dummy image adds an exact zero and unused vision grads are reset to None before
    # clipping, so the math is stock's: bit-identical (the README's claim), not merely close
    differ = [name for name, w in a["weights"].items() if not torch.equal(b["weights"][name], w)]
    assert not differ, f"{len(differ)} weights differ from stock, e.g. {differ[:3]}"
    if layout == "late":
        # the vision LoRA weights moved only in the last 3 steps, as in stock (None grad before)
        assert any("visual" in k for k in a["weights"])


def test_hang_guard_under_the_trainer_raises_on_both_ranks_fast(tmp_path):
    """Stabiliser and parameter usage off, find_unused forced off: stock would hang or crash on the next step; the guard
    raises the named error on every rank before backward."""
    env = {"HF_DDPFIX_VLM_STABILIZER": "0", "HF_DDPFIX_FIND_UNUSED_PARAMETERS": "0",
           "HF_DDPFIX_PARAMETER_USAGE": "0"}  # nothing ties the vision parameters in
    t0 = time.time()
    done = torchrun("train_vlm.py", "--entry", "patch", "--layout", "mixed", "--out", str(tmp_path / "x.pt"),
                    timeout=120, env=env, check=False)
    assert done.returncode != 0
    assert "hang_guard              = on" in done.stdout
    # every rank raised it (one rank's traceback alone holds the name more than once): torch's launcher
    # prefixes each rank's error lines with "[rankN]:"
    lines = done.stdout.splitlines()
    for rank in (0, 1):
        assert any(line.startswith(f"[rank{rank}]") and "UnusedParametersError" in line for line in lines), (
            f"rank {rank} did not raise UnusedParametersError\n" + done.stdout[-4000:])
    assert time.time() - t0 < 100
