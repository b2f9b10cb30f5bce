"""Parameter usage observed at the loss given to backward (`ParameterUsage.tie_loss`), not at the model output.

Single-process checks of the tie's bookkeeping and of the plan's fact about where the loss is
back-propagated; the 2-process Trainer runs (hidden-state heads, TRL) are
tests/test_trainer_zoo.py (cases in tests/scripts/trainer_zoo.py and trainer_heads.py).
"""

from __future__ import annotations

import pytest
import torch
from fixtures import lora_llama
from torch import nn
from transformers import Trainer

from hf_ddpfix.config.options import DDPFixConfig
from hf_ddpfix.facts.gather import loss_unseen_reason
from hf_ddpfix.integrations.usage import UNSEEN_LOSS, ParameterUsage
from hf_ddpfix.ops import feature_counts
from hf_ddpfix.ops.autograd_reach import reachable_leaf_ids_split
from hf_ddpfix.ops.zero_tie import ZeroTie, is_zero_tie_node
from hf_ddpfix.plan.resolve import resolve_plan
from hf_ddpfix.plan.types import RunFacts

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def _head_model() -> nn.Module:
    model = lora_llama(targets=ALL)
    torch.manual_seed(3)
    model.add_module("score_head", nn.Linear(model.config.hidden_size, 1))
    return model


def _head_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A loss from a head on the last hidden state: lm_head's LoRA never reaches it, score_head does."""
    out = model(input_ids=ids, output_hidden_states=True)
    return model.score_head(out.hidden_states[-1]).pow(2).mean()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters() if p.requires_grad}


def test_split_walk_separates_real_use_from_zero_ties() -> None:
    a, b, c = (torch.randn(2, requires_grad=True) for _ in range(3))
    loss = (ZeroTie.apply(a * 2, b, c * 3) + c).sum()
    used, tied = reachable_leaf_ids_split([loss], is_zero_tie_node)
    assert used == {id(a), id(c)} and tied == {id(b)}


class _Sink(torch.autograd.Function):
    """Two outputs, each the identity of its input (like DDP's ``_DDPSink``)."""

    @staticmethod
    def forward(ctx, x, y):  # noqa: ANN001, ANN205
        return x.clone(), y.clone()

    @staticmethod
    def backward(ctx, gx, gy):  # noqa: ANN001, ANN205
        return gx, gy


def test_split_walk_takes_only_the_edge_used_through_a_pass_through_node_met_inside_the_graph() -> None:
    """The pass-through node is not the loss's own node (the loss is computed from its outputs): a leaf behind
    the output the loss does not use is not reached (the trainer_zoo's head_in_forward under DDP)."""
    a, b = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
    out_a, _ = _Sink.apply(a * 1.0, b * 1.0)
    loss = (out_a * 2).sum()
    is_sink = lambda node: getattr(type(node), "_forward_cls", None) is _Sink  # noqa: E731
    used, tied = reachable_leaf_ids_split([loss], is_zero_tie_node, is_sink)
    assert used == {id(a)} and tied == set()


def test_the_loss_decides_a_head_outside_the_forward_is_used_and_lm_head_is_tied_in() -> None:
    ids = torch.randint(1, 200, (1, 9))
    stock = _head_model()
    _head_loss(stock, ids).backward()
    expected = _grads(stock)

    model = _head_model()
    usage = ParameterUsage(model).attach()
    usage.at_loss = True
    feature_counts.reset()
    loss = _head_loss(model, ids)
    tied = usage.tie_loss(loss)
    assert torch.equal(tied, loss)  # a bitwise copy
    tied.backward()
    got = _grads(model)
    lm_head = {n for n in got if "lm_head" in n}
    assert len(lm_head) == 2 and all(expected[n] is None for n in lm_head)
    for n, g in got.items():
        if n in lm_head:
            assert g is not None and not g.any(), n  # tied: an exact zero, so DDP's hook fired
        else:
            assert torch.equal(g, expected[n]), n  # the head included: bit-equal to the untouched model
    assert usage.finalize() == 2  # lm_head's LoRA: no rank used it -> None, as stock fu=True leaves it
    assert all(p.grad is None for n, p in model.named_parameters() if "lm_head" in n)
    assert model.score_head.weight.grad is not None  # the forward tied it at the logits; the loss used it
    counts = feature_counts.snapshot()["parameter_usage"]
    assert counts.ran == 1 and counts.amounts["ties_at_loss"] == 2 and counts.amounts["grads_reset"] == 2
    assert counts.amounts["forwards"] == 1 and counts.amounts["ties_at_output"] == 2  # score_head at the logits
    usage.remove()


