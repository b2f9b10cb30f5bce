"""hf_ddpfix's memory features through ``Trainer.train`` / ``evaluate`` under accelerate's FSDP2, as users launch.

Run (2 gloo processes on the CPU; the FSDP test device makes accelerate run FSDP2 there, docs/fsdp.md):

    PYTHONPATH=hf_ddpfix/rehearse/device:. accelerate launch --config_file accelerate_configs/fsdp.yaml \
        --mixed_precision no tests/scripts/fsdp_features.py --mode fixed --out OUT
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml tests/scripts/fsdp_features.py --mode stock --out OUT

``--mode fixed``: ``DDPFixTrainer`` with the cell's feature on (:data:`CELLS`); ``--mode stock``: the stock
``Trainer`` with ``ddp_find_unused_parameters=True`` and no feature (the reference, under ddp_cpu.yaml);
``--mode off``: ``DDPFixTrainer`` with every feature off (to check that the test fails when a feature does not run).

Every cell trains a LoRA Llama (tests/fixtures.py ``lora_llama``: LoRA with random A and B on q/v/gate/up/down,
sdpa attention, 4 heads, 2 KV heads) from the same weights on the same data: rank ``r`` gets item ``k * world + r``
as its ``k``-th micro-batch (batch size 1, no padding, so the patched layer paths run), sequence lengths varying by
step, micro-batch and rank, about a third of the labels masked; AdamW with weight decay 0.1, clipping at 1.0,
non-reentrant checkpointing, 3 optimizer steps, then ``evaluate()``. Cells:

- ``tiled_mlp``: ``tiled_mlp="3"`` (3 shards per MLP call), gradient accumulation 2;
- ``tiled_loss``: ``tiled_loss="4"`` (4 label tokens per chunk: every call runs several chunks);
- ``long_context``: ``long_context="all"`` (rms_norm, grouped attention, tiled layer) with 5-token tiles (the
  Trainer's default is 2048 tokens: :data:`TOKENS_PER_TILE` is passed through the runtime's applier here), so
  the tile count differs per rank and the plan's all-reduced (MAX) count is what keeps FSDP's gathers aligned;
- ``offload``: ``offload_activations=True``, ``offload_min_layer_mib=0``. hf_ddpfix turns offload off without an
  accelerator (nothing to offload to); this script makes the run look like one that has one (the run's facts say
  ``accelerator_available``) and its ``ActivationOffload`` copy CPU tensors through host buffers
  (``simulate=True``: the CUDA state machine, synchronous copies), as tests/test_offload_plan.py does in one process;
- ``sequence_parallel``: ``sequence_parallel=2``, gradient accumulation 2 (Ulysses over both ranks: each trains its
  slice of both ranks' batches, right-padded to one length; evaluation sharded too);
- ``qlora``: the base saved once, reloaded on every rank in NF4 through bitsandbytes on the CPU with
  ``bnb_4bit_quant_storage=torch.float32`` (FSDP2 shards a floating storage; uint8 storage would stay replicated,
  see the plan's ``quantization`` line), LoRA on top, ``prepare_model_for_kbit_training`` without its reentrant
  checkpointing.

- ``vlm_memory``: Qwen2.5-VL (tests/zoo.py: LoRA on the language model, tower and projector) with tiled MLP, tiled
  loss, long-context layers and offload all on, gradient accumulation 2, images on one rank, the other, none,
  both (:data:`VLM_PATTERN`); its MLP calls counted by hooks (``extra["mlp_calls"]``).

Under ``--num_processes 4``: ``sp_dp2`` (``sequence_parallel=2``: DP2 x SP2), ``sp4`` and ``tiled_mlp_offload``, each
with gradient accumulation 2; their reference is ``--mode off --world-of 4 --cells plain`` in one process (no
launcher): the 4 ranks' micro-batches of a step as 8 micro-batches of one optimizer step, every feature off, with
each evaluation item's (loss, label tokens) in ``eval_items`` (the test rebuilds the 4-process evaluation loss).

Rank 0 writes ``OUT/<mode>-<cell>.pt``: {"weights": every trainable tensor (FSDP2 shards gathered), "eval_loss",
"wrapped": the model's class after prepare, "units": FSDP2 units, "plan": the plan's lines, "history": each
step's logged (loss, grad_norm)}; every rank writes
``OUT/<mode>-<cell>-rank<r>.pt``: {"counts": hf_ddpfix's feature counters after train() and evaluate(),
"extra": the cell's own figures}. Prints ``FSDP_FEATURES_OK`` at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fixtures import (  # noqa: E402
    DECODER_TARGETS,
    SMALL_TEXT,
    RankItems,
    lora_llama,
    masked_labels,
    single_collate,
    trainable_weights,
)
from fsdp_trainer import training_args  # noqa: E402

STEPS = 3
TOKENS_PER_TILE = 5
#: cell -> (hf_ddpfix options, gradient accumulation)
CELLS = {
    "tiled_mlp": ({"tiled_mlp": "3"}, 2),
    "tiled_loss": ({"tiled_loss": "4"}, 1),
    "long_context": ({"long_context": "all"}, 1),
    "qlora": ({}, 1),
    "sequence_parallel": ({"sequence_parallel": 2}, 2),
    "offload": ({"offload_activations": True, "offload_min_layer_mib": 0}, 1),  # its test device stays from here
    "vlm_memory": ({"tiled_mlp": "3", "tiled_loss": "4", "long_context": "all", "offload_activations": True,
                    "offload_min_layer_mib": 0}, 2),
}
#: the cells of the 2-process launch (the default ``--cells``)
TWO_PROCESS_CELLS = tuple(CELLS)
#: cells of the 4-process launch (``--num_processes 4``), each against the one-process run of ``plain`` on the whole
#: global batch (``--world-of 4``): DP2 x SP2, SP over all 4 ranks, and a memory cell
CELLS.update({
    "sp_dp2": ({"sequence_parallel": 2}, 2),
    "sp4": ({"sequence_parallel": 4}, 2),
    "tiled_mlp_offload": ({"tiled_mlp": "3", "offload_activations": True, "offload_min_layer_mib": 0}, 2),
    "plain": ({}, 2),
})
#: cells with activation offload, run with the offload test device (:func:`_test_device_offload`; it stays on)
OFFLOAD_CELLS = ("offload", "vlm_memory", "tiled_mlp_offload")
#: cells whose model is Qwen2.5-VL (tests/zoo.py) with image and text-only ranks mixed (:data:`VLM_PATTERN`)
VLM_CELLS = ("vlm_memory",)
#: k-th micro-batch -> (image on even ranks, image on odd ranks): one rank, the other, none, both
VLM_PATTERN = [(True, False), (False, True), (False, False), (True, True)]
MODEL = dict(attn_implementation="sdpa")
#: cells trained in float64 (their float32 run differs from DDP's by the tiling's summation order, see below)
DTYPE = {"long_context": torch.float64}
#: model outputs that are not predictions (a VLM's image features exist on image ranks only: tests/scripts/fsdp_trainer.py)
IGNORE = ["image_hidden_states", "past_key_values", "cache", "rope_deltas", "image_outputs"]


def seq_len(k: int, r: int) -> int:
    """Micro-batch ``k`` of rank ``r``: 7 to 22 tokens, never equal on the two ranks."""
    return 7 + (5 * k + 7 * r) % 16


def items(n_batches: int, world: int, seed: int) -> RankItems:
    """Rank ``r``'s ``k``-th micro-batch: one row of ``seq_len(k, r)`` random tokens, a third of its labels masked."""
    def make(k: int, r: int) -> dict:
        g = torch.Generator().manual_seed(seed + 1000 * k + r)
        ids = torch.randint(1, 250, (1, seq_len(k, r)), generator=g)
        return {"input_ids": ids, "labels": masked_labels(ids, g)}
    return RankItems(n_batches, world, make)


