"""patch_trainer() and DDPFixTrainer: same implementation, reversible patch, DDP == single-process weights."""

import pytest
import torch
from launch import torchrun
from transformers import Trainer

import hf_ddpfix
from hf_ddpfix import DDPFixConfig, DDPFixTrainer, patch_trainer, unpatch_trainer
from hf_ddpfix.trainer import is_patched


def test_patch_is_idempotent_and_reversible():
    stock = Trainer._inner_training_loop
    try:
        patch_trainer()
        patched = Trainer._inner_training_loop
        patch_trainer(strict=True)
        assert Trainer._inner_training_loop is patched and is_patched()
    finally:
        unpatch_trainer()
    assert Trainer._inner_training_loop is stock and not is_patched()
    unpatch_trainer()  # safe when not patched
    assert Trainer._inner_training_loop is stock


def _other_library_patch(calls: list[str], tag: str):
    """Another library's patch of the same two Trainer methods (as Unsloth / Liger do): call-through wrappers."""
    prev_inner, prev_train = Trainer._inner_training_loop, Trainer.train

    def inner(self, *args, **kwargs):
        calls.append(f"{tag}:inner")
        return prev_inner(self, *args, **kwargs)

    def train(self, *args, **kwargs):
        calls.append(f"{tag}:train")
        return prev_train(self, *args, **kwargs)

    Trainer._inner_training_loop, Trainer.train = inner, train
    return prev_inner, prev_train, inner, train


def test_patch_chains_with_other_patches_applied_before_and_after(tmp_path):
    """patch_trainer() wraps what is installed at call time; unpatch_trainer() removes only its own layer."""
    stock_inner, stock_train = Trainer._inner_training_loop, Trainer.train
    calls: list[str] = []
    try:
        _, _, before_inner, before_train = _other_library_patch(calls, "before")
        patch_trainer()
        _, _, after_inner, after_train = _other_library_patch(calls, "after")
        trainer = _tiny_trainer(tmp_path, 1)
        trainer.train()
        assert calls == ["after:train", "before:train", "after:inner", "before:inner"], calls
        assert trainer.hf_ddpfix_plan is not None  # our layer ran in between
        unpatch_trainer()  # we are not on top: our layer turns into a pass-through, both others stay
        assert Trainer._inner_training_loop is after_inner and Trainer.train is after_train
        calls.clear()
        trainer = _tiny_trainer(tmp_path / "again", 1)
        trainer.train()
        assert calls == ["after:train", "before:train", "after:inner", "before:inner"], calls
        assert not hasattr(trainer, "hf_ddpfix_plan")
        # on top again: unpatch restores exactly the method objects it found
        Trainer._inner_training_loop, Trainer.train = before_inner, before_train
        patch_trainer()
        unpatch_trainer()
        assert Trainer._inner_training_loop is before_inner and Trainer.train is before_train
    finally:
        unpatch_trainer()
        Trainer._inner_training_loop, Trainer.train = stock_inner, stock_train


def test_patch_reaches_subclasses_defined_before_and_after_the_call():
    from trl import SFTTrainer

    class Mine(Trainer):
        pass

    try:
        patch_trainer()
        assert SFTTrainer._inner_training_loop is Trainer._inner_training_loop
        assert Mine._inner_training_loop is Trainer._inner_training_loop
    finally:
        unpatch_trainer()


def test_patch_rejects_bad_options_at_call_time():
    with pytest.raises(ValueError, match="unknown hf_ddpfix option"):
        patch_trainer(statik_graph=True)
    with pytest.raises(ValueError, match="static_graph"):
        patch_trainer(static_graph="sometimes")
    assert not is_patched()


def test_public_api():
    for name in hf_ddpfix.__all__:
        assert hasattr(hf_ddpfix, name)
    assert issubclass(DDPFixTrainer, Trainer)
    assert DDPFixConfig(strict=True).strict is True


@pytest.mark.multiprocess
@pytest.mark.parametrize("entry", ["patch", "subclass"])
def test_ddp_with_reentrant_checkpointing_matches_single_process(tmp_path, entry):
    """Stock fails here ('ready only once'); both entry points train and match the 1-process reference."""
    ref, ddp = tmp_path / "ref.pt", tmp_path / "ddp.pt"
    torchrun("train_text.py", "--entry", entry, "--out", str(ref), nproc=1, timeout=120)
    torchrun("train_text.py", "--entry", entry, "--out", str(ddp), nproc=2, timeout=120)
    a, b = torch.load(ref, weights_only=False), torch.load(ddp, weights_only=False)
    assert b["plan"].ddp_kwargs()["find_unused_parameters"] is False
    assert b["plan"].checkpointing.value == "non_reentrant"
    for name, w in a["weights"].items():
        torch.testing.assert_close(b["weights"][name], w, rtol=0, atol=1e-6, msg=name)
    # a plain LoRA run: no hf_ddpfix warning on any rank, the plan's checkpoint function never re-installed
    # (issue #28: our own usage observer was taken for a replacement, 4 re-installs and a warning per rank)
    assert b["warnings"] == [[], []], b["warnings"]
    assert "reinstalled" not in b["counts"].get("checkpointing", {}), b["counts"]


@pytest.mark.multiprocess
def test_stock_ddp_with_reentrant_checkpointing_fails(tmp_path):
    done = torchrun("train_text.py", "--entry", "stock", "--out", str(tmp_path / "x.pt"), nproc=2, timeout=120,
                    check=False)
    assert done.returncode != 0 and "Expected to mark a variable ready only once" in done.stdout


def _tiny_trainer(out, steps, cls=Trainer):
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=2, target_modules=["q_proj"]))
    ds = Dataset.from_list([{"input_ids": [(i + j) % 60 for j in range(8)]} for i in range(16)])

    def collate(batch):
        ids = torch.tensor([b["input_ids"] for b in batch])
        return {"input_ids": ids, "labels": ids.clone()}

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=steps, save_steps=2,
                             save_strategy="steps", report_to=[], use_cpu=True, disable_tqdm=True)
    return cls(model=model, args=args, train_dataset=ds, data_collator=collate)


@pytest.mark.parametrize("entry", ["stock", "patch", "subclass"])
def test_resume_true_skips_a_half_written_checkpoint(tmp_path, entry):
    """A rank that died while saving checkpoint-4 left it without trainer state: stock resumes from it and
    fails; hf_ddpfix resumes from checkpoint-2 and finishes."""
    _tiny_trainer(tmp_path, 4).train()
    (tmp_path / "checkpoint-4" / "trainer_state.json").unlink()
    try:
        if entry == "patch":
            patch_trainer()
        trainer = _tiny_trainer(tmp_path, 6, DDPFixTrainer if entry == "subclass" else Trainer)
        if entry == "stock":
            with pytest.raises(FileNotFoundError, match="trainer_state.json"):
                trainer.train(resume_from_checkpoint=True)
            return
        trainer.train(resume_from_checkpoint=True)
    finally:
        unpatch_trainer()
    assert trainer.state.global_step == 6
    assert (tmp_path / "checkpoint-6" / "trainer_state.json").exists()
