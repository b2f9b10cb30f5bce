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
- the watchdog (:mod:`hf_ddpfix.rehearse.watchdog`) and an exception hook that writes the failing frames.

Each rank writes ``<dir>/rank<R>.json`` (rewritten as the run goes). Environment (set by the driver):
``DDPFIX_REHEARSE_DIR``, ``_STEPS``, ``_SKEW``, ``_STOCK``, ``_SHRINK``, ``_HANG_S``, ``_RESUME``.

Guarantees: outside a rehearsal (``DDPFIX_REHEARSE_DIR`` unset) :func:`install` does nothing; every substitution
made is listed in the rank's record.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.abc
import importlib.util
import json
import os
import re
import sys
import threading
import time
from typing import Any

__all__ = ["install", "skew_batch", "RehearsalStepError"]

ENV = "DDPFIX_REHEARSE_"
_local = threading.local()


class RehearsalStepError(RuntimeError):
    """A step of the rehearsal that cannot run here; the message names the step and what to do."""


def _env(name: str, default: str = "") -> str:
    return os.environ.get(ENV + name, default)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# --------------------------------------------------------------------------------------------------
# The rank's record
# --------------------------------------------------------------------------------------------------

_record: dict[str, Any] = {}
_lock = threading.Lock()


def note(key: str, value: Any, append: bool = False) -> None:
    """Set (or append to) ``key`` in this rank's record and write it."""
    with _lock:
        if append:
            _record.setdefault(key, []).append(value)
        else:
            _record[key] = value
        _write()