def vlm_setup(n_batches: int, world: int):  # noqa: ANN201
    """Qwen2.5-VL LoRA (tests/zoo.py: language model, tower and projector) and its data: rank ``r``'s ``k``-th
    micro-batch has an image as :data:`VLM_PATTERN` says, 12 or 16 tokens (tests/zoo.py's ``seq_len``)."""
    from zoo import ZOO
    from zoo import seq_len as zoo_len

    entry = ZOO["qwen2_5_vl"]

    def make(pattern, seed):  # noqa: ANN001, ANN202
        return lambda k, r: entry.batch(pattern[k % len(pattern)][r % 2], seed + 1000 * k + r, zoo_len(k, 0, r))

    return (entry.model(0), RankItems(n_batches, world, make(VLM_PATTERN, 0)),
            RankItems(3, world, make(VLM_PATTERN, 50_000)))


def eval_items(model, dataset) -> list[tuple[float, int]]:  # noqa: ANN001
    """(mean loss, label tokens) of every evaluation item, one forward each: under N processes the Trainer's
    ``evaluate()`` averages, per evaluation step, the step's N items weighted by their tokens
    (``average_tokens_across_devices``), then the steps; one process averages its items' means."""
    was = model.training
    model.eval()
    with torch.no_grad():
        out = [(float(model(**dataset[i]).loss), int((dataset[i]["labels"][:, 1:] != -100).sum()))
               for i in range(len(dataset))]
    model.train(was)
    return out


