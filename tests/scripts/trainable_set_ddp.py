"""The trainable set changing after DDP wrapped the model, and gradients added below the loss, through the Trainer.

2 gloo processes (torchrun), tiny Llama (attention projections and ``lm_head`` trainable), AdamW (weight decay
0.1), clipping 1.0, variable sequence lengths; each case trains the stock ``Trainer`` and ``DDPFixTrainer`` from
the same weights on the same data and prints ``CASE rank=<r> case=<case> diff=<max |fixed - stock|>`` over every
parameter (frozen ones included). Cases:

- ``freeze``: ``lm_head`` frozen by a callback at the start of optimizer step 3 (the plan: find_unused False,
  static graph on); stock (find_unused True) trains on, its AdamW skipping the head from step 3.
- ``freeze_ga2``: the same at gradient accumulation 2, frozen between the two micro-batches of step 3
  (``on_substep_end``): the first micro-batch's gradient of the head is stepped, as in stock.
- ``freeze_lora``: a LoRA model (stock: find_unused True for a PeftModel); one layer's LoRA modules frozen at step 3.
- ``freeze_trl_vlm``: TRL's ``SFTTrainer`` (``patch_trainer()``) on a tiny Qwen2-VL, images on rank 0 only, the
  vision tower's LoRA frozen at step 3 (tolerance 1e-6: the zoo's, non-reentrant vs reentrant asked).
- ``reg_accelerator``: an ``Accelerator`` subclass whose ``backward`` adds a regulariser over an auxiliary
  module the model's forward never uses; stock with ``ddp_find_unused_parameters=False`` (stock True fails: a
  parameter used outside forward) reduces its gradient; hf_ddpfix must keep it (bit-equal).
- ``reg_zero``: the same with the regulariser ``0.05 * sum(aux_b @ aux)``, ``aux_b`` zero at the start (LoRA's B):
  ``aux``'s real gradient is exactly zero at step 1; stock keeps it (AdamW decays ``aux`` and counts the step), so
  must hf_ddpfix (issue 48: it read ``grad.any()`` and reset it to None). The AdamW state (``exp_avg``,
  ``exp_avg_sq``, ``step``) is compared too (``opt:`` entries of the weights dict).
- ``reg_second`` (DDP): ``training_step`` runs a second ``accelerator.backward`` of that regulariser after the
  loss's; stock DDP cannot reduce it (find_unused True: "gradient which is undefined, but still allreduced";
  False: "Expected to have finished reduction"), and neither can hf_ddpfix's static graph: a named
  ``DDPFixError`` saying to add the term to the loss (``REFUSED rank=<r> case=reg_second ok=<bool>``).

Then ``one_rank``: only rank 0 freezes the head at step 3: ``TrainableSetChangedError`` on every rank
(``REFUSED rank=<r> case=one_rank ok=<bool> after_freeze_s=<seconds>``), the seconds measured on each rank from the
start of step 3 (where rank 0 freezes) to the refusal it raises; the test bounds them (no hang, no late refusal).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: fixtures
from _unfreeze import collate, rows  # noqa: E402
from fixtures import _full, in_order, lora, teardown, tiny_llama, zero_config  # noqa: E402

from hf_ddpfix import DDPFixTrainer  # noqa: E402
from hf_ddpfix.integrations.usage.trainable_set import TrainableSetChangedError  # noqa: E402

STEPS, AT = 5, 3
LENGTHS = (9, 14, 7, 12, 10)
RANK = int(os.environ.get("RANK", 0))
#: ``time.monotonic()`` at the start of the step where ``Freeze`` acts, on every rank (frozen there or not)
FREEZE_T: list[float] = []


class Freeze(TrainerCallback):
    """``requires_grad_(False)`` on the parameters of ``model`` whose name ``pick`` accepts (looked up then: FSDP2
    replaces the parameter objects when it wraps) at the start of optimizer step ``at`` (or, ``substep``, after the
    first micro-batch of that step); ``ranks``: only on these ranks."""

    def __init__(self, model, pick, at: int, substep: bool = False, ranks=None) -> None:  # noqa: ANN001
        self.model, self.pick, self.at, self.substep, self.ranks = model, pick, at, substep, ranks
        self.frozen: list[str] = []

    def _freeze(self, state) -> None:  # noqa: ANN001
        if state.global_step + 1 == self.at and not FREEZE_T:
            FREEZE_T.append(time.monotonic())
        if state.global_step + 1 == self.at and (self.ranks is None or RANK in self.ranks):
            for n, p in self.model.named_parameters():
                if self.pick(n) and p.requires_grad:
                    p.requires_grad_(False)
                    self.frozen.append(n)

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if not self.substep:
            self._freeze(state)

    def on_substep_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if self.substep:
            self._freeze(state)


def build(case: str) -> torch.nn.Module:
    model = tiny_llama(0)
    if case == "freeze_lora":
        model = lora(model, targets=("q_proj", "v_proj"))
        g = torch.Generator().manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:  # non-zero B: the frozen module's output matters
                p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
        return model.train()
    for name, p in model.named_parameters():
        p.requires_grad_("self_attn" in name or "lm_head" in name)
    if case.startswith("reg"):
        torch.manual_seed(2)
        model.aux = torch.nn.Linear(32, 4, bias=False)  # trainable, never used by the forward
        if case == "reg_zero":
            model.aux_b = torch.nn.Linear(4, 4, bias=False)
            torch.nn.init.zeros_(model.aux_b.weight)  # as LoRA's B: aux's first gradient is exactly zero
    return model.train()


def reg_of(model: torch.nn.Module) -> torch.Tensor:
    w = model.aux.weight
    if hasattr(model, "aux_b"):
        return 0.05 * (model.aux_b.weight @ w).sum()
    return 0.05 * (w - 0.3).pow(2).sum()


def accelerator_class(model: torch.nn.Module):  # noqa: ANN201
    from accelerate import Accelerator

    class RegAccelerator(Accelerator):
        def backward(self, loss, **kwargs):  # noqa: ANN001, ANN003, ANN201
            return super().backward(loss + reg_of(model), **kwargs)

    return RegAccelerator


#: the stock run a case is compared with, when not its own: stock DDP cannot train a second backward over a
#: parameter outside the forward (find_unused True: "undefined gradient ... allreduced"; False: "Expected to have
#: finished reduction"); the regulariser added in backward gives that parameter the same gradient (GA 1)
STOCK_OF = {"reg_second": "reg_accelerator"}
PARALLEL = os.environ.get("TS_PARALLEL", "ddp")  # ddp (torchrun) | fsdp (accelerate launch fsdp.yaml) | zero2


def train(kind: str, case: str, ranks=None) -> dict[str, torch.Tensor]:  # noqa: ANN001
    model = build(case)
    ga = 2 if case == "freeze_ga2" else 1
    fu = {"reg_accelerator": False, "reg_zero": False}.get(case) if kind == "stock" else None
    args = TrainingArguments(output_dir=f"/tmp/hf_ddpfix_ts_{kind}_{case}", per_device_train_batch_size=1,
                             gradient_accumulation_steps=ga, max_steps=STEPS, report_to=[], use_cpu=True,
                             save_strategy="no", max_grad_norm=1.0, learning_rate=1e-2, weight_decay=0.1,
                             remove_unused_columns=False, disable_tqdm=True, seed=0, logging_steps=1,
                             ddp_find_unused_parameters=fu,
                             deepspeed=zero_config(2) if PARALLEL == "zero2" else None)
    callbacks = []
    if case.startswith("freeze") or case == "one_rank":
        pick = (lambda n: "layers.1." in n and "lora_" in n) if case == "freeze_lora" else (lambda n: "lm_head" in n)
        callbacks.append(Freeze(model, pick, AT, substep=case == "freeze_ga2", ranks=ranks))
    base = in_order(DDPFixTrainer if kind == "fixed" else Trainer)
    if case == "reg_second":
        parent = base

        def training_step(self, model_, inputs, num_items_in_batch=None):  # noqa: ANN001, ANN202
            loss = parent.training_step(self, model_, inputs, num_items_in_batch)
            self.accelerator.backward(reg_of(model))
            return loss
        base = type("Second" + base.__name__, (base,), {"training_step": training_step})
    n_rows = STEPS * ga
    trainer = base(model=model, args=args, train_dataset=Dataset.from_list(rows(n_rows, LENGTHS)),
                   data_collator=collate, callbacks=callbacks)
    if case in ("reg_accelerator", "reg_zero"):
        trainer.accelerator.__class__ = accelerator_class(model)
    trainer.train()
    if callbacks:
        assert callbacks[0].frozen or (ranks is not None and RANK not in ranks), "nothing frozen"
    out = {n: _full(p).clone() for n, p in model.named_parameters()}
    if case == "reg_zero":  # AdamW's state too: exp_avg, exp_avg_sq, step per trainable parameter
        state = trainer.optimizer.state
        for n, p in model.named_parameters():
            for k, v in state.get(p, {}).items():
                out[f"opt:{n}:{k}"] = torch.as_tensor(v, dtype=torch.float64).clone()
        assert "opt:aux.weight:step" in out, sorted(out)[-5:]
    return out


def train_trl_vlm(kind: str) -> dict[str, torch.Tensor]:
    """TRL's ``SFTTrainer`` on the zoo's tiny Qwen2-VL with LoRA on the tower too (tests/scripts/trainer_zoo.py's
    ``sft_vlm``: rank 0's rows have an image, rank 1's none), through ``patch_trainer()`` (fixed) or stock; the
    vision tower's LoRA frozen at the start of step 3."""
    import trainer_zoo as zoo

    from hf_ddpfix import patch_trainer, unpatch_trainer

    zoo.STEPS, zoo.COMMON = STEPS, {**zoo.COMMON, "max_steps": STEPS}
    if kind == "fixed":
        patch_trainer()
    try:
        trainer = zoo.sft_vlm(f"/tmp/hf_ddpfix_ts_trl_{kind}", kind == "fixed", {})
        model = trainer.model
        freeze = Freeze(model, lambda n: "visual" in n and "lora_" in n, AT)
        trainer.add_callback(freeze)
        trainer.train()
        assert freeze.frozen, "nothing frozen"
        return {n: _full(p).clone() for n, p in model.named_parameters()}
    finally:
        if kind == "fixed":
            unpatch_trainer()


