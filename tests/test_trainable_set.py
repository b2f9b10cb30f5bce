"""A parameter unfrozen after DDP wrapped the model (tests/scripts/unfreeze_ddp.py): hf_ddpfix averages its
gradient over the ranks from the step of the change, so 2-process DDP equals a one-process run with the same
global batch; the stock Trainer's replicas drift apart."""

from __future__ import annotations

import re

import pytest
import torch
from launch import SCRIPTS, accelerate_launch, fsdp_device_env, torchrun

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.multiprocess
def test_a_head_unfrozen_at_step_2_trains_like_one_process_sgd_and_adamw(tmp_path):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    torchrun("unfreeze_ddp.py", "--out", str(one), nproc=1, timeout=240)
    done = torchrun("unfreeze_ddp.py", "--out", str(two), nproc=2, timeout=300)
    ref, got = torch.load(one), torch.load(two)
    gaps = got["gaps"]
    for opt in ("sgd", "adamw"):
        diff = max((got["weights"][opt][n] - ref["weights"][opt][n]).abs().max().item() for n in ref["weights"][opt])
        assert diff <= 1e-6, (opt, diff)
        assert gaps[f"head_moved_{opt}"] > 1e-3, gaps  # the unfrozen head was trained
        assert gaps[f"fixed_rank_gap_{opt}"] == 0.0, gaps
        assert gaps[f"stock_rank_gap_{opt}"] > 1e-4, gaps  # what stock DDP does: the replicas drift apart
    assert "require grad that did not when DDP wrapped the model (lm_head.weight)" in done.stdout, done.stdout[-3000:]


@pytest.mark.multiprocess
def test_fsdp_and_rank_mismatched_unfreezing_are_refused_at_the_step_on_every_rank():
    done = torchrun("trainable_set_refusals.py", timeout=120)
    out = done.stdout
    assert "NOT_REFUSED" not in out, out[-3000:]
    for case in ("fsdp", "ddp_mismatch", "ddp_one_rank"):
        assert sorted(re.findall(rf"REFUSED rank=(\d) case={case} ok=True", out)) == ["0", "1"], out[-3000:]
    assert sorted(re.findall(r"QUIET rank=(\d) reduced=0", out)) == ["0", "1"], out[-3000:]


@pytest.mark.multiprocess
def test_deepspeed_zero2_and_zero3_refuse_a_head_unfrozen_at_step_2_and_a_plain_run_is_untouched():
    """tests/scripts/unfreeze_deepspeed.py through the Trainer: stock ZeRO trains on and silently never steps the
    unfrozen head; hf_ddpfix raises at step 2 on every rank. Without a change: bit-equal to stock (ZeRO-2 and
    ZeRO-3), no warning. Skips where DeepSpeed is not installed (a test extra)."""
    pytest.importorskip("deepspeed", reason="test extra: DS_BUILD_OPS=0 pip install deepspeed==0.19.8")
    done = torchrun("unfreeze_deepspeed.py", timeout=300, env={"DS_ACCELERATOR": "cpu"})
    out = done.stdout
    assert "NOT_REFUSED" not in out, out[-3000:]
    for case in ("zero2", "zero3"):
        assert sorted(re.findall(rf"REFUSED rank=(\d) case={case} ok=True", out)) == ["0", "1"], out[-3000:]
    for case in ("zero2", "zero3"):
        assert sorted(re.findall(rf"QUIET rank=(\d) case={case} diff=0\.0(?![0-9e])", out)) == ["0", "1"], out[-3000:]
    quiet = (out + done.stderr).split("REFUSED", 1)[0]
    assert "hf_ddpfix: at optimizer step" not in quiet and "require grad" not in quiet, quiet[-3000:]


# -- the trainable set shrinking after wrapping, and gradients below the loss seen (issue 38) ------------------------

FREEZE_CASES = ("freeze", "freeze_ga2", "freeze_lora")