def test_fsdp_loss_observer_keeps_a_head_used_only_in_compute_loss_and_ties_nothing() -> None:
    """FSDP2's route (``at_loss`` off, ``observe_loss`` at backward): the head called outside the forward keeps its
    gradient at finalize; the loss is returned as is; lm_head's unused LoRA is still reset. Without the observer
    the head, tied at the output, is kept too: the real gradient backward gave it is seen at its leaf
    (``ParameterUsage._watch_real``, issue 38); before that it was reset (the FSDP2 defect
    tests/test_fsdp_trainer_zoo.py measured)."""
    ids = torch.randint(1, 200, (1, 9))
    for observe in (True, False):
        model = _head_model()
        usage = ParameterUsage(model).attach()
        feature_counts.reset()
        loss = _head_loss(model, ids)
        seen = usage.observe_loss(loss) if observe else loss
        assert seen is loss
        seen.backward()
        usage.finalize()
        assert all(p.grad is None for n, p in model.named_parameters() if "lm_head" in n)
        assert model.score_head.weight.grad is not None, observe
        amounts = feature_counts.snapshot()["parameter_usage"].amounts
        assert amounts.get("used_at_loss", 0) == (2 if observe else 0) and "ties_at_loss" not in amounts, amounts
        usage.remove()


def test_a_loss_that_skips_tie_loss_falls_back_to_the_output_and_says_so() -> None:
    model = _head_model()
    usage = ParameterUsage(model).attach()
    usage.at_loss = True
    feature_counts.reset()
    _head_loss(model, torch.randint(1, 200, (1, 5))).backward()  # not through tie_loss
    usage.finalize()
    assert feature_counts.snapshot()["parameter_usage"].fallbacks == {UNSEEN_LOSS: 1}
    usage.remove()


def test_a_loss_without_a_training_forward_or_grad_passes_through() -> None:
    model = _head_model()
    usage = ParameterUsage(model).attach()
    x = torch.ones(2, requires_grad=True).sum()
    assert usage.tie_loss(x) is x
    assert usage.tie_loss(3.0) == 3.0
    usage.remove()


