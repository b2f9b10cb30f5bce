"""QLoRA: bitsandbytes facts, the placement / storage-dtype guardrails, and QLoRA under DDP, FSDP2 and ZeRO-3.

The models are real NF4 / int8 bitsandbytes models on the CPU (bitsandbytes 0.50.2 quantizes there): a tiny
Llama saved with `save_pretrained` and reloaded with a `BitsAndBytesConfig`. The guardrail rules are tested
on hand-built facts (pure), each on a failing set-up and on its working neighbour; the multi-process
scripts check that what the plan lets through trains (against stock or a replicated reference) and that
what it refuses really fails in stock.
"""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest
import torch
from launch import torchrun

from hf_ddpfix.integrations.quantized import (
    QuantFacts,
    device_name,
    dtype_name,
    placement_devices,
    quantization_facts,
    sharding_facts,
)
from hf_ddpfix.plan import PlacementError, PlanError, QuantStorageError, RunFacts, resolve_plan

# nn.Linear weights of the tiny Llama below: per layer q, o (64x64), k, v (32x64), gate, up (128x64), down (64x128)
LINEAR_WEIGHTS = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved with save_pretrained (bitsandbytes quantizes at load time)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _load(path: str, **quant):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(**quant), device_map="cpu")


# ---------------------------------------------------------------------------------------------------
# Facts
# ---------------------------------------------------------------------------------------------------


def test_nf4_model_facts_name_storage_compute_type_and_exact_bytes(tiny_dir):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = _load(tiny_dir, load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                  bnb_4bit_compute_dtype=torch.bfloat16)
    model = get_peft_model(prepare_model_for_kbit_training(model), LoraConfig(r=4, target_modules=["q_proj"]))
    q = quantization_facts(model)
    assert (q.method, q.num_modules, q.storage_dtype, q.compute_dtype, q.quant_type) == (
        "bnb_4bit", 14, "uint8", "bfloat16", "nf4")
    assert q.quant_bytes == LINEAR_WEIGHTS // 2  # two 4-bit values per byte
    assert q.other_dtype == "float32" and not q.float_storage
    assert q.describe() == "bnb 4-bit nf4 (14 modules, storage uint8, compute bfloat16)"


def test_float_storage_is_reported_as_such(tiny_dir):
    model = _load(tiny_dir, load_in_4bit=True, bnb_4bit_quant_storage=torch.bfloat16)
    q = quantization_facts(model)
    assert q.storage_dtype == "bfloat16" and q.float_storage and q.quant_bytes == LINEAR_WEIGHTS // 2


def test_int8_model_facts(tiny_dir):
    q = quantization_facts(_load(tiny_dir, load_in_8bit=True))
    assert (q.method, q.storage_dtype, q.quant_bytes, q.quant_type) == ("bnb_8bit", "int8", LINEAR_WEIGHTS, None)


def test_a_model_without_bitsandbytes_layers_has_no_quant_facts():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert quantization_facts(model) is None
    assert placement_devices(model) == ()  # no device map: accelerate moves it onto the rank's device


def test_placement_reads_every_device_map_and_where_parameters_are(tiny_dir):
    from peft import LoraConfig, get_peft_model

    base = _load(tiny_dir, load_in_4bit=True)
    base.hf_device_map = {"model.embed_tokens": 0, "model.layers": torch.device("cuda", 1), "lm_head": "cpu"}
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))  # the map stays on the base
    assert placement_devices(model) == ("cpu", "cuda:0", "cuda:1")
    assert placement_devices(_load(tiny_dir, load_in_4bit=True)) == ()  # device_map="cpu" leaves no map


def test_device_and_dtype_names_are_normalised():
    assert [device_name(v) for v in (0, "1", "cuda", "cpu", torch.device("cuda", 2), "disk", "xpu:1")] == [
        "cuda:0", "cuda:1", "cuda:0", "cpu", "cuda:2", "disk", "xpu:1"]
    assert [dtype_name(v) for v in (torch.bfloat16, "torch.float16", "bf16", None)] == [
        "bfloat16", "float16", "bfloat16", None]


def _trainer(state, **args):
    return SimpleNamespace(accelerator=SimpleNamespace(state=state, mixed_precision=args.pop("mp", "no")),
                           args=SimpleNamespace(**args))