#: seconds from the start of the step where one rank freezes to the refusal on each rank. The refusal is one small
#: all-gather at that step (measured 2026-12-02 under DDP: 0.02 s on both ranks, 2-core box at load 1); a hang or a
#: late refusal (a collective timeout) would end only at the launch's 300-420 s timeout. Shown failing once: a
#: ``time.sleep(25)`` in ``_differently`` (integrations/trainable_set.py, which builds the error every rank raises)
#: made ``after_freeze_s`` 25.01 and this bound failed ("AssertionError: ('0', '25.01', 20.0)").
REFUSAL_BOUND_S = 20.0


def _judge(out: str, cases: tuple[str, ...]) -> None:
    """Every case on both ranks: max |fixed - stock| <= 1e-6 over every parameter (measured: 0.0); the regulariser's
    module moved; the one-rank freeze refused on both ranks, naming step 3, within ``REFUSAL_BOUND_S`` seconds of
    the start of that step."""
    assert "NOT_REFUSED" not in out, out[-3000:]
    for case in cases:
        found = re.findall(rf"CASE rank=(\d) case={case} diff=(\S+) aux_moved=(\S+)", out)
        assert sorted(r for r, _, _ in found) == ["0", "1"], (case, out[-3000:])
        for _, diff, aux in found:
            assert float(diff) <= 1e-6, (case, diff)
            if case.startswith("reg"):
                assert float(aux) > 1e-3, (case, aux)  # its gradient was kept and stepped
    refused = re.findall(r"REFUSED rank=(\d) case=one_rank ok=True after_freeze_s=(\S+)", out)
    assert sorted(r for r, _ in refused) == ["0", "1"], out[-3000:]
    for rank, after in refused:
        assert float(after) <= REFUSAL_BOUND_S, (rank, after, REFUSAL_BOUND_S)


@pytest.mark.multiprocess
def test_ddp_a_head_frozen_after_wrapping_trains_as_stock_and_a_regulariser_below_the_loss_is_kept():
    """tests/scripts/trainable_set_ddp.py under DDP with the plan's settings (find_unused False, static graph at GA 1):
    ``lm_head`` frozen at step 3 (GA 1, and between the micro-batches of step 3 at GA 2), a LoRA layer frozen, TRL's
    SFTTrainer on a tiny Qwen2-VL (images on rank 0 only) with its vision tower's LoRA frozen; an Accelerator
    subclass adding a regulariser over a module the forward never uses; each within 1e-6 of the stock Trainer
    (measured 0.0 but TRL's; find_unused True; the regulariser: False, the setting under which stock DDP reduces
    it). A second backward of that regulariser, which DDP cannot reduce: a named DDPFixError. Main's code:
    'Expected to have finished reduction' on both ranks (freeze), the regulariser's module never moves (reg: 3.0e-2
    from stock). ``reg_zero`` (issue 48): the regulariser's gradient of ``aux`` is exactly zero at step 1 (``aux_b``
    zero, as LoRA's B): weights and AdamW state (exp_avg, exp_avg_sq, step) bit-equal to stock; on 2410770 (the
    ``grad.any()`` read) its gradient was reset to None, AdamW skipped it. Then only rank 0 freezes:
    TrainableSetChangedError on both ranks at step 3."""
    done = torchrun("trainable_set_ddp.py", timeout=420)
    _judge(done.stdout, (*FREEZE_CASES, "freeze_trl_vlm", "reg_accelerator", "reg_zero"))
    # issue 48: aux's real gradient is exactly zero at step 1; weights and AdamW state bit-equal to stock
    assert sorted(re.findall(r"CASE rank=(\d) case=reg_zero diff=0\.0 ", done.stdout)) == ["0", "1"], done.stdout[-3000:]
    assert sorted(re.findall(r"REFUSED rank=(\d) case=reg_second ok=True", done.stdout)) == ["0", "1"], done.stdout[-3000:]
    assert "stopped requiring grad after the model was wrapped (lm_head.weight)" in done.stdout, done.stdout[-3000:]