def count_mlp_calls(model) -> dict[str, int]:  # noqa: ANN001
    """Calls of the model's MLPs (modules named ``*.mlp``), counted by a forward pre-hook: ``"<tower|text>/<grad|
    no_grad>"`` -> calls (training forwards and checkpoint recomputes run with grad; evaluation without)."""
    from collections import Counter

    calls: Counter = Counter()

    def hook(part: str):  # noqa: ANN202
        return lambda module, args: calls.update([f"{part}/{'grad' if torch.is_grad_enabled() else 'no_grad'}"])

    for name, module in model.named_modules():
        if name.endswith(".mlp"):
            module.register_forward_pre_hook(hook("tower" if ".visual." in name else "text"))
    return calls


def qlora_model(out: str, world: int):
    """A tiny Llama saved once (rank 0), reloaded in NF4 with float32 storage on every rank, LoRA on top."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    base = os.path.join(out, "saved-qlora-base")
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.isdir(base):
        from transformers import LlamaConfig

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMALL_TEXT, max_position_embeddings=128)).save_pretrained(base)
    if world > 1:
        dist.barrier()
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_quant_storage=torch.float32, bnb_4bit_compute_dtype=torch.float32)
    model = LlamaForCausalLM.from_pretrained(base, quantization_config=q, device_map="cpu", **MODEL)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    adapters = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(DECODER_TARGETS),
                          init_lora_weights=False)
    return get_peft_model(model, adapters).train()


def four_bit_names(model) -> set[str]:
    """Names of the bitsandbytes 4-bit weights (before any wrapping)."""
    return {n for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}


def local_bytes(model, names: set[str]) -> int:
    """Bytes of the named parameters this rank holds (its local shards under FSDP2)."""
    total = 0
    for n, p in model.named_parameters():
        if n in names:
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
    return total


@functools.cache
def _test_device_offload() -> None:
    """Offload on a CPU run, as on a machine with an accelerator (see the module docstring)."""
    import hf_ddpfix.runtime.attach as runtime_mod
    import hf_ddpfix.trainer as trainer_mod
    from hf_ddpfix.ops.offload import ActivationOffload

    real = trainer_mod.gather_facts
    trainer_mod.gather_facts = lambda tr: dataclasses.replace(real(tr), accelerator_available=True)
    runtime_mod.ActivationOffload = functools.partial(ActivationOffload, min_bytes=0, simulate=True)


def _small_tiles() -> None:
    import hf_ddpfix.runtime.attach as runtime_mod
    from hf_ddpfix.integrations.long_context.long_context import apply_long_context

    runtime_mod.apply_long_context = functools.partial(apply_long_context, tokens_per_tile=TOKENS_PER_TILE)


class PlanLines:
    """Collects hf_ddpfix's log records (the plan report) on this rank."""

    def __init__(self):
        import logging

        self.lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: self.lines.append(record.getMessage())
        logging.getLogger("hf_ddpfix").addHandler(handler)


