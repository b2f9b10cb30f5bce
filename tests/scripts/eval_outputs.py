"""Evaluation and prediction of VLMs whose outputs differ by rank, launched as users launch them (2 gloo processes).

Run (one launch per parallel mode; the DDP launch writes the stock reference the other two compare with):

    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml tests/scripts/eval_outputs.py --mode ddp --out OUT
    PYTHONPATH=hf_ddpfix/rehearse/device:. accelerate launch --config_file accelerate_configs/fsdp.yaml --mixed_precision no \
        tests/scripts/eval_outputs.py --mode fsdp --out OUT
    accelerate launch --config_file accelerate_configs/zero3.yaml tests/scripts/eval_outputs.py --mode zero3 --out OUT

Cases (each: ``evaluate()`` with a ``compute_metrics`` that keeps the gathered predictions, then ``predict()``;
batch size 1, rank ``r`` gets item ``k * world + r`` as its ``k``-th batch, sequence lengths varying by rank/step):

- ``<family>-mixed`` (Qwen2.5-VL; LLaVA with ``output_hidden_states=True`` in its batches, a prediction field the
  user asked for): image on rank 0 / text on rank 1, then the reverse, then text on both; hf_ddpfix (``DDPFixTrainer``, no
  ``ignore_keys``) must drop exactly the fields a local forward with an image has and one without lacks (observed
  here, e.g. 5.24's ``image_outputs``, 5.23's ``image_hidden_states``) and nothing else;
- ``qwen2_5_vl-images``: an image on every rank at every step: nothing differs, nothing may change (no field
  dropped, no output rebuilt) and the predictions equal stock's without ``ignore_keys`` (``image_outputs`` on 5.24);
- ``qwen2_5_vl-later``: images on both ranks at the first step, then mixed: a field kept at the first step that a
  rank lacks later is a -100 placeholder there (counted); the logits part equals stock's.

Reference (DDP launch): the stock ``Trainer`` on the same model and data with ``ignore_keys`` = the Trainer's default
plus the fields hf_ddpfix is expected to drop (what stock 5.23 returns for Qwen2.5-VL without any ``ignore_keys``);
under DDP the hf_ddpfix run must equal it bit for bit, under FSDP2 and ZeRO-3 within ``--tol`` (different
all-gathered kernels: ZeRO-3's own linear). Rank 0 writes ``OUT/<mode>.json`` (per case: max differences, dropped
fields, counters) and, under DDP, ``OUT/reference.pt``. Prints ``EVAL_OUTPUTS_OK``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fixtures import RankItems, single_collate  # noqa: E402
from zoo import ZOO  # noqa: E402

#: case -> (family, per-step (rank 0 image, rank 1 image))
CASES = {
    "qwen2_5_vl-mixed": ("qwen2_5_vl", [(True, False), (False, True), (False, False)]),
    "llava-mixed": ("llava", [(True, False), (False, True), (False, False)]),
    "qwen2_5_vl-images": ("qwen2_5_vl", [(True, True), (True, True)]),
    "qwen2_5_vl-later": ("qwen2_5_vl", [(True, True), (False, True), (True, False)]),
}
HIDDEN_STATES = ("llava",)  # families run with output_hidden_states=True (a field the user asks for, kept)
SEQ = ((12, 16), (16, 12), (14, 10))  # step -> rank -> sequence length


def build(family: str):  # noqa: ANN201
    return ZOO[family].model(0).eval()


def dataset(case: str, world: int) -> RankItems:
    family, pattern = CASES[case]
    entry = ZOO[family]
    asked = {"output_hidden_states": True} if family in HIDDEN_STATES else {}
    return RankItems(len(pattern), world, lambda k, r: {
        **entry.batch(pattern[k][r % 2], 5000 + 100 * k + r, SEQ[k % len(SEQ)][r % 2]), **asked})


def conditional_fields(family: str) -> set[str]:
    """The output fields a local forward with an image has and one without lacks, plus fields the Trainer's gather
    cannot take (a ``None`` inside: 5.24's ``image_outputs.hidden_states`` with ``output_hidden_states``): observed
    on this stack, no list of names."""
    from hf_ddpfix.ops.output_agreement import describe, gatherable

    model = build(family)
    outs = {}
    for image in (True, False):
        with torch.no_grad():
            outs[image] = model(**ZOO[family].batch(image, 1, 12), output_hidden_states=family in HIDDEN_STATES)
    from hf_ddpfix._compat import default_prediction_ignore_keys

    skip = set(default_prediction_ignore_keys()) | {"loss"}
    lacking = set(outs[True].keys()) - set(outs[False].keys())
    ungatherable = {k for k, v in outs[True].items() if k not in skip and not gatherable(describe(v))}
    return (lacking | ungatherable) - skip


def args_for(out: str, mode: str):  # noqa: ANN201
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=os.path.join(out, f"run-{mode}"), per_device_eval_batch_size=1,
                             per_device_train_batch_size=1, max_steps=1, learning_rate=0.0, weight_decay=0.0,
                             report_to="none", remove_unused_columns=False, use_cpu=True, seed=0, save_strategy="no")


def run(case: str, model, trainer_cls, out: str, mode: str, ignore_keys=None) -> dict:  # noqa: ANN001
    """``evaluate()`` (predictions kept by ``compute_metrics``) then ``predict()`` of ``case`` on ``model``. Under FSDP2
    one training step at learning rate 0 first (the weights stay exactly as built): accelerate 1.15 cannot prepare an
    FSDP2 model for ``evaluate()`` alone ("a model and optimizer must be passed together")."""
    import torch.distributed as dist

    kept: list = []

    def compute_metrics(pred) -> dict:  # noqa: ANN001
        kept.append(pred.predictions)
        return {"n": float(len(np.asarray(pred.label_ids)))}

    ds = dataset(case, dist.get_world_size())
    trainer = trainer_cls(model=model, args=args_for(out, mode), data_collator=single_collate,
                          compute_metrics=compute_metrics, train_dataset=ds)
    if mode == "fsdp":
        trainer.train()
    metrics = trainer.evaluate(eval_dataset=ds, ignore_keys=ignore_keys)
    pred = trainer.predict(ds, ignore_keys=ignore_keys)
    really = {"ddp": not trainer.is_fsdp_enabled and not trainer.is_deepspeed_enabled,
              "fsdp": trainer.is_fsdp_enabled and type(trainer.model).__name__.startswith("FSDP"),
              "zero3": trainer.is_deepspeed_enabled and trainer.deepspeed is not None
              and trainer.deepspeed.zero_optimization_stage() == 3}[mode]
    assert really, f"{case}: the launch did not run {mode} ({type(trainer.model).__name__})"
    sync = getattr(trainer, "hf_ddpfix_eval_outputs", None)
    res = {"eval_loss": metrics["eval_loss"], "test_loss": pred.metrics["test_loss"], "eval_predictions": kept[0],
           "predictions": pred.predictions, "label_ids": pred.label_ids}
    if sync is not None:
        a = sync.agreement
        res["agreement"] = {"dropped": sorted(a.dropped), "forwards": a.forwards, "changed": a.changed,
                            "placeholders": a.placeholders, "padded": a.padded, "exchanges": sync.exchanges}
    return res


def flat(x, path: str = "") -> dict[str, np.ndarray]:  # noqa: ANN001
    if isinstance(x, dict):
        return {k2: v for k, v in x.items() for k2, v in flat(v, f"{path}.{k}").items()}
    if isinstance(x, (tuple, list)):
        return {k2: v for i, v in enumerate(x) for k2, v in flat(v, f"{path}[{i}]").items()}
    return {path: np.asarray(x)}


def max_diff(a, b, what: str) -> float:  # noqa: ANN001
    fa, fb = flat(a), flat(b)
    assert list(fa) == list(fb), f"{what}: structure {list(fa)} != {list(fb)}"
    worst = 0.0
    for k in fa:
        assert fa[k].shape == fb[k].shape, f"{what}{k}: shape {fa[k].shape} != {fb[k].shape}"
        worst = max(worst, float(np.abs(fa[k].astype(np.float64) - fb[k].astype(np.float64)).max(initial=0.0)))
    return worst


def compare(case: str, got: dict, ref: dict, tol: float) -> dict:
    diffs = {k: abs(got[k] - ref[k]) for k in ("eval_loss", "test_loss")}
    diffs |= {k: max_diff(got[k], ref[k], f"{case} {k}") for k in ("eval_predictions", "predictions", "label_ids")}
    bad = {k: v for k, v in diffs.items() if v > tol}
    assert not bad, f"{case}: differs from stock DDP by {bad} (tol {tol})"
    return diffs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "fsdp", "zero3"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tol", type=float, default=0.0)
    p.add_argument("--cases", default=",".join(CASES))
    a = p.parse_args()
    import torch.distributed as dist
    from transformers import Trainer

    from hf_ddpfix import DDPFixTrainer
    from hf_ddpfix._compat import default_prediction_ignore_keys

    t0 = time.time()
    report: dict = {}
    refs: dict = {}
    ref_path = os.path.join(a.out, "reference.pt")
    from accelerate import PartialState

    PartialState()  # the process group (as TrainingArguments would), without DeepSpeed's zero.Init
    cases = a.cases.split(",")
    # every model and observation before the first TrainingArguments (under zero3.yaml they switch zero.Init on for
    # any later build, and peft cannot wrap a partitioned Conv3d): the DeepSpeed engine partitions them itself
    expect = {f: conditional_fields(f) for f in {CASES[c][0] for c in cases}}
    models = {(c, kind): build(CASES[c][0]) for c in cases for kind in (("fixed", "stock") if a.mode == "ddp"
                                                                         else ("fixed",))}
    for case in cases:
        family = CASES[case][0]
        expected = expect[family]
        stock_ignore = default_prediction_ignore_keys() + sorted(expected)
        got = run(case, models[case, "fixed"], DDPFixTrainer, a.out, a.mode)
        if family in HIDDEN_STATES:  # the field the user asked for (every rank has it) is kept: logits + layers
            assert len(flat(got["predictions"])) > 2, (case, list(flat(got["predictions"])))
        agreement = got["agreement"]
        # issue 48: signatures exchanged at the loop's first step only (one forward per step), not at every step
        assert agreement["exchanges"] == 1 < agreement["forwards"], (case, agreement)
        if case.endswith("-images"):  # nothing differs: nothing may change, stock without ignore_keys
            assert agreement["dropped"] == [] and agreement["changed"] == 0, (case, agreement)
            stock_ignore = None
        elif case.endswith("-later"):  # kept at the first step, lacked later: placeholders exactly when a field is
            assert agreement["dropped"] == [] and (agreement["placeholders"] > 0) == bool(expected), (case, agreement)
        else:  # mixed from the first step: exactly the conditional fields dropped
            assert agreement["dropped"] == sorted(expected), (case, agreement, expected)
        if a.mode == "ddp":
            ref = run(case, models[case, "stock"], Trainer, a.out, a.mode, ignore_keys=stock_ignore)
            if case.endswith("-later") and expected:  # the placeholder field: compare the logits part only
                got_cmp = {**got, "eval_predictions": got["eval_predictions"][0], "predictions": got["predictions"][0]}
                check_placeholders(case, got)
            else:
                got_cmp = got
            refs[case] = {k: v for k, v in ref.items() if k != "agreement"}
            report[case] = {"diff": compare(case, got_cmp, ref, a.tol), "agreement": agreement,
                            "expected_dropped": sorted(expected)}
        else:
            refs = refs or torch.load(ref_path, weights_only=False)
            ref = refs[case]
            got_cmp = got
            if case.endswith("-later") and expected:
                got_cmp = {**got, "eval_predictions": got["eval_predictions"][0], "predictions": got["predictions"][0]}
                check_placeholders(case, got)
            report[case] = {"diff": compare(case, got_cmp, ref, a.tol), "agreement": agreement,
                            "expected_dropped": sorted(expected)}
        dist.barrier()
    if dist.get_rank() == 0:
        if a.mode == "ddp":
            torch.save(refs, ref_path)
        with open(os.path.join(a.out, f"{a.mode}.json"), "w") as f:
            json.dump({"cases": report, "wall_s": round(time.time() - t0, 1)}, f, indent=1)
        print("EVAL_OUTPUTS_OK", json.dumps(report), flush=True)
    dist.barrier()


def check_placeholders(case: str, got: dict) -> None:
    """The kept field a rank lacked at a later step holds -100 rows for that rank's step (the Trainer's padding)."""
    field = flat(got["predictions"][1:])
    assert field, f"{case}: the field kept at the first step is missing from the predictions"
    assert any((v == -100).any() for v in field.values()), f"{case}: no -100 placeholder rows in {list(field)}"


if __name__ == "__main__":
    main()