@pytest.mark.multiprocess
def test_fsdp2_a_head_frozen_after_wrapping_trains_as_stock_fsdp_and_a_one_rank_freeze_is_refused():
    """The same script through ``accelerate launch`` (fsdp.yaml, the FSDP test device): stock FSDP2 is the reference.
    A rank that froze alone would reduce-scatter other gradients than its peers in backward (a hang): the ranks
    check before each micro-batch's forward. Wall: ~90 s."""
    done = accelerate_launch("fsdp.yaml", SCRIPTS / "trainable_set_ddp.py", "freeze,freeze_ga2,reg_accelerator,one_rank",
                             timeout=360, env=fsdp_device_env({"TS_PARALLEL": "fsdp", **OFFLINE}),
                             extra=("--mixed_precision", "no"))
    _judge(done.stdout, ("freeze", "freeze_ga2", "reg_accelerator"))


@pytest.mark.multiprocess
def test_zero2_a_head_frozen_after_wrapping_trains_as_stock_deepspeed_and_a_one_rank_freeze_is_refused():
    """The same script under DeepSpeed ZeRO-2 (CPU): stock ZeRO-2 is the reference. Wall: ~60 s. Skips where
    DeepSpeed is not installed (a test extra)."""
    pytest.importorskip("deepspeed", reason="test extra: DS_BUILD_OPS=0 pip install deepspeed==0.19.8")
    done = torchrun("trainable_set_ddp.py", "freeze,freeze_ga2,one_rank", timeout=300,
                    env={"DS_ACCELERATOR": "cpu", "TS_PARALLEL": "zero2"})
    _judge(done.stdout, ("freeze", "freeze_ga2"))


# -- single process: the mechanisms -------------------------------------------------------------------------------


def _head_model() -> torch.nn.Module:
    from fixtures import lora_llama

    model = lora_llama(targets=("q_proj", "v_proj", "lm_head"))
    torch.manual_seed(3)
    model.add_module("score_head", torch.nn.Linear(model.config.hidden_size, 1))
    return model


def _head_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, output_hidden_states=True)  # lm_head's LoRA never reaches this loss
    return model.score_head(out.hidden_states[-1]).pow(2).mean()


def _reg(model: torch.nn.Module) -> torch.Tensor:
    return sum(p.pow(2).sum() for n, p in model.named_parameters() if "lm_head" in n and p.requires_grad) * 0.1


@pytest.mark.parametrize("route", ["below", "second", "observe_only"])
def test_a_gradient_below_the_loss_seen_is_kept_bit_equal(route):
    """A regulariser over lm_head's LoRA (which the loss seen does not reach) added below ``tie_loss`` (an
    Accelerator subclass's backward), or back-propagated in a second backward before the step: its gradient is
    kept bit-equal to the untouched model's, not reset to None at finalize; the observe-only tracker
    (``tie=False``: ZeRO's skip-unused) counts it used. Main's code resets it (2 grads to None)."""
    from hf_ddpfix.integrations.usage import ParameterUsage

    ids = torch.randint(1, 200, (1, 9))
    stock = _head_model()
    (_head_loss(stock, ids) + _reg(stock)).backward()
    expected = {n: p.grad.clone() for n, p in stock.named_parameters() if "lm_head" in n and p.requires_grad}

    model = _head_model()
    usage = ParameterUsage(model, tie=route != "observe_only", guard=False).attach()
    usage.at_loss = True
    loss = usage.tie_loss(_head_loss(model, ids))
    if route == "second":
        loss.backward()
        _reg(model).backward()
    else:
        (loss + _reg(model)).backward()
    if route == "observe_only":
        mask = usage.agreed_step_usage()
        assert mask is not None and bool(mask.all()), mask
    else:
        assert usage.finalize() == 0
    for n, g in expected.items():
        assert torch.equal(dict(model.named_parameters())[n].grad, g), n
    usage.remove()


def _reg_through_zero_b(model: torch.nn.Module) -> torch.Tensor:
    """0.1 * sum(B @ A) over lm_head's LoRA: with B zero, A's gradient (B^T 1) is exactly zero, B's is not."""
    mods = dict(model.named_modules())
    name = next(n for n in mods if n.endswith("lm_head.lora_A.default"))
    a, b = mods[name].weight, mods[name.replace("lora_A", "lora_B")].weight
    return 0.1 * (b @ a).sum()


