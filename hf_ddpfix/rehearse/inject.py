"""What runs inside every process a rehearsal launches (called by ``shim/sitecustomize.py``; the script is unchanged).

Nothing heavy is imported here: each patch waits for the first import of the module it patches (a meta-path hook),
so the launchers (accelerate's CLI, torchrun's agent) are untouched. In a rank it:

- ``from_pretrained`` (``PreTrainedModel`` and the ``AutoModel*`` classes; PEFT's ``PeftModel.from_pretrained``):
  reads the checkpoint's config (a local folder with config.json works offline), cuts it
  (:func:`hf_ddpfix.rehearse.shrink.shrink_config`), builds that model with seeded random weights, saves it to the
  rehearsal folder and loads THAT through the stock ``from_pretrained`` with the script's own arguments
  (quantization, ``device_map``, DeepSpeed's ``zero.Init`` all run as usual). fp32 instead of bf16/fp16 weights,
  ``device_map`` onto the CPU, ``sdpa`` instead of CUDA-only attention kernels: each said in the record;
- ``TrainingArguments``: ``max_steps`` capped, ``output_dir`` moved into the rehearsal folder, ``use_cpu``,
  checkpoint and evaluation cadence set to the last step when the script saves / evaluates by steps, ``report_to``
  none, ``ddp_timeout`` bounded;
- ``Trainer``: a callback that records what ran (parallel mode, plan lines, FSDP units, features and counters, steps,
  evaluation, prediction, checkpoints) and checks replicas in sync at the end (hf_ddpfix's ``ReplicaSyncCallback``),
  evaluation/prediction sets cut to a few batches, and with ``--skew`` the last rank's batches made text-only and
  shorter;
- hf_ddpfix on every Trainer (``patch_trainer()``, as ``patches/`` does; a script that calls it itself only sets its
  options); ``--stock``: ``hf_ddpfix.patch_trainer()`` called by the script does nothing (and ``HF_DDPFIX_DISABLE=1`` turns
  ``patches/`` off), so the same launch runs without hf_ddpfix;
- the watchdog (:mod:`hf_ddpfix.rehearse.watchdog`) and an exception hook that writes the failing frames;
- the sandbox (:mod:`hf_ddpfix.rehearse.sandbox`): every write outside the rehearsal redirected into it, listed;
- ``sys.stdout`` / ``sys.stderr`` also copied to ``<dir>/rank<R>.out`` (the report shows rank 0's last lines).

Each rank writes ``<dir>/rank<R>.json`` (rewritten as the run goes). Environment (set by the driver):
``DDPFIX_REHEARSE_DIR``, ``_ROOT``, ``_STEPS``, ``_SKEW``, ``_STOCK``, ``_SHRINK``, ``_HANG_S``, ``_RESUME``.

Guarantees: outside a rehearsal (``DDPFIX_REHEARSE_DIR`` unset) :func:`install` does nothing; every substitution
made is listed in the rank's record.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import os
import re
import sys
import time
from typing import Any

from .loading import _patch_auto, _patch_modeling, _patch_peft, _patch_processor_auto, _patch_tokenizer_auto
from .record import ENV, RehearsalStepError, _env, _rank, _record, _tee_output, _world, _write, note  # noqa: F401

__all__ = ["install", "skew_batch", "RehearsalStepError"]

# --------------------------------------------------------------------------------------------------
# Import hooks
# --------------------------------------------------------------------------------------------------


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hooks[name](module)`` right after ``name`` is first executed."""

    def __init__(self, hooks: dict[str, Any]) -> None:
        self.hooks = hooks

    def find_spec(self, name, path=None, target=None):
        hook = self.hooks.get(name)
        if hook is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, inner = spec.loader, spec.loader.exec_module

        def exec_and_patch(module):
            inner(module)
            del self.hooks[name]
            hook(module)

        loader.exec_module = exec_and_patch
        return spec



def _strategy(value: Any) -> str:
    return str(getattr(value, "value", value) or "no").lower()


