"""The trainer's own loss under sequence parallelism (docs/sequence-parallel-losses.md): which route a run takes
(sharded / gathered / refused), decided from what the run shows, and one launch of 2 gloo processes training every
case against stock DDP and one process on the whole batch (tests/scripts/sp_losses.py)."""

from __future__ import annotations

import json

import pytest
from transformers import Trainer


def _facts(**kw):
    from hf_ddpfix.integrations.sequence_parallel.facts import SequenceParallelFacts
    from hf_ddpfix.plan.types import RunFacts

    sp = SequenceParallelFacts(**{"attn_implementation": "sdpa", "num_heads": 8, "num_kv_heads": 4, **kw})
    return RunFacts(parallel="ddp", world_size=4, sequence_parallel=sp)


def _plan(**kw):
    from hf_ddpfix.config.options import DDPFixConfig
    from hf_ddpfix.plan.resolve import resolve_plan

    return resolve_plan(_facts(**kw), DDPFixConfig.from_env({}, sequence_parallel=2)).sequence_parallel


def test_the_stock_loss_runs_sharded_and_every_other_loss_gathered_and_the_plan_says_why():
    assert "loss sharded" in _plan().reason
    for kw, said in ((dict(trainer_loss="Double.compute_loss", trainer_name="Double"), "Double.compute_loss"),
                     (dict(compute_loss_func=True), "compute_loss_func"), (dict(label_smoothing=True), "label smoothing"),
                     (dict(average_tokens_across_devices=False), "average_tokens_across_devices=False")):
        reason = _plan(**kw).reason
        assert "loss gathered" in reason and said in reason, reason