def test_sharding_facts_read_fsdp_mixed_precision_and_deepspeed_dtype():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = SimpleNamespace(fsdp_version=2, mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert sharding_facts(_trainer(SimpleNamespace(fsdp_plugin=plugin)), "fsdp") == {
        "fsdp_version": 2, "shard_cast_dtype": "bfloat16", "zero_stage": None}
    unset = SimpleNamespace(fsdp_version=1, mixed_precision_policy=None)
    assert sharding_facts(_trainer(SimpleNamespace(fsdp_plugin=unset), mp="fp16"), "fsdp")["shard_cast_dtype"] == "float16"
    assert sharding_facts(_trainer(SimpleNamespace(fsdp_plugin=unset)), "fsdp")["shard_cast_dtype"] is None
    ds = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}})
    assert sharding_facts(_trainer(SimpleNamespace(deepspeed_plugin=ds), bf16=True), "deepspeed") == {
        "fsdp_version": None, "shard_cast_dtype": "bfloat16", "zero_stage": 3}
    assert sharding_facts(_trainer(SimpleNamespace(deepspeed_plugin=ds), bf16=False), "deepspeed")[
        "shard_cast_dtype"] is None
    assert sharding_facts(_trainer(None), "ddp") == {"fsdp_version": None, "shard_cast_dtype": None, "zero_stage": None}