def _patch_training_args(module: Any) -> None:
    cls = module.TrainingArguments
    inner = cls.__post_init__
    if getattr(inner, "_hf_ddpfix_rehearse", False):
        return

    def __post_init__(self, *args, **kwargs):
        import torch

        steps = int(_env("STEPS", "3"))
        resume = _env("RESUME")
        subs = []
        asked = {"max_steps": self.max_steps, "num_train_epochs": self.num_train_epochs,
                 "output_dir": self.output_dir, "per_device_train_batch_size": self.per_device_train_batch_size,
                 "gradient_accumulation_steps": self.gradient_accumulation_steps}
        self.max_steps = steps + (1 if resume else 0)
        self.output_dir = os.path.join(_env("DIR"), "output")
        if not torch.accelerator.is_available() and not self.use_cpu:
            self.use_cpu = True
            subs.append("use_cpu=True (no accelerator: every rank on the CPU, gloo)")
        if _strategy(self.save_strategy) == "steps":
            self.save_steps = steps
        if _strategy(getattr(self, "eval_strategy", "no")) == "steps":
            self.eval_steps = steps
        if getattr(self, "fp16", False):
            self.fp16, self.bf16 = False, True
            subs.append("fp16 -> bf16 (no fp16 autocast on the CPU)")
        if getattr(self, "torch_compile", False):
            self.torch_compile = False
            subs.append("torch_compile off (compiles for minutes on the CPU; the collectives are the same)")
        self.report_to = "none"
        self.push_to_hub = False
        self.ddp_timeout = max(60, int(4 * float(_env("HANG_S", "20"))))
        note("training_args", {"asked": asked, "max_steps": self.max_steps, "substitutions": subs})
        return inner(self, *args, **kwargs)

    __post_init__._hf_ddpfix_rehearse = True  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__


#: Batch keys that carry images / video / audio: the skewed rank's batches lose them.
_MEDIA = re.compile(r"pixel|image|video|audio|aspect_ratio|cross_attention_mask|grid_thw|second_per_grid|"
                    r"input_features|feature_attention")


def _media_token_ids(config: Any) -> set[int]:
    out: set[int] = set()
    for cfg in [config, *[v for v in vars(config).values() if hasattr(v, "to_dict")]]:
        for key, value in vars(cfg).items():
            if isinstance(value, int) and not isinstance(value, bool) and (
                    key.endswith("token_id") or key.endswith("token_index")) and \
                    re.search(r"image|video|vision|boi|eoi|audio|media", key):
                out.add(value)
    return out


def skew_batch(batch: dict[str, Any], media_ids: set[int], pad_id: int) -> dict[str, Any]:
    """The skewed rank's batch: no media inputs (their placeholder tokens become ``pad_id``) and, where the labels
    allow, only the last half of every sequence (unequal lengths across ranks).

    Guarantees: keys not about media keep their type; a batch whose last half has no label left keeps its length.
    """
    import torch

    out = {k: v for k, v in batch.items() if not _MEDIA.search(k)}
    ids = out.get("input_ids")
    if isinstance(ids, torch.Tensor) and media_ids:
        mask = torch.isin(ids, torch.tensor(sorted(media_ids), dtype=ids.dtype))
        out["input_ids"] = ids.masked_fill(mask, pad_id)
    for key in ("mm_token_type_ids", "token_type_ids"):
        if isinstance(out.get(key), torch.Tensor):
            out[key] = torch.zeros_like(out[key])
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] >= 8:
        n = ids.shape[1]
        keep = n - n // 2
        labels = out.get("labels")
        if not isinstance(labels, torch.Tensor) or bool((labels[:, -keep:] != -100).any()):
            for key, value in list(out.items()):
                if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == n:
                    out[key] = value[:, -keep:]
    return out


def _cap_eval(dataset: Any, rows: int) -> Any:
    if dataset is None:
        return None
    if isinstance(dataset, dict):
        return {k: _cap_eval(v, rows) for k, v in dataset.items()}
    try:
        n = len(dataset)
    except TypeError:
        return dataset  # an iterable dataset: the rehearsal cannot cut it
    if n <= rows:
        return dataset
    if hasattr(dataset, "select"):
        return dataset.select(range(rows))
    import torch

    return torch.utils.data.Subset(dataset, list(range(rows)))