class _OwnBackward(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = self.compute_loss(model, inputs)
        loss.backward()
        return loss.detach()


class _Wrapped(Trainer):
    def training_step(self, *args, **kwargs):
        return super().training_step(*args, **kwargs)


def test_plan_keeps_stock_find_unused_where_the_loss_cannot_be_seen() -> None:
    reason = loss_unseen_reason(object.__new__(_OwnBackward))
    assert reason == "_OwnBackward.training_step calls backward() itself"
    assert loss_unseen_reason(object.__new__(_Wrapped)) is None
    facts = RunFacts(parallel="ddp", world_size=2, is_peft=True, loss_unseen=reason)
    plan = resolve_plan(facts, DDPFixConfig())
    assert plan.parameter_usage.value is False and reason in plan.parameter_usage.reason
    assert plan.find_unused_parameters.value is True
    seen = resolve_plan(RunFacts(parallel="ddp", world_size=2, is_peft=True), DDPFixConfig())
    assert seen.parameter_usage.value is True and seen.find_unused_parameters.value is False
    assert "docs/plan.md#parameter_usage" in seen.parameter_usage.reason  # the line links the whole reason:
    from pathlib import Path

    section = (Path(__file__).resolve().parents[1] / "docs" / "plan.md").read_text().split("### parameter_usage")[1]
    assert "accelerator.backward" in section.split("###")[0]
    assert "every trainable parameter reaches the loss" in seen.find_unused_parameters.reason


def test_an_accelerate_loop_gets_the_plan_through_one_call_and_trains_like_stock() -> None:
    """prepare_accelerate_loop: reentrant requested, gradient accumulation 2, a head loss leaving lm_head's
    LoRA out; DDP built with find_unused_parameters=False, weights bit-equal to stock fu=True."""
    from launch import torchrun

    done = torchrun("accelerate_loop.py", timeout=300)
    assert done.stdout.count("ACCELERATE_LOOP_OK") == 2, done.stdout[-4000:]
    assert done.stdout.count("hf_ddpfix fu=False, max |fix - stock| = 0.0e+00") == 2, done.stdout[-4000:]


def test_prepare_accelerate_loop_refuses_a_wrapped_model_and_detaches_on_close() -> None:
    import pytest
    from accelerate import Accelerator

    from hf_ddpfix import prepare_accelerate_loop

    acc = Accelerator(cpu=True)
    model = lora_llama()
    with pytest.raises(ValueError, match="before accelerator.prepare"):
        wrapper = nn.Module()
        wrapper.module = model  # DDP-style: what accelerator.prepare returns
        prepare_accelerate_loop(acc, wrapper)
    with prepare_accelerate_loop(acc, model) as run:
        assert run.plan.parallel == "single" and run.usage is None
    assert "backward" not in vars(acc)


def test_reentrant_layers_reached_only_through_a_zero_tie_count_as_unused() -> None:
    """The ZeRO dummy image runs the tower's reentrant checkpointed blocks on a text-only micro-batch; their
    output reaches the loss only through the exact-zero tie, so the step's usage must call the tower unused
    (as the graph walk does without checkpointing), and used when the batch has an image: what
    `zero_skip_unused` restores by (tests/scripts/deepspeed_train.py, DS_SKIP_CKPT=reentrant by hand)."""
    from fixtures import add_lora, build_qwen2_5_vl, make_batch

    from hf_ddpfix.integrations.checkpointing import apply_checkpointing
    from hf_ddpfix.integrations.vision.zero import ZeroVisionStabilizer

    model = add_lora(build_qwen2_5_vl(0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert apply_checkpointing(model, use_reentrant=True) > 0
    model.train()
    stab = ZeroVisionStabilizer(model).attach()
    usage = ParameterUsage(model, tie=False, guard=False).attach()
    usage.at_loss = True
    tower = [i for i, s in enumerate(usage.slots) if ".visual." in s.name]
    assert tower and len(tower) < len(usage.slots)
    for has_image in (False, True):
        loss = usage.tie_loss(model(**make_batch(has_image, seed=2)).loss)
        loss.backward()
        used = usage.agreed_step_usage()
        assert used is not None and bool(used[tower].all()) is has_image and bool(used[tower].any()) is has_image
        assert all(used[i] for i in range(len(usage.slots)) if i not in tower)
    assert stab.dummy_runs == 1 and usage._regions is not None
    usage.remove()
    stab.remove()


def test_one_walk_per_micro_batch_once_the_route_is_set_and_the_forward_walk_comes_back_when_a_loss_is_missed() -> None:
    """Step 1 predicts from the output (2 walks per micro-batch); once every loss of a step was seen at backward
    only the walk from the loss runs (1), and it still ties what this micro-batch leaves unused; a loss that
    skips tie_loss brings the forward walk back for the rest of the run (counted)."""
    model = _head_model()
    usage = ParameterUsage(model).attach()
    usage.at_loss = True
    feature_counts.reset()
    ids = torch.randint(1, 200, (1, 7))
    walks, resets = [], []
    for step in range(4):
        before = usage.walks
        loss = _head_loss(model, ids)
        if step == 2:
            loss.backward()  # not through tie_loss
        else:
            usage.tie_loss(loss).backward()
        resets.append(usage.finalize())
        walks.append(usage.walks - before)
    assert walks == [2, 1, 0, 2], walks
    # lm_head's LoRA tied (at the output, then at the loss) and reset; the step whose loss was not seen and not
    # predicted resets nothing (every parameter counts as used: never a reset of one that was used)
    assert resets == [2, 2, 0, 2], resets
    amounts = feature_counts.snapshot()["parameter_usage"].amounts
    assert amounts["forward_walks_resumed"] == 1 and amounts["ties_at_loss"] == 2 * 3, amounts
    usage.remove()


def test_no_walk_once_established_and_a_changed_pattern_is_caught_at_backward_and_retried():
    """After ESTABLISH all-used walks of one batch signature the loss is not walked (checked at backward);
    a micro-batch that then leaves a parameter out is caught before anything accumulates, retried with a
    walk and a tie, and trains exactly like the walk would (grads of the others unchanged, the unused one
    reset to None at finalize)."""
    from hf_ddpfix.integrations.usage import UsageChanged
    from hf_ddpfix.integrations.usage.no_walk import ESTABLISH

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x, use_b=True):
            y = self.a(x)
            return (self.b(y) if use_b else y).pow(2).mean()

    torch.manual_seed(0)
    model = TwoHeads()
    ref = TwoHeads()
    ref.load_state_dict(model.state_dict())
    usage = ParameterUsage(model).attach()
    usage.at_loss = usage.backward_retries = True
    retried = []

    def backward(loss):
        try:
            usage.tie_loss(loss).backward()
        except UsageChanged:
            retried.append(True)
            usage.tie_loss(loss).backward()

    x = torch.randn(3, 4)
    for step in range(ESTABLISH + 4):
        use_b = step != ESTABLISH + 2
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        backward(model(x, use_b=use_b))
        usage.finalize()
        ref(x, use_b=use_b).backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), (step, n)
            if q.grad is not None:
                assert torch.equal(p.grad, q.grad), (step, n)
    assert retried == [True]
    # walks: 2 (first step: forward + loss), ESTABLISH-1 more to establish, the retry, one to re-establish ...
    assert usage.no_walk.checks == (ESTABLISH + 4) - 1 - (ESTABLISH - 1) - 1 - ESTABLISH, usage.describe()


@pytest.mark.multiprocess
def test_no_walk_under_ddp_a_rank_that_leaves_a_parameter_out_is_caught_retried_and_trains_like_stock() -> None:
    """2 gloo ranks, DDP(find_unused_parameters=False), static graph and not: after the check took over, rank 1
    then both ranks leave a layer out; each is caught at backward, retried with a tie (no hang), and the weights
    are bit-equal to stock DDP(find_unused_parameters=True) (AdamW with weight decay, clipping, variable batch)."""
    from launch import torchrun

    done = torchrun("usage_no_walk_ddp.py", timeout=120)
    assert done.stdout.count("NO_WALK_DDP_OK") == 2, done.stdout[-4000:]
    assert done.stdout.count("same=True retried=1") == 4, done.stdout[-4000:]


def test_fsdp_unit_ties_reach_a_loss_built_from_another_output() -> None:
    """Under FSDP2 (units) a unit's ties are its forward's only chance: TRL's fused LM head returns ``loss`` and
    ``log_probs`` and SFTTrainer back-propagates ``-log_probs``, never ``loss``. The unused parameter must still get
    its exact-zero gradient (else that rank's reduce-scatter lacks it: the mixed-rank VLM hang): the loss observer
    moves the unreached tie into the loss given to backward; outputs and loss unchanged."""
    from transformers.utils import ModelOutput

    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> ModelOutput:
            log_probs = torch.log_softmax(self.used(x), -1)[:, 0]
            return ModelOutput(loss=-log_probs.mean(), log_probs=log_probs)

    x = torch.randn(5, 4)
    model = Fused()
    want = model(x)["log_probs"].detach().clone()
    usage = ParameterUsage(model, units=[model]).attach()
    feature_counts.reset()
    out = model(x)
    assert torch.equal(out["log_probs"], want) and torch.equal(out.log_probs, out["log_probs"])
    loss = -out["log_probs"].sum()
    seen = usage.observe_loss(loss)  # FSDP2's wiring at accelerator.backward: the tie moves into this loss
    assert seen is not loss and torch.equal(seen, loss)
    seen.backward()
    assert model.unused.weight.grad is not None and not model.unused.weight.grad.any()
    assert feature_counts.snapshot()["parameter_usage"].amounts.get("ties_moved_to_loss") == 2
    assert model.used.weight.grad is not None and model.used.weight.grad.any()
    model(x)  # a forward the next loss does not reach at all (none of its outputs): its ties stay where they are
    other = model.used(x).sum()
    assert usage.observe_loss(other) is other
    assert feature_counts.snapshot()["parameter_usage"].amounts.get("ties_moved_to_loss") == 2
    model(x)  # never back-propagated: its pending ties (and the graph they hold) go with the step at finalize
    assert usage._step.unit_ties.pending
    usage.finalize()
    assert not usage._step.unit_ties.pending
    usage.remove()