def main() -> None:
    if os.environ.get("TS_DUMP"):
        import faulthandler
        faulthandler.dump_traceback_later(int(os.environ["TS_DUMP"]), exit=True)
    cases = sys.argv[1].split(",") if len(sys.argv) > 1 else [
        "freeze", "freeze_ga2", "freeze_lora", "freeze_trl_vlm", "reg_accelerator", "reg_zero"]
    for case in cases:
        if case == "one_rank":
            continue
        t0 = time.time()
        if case == "freeze_trl_vlm":
            stock, fixed = train_trl_vlm("stock"), train_trl_vlm("fixed")
        else:
            stock = train("stock", STOCK_OF.get(case, case))
            fixed = train("fixed", case)
        diff = max((stock[n] - fixed[n]).abs().max().item() for n in stock)
        aux = -1.0
        if "aux.weight" in fixed:
            aux = (fixed["aux.weight"] - dict(build(case).named_parameters())["aux.weight"]).abs().max().item()
        print(f"CASE rank={RANK} case={case} diff={diff} aux_moved={aux:.3g} s={time.time() - t0:.1f}", flush=True)
    if "reg_second" in cases or (len(sys.argv) == 1 and PARALLEL == "ddp"):
        t0 = time.time()
        try:  # stock DDP cannot reduce it (either find_unused setting fails): a named refusal, not a silent reset
            train("fixed", "reg_second")
            print(f"NOT_REFUSED rank={RANK} case=reg_second", flush=True)
        except Exception as err:  # noqa: BLE001
            ok = type(err).__name__ == "DDPFixError" and "apart from the loss" in str(err)
            print(f"REFUSED rank={RANK} case=reg_second ok={ok} s={time.time() - t0:.1f} :: {str(err)[:300]}", flush=True)
    if "one_rank" in cases or len(sys.argv) == 1:
        t0 = time.time()
        FREEZE_T.clear()
        try:
            train("fixed", "one_rank", ranks=(0,))
            print(f"NOT_REFUSED rank={RANK} case=one_rank", flush=True)
        except TrainableSetChangedError as err:
            ok = "optimizer step 3" in str(err) and "differently" in str(err)
            after = time.monotonic() - FREEZE_T[0] if FREEZE_T else float("inf")
            print(f"REFUSED rank={RANK} case=one_rank ok={ok} after_freeze_s={after:.2f} s={time.time() - t0:.1f} :: "
                  f"{err}", flush=True)
            dist.destroy_process_group()
            return
    teardown()


if __name__ == "__main__":
    main()