@pytest.mark.parametrize("route", ["below", "second"])
def test_a_real_gradient_exactly_zero_is_kept_and_adamw_state_equals_stock_bit_for_bit(route):
    """Issue 48: lm_head's LoRA B is zero, so a regulariser ``sum(B @ A)`` below the loss seen (which does not reach
    lm_head's LoRA: tied in with a zero) gives A an exactly zero real gradient at step 1. Stock keeps it (zeros, not
    None): AdamW decays A, counts the step and updates its moments. hf_ddpfix must give AdamW the same: after two
    steps every weight, ``exp_avg``, ``exp_avg_sq`` and ``step`` equal stock bit for bit, with no host read of a
    gradient's values in the hooks. Shown failing on 2410770 (``bool(grad.any())`` in ``mark_real``): A's gradient
    reset to None at step 1 (``finalize`` returned 1), AdamW skipped it (step 1 vs 2, A not decayed)."""
    from hf_ddpfix.integrations.usage import ParameterUsage

    torch.manual_seed(5)
    batches = [torch.randint(1, 200, (1, 9)) for _ in range(2)]

    def zero_b(model: torch.nn.Module) -> torch.nn.Module:
        for n, p in model.named_parameters():
            if "lm_head.lora_B" in n:
                p.data.zero_()
        return model

    def run(patched: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[int]]:
        model = zero_b(_head_model())
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        usage = ParameterUsage(model, tie=True, guard=False).attach() if patched else None
        resets = []
        for ids in batches:
            loss = _head_loss(model, ids)
            if usage is not None:
                usage.at_loss = True
                loss = usage.tie_loss(loss)
            if route == "second":
                loss.backward()
                _reg_through_zero_b(model).backward()
            else:
                (loss + _reg_through_zero_b(model)).backward()
            if usage is not None:
                resets.append(usage.finalize())
            opt.step()
            opt.zero_grad(set_to_none=True)
        if usage is not None:
            usage.remove()
        return model, opt, resets

    stock, stock_opt, _ = run(False)
    model, opt, resets = run(True)
    a = next(p for n, p in model.named_parameters() if "lm_head.lora_A" in n)
    assert resets == [0, 0], resets  # nothing reset: A's zero gradient was real
    for (n, p), q in zip(stock.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), n
    for p, q in zip(stock_opt.param_groups[0]["params"], opt.param_groups[0]["params"], strict=True):
        sp, sq = stock_opt.state[p], opt.state[q]
        assert set(sp) == set(sq) and all(torch.equal(sp[k], sq[k]) for k in sp), (sp, sq)
    assert int(opt.state[a]["step"]) == 2


def test_ties_alone_hand_a_leaf_one_marked_zero_per_backward_and_a_real_zero_is_not_one():
    """Two ties of the same leaf in one backward: the leaf's hook sees one marked zero (the second tie gives None);
    a real gradient that is exactly zero, summed with a tie's zero, is unmarked. Without the one-zero rule the two
    ties' zeros are summed into an unmarked zero (shown: the first assertion fails); without
    ``set_materialize_grads(False)`` the last one fails (``w`` gets a computed zero)."""
    from hf_ddpfix.ops.zero_tie import ZeroTie, is_tie_zero

    used, leaf = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    seen: list[bool] = []
    leaf.register_hook(lambda g: seen.append(is_tie_zero(g)))
    ZeroTie.tie(ZeroTie.tie((used * 2).sum(), [leaf]) * 3, [leaf]).backward()
    ZeroTie.tie(ZeroTie.tie((used * 2).sum(), [leaf]) * 3, [leaf]).backward()  # a new pass: marked again
    (ZeroTie.tie((used * 2).sum(), [leaf]) + (leaf * 0).sum()).backward()
    assert seen == [True, True, False], seen
    assert torch.equal(leaf.grad, torch.zeros(4))
    # a tied output the loss does not read (DDP's sink hands it None): no zero through its own graph, so a parameter
    # only behind it gets nothing from there (stock gives it nothing); on 2410770 it got a computed zero
    class Sink(torch.autograd.Function):  # DDP's _DDPSink: identity on its outputs, None stays None
        @staticmethod
        def forward(ctx, a, b):  # noqa: ANN001, ANN205
            ctx.set_materialize_grads(False)
            return a.clone(), b.clone()

        @staticmethod
        def backward(ctx, ga, gb):  # noqa: ANN001, ANN205
            return ga, gb

    w = torch.nn.Parameter(torch.ones(2))
    _, used_out = Sink.apply(ZeroTie.tie(w * 2, [leaf]), used * 1)
    used_out.sum().backward()
    assert w.grad is None, w.grad