def test_a_model_without_an_lm_head_runs_head_whole_found_by_structure_and_an_encoder_is_refused():
    """A sequence-classification model (any family built as decoder + score head, LoRA-wrapped or not): the plan
    says the head-whole route with the decoder it found; a BERT-like encoder (attention not causal) is refused."""
    from peft import LoraConfig, get_peft_model
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Qwen2Config,
        Qwen2ForSequenceClassification,
    )

    from hf_ddpfix.integrations.sequence_parallel.facts import gather_sequence_parallel_facts
    from hf_ddpfix.integrations.sequence_parallel.head import pooled_head_structure

    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32, vocab_size=50)
    model = get_peft_model(Qwen2ForSequenceClassification(Qwen2Config(**small, num_key_value_heads=2, pad_token_id=0,
                                                                      num_labels=1)),
                           LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj"]))
    trainer = object.__new__(Trainer)
    sp = gather_sequence_parallel_facts(trainer, model)
    assert not sp.lm_head and sp.pooled_head == ("Qwen2ForSequenceClassification: decoder 'model' (Qwen2Model) "
                                                 "sharded, score and pooling on the whole sequence")
    reason = _plan(lm_head=False, pooled_head=sp.pooled_head, trainer_name="RewardTrainer",
                   trainer_loss="RewardTrainer.compute_loss").reason
    assert "loss head-whole: Qwen2ForSequenceClassification: decoder 'model'" in reason, reason
    assert "RewardTrainer's compute_loss" in reason and "[batch, sequence, hidden] gathered" in reason
    bert = BertForSequenceClassification(BertConfig(**small))
    head, decoder, why = pooled_head_structure(bert)
    assert head is None and decoder is None and "BertModel has attention that is not causal" in why
    sp = gather_sequence_parallel_facts(trainer, bert)
    assert sp.pooled_head is None and "not causal" in sp.pooled_head_refusal


@pytest.mark.parametrize(("kw", "match"), [
    (dict(router_aux_loss=True, trainer_name="SFTTrainer"), "SFTTrainer trains a model that adds a MoE router.*"
     "output_router_logits=False"),
    (dict(trainer_loss="SFTTrainer.compute_loss", trainer_name="SFTTrainer", vision_family="qwen2_5_vl"),
     "SFTTrainer on qwen2_5_vl.*made whole"),
    (dict(lm_head=False, trainer_name="RewardTrainer", pooled_head_refusal="BertForSequenceClassification: its "
          "decoder BertModel has attention that is not causal"), "RewardTrainer trains a model without a language-model "
     "head .*which the head-whole route cannot run \\(BertForSequenceClassification: .*not causal"),
    (dict(lm_head=False, trainer_name="Trainer", vision_family="qwen2_5_vl", pooled_head="X: decoder sharded"),
     "Trainer trains a model without a language-model head .*on qwen2_5_vl"),
    (dict(trainer_loss="KTOTrainer.compute_loss", trainer_name="KTOTrainer", world_statistic="its loss subtracts a KL"),
     "KTOTrainer: its loss subtracts a KL"),
])
def test_a_loss_that_cannot_be_made_exact_is_a_plan_error_naming_the_trainer_and_the_fix(kw, match):
    from hf_ddpfix.plan.types import PlanError

    with pytest.raises(PlanError, match=match):
        _plan(**kw)


def test_the_trainer_loss_is_read_from_the_class_and_the_instance_not_from_a_list_of_names():
    from hf_ddpfix.integrations.sequence_parallel.facts import trainer_loss_override

    class Renamed(Trainer):  # a subclass that keeps stock's loss
        pass

    class Own(Trainer):
        def compute_loss(self, *a, **k):  # noqa: ANN002, ANN003, ANN202
            return super().compute_loss(*a, **k)

    assert trainer_loss_override(object.__new__(Trainer)) is None
    assert trainer_loss_override(object.__new__(Renamed)) is None
    assert trainer_loss_override(object.__new__(Own)).endswith("Own.compute_loss")
    patched = object.__new__(Trainer)

    def my_loss(*a, **k):  # noqa: ANN002, ANN003, ANN202
        return 0

    patched.compute_loss = my_loss  # set on the instance by a user
    assert trainer_loss_override(patched).endswith("my_loss")
    my_loss._hf_ddpfix_sequence_parallel = True  # hf_ddpfix's own, set while it trains
    assert trainer_loss_override(patched) is None


def test_a_world_gathered_statistic_in_the_loss_is_read_from_the_trainer():
    from hf_ddpfix.integrations.sequence_parallel.facts import trainer_world_statistic

    kto = object.__new__(Trainer)
    assert trainer_world_statistic(kto) is None
    kto.calculate_KL = True  # TRL KTOTrainer, loss_type="kto"
    assert "apo_zero_unpaired" in trainer_world_statistic(kto)
    kto.calculate_KL = False  # loss_type="apo_zero_unpaired"
    assert trainer_world_statistic(kto) is None


def test_packed_kwargs_are_dropped_only_when_they_follow_the_position_ids():
    import torch

    from hf_ddpfix.integrations.sequence_parallel.whole import _drop_packed_kwargs

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    good = {"cu_seq_lens_q": torch.tensor([0, 3, 5, 9], dtype=torch.int32), "cu_seq_lens_k": torch.tensor([0, 3, 5, 9]),
            "max_length_q": 4, "max_length_k": 4, "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]]), "other": 1}
    kw = dict(good)
    _drop_packed_kwargs(kw, pos, None, "SFTTrainer")
    assert kw == {"other": 1}
    for key, bad in (("cu_seq_lens_q", torch.tensor([0, 4, 5, 9])), ("max_length_k", 3),
                     ("seq_idx", torch.zeros(1, 9, dtype=torch.long))):
        with pytest.raises(RuntimeError, match="SFTTrainer's compute_loss passes .*do not follow its position_ids"):
            _drop_packed_kwargs({**good, key: bad}, pos, None, "SFTTrainer")
    with pytest.raises(RuntimeError, match="cannot be sharded"):  # with a mask, position ids do not mark documents
        _drop_packed_kwargs(dict(good), pos, torch.ones(1, 9), "SFTTrainer")


def test_positional_model_arguments_are_named_by_the_forward_and_other_models_are_found_on_the_trainer():
    from torch import nn

    from hf_ddpfix.integrations.sequence_parallel.whole import WholeOutputsForward, other_models

    def forward(input_ids=None, attention_mask=None, **kwargs):  # noqa: ANN001, ANN003, ANN202
        return None

    hook = WholeOutputsForward(forward, None, 0, "ORPOTrainer")
    assert hook._named(("ids",), {"attention_mask": "m", "use_cache": False}) == {
        "input_ids": "ids", "attention_mask": "m", "use_cache": False}
    with pytest.raises(RuntimeError, match="ORPOTrainer's compute_loss called the model with positional"):
        hook._named(("ids", "m", "extra"), {})
    trainer = object.__new__(Trainer)
    trainer.model, trainer.teacher_model = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2))
    trainer.model_wrapped = nn.ModuleList([trainer.model])  # a wrapper of the trained model: not another model
    found = {id(m) for m in other_models(trainer, trainer.model)}
    assert {id(m) for m in trainer.teacher_model.modules()} <= found
    assert not found & {id(m) for m in trainer.model.modules()}


