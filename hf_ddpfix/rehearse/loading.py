"""The shrunk ``from_pretrained`` of a rehearsal rank: models (``PreTrainedModel``, ``AutoModel*``, PEFT) built from
the checkpoint's config cut by :func:`hf_ddpfix.rehearse.shrink.shrink_config`, saved with seeded random weights and
loaded through the stock ``from_pretrained``; tokenizer / processor loads that cannot run offline named as a step.
Installed by :func:`hf_ddpfix.rehearse.inject.install`.

Guarantees: every substitution made is listed in the rank's record (:func:`hf_ddpfix.rehearse.record.note`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from typing import Any

from .record import ENV, RehearsalStepError, _env, _rank, _world, note  # noqa: F401
from .sandbox import resolve

_local = threading.local()

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
    import json

    from .._compat.models import auto_model_class
    from .shrink import shrink_config
    from .shrink_check import repair_shrunk, shrink_checked

    model_cls = auto_model_class(cls, config) if cls.__name__.startswith("AutoModel") else cls
    if model_cls is None:
        raise RehearsalStepError(f"rehearse, step 'shrink the model': {cls.__name__} has no model class for "
                                 f"{type(config).__name__}")
    shrunk = repair_shrunk(shrink_config(config), model_cls)
    key = hashlib.sha1(f"{model_cls.__name__}{config.to_json_string()}".encode()).hexdigest()[:12]
    folder = os.path.join(_env("DIR"), "models", f"{model_cls.__name__}-{key}-rank{_rank()}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        try:  # built, seeded and run with and without an image; a copy with the tower's widths kept if that fails
            checked = shrink_checked(config, model_cls, seed=0)
            shrunk, model = checked.shrunk, checked.model
            model.save_pretrained(folder)
            with open(os.path.join(folder, "hf_ddpfix_shrink.json"), "w") as f:
                json.dump(shrunk.lines, f)
        except Exception as e:  # noqa: BLE001 - reported with the step's name
            raise RehearsalStepError(
                f"rehearse, step 'build the shrunk model' ({model_cls.__name__} from {name!r}): "
                f"{type(e).__name__}: {str(e)[:400]}. Shrunk fields: {'; '.join(shrunk.lines) or 'none'}. "
                "Rehearse at full size with --no-shrink (slow), or report the config.") from e
        del model
    else:
        try:
            with open(os.path.join(folder, "hf_ddpfix_shrink.json")) as f:
                shrunk.lines = list(json.load(f))
        except (OSError, ValueError):
            pass
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
    name = resolve(name)  # a folder the script saved earlier in this rehearsal: its redirected copy
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
    from .memory import carry_over  # the real-size plan's size-dependent choices, forced on the shrunk run

    carry_over(config, model_cls, asked_dtype)
    _local.inside = True
    try:
        return inner(cls, folder, *args, **kwargs)
    finally:
        _local.inside = False


def _wrap_classmethod(owner: Any, name: str, wrapper: Any) -> None:
    raw = owner.__dict__[name]
    if getattr(raw, "_hf_ddpfix_rehearse", False):
        return
    inner = raw.__func__

    @functools.wraps(inner)
    def method(cls, *args, **kwargs):
        return wrapper(inner, cls, *args, **kwargs)

    wrapped = classmethod(method)
    wrapped._hf_ddpfix_rehearse = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)


def _patch_modeling(module: Any) -> None:
    _wrap_classmethod(module.PreTrainedModel, "from_pretrained", _from_pretrained)


def _patch_auto(module: Any) -> None:
    from .._compat.models import auto_model_base

    _wrap_classmethod(auto_model_base(module), "from_pretrained", _from_pretrained)


def _patch_peft(module: Any) -> None:
    """``PeftModel.from_pretrained(model, adapter)``: the adapter's config on the shrunk model, random adapter
    weights (the real adapter's tensors have the real shapes)."""
    cls = module.PeftModel
    raw = cls.__dict__["from_pretrained"]
    inner = raw.__func__

    def from_pretrained(klass, model, model_id, adapter_name="default", is_trainable=False, config=None, **kw):
        model_id = resolve(model_id)
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
        name = resolve(name)
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
