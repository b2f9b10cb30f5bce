"""Outputs that differ by rank never reach the Trainer's prediction gathers unequal (hf_ddpfix.ops.output_agreement,
hf_ddpfix.plan.evaluation); the 2-process runs under DDP, FSDP2 and ZeRO-3 (tests/scripts/eval_outputs.py) last."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling, CausalLMOutputWithPast
from transformers.utils import ModelOutput

from hf_ddpfix.config.options import DDPFixConfig
from hf_ddpfix.ops.output_agreement import PAD, OutputAgreement, describe, pad_all_dims


def _run(outputs: list, agreements: list[OutputAgreement] | None = None, index: int = 0) -> list:
    """Every rank's `apply` over the exchanged signatures (what the all_gather_object hands each rank)."""
    agreements = agreements or [OutputAgreement(rank=r, skip=("cache",)) for r in range(len(outputs))]
    sigs = [a.describe(o) for a, o in zip(agreements, outputs, strict=True)]
    return [a.apply(o, sigs, index) for a, o in zip(agreements, outputs, strict=True)]


def _vlm_out(image: bool, seq: int = 5, patches: int = 16, batch: int = 1) -> ModelOutput:
    """A 5.24-style VLM output: `image_outputs` only with an image (its `hidden_states` off)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast as Base

    class Out(Base):
        pass

    Out.__annotations__ = {}
    out = {"loss": torch.tensor(1.0), "logits": torch.randn(batch, seq, 7)}
    if image:
        out["image_outputs"] = BaseModelOutputWithPooling(last_hidden_state=torch.randn(patches, 4),
                                                          pooler_output=torch.randn(patches // 4, 6))
    return out


def _structure(value):
    sig = describe(value)

    def strip(s):
        if s[0] == "t":
            return ("t", s[1], len(s[2]))
        return (s[0], tuple((k, strip(c)) for k, c in s[1]) if s[0] == "map" else tuple(strip(c) for c in s[1]))
    return strip(sig)


def _without_loss(out):
    return {k: v for k, v in out.items() if k != "loss"}


def test_a_field_some_ranks_lack_at_the_first_step_is_dropped_on_every_rank_at_every_step():
    agreements = [OutputAgreement(rank=r) for r in range(2)]
    first = [_vlm_out(True), _vlm_out(False)]
    got = _run(first, agreements)
    assert [list(o) for o in got] == [["loss", "logits"], ["loss", "logits"]]
    assert got[0]["logits"] is first[0]["logits"] and got[1] is first[1]  # rank 1 had nothing to drop: same object
    assert set(agreements[0].dropped) == {"image_outputs"} and "absent on rank 1" in agreements[0].dropped["image_outputs"]
    for later in ([_vlm_out(True), _vlm_out(True)], [_vlm_out(False), _vlm_out(True)]):  # never comes back
        assert [list(o) for o in _run(later, agreements)] == [["loss", "logits"], ["loss", "logits"]]


def test_nothing_differs_nothing_changes():
    agreements = [OutputAgreement(rank=r) for r in range(2)]
    for _ in range(2):
        outs = [_vlm_out(True), _vlm_out(True)]
        got = _run(outs, agreements)
        assert got[0] is outs[0] and got[1] is outs[1]
    assert agreements[0].dropped == {} and agreements[0].changed == 0 and agreements[0].forwards == 2


def test_a_kept_field_a_rank_lacks_later_is_a_minus_100_placeholder_of_the_same_structure():
    agreements = [OutputAgreement(rank=r) for r in range(2)]
    _run([_vlm_out(True), _vlm_out(True)], agreements)
    outs = [_vlm_out(True, patches=16), _vlm_out(False)]
    got = _run(outs, agreements)
    assert _structure(_without_loss(got[0])) == _structure(_without_loss(got[1]))
    ph = got[1]["image_outputs"]
    assert type(ph) is BaseModelOutputWithPooling  # the class of the first step: the Trainer concatenates by class
    assert ph["last_hidden_state"].shape == (16, 4) and bool((ph["last_hidden_state"] == PAD).all())
    assert got[0]["image_outputs"] is outs[0]["image_outputs"] and agreements[1].placeholders == 1


def test_shapes_that_differ_outside_dimension_1_are_padded_to_the_largest():
    agreements = [OutputAgreement(rank=r) for r in range(2)]
    outs = [_vlm_out(True, patches=16), _vlm_out(True, patches=8, seq=9)]  # a different number of image patches
    got = _run(outs, agreements)
    a, b = got[0]["image_outputs"]["last_hidden_state"], got[1]["image_outputs"]["last_hidden_state"]
    assert a.shape == b.shape == (16, 4)
    assert torch.equal(b[:8], outs[1]["image_outputs"]["last_hidden_state"]) and bool((b[8:] == PAD).all())
    assert got[1]["logits"].shape == (1, 9, 7)  # dimension 1: the Trainer's own pad_across_processes pads it
    assert agreements[1].padded == 2 and agreements[0].padded == 0


def _trainer_pads(outs: list, dim: int = 1) -> list:
    """What the Trainer's gathers get once hf_ddpfix's ``pad_across_processes`` ran on every rank: each tensor padded
    in every dimension to the largest over the ranks (``pad_all_dims`` over the sizes stock gathers)."""
    flat = [[t for t in _leaves(_without_loss(o))] for o in outs]
    assert len({len(f) for f in flat}) == 1, [len(f) for f in flat]  # the same tensors on every rank
    return [[pad_all_dims(t, [list(f[i].shape) for f in flat], dim, PAD)[0] for i, t in enumerate(mine)]
            for mine in flat]


def _leaves(x) -> list:
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _leaves(v)]
    return [t for v in x for t in _leaves(v)]


@pytest.mark.parametrize("later", [
    [(True, 16, 5), (False, 16, 5)],  # a kept field one rank lacks: a placeholder
    [(True, 16, 5), (True, 8, 9)],  # sizes differing outside dimension 1: padded
    [(False, 16, 5), (False, 16, 9)],  # every rank lacks it
    [(True, 16, 5), (True, 16, 5)],  # nothing differs: untouched
])
def test_later_steps_agree_alone_and_the_trainers_padding_gives_what_the_exchange_gave(later):
    """Issue 48: after the first step (signatures exchanged once) each rank conforms alone (``apply_local``: no
    collective) and the Trainer's ``pad_across_processes`` (hf_ddpfix's: every dimension, from the sizes stock
    gathers anyway) pads; the tensors every rank hands the gathers equal, bit for bit, those of the per-step
    exchange (``apply``) where a rank has the field, and are -100 where none has it (the exchange gave the first
    step's shape then: placeholders sized 0 in dimensions 0 and 1 now)."""
    torch.manual_seed(0)
    local = [OutputAgreement(rank=r) for r in range(2)]
    exchanged = [OutputAgreement(rank=r) for r in range(2)]
    first = [_vlm_out(True), _vlm_out(True)]
    _run(first, local)
    _run(first, exchanged)
    outs = [_vlm_out(img, patches=p, seq=s) for img, p, s in later]
    got = [a.apply_local(o, 0) for a, o in zip(local, outs, strict=True)]
    ref = _run(outs, exchanged)
    if all(img for img, _, _ in later) and later[0] == later[1]:
        assert got[0] is outs[0] and got[1] is outs[1]
    assert [_structure(_without_loss(g)) for g in got] == [_structure(_without_loss(r)) for r in ref]
    mine, theirs = _trainer_pads(got), _trainer_pads(ref)
    for rank in range(2):
        for i, (a, b) in enumerate(zip(mine[rank], theirs[rank], strict=True)):
            assert a.shape == mine[1 - rank][i].shape, (rank, i)  # every rank hands the gather the same shape
            if any(img for img, _, _ in later) or i == 0:  # i == 0: the logits, on every rank
                assert torch.equal(a, b), (rank, i)
            else:  # image_outputs, which no rank has: -100 placeholders
                assert bool((a == PAD).all()), (rank, i)
    assert all(a.forwards == 2 for a in local)


def test_pad_all_dims_pads_every_dimension_and_only_dim_where_the_others_agree():
    t = torch.arange(6.0).reshape(1, 2, 3)
    out, other = pad_all_dims(t, [[1, 2, 3], [2, 4, 3]], 1, PAD)
    assert out.shape == (2, 4, 3) and other and torch.equal(out[:1, :2], t) and bool((out[1:] == PAD).all())
    out, other = pad_all_dims(t, [[1, 2, 3], [1, 5, 3]], 1, PAD, pad_first=True)
    assert out.shape == (1, 5, 3) and not other and torch.equal(out[:, 3:], t)  # accelerate's own result
    same, other = pad_all_dims(t, [[1, 2, 3], [1, 2, 3]], 1, PAD)
    assert same is t and not other


def test_a_field_holding_none_or_a_cache_is_not_gatherable_and_dropped_keys_the_trainer_ignores_are_left_alone():
    class Cache:  # what the Trainer leaves out by its ignore_keys: not agreed on, passed through
        pass

    outs = [{"loss": torch.tensor(0.0), "logits": torch.ones(1, 2, 3), "cache": Cache(),
             "image_outputs": {"hidden_states": (None, torch.ones(1, 2))}} for _ in range(2)]
    agreements = [OutputAgreement(rank=r, skip=("cache",)) for r in range(2)]
    got = _run(outs, agreements)
    assert list(got[0]) == ["loss", "logits", "cache"] and got[0]["cache"] is outs[0]["cache"]
    assert "NoneType" in agreements[0].dropped["image_outputs"]


def test_a_model_output_keeps_its_class_and_field_order_and_structure_differences_are_dropped():
    outs = [CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=torch.ones(1, 3, 5),
                                   hidden_states=(torch.ones(1, 3, 2),) * n) for n in (2, 3)]
    agreements = [OutputAgreement(rank=r) for r in range(2)]
    got = _run(outs, agreements)
    assert all(type(o) is CausalLMOutputWithPast and list(o) == ["loss", "logits"] for o in got)
    assert "structure differs on rank 1" in agreements[0].dropped["hidden_states"]