def test_sharding_facts_read_the_real_accelerate_fsdp_plugin():
    """Contract with accelerate 1.15: the attributes `sharding_facts` reads on its FSDP plugin."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2)
    fsdp.set_mixed_precision("bf16")
    assert sharding_facts(_trainer(SimpleNamespace(fsdp_plugin=fsdp), mp="bf16"), "fsdp") == {
        "fsdp_version": 2, "shard_cast_dtype": "bfloat16", "zero_stage": None}


def test_sharding_facts_read_the_real_accelerate_deepspeed_plugin():
    """Contract with accelerate 1.15: the attributes `sharding_facts` reads on its DeepSpeed plugin."""
    pytest.importorskip("deepspeed")
    from accelerate.utils import DeepSpeedPlugin

    ds = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                       "train_micro_batch_size_per_gpu": 1})
    assert sharding_facts(_trainer(SimpleNamespace(deepspeed_plugin=ds)), "deepspeed") == {
        "fsdp_version": None, "shard_cast_dtype": "bfloat16", "zero_stage": 3}


# ---------------------------------------------------------------------------------------------------
# Plan guardrails (pure): each raises on the bad set-up and stays silent on the good one
# ---------------------------------------------------------------------------------------------------

NF4 = QuantFacts("bnb_4bit", 14, 36864, "uint8", "bfloat16", "nf4", "float32")
NF4_BF16 = QuantFacts("bnb_4bit", 14, 36864, "bfloat16", "bfloat16", "nf4", "bfloat16")
NF4_FP32 = QuantFacts("bnb_4bit", 14, 36864, "float32", "float32", "nf4", "float32")
INT8 = QuantFacts("bnb_8bit", 14, 73728, "int8", None, None, "float16")


def _plan(**facts):
    return resolve_plan(RunFacts(**{"is_peft": True, "world_size": 2, **facts}))


def test_ddp_refuses_a_rank_model_spread_over_several_devices():
    with pytest.raises(PlacementError, match=r"""device_map=\{"": local_rank\}""") as err:
        _plan(parallel="ddp", quant=NF4, placement=("cuda:0", "cuda:1"), rank_device="cuda:0")
    assert "cuda:0, cuda:1" in str(err.value) and isinstance(err.value, PlanError)
    with pytest.raises(PlacementError):  # not only quantized models: DDP cannot wrap a multi-device module
        _plan(parallel="ddp", placement=("cuda:0", "cuda:1"), rank_device="cuda:0")
    plan = _plan(parallel="ddp", quant=NF4, placement=("cuda:1",), rank_device="cuda:1")
    assert plan.quantization.value == NF4.describe() and "on cuda:1" in plan.quantization.reason
    assert "quantization" in plan.report()


def test_ddp_refuses_a_quantized_model_on_another_ranks_device():
    with pytest.raises(PlacementError, match="trains on cuda:1 but .* loaded on cuda:0"):
        _plan(parallel="ddp", quant=NF4, placement=("cuda:0",), rank_device="cuda:1")
    _plan(parallel="ddp", quant=NF4, placement=("cpu",), rank_device="cpu")  # CPU / gloo
    _plan(parallel="ddp", placement=("cuda:0",), rank_device="cuda:1")  # not quantized: accelerate moves it


def test_placement_is_not_checked_outside_ddp():
    _plan(parallel="single", world_size=1, quant=NF4, placement=("cuda:0", "cuda:1"), rank_device="cuda:0")
    plan = _plan(parallel="single", placement=("cuda:0", "cuda:1"))
    assert plan.quantization.value is None and "quantization" not in plan.report()


def test_fsdp2_refuses_float_storage_that_mixed_precision_would_cast():
    with pytest.raises(QuantStorageError, match=r"bnb_4bit_quant_storage=torch\.bfloat16") as err:
        _plan(parallel="fsdp", quant=NF4_FP32, fsdp_version=2, shard_cast_dtype="bfloat16")
    assert "float32 storage" in str(err.value)
    with pytest.raises(QuantStorageError, match=r"quant_storage=torch\.float32"):
        _plan(parallel="fsdp", quant=NF4_BF16, fsdp_version=2, shard_cast_dtype="float32")
    ok = _plan(parallel="fsdp", quant=NF4_BF16, fsdp_version=2, shard_cast_dtype="bfloat16")
    assert "sharded in bfloat16 storage" in ok.quantization.reason
    assert "sharded in float32" in _plan(parallel="fsdp", quant=NF4_FP32, fsdp_version=2).quantization.reason


def test_fsdp2_lets_uint8_storage_train_replicated_and_says_how_to_shard_it():
    plan = _plan(parallel="fsdp", quant=NF4, fsdp_version=2, shard_cast_dtype="bfloat16")
    reason = plan.quantization.reason
    assert "out of sharding" in reason and "36864 bytes" in reason and "quant_storage=torch.bfloat16" in reason


def test_fsdp1_refuses_integer_storage_and_warns_about_mixed_dtypes():
    with pytest.raises(QuantStorageError, match="Cannot flatten integer dtype"):
        _plan(parallel="fsdp", quant=NF4, fsdp_version=1, shard_cast_dtype="bfloat16")
    # which parameters share a unit is only known at wrap time: reported, not refused
    mixed = QuantFacts("bnb_4bit", 14, 36864, "bfloat16", "bfloat16", "nf4", "float32")
    reason = _plan(parallel="fsdp", quant=mixed, fsdp_version=1, shard_cast_dtype="bfloat16").quantization.reason
    assert "uniform dtype" in reason and "use FSDP2" in reason
    ok = _plan(parallel="fsdp", quant=NF4_BF16, fsdp_version=1, shard_cast_dtype="bfloat16")
    assert ok.quantization.reason.startswith("FSDP1: 4-bit weights sharded in bfloat16")


def test_zero3_refuses_float_storage_that_the_engine_casts():
    with pytest.raises(QuantStorageError, match=r"bnb_4bit_quant_storage=torch\.bfloat16"):
        _plan(parallel="deepspeed", quant=NF4_FP32, zero_stage=3, shard_cast_dtype="bfloat16")
    for quant in (NF4, NF4_BF16):
        plan = _plan(parallel="deepspeed", quant=quant, zero_stage=3, shard_cast_dtype="bfloat16")
        assert plan.quantization.reason.startswith("ZeRO-3 partitions the 4-bit weights")
    assert "not partitioned" in _plan(parallel="deepspeed", quant=NF4_FP32, zero_stage=2,
                                      shard_cast_dtype="bfloat16").quantization.reason
    assert "ZeRO-3 partitions" in _plan(parallel="deepspeed", quant=NF4_FP32, zero_stage=3).quantization.reason


def test_8bit_is_reported_and_left_to_stock_under_sharding():
    plan = _plan(parallel="fsdp", quant=INT8, fsdp_version=2, shard_cast_dtype="bfloat16")
    assert plan.quantization.value.startswith("bnb 8-bit") and "not checked" in plan.quantization.reason


def test_quantized_facts_change_no_other_decision():
    """A QLoRA run gets the same DDP / checkpointing plan as the same LoRA run without quantization."""
    for ckpt in ("off", "reentrant", "non_reentrant"):
        base = dict(parallel="ddp", checkpointing=ckpt, placement=("cuda:0",), rank_device="cuda:0")
        with_q, without = _plan(quant=NF4, **base), _plan(**base)
        assert with_q.ddp_kwargs() == without.ddp_kwargs()
        assert with_q.checkpointing == without.checkpointing


# ---------------------------------------------------------------------------------------------------
# hf-ddpfix doctor
# ---------------------------------------------------------------------------------------------------


def test_qlora_advice_names_the_fixes_the_plan_enforces():
    from hf_ddpfix.facts.advice import qlora_advice

    assert qlora_advice(None)[0].startswith("bitsandbytes not installed")
    assert len(qlora_advice("0.50.2", 1)) == 2
    text = " ".join(qlora_advice("0.50.2", 8))
    for needle in ("device_map={'': int(os.environ['LOCAL_RANK'])}", "PlacementError", "non-reentrant",
                   "bnb_4bit_quant_storage=torch.bfloat16", "QuantStorageError", "unsharded"):
        assert needle in text, needle


def test_qlora_advice_without_an_accelerator_says_device_map_cpu_not_cuda_0(capsys):
    """`doctor --cpu` advised device_map={'': 0}, which fails on a CPU-only machine (issue 29)."""
    import json

    from hf_ddpfix.cli import main
    from hf_ddpfix.facts.advice import qlora_advice

    for n in (1, 2):
        text = " ".join(qlora_advice("0.50.2", n, accelerator=False))
        assert "device_map='cpu'" in text and "multiple of 64" in text
        assert "LOCAL_RANK" not in text and "load with device_map={'': 0}" not in text
    main(["doctor", "--json", "--cpu", "--devices", "2"])
    report = json.loads(capsys.readouterr().out)
    if report["versions"]["bitsandbytes"]:
        assert "device_map='cpu'" in report["qlora"][1]


def test_doctor_reports_bitsandbytes_and_qlora_advice(capsys):
    import json
    from importlib import metadata

    from hf_ddpfix.cli import main

    main(["doctor", "--json", "--devices", "2"])
    report = json.loads(capsys.readouterr().out)
    try:
        version = metadata.version("bitsandbytes")
    except metadata.PackageNotFoundError:
        version = None
    assert report["versions"]["bitsandbytes"] == version
    assert report["qlora"][0].startswith(f"bitsandbytes {version}" if version else "bitsandbytes not installed")
    main(["doctor", "--devices", "2"])
    assert "  qlora: " in capsys.readouterr().out


def test_plan_command_dry_runs_the_qlora_guardrails(capsys):
    from hf_ddpfix.cli import main

    assert main(["plan", "--parallel", "fsdp", "--quant", "4bit", "--quant-storage", "float32",
                 "--mixed-precision", "bf16"]) == 2
    assert "bnb_4bit_quant_storage=torch.bfloat16" in capsys.readouterr().err
    assert main(["plan", "--quant", "4bit", "--placement", "0,1"]) == 2
    assert "cuda:0, cuda:1" in capsys.readouterr().err
    assert main(["plan", "--parallel", "fsdp", "--quant", "4bit", "--quant-storage", "bfloat16",
                 "--mixed-precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "quantization" in out and "sharded in bfloat16 storage" in out and "docs/plan.md#quantization" in out
    assert main(["plan", "--parallel", "fsdp", "--quant", "4bit", "--quant-storage", "bfloat16",
                 "--mixed-precision", "bf16", "--json"]) == 0  # the whole reason (the report's line fits 160)
    assert "the 4-bit bytes" in json.loads(capsys.readouterr().out)["decisions"]["quantization"]["reason"]


# ---------------------------------------------------------------------------------------------------
# Multi-process (2 gloo processes, hard timeouts)
# ---------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------
# bitsandbytes' CPU repack under FSDP2: off for train() and for an evaluation outside it, restored after
# ---------------------------------------------------------------------------------------------------


def _repacking_model():
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(8, 8, bias=False, quant_type="nf4")
    layer.support_avx512bf16_for_cpu = 1  # as on an AVX512-BF16 CPU (an int there)
    return torch.nn.Sequential(layer), layer


def test_cpu_repack_undo_is_idempotent_and_keeps_a_later_library_value():
    from hf_ddpfix._compat import disable_cpu_repack

    model, layer = _repacking_model()
    n, undo = disable_cpu_repack(model)
    assert n == 1 and layer.support_avx512bf16_for_cpu is False
    assert disable_cpu_repack(model)[0] == 0  # idempotent: nothing left on
    undo()
    assert layer.support_avx512bf16_for_cpu == 1
    layer.support_avx512bf16_for_cpu = 0  # the user turns it off after our undo: a second undo keeps that
    undo()
    assert layer.support_avx512bf16_for_cpu == 0
    layer.support_avx512bf16_for_cpu = 1
    _, undo = disable_cpu_repack(model)
    layer.support_avx512bf16_for_cpu = 2  # another library's value set while ours was in force: kept (chained)
    undo()
    assert layer.support_avx512bf16_for_cpu == 2


def test_train_turns_the_cpu_repack_off_under_fsdp2_and_restores_it_when_it_ends(monkeypatch):
    """attach_runtime's undo stack (closed when train() ends, here by an exception after the repack step)
    gives every Linear4bit its own switch back, and the switch-off is counted."""
    from contextlib import ExitStack

    import hf_ddpfix.runtime.attach as rt
    from hf_ddpfix.ops import feature_counts
    from hf_ddpfix.plan.types import Decision

    model, layer = _repacking_model()
    seen = []

    def stop(*_a, **_k):
        seen.append(layer.support_avx512bf16_for_cpu)
        raise RuntimeError("stop")

    monkeypatch.setattr(rt, "_apply_checkpointing", stop)
    plan = SimpleNamespace(offload_activations=Decision(False, "not requested"), parallel="fsdp",
                           quantization=Decision("bnb_4bit", "FSDP2"))
    feature_counts.reset()
    with pytest.raises(RuntimeError, match="stop"), ExitStack() as stack:
        rt.attach_runtime(None, model, plan, stack)
    assert seen == [False] and layer.support_avx512bf16_for_cpu == 1
    assert feature_counts.snapshot()["quantization"].amounts == {"cpu_repack_off": 1}
    feature_counts.reset()


def test_an_evaluation_outside_train_turns_the_cpu_repack_off_under_fsdp2_for_its_loop(monkeypatch):
    """evaluate() after train() (the model still FSDP2-wrapped): off during the loop, restored after."""
    import hf_ddpfix.trainer as tr
    from hf_ddpfix.config.options import DDPFixConfig

    model, layer = _repacking_model()
    quant = QuantFacts(method="bnb_4bit", num_modules=1, quant_bytes=32, storage_dtype="uint8")
    monkeypatch.setattr(tr, "gather_facts", lambda trainer: RunFacts(parallel="fsdp", world_size=2, quant=quant))
    monkeypatch.setattr(tr, "_trainer_config", lambda trainer: DDPFixConfig())
    trainer = SimpleNamespace(model=model, is_world_process_zero=lambda: True)
    seen = []
    assert tr.run_evaluation_with_plan(trainer, lambda: seen.append(layer.support_avx512bf16_for_cpu) or "m") == "m"
    assert seen == [False] and layer.support_avx512bf16_for_cpu == 1


@pytest.mark.multiprocess
def test_qlora_ddp_kbit_defaults_match_stock_non_reentrant_and_placement_guard(tiny_dir, tmp_path):
    """prepare_model_for_kbit_training defaults (reentrant) under patch_trainer == stock non-reentrant fu=True
    to 1e-6 (bit-equal measured), replicas equal; a spread placement raises PlacementError before step 1; the
    stock Trainer on the same kbit defaults fails on every rank with DDP's "ready only once" at step 0."""
    pytest.importorskip("bitsandbytes")
    out = torchrun("qlora_ddp.py", "--model-dir", tiny_dir, "--out", str(tmp_path / "run"), timeout=300)
    assert out.stdout.count("QLORA_DDP_OK") == 2, out.stdout[-3000:]
    assert "max |w - stock| = " in out.stdout and "PlacementError before step 1" in out.stdout
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank} .*\] stock kbit defaults \(reentrant, fu=True\): RuntimeError at step 0: "
                         r"Expected to mark a variable ready only once\. ", out.stdout), (rank, out.stdout[-3000:])