def _write() -> None:
    directory = _env("DIR")
    if not directory:
        return
    path = os.path.join(directory, f"rank{_rank()}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(_record, f, indent=1, default=str)
        os.replace(tmp, path)
    except OSError:  # pragma: no cover - the folder was removed under us
        pass


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


# --------------------------------------------------------------------------------------------------
# The shrunk from_pretrained
# --------------------------------------------------------------------------------------------------

_CUDA_ONLY_ATTN = ("flash_attention_2", "flash_attention_3", "flex_attention")


def _config_for(cls: Any, name: Any, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    config = kwargs.get("config")
    if isinstance(config, PretrainedConfig):
        return config
    source = config if isinstance(config, str | os.PathLike) else name
    keys = ("revision", "subfolder", "token", "trust_remote_code", "cache_dir", "local_files_only")
    try:
        return AutoConfig.from_pretrained(source, **{k: kwargs[k] for k in keys if k in kwargs})
    except Exception as e:  # noqa: BLE001 - reported with the step's name
        raise RehearsalStepError(
            f"rehearse, step 'load the model config' ({cls.__name__}.from_pretrained({source!r})): "
            f"{type(e).__name__}: {str(e)[:400]}. The rehearsal needs only config.json: give the script a local "
            "folder that has it (`AutoConfig.from_pretrained(id).save_pretrained(dir)` on a machine online), or put "
            "the Hub id in the local cache.") from e


def _shrunk_dir(cls: Any, name: Any, config: Any) -> tuple[str, list[str], Any]:
    """Build, seed and save the shrunk model once per (class, config) in this rank; return its folder."""
    import torch

    from .._compat.models import auto_model_class
    from .shrink import shrink_config

    shrunk = shrink_config(config)
    model_cls = auto_model_class(cls, config) if cls.__name__.startswith("AutoModel") else cls
    if model_cls is None:
        raise RehearsalStepError(f"rehearse, step 'shrink the model': {cls.__name__} has no model class for "
                                 f"{type(config).__name__}")
    key = hashlib.sha1(f"{model_cls.__name__}{shrunk.config.to_json_string()}".encode()).hexdigest()[:12]
    folder = os.path.join(_env("DIR"), "models", f"{model_cls.__name__}-{key}-rank{_rank()}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = model_cls(shrunk.config)
            model.save_pretrained(folder)
        except Exception as e:  # noqa: BLE001 - reported with the step's name
            raise RehearsalStepError(
                f"rehearse, step 'build the shrunk model' ({model_cls.__name__} from {name!r}): "
                f"{type(e).__name__}: {str(e)[:400]}. Shrunk fields: {'; '.join(shrunk.lines) or 'none'}. "
                "Rehearse at full size with --no-shrink (slow), or report the config.") from e
        del model
    return folder, shrunk.lines, model_cls


def _substitute(kwargs: dict[str, Any], subs: list[str]) -> None:
    import torch

    for key in ("dtype", "torch_dtype"):
        value = kwargs.get(key)
        if value is not None and value not in (torch.float32, "float32", "auto"):
            subs.append(f"{key}={value} -> float32 (random weights in fp32 on the CPU)")
            kwargs[key] = torch.float32
        elif value == "auto":
            kwargs[key] = torch.float32
    device_map = kwargs.get("device_map")
    if device_map is not None and device_map != "cpu" and not torch.accelerator.is_available():
        subs.append(f"device_map={device_map!r} -> 'cpu' (no accelerator here)")
        kwargs["device_map"] = "cpu"
    attn = kwargs.get("attn_implementation")
    if isinstance(attn, str) and (attn in _CUDA_ONLY_ATTN or "/" in attn):
        subs.append(f"attn_implementation={attn!r} -> 'sdpa' (a CUDA-only kernel; the collectives do not depend on "
                    "it)")
        kwargs["attn_implementation"] = "sdpa"


def _from_pretrained(inner: Any, cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
    if getattr(_local, "inside", False) or _env("SHRINK", "1") == "0":
        if _env("SHRINK", "1") == "0" and not getattr(_local, "inside", False):
            subs: list[str] = []
            _substitute(kwargs, subs)
            note("models", {"name": str(name), "class": cls.__name__, "shrunk": False, "substitutions": subs},
                 append=True)
        return inner(cls, name, *args, **kwargs)
    if kwargs.get("gguf_file"):
        raise RehearsalStepError("rehearse, step 'shrink the model': GGUF checkpoints are not rehearsed")
    config = _config_for(cls, name, kwargs)
    folder, lines, model_cls = _shrunk_dir(cls, name, config)
    subs = []
    asked_dtype = str(kwargs.get("dtype") or kwargs.get("torch_dtype") or "")  # the real run's weights
    _substitute(kwargs, subs)
    for key in ("config", "revision", "subfolder", "gguf_file", "cache_dir", "local_files_only", "token"):
        kwargs.pop(key, None)
    note("models", {"name": str(name), "class": cls.__name__, "model_class": model_cls.__name__,
                    "config_class": type(config).__name__, "real_config": config.to_dict(), "shrunk": True,
                    "shrink": lines, "substitutions": subs, "dtype": asked_dtype,
                    "quantized": kwargs.get("quantization_config") is not None}, append=True)
    _local.inside = True
    try:
        return inner(cls, folder, *args, **kwargs)
    finally:
        _local.inside = False


def _wrap_classmethod(owner: Any, name: str, wrapper: Any) -> None:
    raw = owner.__dict__[name]
    if getattr(raw, "_rehearse", False):
        return
    inner = raw.__func__

    @functools.wraps(inner)
    def method(cls, *args, **kwargs):
        return wrapper(inner, cls, *args, **kwargs)

    wrapped = classmethod(method)
    wrapped._rehearse = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)


def _patch_modeling(module: Any) -> None:
    _wrap_classmethod(module.PreTrainedModel, "from_pretrained", _from_pretrained)


def _patch_auto(module: Any) -> None:
    _wrap_classmethod(module._BaseAutoModelClass, "from_pretrained", _from_pretrained)


def _patch_peft(module: Any) -> None:
    """``PeftModel.from_pretrained(model, adapter)``: the adapter's config on the shrunk model, random adapter
    weights (the real adapter's tensors have the real shapes)."""
    cls = module.PeftModel
    raw = cls.__dict__["from_pretrained"]
    inner = raw.__func__

    def from_pretrained(klass, model, model_id, adapter_name="default", is_trainable=False, config=None, **kw):
        if _env("SHRINK", "1") == "0":
            return inner(klass, model, model_id, adapter_name, is_trainable, config, **kw)
        from peft import PeftConfig, get_peft_model

        try:
            cfg = config or PeftConfig.from_pretrained(model_id, **{k: kw[k] for k in ("revision", "subfolder",
                                                                                          "token") if k in kw})
        except Exception as e:  # noqa: BLE001 - reported with the step's name
            raise RehearsalStepError(f"rehearse, step 'load the adapter config' (PeftModel.from_pretrained("
                                     f"{model_id!r})): {type(e).__name__}: {str(e)[:300]}") from e
        cfg.inference_mode = not is_trainable
        peft_model = get_peft_model(model, cfg, adapter_name=adapter_name)
        if not is_trainable:
            for n, p in peft_model.named_parameters():
                if adapter_name in n:
                    p.requires_grad_(False)
        note("adapters", {"name": str(model_id), "trainable": is_trainable, "note": "random adapter weights "
                          "(the saved ones have the real model's shapes)"}, append=True)
        return peft_model

    cls.from_pretrained = classmethod(from_pretrained)


def _named_step(step: str) -> Any:
    """A ``from_pretrained`` wrapper that names ``step`` when loading fails (e.g. a Hub id offline)."""

    def wrapper(inner: Any, cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return inner(cls, name, *args, **kwargs)
        except (OSError, ValueError) as e:
            raise RehearsalStepError(
                f"rehearse, step '{step}' ({cls.__name__}.from_pretrained({name!r})): {type(e).__name__}: "
                f"{str(e)[:300]}. The rehearsal loads tokenizers and processors as the script asks (they are small): "
                "run it where the Hub is reachable once (the files are cached), or point the script at a local "
                "copy.") from e

    return wrapper


def _patch_tokenizer_auto(module: Any) -> None:
    _wrap_classmethod(module.AutoTokenizer, "from_pretrained", _named_step("load the tokenizer"))


def _patch_processor_auto(module: Any) -> None:
    _wrap_classmethod(module.AutoProcessor, "from_pretrained", _named_step("load the processor"))


# --------------------------------------------------------------------------------------------------
# TrainingArguments and Trainer
# --------------------------------------------------------------------------------------------------


def _strategy(value: Any) -> str:
    return str(getattr(value, "value", value) or "no").lower()


def _patch_training_args(module: Any) -> None:
    cls = module.TrainingArguments
    inner = cls.__post_init__
    if getattr(inner, "_rehearse", False):
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

    __post_init__._rehearse = True  # type: ignore[attr-defined]
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
            from ..feature_report import feature_metrics

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
                from ..errors import ReplicaDivergenceError

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
    if getattr(init, "_rehearse", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if _env("STOCK") != "1" and not getattr(cls, "_rehearse_patched", False):
            # hf_ddpfix on every Trainer, as patches/ does (a script's own patch_trainer() call only sets options);
            # here, not at import: the script may be importing hf_ddpfix.trainer itself right then
            cls._rehearse_patched = True
            from ..trainer import is_patched, patch_trainer

            if not is_patched():
                patch_trainer()
        init(self, *args, **kwargs)
        if type(self).__init__ is not cls.__init__ and getattr(self, "_rehearse_ready", False):
            return
        self._rehearse_ready = True
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

    __init__._rehearse = True  # type: ignore[attr-defined]
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


def _is_rank() -> bool:
    return "LOCAL_RANK" in os.environ or _env("SINGLE") == "1"


def install() -> None:
    """Install the rehearsal's hooks in this process (a no-op outside a rehearsal)."""
    directory = _env("DIR")
    if not directory or getattr(install, "_done", False):
        return
    install._done = True  # type: ignore[attr-defined]
    hooks: dict[str, Any] = {"transformers.modeling_utils": _patch_modeling,
                             "transformers.models.auto.auto_factory": _patch_auto,
                             "transformers.training_args": _patch_training_args,
                             "transformers.trainer": _patch_trainer, "peft.peft_model": _patch_peft,
                             "torch.nn.parallel.distributed": _patch_ddp,
                             "transformers.models.auto.tokenization_auto": _patch_tokenizer_auto,
                             "transformers.models.auto.processing_auto": _patch_processor_auto}
    if _env("STOCK") == "1":
        hooks["hf_ddpfix.trainer"] = _patch_hf_ddpfix_trainer
    for name in list(hooks):
        if name in sys.modules:
            hooks.pop(name)(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport(hooks))
    if not _is_rank():
        return
    _record.update({"rank": _rank(), "world": _world(), "pid": os.getpid(), "host_node": os.environ.get(
        "GROUP_RANK", os.environ.get("NODE_RANK", "0")), "argv": sys.argv[:12], "phase": _env("PHASE", "train")})
    _write()
    sys.excepthook = _excepthook(sys.excepthook)
    atexit.register(lambda: note("exited", time.time()))
    from .watchdog import start

    start(directory, _rank(), float(_env("HANG_S", "20")))
