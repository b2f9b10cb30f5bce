"""QLoRA (bitsandbytes NF4 base + LoRA) under FSDP2 (`fully_shard`, 2 gloo processes): what trains, what cannot.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
          tests/scripts/qlora_fsdp.py --model-dir DIR

DIR holds a tiny Llama saved with `save_pretrained`; every rank reloads it in NF4 on the CPU with the
storage dtype of each case, adds LoRA (q/v/down, dropout 0) and shards every decoder layer and the root.

1. storage float32, no mixed precision: the plan is silent; the 4-bit weights are sharded (each rank
   holds exactly half of the quantized bytes, counted from the local shards) and 4 AdamW steps
   (weight_decay=0.1, clip 0.2, variable lengths) give the same LoRA weights as a replicated reference
   that all-reduces gradients like DDP (to 1e-5: only the reduction order differs).
2. storage bfloat16 + MixedPrecisionPolicy(param_dtype=bfloat16): the plan is silent; trains (finite
   losses, every LoRA tensor moves), 4-bit bytes halved.
3. storage float32 + MixedPrecisionPolicy(param_dtype=bfloat16): the plan raises `QuantStorageError`
   naming `bnb_4bit_quant_storage=torch.bfloat16`; run anyway, the first forward fails ("invalid for
   input of size"): the all-gather value-casts the packed bytes.
4. accelerate's own FSDP2 preparation (`fsdp2_prepare_model`, what the Trainer runs on GPUs; accelerate
   1.15) with bf16 mixed precision: uint8 storage stays replicated (every rank holds all 36864 4-bit bytes)
   and bfloat16 storage is sharded (18432 per rank), both run forward + backward with a finite loss; the
   plan's reasons say the same.

Prints ``QLORA_FSDP_OK``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig, LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from fixtures import init_gloo, rank_log, teardown  # noqa: E402

from hf_ddpfix.integrations.quantized import quantization_facts  # noqa: E402
from hf_ddpfix.plan import QuantStorageError, RunFacts, resolve_plan  # noqa: E402

STEPS = 4
LENGTHS = ((9, 14), (16, 6), (12, 12), (5, 15))  # (rank 0, rank 1) sequence length per step


def load(model_dir: str, storage: torch.dtype):
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_quant_storage=storage, bnb_4bit_compute_dtype=torch.float32)
    model = LlamaForCausalLM.from_pretrained(model_dir, quantization_config=q, device_map="cpu")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    # train mode, as the Trainer runs it: in eval mode bitsandbytes' CPU path repacks the 4-bit weight in
    # place on the first forward (`_convert_weight_packed_for_cpu`), which a sharded weight does not survive
    return model.train()


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    n = LENGTHS[step][rank]
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(1, 250, (1, n), generator=g)
    labels = ids.clone()
    labels[0, : n // 3] = -100  # a masked prompt, different per rank and step
    return {"input_ids": ids, "labels": labels}


def plan_for(model, cast: str | None):
    return resolve_plan(RunFacts(parallel="fsdp", world_size=dist.get_world_size(), is_peft=True,
                                 quant=quantization_facts(model), fsdp_version=2, shard_cast_dtype=cast))


def shard(model, mp_dtype: torch.dtype | None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=mp_dtype) if mp_dtype is not None else MixedPrecisionPolicy()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def accelerate_fsdp2(model):
    """accelerate 1.15's `fsdp2_prepare_model` with bf16 mixed precision and decoder-layer wrapping.

    The Trainer cannot run FSDP on a CPU-only machine (it falls back to DDP), so the accelerator is a
    stand-in with the attributes that function reads.
    """
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    plugin.set_mixed_precision("bf16")
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16",
                                  is_main_process=dist.get_rank() == 0, torch_device_mesh=None,
                                  parallelism_config=None, device=torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Params4bit.*")
        return fsdp2_prepare_model(accelerator, model)


def train(model, *, ddp_reference: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """4 steps; `ddp_reference`: the unsharded model, gradients all-reduced (mean) by hand like DDP."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        loss = model(**batch(step, dist.get_rank())).loss
        loss.backward()
        if ddp_reference:
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        torch.nn.utils.clip_grad_norm_(params, 0.2)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    weights = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            t = p.detach()
            weights[n] = (t.full_tensor() if hasattr(t, "full_tensor") else t).float().clone()
    return weights, losses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    a = p.parse_args()
    rank, _ = init_gloo()
    log = rank_log()

    # 1. float32 storage, no mixed precision: sharded, equal to the replicated (DDP-like) reference
    ref_w, ref_losses = train(load(a.model_dir, torch.float32), ddp_reference=True)
    model = load(a.model_dir, torch.float32)
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    plan = plan_for(model, None)
    assert "sharded in float32" in plan.quantization.reason, plan.report()
    before = quantization_facts(model).quant_bytes
    shard(model, None)
    after = quantization_facts(model).quant_bytes
    assert after * dist.get_world_size() == before, (before, after)
    fsdp_w, fsdp_losses = train(model, ddp_reference=False)
    diff = max((ref_w[n] - fsdp_w[n]).abs().max().item() for n in ref_w)
    assert diff <= 1e-5, f"FSDP2 QLoRA vs replicated reference: max |diff| {diff:.3e} {ref_losses} {fsdp_losses}"
    moved = sum(not torch.equal(init[n], fsdp_w[n]) for n in init)
    assert moved == len(init), f"only {moved}/{len(init)} LoRA tensors moved"
    log(f"float32 storage: 4-bit bytes per rank {before} -> {after}; losses {[round(x, 4) for x in fsdp_losses]}; "
        f"max |FSDP2 - reference| = {diff:.2e}")
    del model
    gc.collect()

    # 2. bfloat16 storage under bfloat16 mixed precision: no cast of the packed bytes, trains
    model = load(a.model_dir, torch.bfloat16)
    plan_for(model, "bfloat16")  # silent
    before = quantization_facts(model).quant_bytes
    shard(model, torch.bfloat16)
    after = quantization_facts(model).quant_bytes
    assert after * dist.get_world_size() == before, (before, after)
    bf_w, bf_losses = train(model, ddp_reference=False)
    assert all(torch.isfinite(torch.tensor(bf_losses))), bf_losses
    assert all(not torch.equal(init[n], bf_w[n]) for n in init)
    log(f"bfloat16 storage + bf16 mixed precision: 4-bit bytes {before} -> {after}; losses "
        f"{[round(x, 3) for x in bf_losses]}")
    del model
    gc.collect()

    # 3. float32 storage under bfloat16 mixed precision: refused by the plan; stock fails in the first forward
    model = load(a.model_dir, torch.float32)
    try:
        plan_for(model, "bfloat16")
    except QuantStorageError as err:
        assert "bnb_4bit_quant_storage=torch.bfloat16" in str(err), err
    else:
        raise AssertionError("float32 storage under bf16 FSDP mixed precision was not refused")
    shard(model, torch.bfloat16)
    try:
        model(**batch(0, rank)).loss.backward()
    except RuntimeError as err:
        assert "invalid for input of size" in str(err), err
        log(f"float32 storage + bf16 mixed precision: refused by the plan; run anyway: {str(err)[:70]}")
    else:
        raise AssertionError("expected the value-cast 4-bit weights to fail (the refusal would be unfounded)")
    del model
    gc.collect()

    # 4. accelerate's FSDP2 preparation, as the Trainer runs it
    for storage, expect_sharded in ((torch.uint8, False), (torch.bfloat16, True)):
        model = load(a.model_dir, storage)
        reason = plan_for(model, "bfloat16").quantization.reason
        assert ("out of sharding" in reason) is not expect_sharded, reason
        before = quantization_facts(model).quant_bytes
        model = accelerate_fsdp2(model)
        after = quantization_facts(model).quant_bytes
        assert after == (before // dist.get_world_size() if expect_sharded else before), (storage, before, after)
        loss = model(**batch(0, rank)).loss
        loss.backward()
        assert torch.isfinite(loss), loss
        log(f"accelerate fsdp2_prepare_model, {storage} storage: 4-bit bytes per rank {before} -> {after}")
        del model
        gc.collect()
    log("QLORA_FSDP_OK")
    teardown()


if __name__ == "__main__":
    main()
