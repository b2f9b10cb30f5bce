"""VLM under the HF Trainer, 2 gloo processes: hf_ddpfix (stabiliser, find_unused_parameters=False)
ends with the same weights as the stock find_unused_parameters=True run, for fixed image layouts."""

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
    for name, w in a["weights"].items():
        torch.testing.assert_close(b["weights"][name], w, rtol=0, atol=1e-6, msg=name)
    if layout == "late":
        # the vision LoRA weights moved only in the last 3 steps, as in stock (None grad before)
        assert any("visual" in k for k in a["weights"])