def _rehearsal_callback(trainer: Any) -> Any:
    from transformers import TrainerCallback

    class RehearsalCallback(TrainerCallback):
        """Records what the Trainer ran; checks replicas at the end (hf_ddpfix's ReplicaSyncCallback.check)."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            from .._compat.models import unwrap_model

            acc = getattr(trainer, "accelerator", None)
            mode = str(getattr(getattr(acc, "state", None), "distributed_type", "?")).split(".")[-1]
            inner = unwrap_model(trainer.model)
            trainable = [(n, tuple(getattr(p, "ds_shape", p.shape)))  # ZeRO-3 partitions: ds_shape is the whole
                         for n, p in inner.named_parameters() if p.requires_grad]
            units = 0
            try:
                from torch.distributed.fsdp import FSDPModule

                units = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
            except ImportError:  # pragma: no cover
                pass
            stage = None
            if getattr(trainer, "is_deepspeed_enabled", False):
                plugin = getattr(acc.state, "deepspeed_plugin", None)
                stage = getattr(plugin, "zero_stage", None)
            plan = getattr(trainer, "hf_ddpfix_plan", None)
            note("train", {"mode": mode, "fsdp": bool(getattr(trainer, "is_fsdp_enabled", False)),
                           "zero_stage": stage, "world": args.world_size, "trainer": type(trainer).__name__,
                           "model": type(inner).__name__, "fsdp_units": units,
                           "trainable": [[n, list(s)] for n, s in trainable],
                           "trainable_params": sum(_numel(s) for _, s in trainable),
                           "plan": plan.report().splitlines() if plan is not None else None,
                           "hf_ddpfix": plan is not None, "started": time.time()})

        def on_step_end(self, args, state, control, **kwargs):
            note("steps", state.global_step)

        def on_save(self, args, state, control, **kwargs):
            note("saved", os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), append=True)

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            note("evaluated", sorted((metrics or {}).keys())[:12], append=True)

        def on_predict(self, args, state, control, metrics=None, **kwargs):
            note("predicted", sorted((metrics or {}).keys())[:12], append=True)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            from ..runtime.feature_report import feature_metrics

            counters = {k: v for k, v in feature_metrics().items() if v}
            note("features", counters)
            sharded = bool(getattr(trainer, "is_fsdp_enabled", False)) or (
                _record.get("train", {}).get("zero_stage") == 3)
            if args.world_size <= 1:
                note("replicas", "one process: nothing to compare")
            elif sharded:
                note("replicas", "sharded (FSDP / ZeRO-3 keep one copy of each parameter): nothing to compare")
            elif model is not None:
                from ..callbacks import ReplicaSyncCallback
                from ..runtime.errors import ReplicaDivergenceError

                try:
                    ReplicaSyncCallback(every_n_steps=1).check(model, state.global_step)
                except ReplicaDivergenceError as e:
                    note("replicas", f"DIVERGED: {str(e)[:600]}")
                    raise
                note("replicas", f"in sync at step {state.global_step} (checksums of every trainable parameter, "
                                 "all ranks)")
            note("train_done", state.global_step)

    return RehearsalCallback()


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _patch_trainer(module: Any) -> None:
    cls = module.Trainer
    init, train = cls.__init__, cls.train
    if getattr(init, "_hf_ddpfix_rehearse", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if _env("STOCK") != "1" and not getattr(cls, "_hf_ddpfix_rehearse_patched", False):
            # hf_ddpfix on every Trainer, as patches/ does (a script's own patch_trainer() call only sets options);
            # here, not at import: the script may be importing hf_ddpfix.trainer itself right then
            cls._hf_ddpfix_rehearse_patched = True
            from ..trainer import is_patched, patch_trainer

            if not is_patched():
                patch_trainer()
        init(self, *args, **kwargs)
        if type(self).__init__ is not cls.__init__ and getattr(self, "_hf_ddpfix_rehearse_ready", False):
            return
        self._hf_ddpfix_rehearse_ready = True
        self.add_callback(_rehearsal_callback(self))
        rows = 2 * self.args.per_device_eval_batch_size * max(1, self.args.world_size)
        self.eval_dataset = _cap_eval(self.eval_dataset, rows)
        if _env("SKEW") == "1" and _world() > 1 and _rank() == _world() - 1 and self.data_collator is not None:
            config = getattr(getattr(self, "model", None), "config", None)
            media = _media_token_ids(config) if config is not None else set()
            tok = getattr(self, "processing_class", None)
            tok = getattr(tok, "tokenizer", tok)
            pad = getattr(tok, "pad_token_id", None)
            pad = pad if pad is not None else getattr(getattr(config, "get_text_config", lambda: config)(),
                                                       "pad_token_id", None) or 0
            collate = self.data_collator

            def skewed(features):
                return skew_batch(collate(features), media, int(pad))

            self.data_collator = skewed
            note("skew", {"rank": _rank(), "media_token_ids": sorted(media), "pad_id": int(pad)})

    @functools.wraps(train)
    def train_(self, resume_from_checkpoint=None, *args, **kwargs):
        resume = _env("RESUME")
        if resume:
            resume_from_checkpoint = resume
            note("resumed_from", resume)
        return train(self, resume_from_checkpoint, *args, **kwargs)

    __init__._hf_ddpfix_rehearse = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    cls.train = train_


def _patch_hf_ddpfix_trainer(module: Any) -> None:
    """``--stock``: ``patch_trainer()`` called by the script installs nothing."""
    def patch_trainer(**options: Any) -> None:
        note("stock", f"patch_trainer({', '.join(f'{k}={v!r}' for k, v in options.items())}) called by the "
                      "script: not installed (--stock)")

    module.patch_trainer = patch_trainer
    pkg = sys.modules.get("hf_ddpfix")
    if pkg is not None and "patch_trainer" in vars(pkg):
        pkg.patch_trainer = patch_trainer


# --------------------------------------------------------------------------------------------------
# install
# --------------------------------------------------------------------------------------------------


def _excepthook(inner: Any) -> Any:
    def hook(exc_type, exc, tb):
        try:
            import traceback

            from .watchdog import collective_of, user_frames

            frames = [{"file": f.filename, "line": f.lineno, "func": f.name, "code": (f.line or "").strip()}
                      for f in traceback.extract_tb(tb)]
            name, issuer = collective_of(frames)
            note("error", {"type": exc_type.__name__, "message": str(exc)[:6000], "collective": name, "at": time.time(),
                           "issued_at": issuer, "user_frames": user_frames(frames), "stack": frames[-25:]})
        finally:
            inner(exc_type, exc, tb)

    return hook


def _patch_ddp(module: Any) -> None:
    """DETAIL + DDP crashes torch 2.13's DDP usage log on gloo (hf_ddpfix._compat.torch_internals): the shim is put
    in place when the first ``DistributedDataParallel`` is built (not now: this runs while ``import torch`` is still
    executing, where importing anything else of torch breaks its start-up)."""
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() != "DETAIL":
        return
    cls = module.DistributedDataParallel
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        from .._compat.torch_internals import ddp_logger_without_construction_log

        ddp_logger_without_construction_log(module.dist)
        init(self, *args, **kwargs)

    cls.__init__ = __init__


def _chained(*patches: Any) -> Any:
    def patch(module: Any) -> None:
        for p in patches:
            p(module)

    return patch


def _is_rank() -> bool:
    return "LOCAL_RANK" in os.environ or _env("SINGLE") == "1"


def install() -> None:
    """Install the rehearsal's hooks in this process (a no-op outside a rehearsal)."""
    directory = _env("DIR")
    if not directory or getattr(install, "_hf_ddpfix_done", False):
        return
    install._hf_ddpfix_done = True  # type: ignore[attr-defined]
    hooks: dict[str, Any] = {"transformers.modeling_utils": _patch_modeling,
                             "transformers.models.auto.auto_factory": _patch_auto,
                             "transformers.training_args": _patch_training_args,
                             "transformers.trainer": _patch_trainer, "peft.peft_model": _patch_peft,
                             "torch.nn.parallel.distributed": _patch_ddp,
                             "transformers.models.auto.tokenization_auto": _patch_tokenizer_auto,
                             "transformers.models.auto.processing_auto": _patch_processor_auto}
    if _env("STOCK") == "1":
        hooks["hf_ddpfix.trainer"] = _patch_hf_ddpfix_trainer
    rank = _is_rank()
    if rank:  # writes outside the rehearsal redirected into it (sandbox.py): installed before the script runs
        from . import sandbox
        from .saves import HOOKS

        sandbox.install(directory, _env("ROOT") or directory, HOOKS)
        for name, patch in HOOKS.items():
            hooks[name] = _chained(hooks[name], patch) if name in hooks else patch
    for name in list(hooks):
        if name in sys.modules:
            hooks.pop(name)(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport(hooks))
    if not rank:
        return
    _record.update({"rank": _rank(), "world": _world(), "pid": os.getpid(), "host_node": os.environ.get(
        "GROUP_RANK", os.environ.get("NODE_RANK", "0")), "argv": sys.argv[:12], "phase": _env("PHASE", "train")})
    _write()
    sys.excepthook = _excepthook(sys.excepthook)
    _tee_output(os.path.join(directory, f"rank{_rank()}.out"))
    atexit.register(lambda: note("exited", time.time()))
    from .watchdog import start

    start(directory, _rank(), float(_env("HANG_S", "20")))
