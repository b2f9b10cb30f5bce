"""Sequence-parallel evaluation never hands a caller a rank's slice where stock returns the whole sequence.

`ops.sequence_parallel.outputs.held_tensors` finds every tensor a model output holds, however nested; the sharded
evaluation path (`integrations/sequence_parallel/trainer.py`) runs a prediction unsharded (a counted fallback that
names the outputs) when the caller receives any output beside the loss and logits that holds one, and gathers the
logits whenever the caller receives the outputs. One process, a world-1 gloo group: the path is the same code as
under N ranks (tests/scripts/sp_trainer.py runs it on 2 and 4).
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from hf_ddpfix.ops import feature_counts
from hf_ddpfix.ops.sequence_parallel.outputs import held_tensors


@dataclass
class _Pair:
    first: torch.Tensor
    note: str = "x"


class _Slotted:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def test_held_tensors_finds_tensors_however_nested():
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    t = torch.zeros(2, 3)
    assert held_tensors({"rope_deltas": t}) == ["rope_deltas"]
    assert held_tensors({"hidden_states": (t, t)}) == ["hidden_states[0]", "hidden_states[1]"]
    assert held_tensors({"extra": {"a": [None, {"b": t}]}}) == ["extra.a[1].b"]
    assert held_tensors({"pair": _Pair(t)}) == ["pair.first"]
    assert held_tensors({"slots": _Slotted(t)}) == ["slots.value"]
    assert held_tensors({"past_key_values": cache}) == ["past_key_values.layers[0].keys",
                                                        "past_key_values.layers[0].values"]
    assert held_tensors({"hidden_states": tuple([t] * 20)}, limit=3) == [f"hidden_states[{i}]" for i in range(3)]
    cyclic: list = [t]
    cyclic.append(cyclic)
    assert held_tensors({"c": cyclic}) == ["c[0]"]


def test_held_tensors_is_empty_without_tensors_and_refuses_what_it_cannot_inspect():
    from transformers import DynamicCache

    assert held_tensors({"n": None, "k": 3, "s": "text", "d": torch.float32, "empty": (), "cache": DynamicCache(),
                         "pair": {"x": [1.5, True]}}) == []
    opaque = held_tensors({"it": iter([torch.zeros(1)])})
    assert len(opaque) == 1 and "cannot be inspected" in opaque[0]
    deep: dict = {}
    node = deep
    for _ in range(20):
        node["n"] = {}
        node = node["n"]
    node["leaf"] = 1
    assert "too deep" in held_tensors({"deep": deep})[0]


@pytest.fixture
def sp_trainer():
    """A tiny Llama under attach_sequence_parallel(sp_size=1) in a world-1 gloo group, with a stock
    `Trainer.prediction_step` (the class's own) whose `compute_loss` is a marker for the unsharded fallback."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    from hf_ddpfix.integrations.sequence_parallel.trainer import attach_sequence_parallel

    class _Trainer(Trainer):  # the stock prediction_step, no __init__ (nothing else is read)
        pass

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    model.eval()
    trainer = _Trainer.__new__(_Trainer)  # what stock compute_loss / prediction_step read of it
    trainer.args = SimpleNamespace(average_tokens_across_devices=True, past_index=-1, n_gpu=1)
    trainer.compute_loss_func = trainer.label_smoother = None
    trainer.model_accepts_loss_kwargs = False
    trainer.accelerator = SimpleNamespace(unwrap_model=lambda m: m, num_processes=1)
    trainer.model, trainer.label_names, trainer.can_return_loss = model, ["labels"], False
    trainer.args.device, trainer.args.use_liger_kernel = torch.device("cpu"), False
    trainer._prepare_inputs = lambda inputs: inputs  # what prediction_step calls on the way (single CPU process)
    trainer._prepare_context_parallel_inputs = lambda model, inputs: (nullcontext, inputs)
    trainer._get_num_items_in_batch = lambda batches, device: None
    trainer.compute_loss_context_manager = nullcontext
    trainer.is_world_process_zero = lambda: True
    trainer.training_step = lambda *a, **k: None
    feature_counts.reset()
    try:
        with ExitStack() as stack:
            attach_sequence_parallel(trainer, model, sp_size=1, stack=stack)
            yield trainer, model
    finally:
        feature_counts.reset()
        dist.destroy_process_group()


def _inputs():
    ids = torch.randint(1, 32, (2, 7))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def _sp_counts():
    return feature_counts.snapshot().get("sequence_parallel")


def _outputs_fallbacks(counts) -> int:
    """Fallbacks of the evaluation path itself (the attention wrapper counts the unsharded reference forwards)."""
    return sum(n for r, n in counts.fallbacks.items() if "no sequence-parallel batch active" not in r)


def _with_extra_output(model):
    """The model's forward also returns `extra`: a dict holding a per-token tensor (any nested output)."""
    forward = model.forward

    def extra_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        out["extra"] = {"per_token": [out.logits[..., :1].clone()]}
        return out

    model.forward = extra_forward


@pytest.mark.parametrize("field", ["hidden_states", "extra"])
def test_a_prediction_with_nested_outputs_runs_unsharded_and_says_which(sp_trainer, field):
    """hidden_states (a tuple of this rank's slices) or a dict of per-token tensors: stock's whole ones are needed,
    in a prediction_step that returns them beside the logits and to a caller of compute_loss asking for them."""
    trainer, model = sp_trainer
    if field == "hidden_states":
        model.config.output_hidden_states = True
    else:
        _with_extra_output(model)
    inputs = _inputs()
    with torch.no_grad():
        ref = model(**inputs)
        loss, outputs = trainer.compute_loss(model, inputs, return_outputs=True)
        _, logits, _ = trainer.prediction_step(model, inputs, prediction_loss_only=False)
    torch.testing.assert_close(outputs["logits"], ref["logits"], rtol=0, atol=0)  # stock's own (unsharded) outputs
    torch.testing.assert_close(outputs[field], ref[field], rtol=0, atol=0)
    torch.testing.assert_close(logits[0], ref["logits"], rtol=0, atol=0)
    counts = _sp_counts()
    name = "hidden_states[0]" if field == "hidden_states" else "extra.per_token[0]"
    reasons = [r for r in counts.fallbacks if r.startswith("prediction outputs")]
    assert len(reasons) == 1 and counts.fallbacks[reasons[0]] == 2 and f"'{name}'" in reasons[0]
    assert not counts.amounts.get("eval_sharded_batches")


def test_plain_outputs_stay_sharded_with_the_logits_whole(sp_trainer):
    """Nothing but loss and logits: sharded, and the logits equal the model's on the whole batch (also for a
    caller outside prediction_step that asks for the outputs: never dropped)."""
    trainer, model = sp_trainer
    inputs = _inputs()
    with torch.no_grad():
        ref = model(input_ids=inputs["input_ids"]).logits
        loss, outputs = trainer.compute_loss(model, inputs, return_outputs=True)
        _, logits, _ = trainer.prediction_step(model, inputs, prediction_loss_only=False)
    torch.testing.assert_close(outputs["logits"], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    counts = _sp_counts()
    assert _outputs_fallbacks(counts) == 0 and counts.amounts["eval_sharded_batches"] == 2


def test_a_loss_only_prediction_with_nested_outputs_stays_sharded(sp_trainer):
    """The stock prediction_step discards the outputs with prediction_loss_only: nothing to make whole."""
    trainer, model = sp_trainer
    model.config.output_hidden_states = True
    with torch.no_grad():
        loss, logits, labels = trainer.prediction_step(model, _inputs(), prediction_loss_only=True)
    assert logits is None and labels is None and float(loss) > 0
    counts = _sp_counts()
    assert _outputs_fallbacks(counts) == 0 and counts.amounts["eval_sharded_batches"] == 1


def test_outputs_the_prediction_ignores_do_not_count(sp_trainer):
    """`ignore_keys` (or the config's keys_to_ignore_at_inference) are left out by stock prediction_step: a nested
    output named there stays sharded, and the logits it returns are whole."""
    trainer, model = sp_trainer
    model.config.output_hidden_states = True
    inputs = _inputs()
    with torch.no_grad():
        ref = model(input_ids=inputs["input_ids"]).logits
        _, logits, _ = trainer.prediction_step(model, inputs, prediction_loss_only=False, ignore_keys=["hidden_states"])
        model.config.keys_to_ignore_at_inference = ["past_key_values", "hidden_states"]
        _, again, _ = trainer.prediction_step(model, inputs, prediction_loss_only=False)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, ref, rtol=1e-5, atol=1e-5)
    counts = _sp_counts()
    assert _outputs_fallbacks(counts) == 0 and counts.amounts["eval_sharded_batches"] == 2