def run(cell: str, mode: str, out: str, lines: PlanLines, world_of: int = 0) -> None:
    import torch.distributed as dist
    from transformers import Trainer

    from hf_ddpfix import DDPFixConfig, DDPFixTrainer
    from hf_ddpfix.ops import feature_counts

    options, ga = CELLS[cell]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    data_world = world
    if world_of:  # one process on the whole global batch of a ``world_of``-process run: its micro-batches in order
        assert world == 1, "--world-of is the one-process reference"
        ga, data_world = ga * world_of, world_of
    args = training_args(os.path.join(out, f"run-{mode}-{cell}"), STEPS, ga, mode)
    assert args.device.type == "cpu"  # sets up accelerate's state and the process group (from_pretrained reads it)
    if cell in VLM_CELLS:
        model, train, evaluation = vlm_setup(STEPS * ga // (data_world // world), data_world)
    else:
        model = qlora_model(out, world) if cell == "qlora" else lora_llama(dtype=DTYPE.get(cell), **MODEL)
        train = items(STEPS * ga // (data_world // world), data_world, seed=0)
        evaluation = items(2, data_world, seed=50_000)
    model.config.use_cache = False
    quantized = four_bit_names(model)
    if mode == "stock":
        trainer = Trainer(model=model, args=args, data_collator=single_collate, train_dataset=train, eval_dataset=evaluation)
    else:
        config = DDPFixConfig(**(options if mode == "fixed" else {}))
        trainer = DDPFixTrainer(model=model, args=args, data_collator=single_collate, train_dataset=train,
                                eval_dataset=evaluation, ddpfix_config=config)
    del lines.lines[:]
    t0 = time.time()
    mlp_calls = count_mlp_calls(model) if cell in VLM_CELLS else None
    result = trainer.train()
    metrics = trainer.evaluate(ignore_keys=IGNORE)
    counts = {k: v.as_dict() for k, v in feature_counts.snapshot().items()}
    from torch.distributed.fsdp import FSDPModule

    units = [n for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)]
    extra = {"train_metrics": {k: v for k, v in result.metrics.items() if k.startswith("hf_ddpfix/")}}
    if cell == "qlora":
        from bitsandbytes.nn.modules import has_avx512bf16

        extra["avx512bf16"] = bool(has_avx512bf16())  # bitsandbytes repacks 4-bit weights for evaluation there
        extra["four_bit"] = {"params": len(quantized), "local_bytes": local_bytes(trainer.model, quantized),
                             "full_bytes": local_bytes(model, quantized) if trainer.model is not model else None}
        from bitsandbytes.nn import Linear4bit

        # each module's own repack switch once train() and evaluate() are over (hf_ddpfix restores it)
        extra["repack_switch_after"] = sorted({bool(m.support_avx512bf16_for_cpu) for m in trainer.model.modules()
                                               if isinstance(m, Linear4bit)})
    runtime = getattr(trainer, "hf_ddpfix_runtime", None)
    if mlp_calls is not None:
        extra["mlp_calls"] = dict(mlp_calls)
    if cell in OFFLOAD_CELLS and runtime is not None and runtime.offload is not None:
        s = runtime.offload.stats
        extra["offload"] = {"steps": s.steps, "offloaded_tensors": s.offloaded_tensors, "in_flight": s.in_flight}
    torch.save({"counts": counts, "extra": extra}, os.path.join(out, f"{mode}-{cell}-rank{rank}.pt"))
    weights = trainable_weights(trainer.model)
    if world_of:  # per evaluation item (loss, label tokens): the test rebuilds the N-process evaluation loss
        extra["eval_items"] = eval_items(trainer.model, evaluation)
    if trainer.is_world_process_zero():
        history = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
        torch.save({"weights": weights, "eval_loss": metrics["eval_loss"], "eval_items": extra.get("eval_items"),
                    "history": history, "wrapped": type(trainer.model).__name__,
                    "units": units, "plan": list(lines.lines) + _full_plan(trainer)}, os.path.join(out, f"{mode}-{cell}.pt"))
        print(f"[{mode}] {cell}: {type(trainer.model).__name__}, {len(units)} FSDP2 units, eval_loss "
              f"{metrics['eval_loss']:.6f}, {time.time() - t0:.1f}s", flush=True)
    if world > 1:
        dist.barrier()



def _full_plan(trainer) -> list[str]:
    """The plan's lines with the whole reasons (the logged lines are cut at 160 characters)."""
    plan = getattr(trainer, "hf_ddpfix_plan", None)
    return plan.report(width=None).splitlines() if plan is not None else []

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("fixed", "stock", "off"), required=True)
    ap.add_argument("--cells", default=",".join(TWO_PROCESS_CELLS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--world-of", type=int, default=0,
                    help="one process trains the global batch of this many processes (the reference)")
    a = ap.parse_args()
    lines = PlanLines()
    _small_tiles()
    for cell in a.cells.split(","):
        if cell in OFFLOAD_CELLS and a.mode != "stock":
            _test_device_offload()
        run(cell, a.mode, a.out, lines, a.world_of)
    print("FSDP_FEATURES_OK", flush=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        from hf_ddpfix.ops.dist import destroy_default_group

        destroy_default_group()