@pytest.mark.multiprocess
def test_qlora_fsdp2_trains_sharded_with_float_storage_and_refuses_a_casting_policy(tiny_dir):
    pytest.importorskip("bitsandbytes")
    out = torchrun("qlora_fsdp.py", "--model-dir", tiny_dir, timeout=240)
    assert out.stdout.count("QLORA_FSDP_OK") == 2, out.stdout[-3000:]
    assert "float32 storage: 4-bit bytes per rank 36864 -> 18432" in out.stdout
    assert "torch.uint8 storage: 4-bit bytes per rank 36864 -> 36864" in out.stdout  # accelerate: replicated
    assert "torch.bfloat16 storage: 4-bit bytes per rank 36864 -> 18432" in out.stdout  # accelerate: sharded


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["train", "refuse"])
def test_qlora_zero3_partitions_uint8_storage_and_refuses_a_casting_engine(tiny_dir, tmp_path, case):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("deepspeed")
    env = {"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": os.environ.get("DS_BUILD_OPS", "0")}
    out = torchrun("qlora_zero3.py", "--model-dir", tiny_dir, "--case", case, "--out", str(tmp_path / "run"),
                   timeout=420, env=env)
    assert out.stdout.count("QLORA_ZERO3_OK") == 2, out.stdout[-3000:]
    if case == "train":
        assert "4-bit bytes held 18432 of 36864" in out.stdout
