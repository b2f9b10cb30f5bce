"""runtime/errors.py: known DDP failures become DDPFixError with cause-in-this-run and fix; others pass through."""

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from hf_ddpfix import DDPFixConfig, RunFacts, resolve_plan
from hf_ddpfix.runtime.errors import DDPFixError, ReplicaDivergenceError, explain, readable_ddp_errors

READY_TWICE = ("Expected to mark a variable ready only once. This error is caused by one of the following "
               "reasons: 1) Use of a module parameter outside the `forward` function.")
UNFINISHED = ("Expected to have finished reduction in the prior iteration before starting a new one. "
              "This error indicates that your module has parameters that were not used in producing loss.\n"
              "Parameters which did not receive grad for rank 1: visual.blocks.0.attn.qkv.lora_A.default.weight")
GRAPH = "Your training graph has changed in this iteration, e.g., one parameter is used in first iteration"
HOOKS = "expect_autograd_hooks_ INTERNAL ASSERT FAILED at \"../torch/csrc/distributed/c10d/reducer.cpp\":1571"
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv"
NCCL_WATCHDOG = "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)"
PEER = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:6275"


def _plan(**facts):
    return resolve_plan(RunFacts(**{"parallel": "ddp", "world_size": 2, **facts}))


def test_ready_twice_names_reentrant_checkpointing_and_the_fix():
    # the plan already switched to non-reentrant: the cause must point outside the plan (per-chunk backward)
    msg = explain(RuntimeError(READY_TWICE), _plan(checkpointing="reentrant", is_peft=True))
    assert "ready only once" in msg and "non_reentrant" in msg and "HF_DDPFIX_TILED_MLP" in msg
    forced = resolve_plan(RunFacts(parallel="ddp", world_size=2, checkpointing="reentrant", is_peft=True),
                          DDPFixConfig(checkpointing="reentrant"))
    msg = explain(RuntimeError(READY_TWICE), forced)
    assert "reentrant checkpointing" in msg and "HF_DDPFIX_CHECKPOINTING=non_reentrant" in msg
    generic = explain(RuntimeError(READY_TWICE), None)
    assert "patch_trainer" in generic and "use_reentrant" in generic


def test_unfinished_reduction_names_the_vlm_and_the_parameters():
    plan = resolve_plan(RunFacts(parallel="ddp", world_size=2, is_vlm=True, vlm_adapter="qwen2_5_vl",
                                 trainable_vision_params=True),
                        DDPFixConfig(vlm_stabilizer=False, find_unused_parameters=False))
    msg = explain(RuntimeError(UNFINISHED), plan)
    assert "vision" in msg and "visual.blocks.0.attn.qkv.lora_A.default.weight" in msg
    assert "HF_DDPFIX_VLM_STABILIZER=1" in msg and "HF_DDPFIX_FIND_UNUSED_PARAMETERS=1" in msg


def test_static_graph_errors_point_at_static_graph():
    plan = _plan()
    assert plan.static_graph.value is True
    assert "HF_DDPFIX_STATIC_GRAPH=0" in explain(RuntimeError(GRAPH), plan)
    facts = RunFacts(parallel="ddp", world_size=2, grad_accum_steps=4)
    msg = explain(RuntimeError(HOOKS), _plan(), facts=facts)
    assert "gradient_accumulation_steps=4" in msg and "HF_DDPFIX_STATIC_GRAPH=0" in msg


@pytest.mark.parametrize("text", [GLOO_TIMEOUT, NCCL_WATCHDOG, PEER])
def test_collective_timeouts_and_dead_peers_are_explained(text):
    msg = explain(RuntimeError(text), _plan())
    assert msg is not None and "ddp_timeout" in msg and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in msg
    assert "Original error (RuntimeError)" in msg


def test_unrelated_errors_pass_through_unchanged():
    assert explain(RuntimeError("CUDA out of memory"), _plan()) is None
    assert explain(TimeoutError("HTTP read timed out"), _plan()) is None  # a timeout, but not distributed
    err = ValueError("bad value")
    with pytest.raises(ValueError) as info, readable_ddp_errors(_plan()):
        raise err
    assert info.value is err
    with pytest.raises(ReplicaDivergenceError), readable_ddp_errors(_plan()):
        raise ReplicaDivergenceError("already explained")


def test_context_manager_reraises_with_cause():
    original = RuntimeError(READY_TWICE)
    with pytest.raises(DDPFixError) as info, readable_ddp_errors(_plan(checkpointing="reentrant")):
        raise original
    assert info.value.__cause__ is original and isinstance(info.value, RuntimeError)


def test_real_ddp_error_from_a_one_process_group_is_translated():
    """A real 'ready only once' from DDP (world size 1, gloo): reentrant checkpoint + find_unused=True."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

            def forward(self, x):
                return checkpoint(self.a, x, use_reentrant=True).sum() + self.b(x).sum()

        model = torch.nn.parallel.DistributedDataParallel(M(), find_unused_parameters=True)
        x = torch.randn(2, 4, requires_grad=True)
        with pytest.raises(DDPFixError) as info, readable_ddp_errors(None):
            model(x).backward()
        assert "Expected to mark a variable ready only once" in str(info.value.__cause__)
        assert "Fix:" in str(info.value)
    finally:
        dist.destroy_process_group()


def test_unfinished_reduction_names_parameters_reported_by_index_and_the_loss_path():
    plan = resolve_plan(RunFacts(parallel="ddp", world_size=2, is_peft=True))
    assert plan.parameter_usage.value is True
    text = ("Expected to have finished reduction in the prior iteration before starting a new one.\n"
            "Parameter indices which did not receive grad for rank 1: 2 5")
    names = [f"layer.{i}.weight" for i in range(6)]
    msg = explain(RuntimeError(text), plan, param_names=names)
    assert "layer.2.weight, layer.5.weight" in msg and "indices" not in msg
    assert "accelerator.backward" in msg and "tiling" not in msg.split("Fix:")[0]
    assert "indices 2 5" in explain(RuntimeError(text), plan)  # without names: the indices stay