def test_a_tie_marks_its_zero_and_ties_a_parameter_frozen_after_wrapping():
    """``ZeroTie.tie``: the frozen leaf's AccumulateGrad runs (a DDP hook on it would fire) and it gets no gradient;
    its requires_grad stays False; the zero a tie hands out is recognisable, a sum with a real gradient is not."""
    from hf_ddpfix.ops.zero_tie import ZeroTie, is_tie_zero

    used, frozen = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    extra = torch.nn.Parameter(torch.ones(4))
    seen: dict[str, bool] = {}
    frozen.register_hook(lambda g: seen.__setitem__("frozen", is_tie_zero(g)))
    extra.register_hook(lambda g: seen.__setitem__("extra", is_tie_zero(g)))
    frozen.requires_grad_(False)
    ZeroTie.tie((used * 2).sum(), [frozen, extra]).backward()
    assert seen == {"frozen": True, "extra": True} and not frozen.requires_grad
    assert frozen.grad is None and extra.grad is not None and not extra.grad.any()
    extra.grad = None
    (ZeroTie.tie((used * 2).sum(), [extra]) + extra.sum()).backward()
    assert seen["extra"] is False and torch.equal(extra.grad, torch.ones(4))


def test_the_watch_sees_a_freeze_once_and_costs_nothing_while_the_set_is_unchanged():
    from hf_ddpfix.integrations.usage.trainable_set import TrainableSetWatch

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    step = [1]
    watch = TrainableSetWatch(model, "ddp", step=lambda: step[0])
    assert not watch.changed()
    step[0] = 2
    model[1].weight.requires_grad_(False)
    assert watch.changed()
    watch.finalize()  # one process: agreed with itself
    assert watch._froze_agreed == ("1.weight",)
    step[0] = 3
    assert not watch.changed()  # frozen since, unchanged: nothing to agree on


def test_fsdp_hold_keeps_the_agreed_set_for_a_micro_batch_and_costs_nothing_while_unchanged():
    """FSDP2's per-micro-batch check is local (issue 48: it all-gathered a byte per rank and micro-batch and read it
    on the host): nothing switched while the set is the agreed one; a parameter frozen at the step's first
    micro-batch is held trainable through that step's micro-batches (its reduce-scatter matches the other ranks'),
    one frozen after an earlier micro-batch is not held, one unfrozen is held frozen; each micro-batch ends with the
    user's values back; after the agreement (one process: agreed with itself) the held parameter's gradient is None
    and nothing is held at the next step."""
    from hf_ddpfix.integrations.usage.trainable_set import TrainableSetWatch

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[2].requires_grad_(False)
    step = [1]
    watch = TrainableSetWatch(model, "fsdp", step=lambda: step[0])
    assert watch.hold() == [] and watch.hold() == []  # steady state: nothing to do
    step[0] = 2
    model[0].weight.requires_grad_(False)  # frozen before the step's first micro-batch: held
    for _ in range(2):  # two micro-batches
        switched = watch.hold()
        assert [p is model[0].weight for p, _, _ in switched] == [True] and model[0].weight.requires_grad
        model(torch.ones(1, 2)).sum().backward()
        watch.release(switched)
        assert not model[0].weight.requires_grad
    model[1].bias.requires_grad_(False)  # frozen after a micro-batch of this step: not held
    switched = watch.hold()
    assert [p is model[0].weight for p, _, _ in switched] == [True]
    watch.release(switched)
    assert model[0].weight.grad is not None
    watch.finalize()  # one process: every rank changed the same way
    assert model[0].weight.grad is None and model[1].bias.grad is not None and watch.holds == 3
    step[0] = 3
    assert watch.hold() == []  # agreed now
    model[2].weight.requires_grad_(True)  # unfrozen since wrapping: held frozen
    switched = watch.hold()
    assert [(p is model[2].weight, was) for p, was, _ in switched] == [(True, True)] and not model[2].weight.requires_grad
    watch.release(switched)
    assert model[2].weight.requires_grad