def test_a_tuple_output_is_left_to_stock_and_each_forward_of_a_step_has_its_own_kept_fields():
    agreements = [OutputAgreement(rank=r) for r in range(2)]
    outs = [(torch.ones(1), torch.ones(2)), (torch.ones(1), torch.ones(2))]
    assert _run(outs, agreements)[0] is outs[0] and agreements[0].not_mappings == 1
    _run([_vlm_out(True), _vlm_out(False)], agreements, index=0)
    got = _run([_vlm_out(True), _vlm_out(True)], agreements, index=1)  # a second forward kind: its own first step
    assert "image_outputs" in got[0] and "image_outputs" in got[1]


@pytest.mark.parametrize("parallel,world,value", [("ddp", 2, True), ("fsdp", 2, True), ("deepspeed", 2, True),
                                                  ("single", 1, None), ("ddp", 1, None)])
def test_the_plan_agrees_on_outputs_wherever_more_than_one_process_gathers(parallel, world, value):
    from hf_ddpfix.plan.evaluation import EVAL_OUTPUTS_HOW, decide_eval_outputs
    from hf_ddpfix.plan.types import RunFacts

    facts = RunFacts(parallel=parallel, world_size=world)
    decision = decide_eval_outputs(facts, DDPFixConfig())
    assert decision.value is value and len(f" * {'eval_outputs':<23} = {'on':<14} {EVAL_OUTPUTS_HOW}") <= 160
    if value:
        off = decide_eval_outputs(facts, DDPFixConfig.from_env(eval_outputs=False))
        assert off.value is False and "as in stock" in off.reason


