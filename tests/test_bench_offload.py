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


def _stock_offload_fails_here() -> bool:
    """The stock failure this test checks, probed on the installed torch the way transformers' offload runs
    (modeling_utils: ``save_on_cpu(pin_memory=True, device_type=<current accelerator, else cpu>)``): True when it
    raises. It raises on torch's CPU build (2.13.0+cpu: no accelerator, so ``cpu``, and no pinned allocator); PyPI's
    CUDA build (2.14.1+cu130) names ``cuda`` as its accelerator even without a GPU, so nothing is pinned and the
    stock run does not fail (measured 2026-11-28). A property of the torch build, not of hf_ddpfix."""
    accelerator = torch.accelerator.current_accelerator()
    x = torch.ones(2, requires_grad=True)
    try:
        with torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=(accelerator or torch.device("cpu")).type):
            y = (x * x).sum()
        y.backward()
    except RuntimeError:
        return True
    return False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure of stock offload")
def test_trainer_path_reaches_stocks_save_on_cpu_which_cannot_pin_without_an_accelerator():
    if not _stock_offload_fails_here():
        pytest.skip(f"torch {torch.__version__}: stock offload does not fail without an accelerator on this build "
                    "(it names an accelerator, so nothing is pinned): the stock failure this test checks is absent")
    bench = _bench()
    model = bench.build_model(SPEC, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="pin_memory"):
        bench.enable_like_trainer(model, torch.device("cpu"), seq=16, vocab=SPEC["vocab"])
    assert bench.hf_offload_installed(model)  # the Trainer installed it; the step then failed in pin_memory