def test_deepspeed_agrees_at_the_step_start_and_holds_a_freeze_between_micro_batches_with_a_zero_gradient():
    """DeepSpeed (issue 48: a one-byte all-gather and two host reads per micro-batch before): the flag goes out once
    per optimizer step, at its first micro-batch (one process: agreed with itself at once); a parameter frozen
    between micro-batches is held trainable with a hook handing the engine a zero gradient (the zero slice stock
    ZeRO steps) until the next step's start agrees on it; an unfrozen one is refused at that step's start."""
    from hf_ddpfix.integrations.usage.agreement import UsageAgreement
    from hf_ddpfix.integrations.usage.trainable_set import TrainableSetChangedError, TrainableSetWatch

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].requires_grad_(False)
    step = [1]
    watch, agreement = TrainableSetWatch(model, "deepspeed", step=lambda: step[0]), UsageAgreement()
    watch.agree_at_step_start(agreement)
    assert watch.hold(zero_frozen=True) == []
    model[0].weight.requires_grad_(False)  # between two micro-batches of step 1
    watch.agree_at_step_start(agreement)  # not the step's first micro-batch: nothing
    switched = watch.hold(zero_frozen=True)
    assert [p is model[0].weight for p, _, _ in switched] == [True] and model[0].weight.requires_grad
    model(torch.ones(1, 2)).sum().backward()
    watch.release(switched)
    assert not model[0].weight.requires_grad and torch.equal(model[0].weight.grad, torch.zeros(2, 2))
    assert model[0].bias.grad is not None and bool(model[0].bias.grad.any())
    step[0] = 2
    watch.agree_at_step_start(agreement)  # agreed: nothing held from now on
    assert watch._froze_agreed == ("0.weight",) and watch.hold(zero_frozen=True) == []
    step[0] = 3
    model[1].weight.requires_grad_(True)
    with pytest.raises(TrainableSetChangedError, match="optimizer step 3.*deepspeed.initialize"):
        watch.agree_at_step_start(agreement)


def test_no_walk_comes_back_after_a_freeze_and_the_frozen_parameter_stays_without_a_gradient():
    """The no-walk check (``ParameterUsage`` at the loss, ``backward_retries``): after ``b`` is frozen the check fails
    once (``b``'s node will not run), the retry walks and ties ``b`` (``ZeroTie.tie``), and after ESTABLISH clean
    walks the loss is checked at backward again, ``b`` tied in without a walk; ``b`` unfrozen again is walked and
    used. Every step's gradients equal the untouched model's, ``b``'s ``None`` while frozen."""
    from hf_ddpfix.integrations.usage import ParameterUsage, UsageChanged
    from hf_ddpfix.integrations.usage.no_walk import ESTABLISH

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)).pow(2).mean()

    torch.manual_seed(0)
    model, ref = TwoLayers(), TwoLayers()
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
    checks = []
    freeze_at = ESTABLISH + 3  # the check runs from step ESTABLISH + 1
    unfreeze_at = freeze_at + ESTABLISH + 4
    steps = unfreeze_at + ESTABLISH + 3
    for step in range(steps):
        if step in (freeze_at, unfreeze_at):
            for m in (model, ref):
                m.b.weight.requires_grad_(step == unfreeze_at)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        backward(model(x))
        usage.finalize()
        ref(x).backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), (step, n)
            if q.grad is not None:
                assert torch.equal(p.grad, q.grad), (step, n)
        checks.append(usage.no_walk.checks)
    assert retried == [True], (retried, checks)  # the freeze (caught by the check); the unfreeze is walked
    frozen_checks = checks[unfreeze_at - 1] - checks[freeze_at + ESTABLISH]
    assert frozen_checks == unfreeze_at - 1 - (freeze_at + ESTABLISH) > 0, checks  # checked, not walked, while frozen
    assert checks[-1] > checks[unfreeze_at], checks  # and again once b trains