# ----------------------------------------------------------------------------- 2 processes, as users launch

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.multiprocess
def test_vlm_outputs_that_differ_by_rank_evaluate_and_predict_as_stock_ddp_under_ddp_fsdp2_and_zero3(tmp_path):
    """tests/scripts/eval_outputs.py, one launch per parallel mode (ddp_cpu.yaml, fsdp.yaml through the FSDP test
    device, zero3.yaml), no ``ignore_keys``: Qwen2.5-VL and LLaVA (``output_hidden_states`` asked) with image and
    text ranks mixed from the first step, images everywhere (nothing may change), images first then mixed
    (placeholders). ``evaluate()``'s loss and gathered predictions and ``predict()``'s equal stock DDP's (the
    DDP launch's stock ``Trainer``, given the differing fields as ``ignore_keys``: stock 5.23's tuple for
    Qwen2.5-VL) bit for bit. Without the agreement (``HF_DDPFIX_EVAL_OUTPUTS=0``) transformers 5.24 fails the first
    launch at the first mixed case with gloo's size mismatch ("8192 vs 8", 2026-11-28).

    Wall (2 cores shared with other jobs, torch 2.13, accelerate 1.15, 2026-11-28): 140-330 s on 5.23 (load 7-20), 204 s
    on 5.24 (load ~11); launches alone at lighter load: ddp 28 s, fsdp 46 s, zero3 45 s."""
    import json

    from fixtures import build_deepspeed_shm_op
    from launch import ROOT, accelerate_launch, fsdp_device_env

    script = ROOT / "tests" / "scripts" / "eval_outputs.py"
    out = str(tmp_path)
    import importlib.util

    launches = [("ddp", "ddp_cpu.yaml", OFFLINE, ()),
                ("fsdp", "fsdp.yaml", fsdp_device_env(OFFLINE), ("--mixed_precision", "no"))]
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    if has_deepspeed:
        build_deepspeed_shm_op()  # cached; outside the launches' hard timeouts
        launches.append(("zero3", "zero3.yaml", OFFLINE, ()))
    for mode, config, env, extra in launches:  # ddp first: it writes the stock reference the others compare with
        done = accelerate_launch(config, script, "--mode", mode, "--out", out, timeout=300, env=env, extra=extra)
        assert "EVAL_OUTPUTS_OK" in done.stdout, done.stdout[-3000:]
        report = json.loads((tmp_path / f"{mode}.json").read_text())["cases"]
        for case, r in report.items():
            assert all(v == 0.0 for v in r["diff"].values()), (mode, case, r)
        assert report["qwen2_5_vl-images"]["agreement"]["changed"] == 0, report  # nothing differs: untouched
    if not has_deepspeed:  # DDP and FSDP2 passed; say that ZeRO-3 did not run
        pytest.skip("ZeRO-3 launch not run: deepspeed is not installed (test extra: DS_BUILD_OPS=0 pip install deepspeed)")
