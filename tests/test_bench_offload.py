"""benchmarks/offload.py switches transformers' offload on through the Trainer, the path users run."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# transformers' own activation offload (`offload=True`, what the benchmark compares against) is new in 5.23
pytestmark = pytest.mark.skipif(
    not hasattr(__import__("transformers").PreTrainedModel, "activation_checkpointing_enable"),
    reason="transformers < 5.23 has no offload=True checkpointing to benchmark against",
)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_offload", ROOT / "benchmarks" / "offload.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SPEC = dict(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, vocab=64, dtype="float32")


def test_stock_offload_wrapper_is_recognised_only_when_transformers_installs_it():
    bench = _bench()
    plain = bench.build_model(SPEC, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert not bench.hf_offload_installed(plain)
    stock = bench.build_model(SPEC, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, offload=True)
    assert bench.hf_offload_installed(stock)
    # the old benchmark's way: "offload" inside the checkpoint kwargs reaches torch, not transformers
    old = bench.build_model(SPEC, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False, "offload": True})
    assert not bench.hf_offload_installed(old)


def _pinning_fails_without_an_accelerator() -> bool:
    """The stock failure this test checks, probed on the installed torch: `pin_memory()` raises without an
    accelerator on torch <= 2.13 (the CPU build CI pins); torch 2.14.1 (PyPI's CUDA build, no GPU) pins."""
    try:
        torch.empty(1).pin_memory()
    except RuntimeError:
        return True
    return False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure of stock offload")
def test_trainer_path_reaches_stocks_save_on_cpu_which_cannot_pin_without_an_accelerator():
    if not _pinning_fails_without_an_accelerator():
        pytest.skip(f"torch {torch.__version__} pins memory without an accelerator: the stock failure this test "
                    "checks is fixed in this release (not a regression of ours)")
    bench = _bench()
    model = bench.build_model(SPEC, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="pin_memory"):
        bench.enable_like_trainer(model, torch.device("cpu"), seq=16, vocab=SPEC["vocab"])
    assert bench.hf_offload_installed(model)  # the Trainer installed it; the step then failed in pin_memory
