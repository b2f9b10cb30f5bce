"""tiled_loss composes with trainers that bring their own loss head (TRL) or pass unknown keywords."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from launch import torchrun

from hf_ddpfix.integrations.long_context.loss_patch import patch_model_loss


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def test_unknown_keyword_goes_to_the_wrapped_forward_with_a_logged_reason(caplog):
    model = _llama()
    seen = []

    def wrapper(*args, my_head=False, **kwargs):  # a forward wrapper with its own keyword, like TRL's
        seen.append(my_head)
        out = type(model).forward(model, *args, **kwargs)
        out.extra = "from the wrapper"
        return out

    model.forward = wrapper
    handle = patch_model_loss(model)
    ids = torch.randint(0, 64, (2, 9))
    with caplog.at_level(logging.INFO, logger="hf_ddpfix"):
        out = model(input_ids=ids, labels=ids, my_head=True)
        model(input_ids=ids, labels=ids, my_head=True)
    assert seen == [True, True] and out.extra == "from the wrapper" and out.logits is not None
    assert handle.calls == 0 and list(handle.stood_down.values()) == [2]
    assert "my_head" in next(iter(handle.stood_down)) and "stands down" in caplog.text
    assert caplog.text.count("stands down") == 1  # logged once per reason
    tiled = model(input_ids=ids, labels=ids)  # no unknown keyword: the tiled loss runs
    assert tiled.logits is None and handle.calls == 1
    ref = type(model).forward(model, input_ids=ids, labels=ids).loss
    assert torch.allclose(tiled.loss, ref, rtol=1e-5)
    handle.remove()
    assert handle.stood_down and model.forward is wrapper


@pytest.mark.multiprocess
def test_trl_sft_trainer_with_tiled_loss_under_ddp_trains_like_trls_own_loss_path(tmp_path):
    out = tmp_path / "trl.json"
    torchrun("trl_tiled_loss.py", "--out", str(out), timeout=300)
    recs = json.loads(out.read_text())
    assert len(recs) == 2
    for r in recs:
        assert r["steps"] == 4 and r["installed"] and r["plan_tiled_loss"] == "on", r
        assert r["loss_max_abs_diff"] <= 1e-5, r
        assert r["weight_max_abs_diff"] <= 1e-6, r
        (reason, count), = r["stood_down"].items()
        assert "fused_lm_head=True" in reason and count == 4, r  # every training forward went to TRL's head
        assert len(set(r["losses_ref"])) > 1  # the loss moved: a real comparison