#: world 4 (DP2 x SP2, gradient accumulation 2): every plain-Trainer loss of the issue (x2 with SGD and with AdamW +
#: clipping + weight decay, a sequence-level head under checkpointing, compute_loss_func, label smoothing, per-rank
#: counts; the MoE refusal runs on every world), TRL SFT dft, DPO, KTO, ORPO, CPO, GRPO, Reward
WORLD4 = ("plain", "double", "double_adamw", "hidden_head_checkpointed", "compute_loss_func", "label_smoothing",
          "sft_dft", "dpo", "avg_tokens_false", "kto_apo", "orpo", "cpo", "grpo", "reward")
#: losses no issue names (tests/scripts/sp_other_losses.py) and TRL trainers beyond SFT / DPO (tests/scripts/sp_trl.py)
#: (CPO: the same path as ORPO; run at world 4 only, 5.6e-17 vs stock DDP)
TRL = ("distill_teacher", "contrastive", "kto_apo", "orpo", "sft_packing", "sft_completion_only", "grpo")
#: no one-process reference: stock DDP divides by each rank's own count / mean (avg_tokens_false, ORPO, CPO), packs
#: each rank's rows into its own bins (sft_packing), contrasts its own rows (contrastive) or samples per process (GRPO)
DDP_ONLY = ("avg_tokens_false", "contrastive", "orpo", "cpo", "sft_packing", "grpo", "seqcls")
#: models without an LM head, on the "head-whole" route (tests/scripts/sp_trl.py): TRL's RewardTrainer on a Qwen2
#: reward model, the plain Trainer on a Llama classifier
HEAD_WHOLE = ("reward", "seqcls")


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [2, 4])
def test_every_trainer_loss_under_sequence_parallel_equals_one_process_and_stock_ddp(tmp_path, nproc):
    """x2 subclass (SGD, AdamW + clipping + weight decay), a hidden-state head (also under non-reentrant
    checkpointing), compute_loss_func, label smoothing, TRL SFT nll and dft, average_tokens_across_devices=False
    with unequal token counts (vs stock DDP: one process computes another mean): fp64 weights within 1e-12 of the
    references (measured <= 1.2e-16; on the code before the gathered route every case but the plain one failed,
    by 5.7e-11 (x2 with AdamW) to 0.16); a MoE router loss a PlanError before step 1. Beyond: a teacher-distillation
    and an in-batch contrastive subclass, TRL KTO (apo_zero_unpaired), ORPO, CPO, GRPO, SFT packing and
    completion-only (fp64 <= 5.6e-17; before: ORPO / CPO / packing / the teacher stopped at their first micro-batch),
    TRL KTO with its world-gathered KL a PlanError (before: trained 3.7e-7 off stock DDP), and SFT / DPO / Reward through
    patches/ with HF_DDPFIX_SEQUENCE_PARALLEL=2 (nproc 2). Models without an LM head on the head-whole route: TRL's
    RewardTrainer (Qwen2 reward model, margin, center_rewards_coefficient; SP 2 and DP2 x SP2) vs one process and
    the plain Trainer on a Llama classifier (nproc 2) vs stock DDP, fp64 weights <= 1.8e-16 (before: a PlanError;
    with the gather's backward not scaled by N: 8e-3 off, with no gradient through it: 1.4e-2). World 4 (DP2 x SP2,
    WORLD4): every plain-Trainer loss and TRL SFT / DPO / KTO / ORPO / CPO / GRPO / Reward, fp64 <= 5.6e-17 vs stock
    DDP and one process (2026-11-27; before compute_loss_func's squared CE kept fp64, stock DDP itself was 1.8e-9 off
    one process there)."""
    from launch import torchrun

    one, out = tmp_path / "one.pt", tmp_path / "spl.json"
    every = ("plain", "double", "double_adamw", "double_find_unused", "hidden_head", "hidden_head_checkpointed", "compute_loss_func",
             "label_smoothing", "sft_nll", "sft_dft", "dpo", "dpo_ld_alpha", "avg_tokens_false", *TRL, *HEAD_WHOLE)
    cases = ("--cases", ",".join(every if nproc == 2 else WORLD4))
    torchrun("sp_losses.py", str(one), "--single-for", str(nproc), *cases, nproc=1, timeout=400)
    torchrun("sp_losses.py", str(out), "--single", str(one), *cases, nproc=nproc, timeout=600)
    records = {r["case"]: r for r in json.loads(out.read_text())}
    refused = ("moe_router_loss_refused", *(("kto_kl_refused",) if nproc == 2 else ()))
    assert set(records) == {*(every if nproc == 2 else WORLD4), *refused, "exchange_tensors_equal_objects"}
    assert all(r["ok"] for r in records.values()), [r for r in records.values() if not r["ok"]]
    for case, r in records.items():
        if case == "exchange_tensors_equal_objects":  # the group's batches as tensors, no pickling
            continue
        if case in refused:  # PlanError before step 1, naming the trainer and the fix: each case its own refusal
            expected = {"moe_router_loss_refused": "output_router_logits",
                        "kto_kl_refused": "KTOTrainer: its loss subtracts a KL estimate"}[case]
            assert r["steps"] == 0 and r["error"] is not None and expected in r["error"], (case, r)
            continue
        assert r["ddp_weight_diff"] <= 1e-12 and r.get("one_weight_diff", 0.0) <= 1e-12, r
        assert r["per_rank_batches"] == [8] * nproc  # counted on every rank
        # the teacher's attention ran as given on every rank (2 layers x 2 group batches x 4 micro-batches, + eval)
        assert all(n >= 16 for n in r["full_sequence_calls"]) if case == "distill_teacher" else \
            not any(r["full_sequence_calls"]), r["full_sequence_calls"]
        # GRPO's generate() forwards run unsharded, as stock (no batch of the group active): counted, nothing else
        assert all(set(f) <= ({"no sequence-parallel batch active (unsharded forward)"} if case == "grpo" else set())
                   for f in r["fallbacks"]), r["fallbacks"]
        route = "sharded" if case == "plain" else "head-whole" if case in HEAD_WHOLE else "gathered"
        assert r["route"] == route and f"loss {route}" in r["plan"]
        assert ("one_weight_diff" in r) == (case not in DDP_ONLY)
        if case in HEAD_WHOLE:  # fp64 weights: measured <= 1.8e-16 vs stock DDP and one process (the two references
            # differ from each other by 5.6e-17); logged losses (fp32 in the Trainer's log) <= 6e-8, 1 ulp at 4 is 4.8e-7
            assert r["ddp_weight_diff"] <= 1e-15 and r.get("one_weight_diff", 0.0) <= 1e-15, r
            assert r["ddp_loss_diff"] <= 5e-7 and r.get("one_loss_diff", 0.0) <= 5e-7, r
        if "ddp_eval_diff" in r:  # evaluate() ran the same route (the Trainer's loop rounds its loss to fp32)
            # 8 evaluation samples, batch 2 per rank, both batches of the group on every rank
            assert r["ddp_eval_diff"] <= 2e-6 and r["eval_batches"] == [2 * (8 // (2 * nproc))] * nproc
        # every logged value (TRL's num_tokens, entropy, rewards/*, min_reward ...) is stock DDP's (sp_losses.py
        # METRIC_TOL, relative; measured <= 1.2e-7) but what metrics.py LIMITS names (METRIC_UNEQUAL)
        assert not r["metrics_differ"], (case, r["metrics_differ"])
        if "vs_plain" in r:  # the trainer's loss ran: never the plain Trainer's weights
            assert r["vs_plain"] > 1e-4
    # the checkpointed backward recomputed each group batch's sharded attention (2 layers x 2 batches x 4 micro-batches)
    if nproc == 2:
        _zero_code_route_equals_one_process(tmp_path, one)
        ck, plain = records["hidden_head_checkpointed"], records["hidden_head"]
        assert [a - b for a, b in zip(ck["attention_calls"], plain["attention_calls"], strict=True)] == [16, 16]


def _zero_code_route_equals_one_process(tmp_path, one):
    """The same TRL SFT (nll), DPO and Reward runs through `patches/` on PYTHONPATH with HF_DDPFIX_SEQUENCE_PARALLEL=2 and no
    hf_ddpfix call (tests/scripts/sp_patches.py): weights within 1e-12 of one process (measured 2.8e-17), logged
    losses within 1e-5 (fp32 logging: 2.4e-7), the plan saying the env var and the gathered route, 8 gathered
    batches and no fallback on every rank."""
    import os

    from launch import ROOT, torchrun

    out = tmp_path / "spp.json"
    path = os.pathsep.join([str(ROOT / "patches"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    torchrun("sp_patches.py", str(out), "--single", str(one), nproc=2, timeout=300,
             env={"PYTHONPATH": path, "HF_DDPFIX_SEQUENCE_PARALLEL": "2"})
    records = {r["case"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"sft_nll", "dpo", "reward"}
    for r in records.values():
        assert r["ok"] and r["patched"] and "HF_DDPFIX_SEQUENCE_PARALLEL" in r["plan"], r
        assert f"loss {r['route']}" in r["plan"] and r["route"] == ("head-whole" if r["case"] == "reward" else "gathered")
        assert r["route_batches"] == [8, 8] and not any(r["fallbacks"]), r
        if r["case"] == "reward":  # measured 5.6e-17 (weights), 0.0 (logged losses)
            assert r["one_weight_diff"] <= 1e-15 and r["one_loss_diff"] <= 5e-7, r
        assert r["one_weight_diff"] <= 1e-12 and r["one_loss_diff"] <= 1e-5, r


def test_the_head_whole_decoder_call_refuses_what_it_cannot_shard_and_is_undone():
    """The decoder's stand-in refuses (named, before any collective) inputs_embeds, a KV cache, attention weights and
    another sequence-shaped tensor; `decoder_sharded` puts the decoder's forward back."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from hf_ddpfix.integrations.sequence_parallel.head import DecoderShardedForward, decoder_sharded

    hook = DecoderShardedForward(lambda **kw: None, None, 0, "RewardTrainer")
    ids = torch.ones(2, 5, dtype=torch.long)
    for kw, what in ((dict(inputs_embeds=torch.zeros(2, 5, 4)), "without input_ids"),
                     (dict(input_ids=ids, past_key_values=object()), "with a KV cache"),
                     (dict(input_ids=ids, output_attentions=True), "attention weights"),
                     (dict(input_ids=ids, token_type_ids=torch.zeros(2, 5)), r"sequence-shaped \['token_type_ids'\]")):
        with pytest.raises(RuntimeError, match=f"RewardTrainer, head-whole route.*{what}"):
            hook(**kw)
    model = LlamaForSequenceClassification(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                       intermediate_size=32, vocab_size=50, pad_token_id=0))
    with decoder_sharded(model, None, 0) as inside:
        assert model.model.forward is inside
    assert "forward" not in vars(model.model)


def test_metric_replay_gives_each_world_gather_the_rank_own_batch_and_keeps_one_call_of_metric_state():
    """metrics.py on rank 0 of an SP group of 2 (world-1 gloo; the accelerator's gather returns its input): the
    group's first call (rank 0's own batch) leaves no metric state behind, the last call's gathers get rank 0's own
    inputs from the same lines (a line the own batch did not reach keeps its input: counted), numbers and
    containers of numbers are put back in place, tensors and objects are not metric state."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from hf_ddpfix.integrations.sequence_parallel.metrics import MetricReplay, metric_state
    from hf_ddpfix.ops import feature_counts

    class Acc:
        device = torch.device("cpu")

        def gather(self, x):  # noqa: ANN001, ANN201
            return x

        def gather_for_metrics(self, x):  # noqa: ANN001, ANN201
            return self.gather(x)  # accelerate's own inner call: passes straight through

    metrics: dict = {"train": {}}
    trainer = SimpleNamespace(accelerator=Acc(), _metrics=metrics, tokens=0, weights=torch.ones(2), label="x")

    def compute_loss(batch: torch.Tensor, rejected: bool) -> torch.Tensor:
        seen = trainer.accelerator.gather_for_metrics(batch.sum())
        trainer.tokens += int(seen)
        trainer._metrics["train"].setdefault("sum", []).append(float(seen))
        if rejected:  # a branch only the last batch takes
            trainer._metrics["train"].setdefault("rej", []).append(float(trainer.accelerator.gather(batch.max())))
        return batch.sum()

    assert set(metric_state(trainer)) == {"_metrics", "tokens"}  # not the tensor, not the string's object peers
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        feature_counts.reset()
        own, last = torch.tensor([1.0, 2.0]), torch.tensor([5.0, 7.0])
        losses = []
        with MetricReplay(trainer, rank=0, size=2) as replay:
            for j, (batch, rejected) in enumerate(((own, False), (last, True))):  # one calling line, as trainer.py's
                losses.append(replay.call(j, lambda batch=batch, rejected=rejected: compute_loss(batch, rejected)))
                if j == 0:
                    assert trainer.tokens == 0 and metrics == {"train": {}}  # put back, in place
        assert losses == [3.0, 12.0]  # each call's loss is its own batch's
        assert trainer.tokens == 3 and metrics["train"]["sum"] == [3.0]  # rank 0's own batch, once
        assert metrics["train"]["rej"] == [7.0]  # not reached by the own batch: the current input, counted
        assert replay.replaced == 1
        assert feature_counts.snapshot()["sequence_parallel"].amounts["metric_gathers_differ"] == 1
        assert "gather" not in vars(trainer.accelerator)  # the wrappers are undone
    finally:
        dist.destroy_process_group()
