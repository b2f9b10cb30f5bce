"""Model-side contracts: wrapper unwrapping, transformers' per-layer checkpointing, the loss identity.

Part of the contract layer (:mod:`hf_ddpfix._compat`): torch-only at module level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn

# --------------------------------------------------------------------------------------------------
# Model wrappers
# --------------------------------------------------------------------------------------------------


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / DataParallel / FSDP1 / ``torch.compile`` (``_orig_mod``) / PEFT wrappers.

    The one unwrap helper of the package.

    Guarantees: ``unwrap_model(DataParallel(get_peft_model(m, cfg))) is m``
    (tests/test_upstream_contracts.py::test_unwrap_model_strips_compile_ddp_style_and_peft_wrappers).
    """
    seen: set[int] = set()
    cur = model
    while id(cur) not in seen:
        seen.add(id(cur))
        inner = getattr(cur, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, nn.Module):
            cur = inner
            continue
        inner = getattr(cur, "module", None)  # DDP, DataParallel, FSDP1, accelerate wrappers
        if isinstance(inner, nn.Module):
            cur = inner
            continue
        get_base = getattr(cur, "get_base_model", None)  # peft.PeftModel
        if callable(get_base):
            inner = get_base()
            if isinstance(inner, nn.Module) and inner is not cur:
                cur = inner
                continue
        break
    return cur


def unwrap_parallel(model: nn.Module) -> nn.Module:
    """Strip only DDP / DataParallel / ``torch.compile`` wrappers (a ``PeftModel`` stays)."""
    seen: set[int] = set()
    cur = model
    while id(cur) not in seen:
        seen.add(id(cur))
        inner = getattr(cur, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(cur, "module", None)
        if not isinstance(inner, nn.Module):
            break
        cur = inner
    return cur


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a transformers config selects (``"sdpa"``, ``"eager"``,
    ``"flash_attention_2"``, ...), or ``None`` (no config, or none chosen yet).

    Reads ``config._attn_implementation`` (transformers 5.0-5.24: a property over
    ``_attn_implementation_internal``, the value the attention modules dispatch on; there is no public
    attribute: ``attn_implementation`` is only a constructor keyword)."""
    return getattr(config, "_attn_implementation", None)


def model_attn_implementation(model: Any) -> str | None:
    """:func:`attn_implementation` of ``model.config`` (``None`` when the model has no config)."""
    return attn_implementation(getattr(model, "config", None))


def no_split_modules(model: nn.Module) -> list[str]:
    """The class names a transformers model says must not be split across devices / FSDP units
    (``PreTrainedModel._no_split_modules``, 5.x: decoder and vision blocks); empty when it names none. A set
    (Gemma 3, LLaVA) is returned sorted, so every process reads the same order whatever its hash seed."""
    declared = getattr(model, "_no_split_modules", None) or []
    return sorted(declared) if isinstance(declared, (set, frozenset)) else list(declared)


def is_namedtuple(obj: Any) -> bool:
    """True for an instance of a ``collections.namedtuple`` / ``typing.NamedTuple`` class (it has the
    ``_fields`` class attribute, the documented namedtuple marker): rebuilt with ``type(obj)(*items)``."""
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


# --------------------------------------------------------------------------------------------------
# transformers' per-layer checkpointing
# --------------------------------------------------------------------------------------------------

#: transformers' checkpointed layers (``GradientCheckpointingLayer``, 5.x) call
#: ``self._gradient_checkpointing_func(forward, *args, **kwargs)`` when ``self.gradient_checkpointing``.
CHECKPOINT_FUNC_ATTR = "_gradient_checkpointing_func"


def checkpointable_layers(model: nn.Module) -> Iterator[nn.Module]:
    """Every submodule transformers can checkpoint: it has a ``gradient_checkpointing`` flag and a
    checkpoint function (whether the flag is on is :func:`is_checkpointing`)."""
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing") and hasattr(module, CHECKPOINT_FUNC_ATTR):
            yield module


def is_checkpointing(layer: nn.Module) -> bool:
    """True when ``layer`` checkpoints its forward in training (its ``gradient_checkpointing`` flag)."""
    return bool(getattr(layer, "gradient_checkpointing", False))


def layer_checkpoint_func(layer: nn.Module) -> Callable[..., Any] | None:
    """The checkpoint function a checkpointed layer calls."""
    return getattr(layer, CHECKPOINT_FUNC_ATTR, None)


def set_layer_checkpoint_func(layer: nn.Module, func: Callable[..., Any]) -> None:
    """Make a checkpointed layer call ``func`` instead of its checkpoint function."""
    setattr(layer, CHECKPOINT_FUNC_ATTR, func)


#: The names a KV cache reaches a decoder layer (and a model) under, newest first: transformers 5.24
#: renamed ``past_key_values`` to ``cache`` (the old name stays a deprecated alias until 5.40); earlier
#: 5.x releases pass ``past_key_values``; ``past_key_value`` is the 4.x attention spelling.
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value")


def passed_cache(kwargs: Mapping[str, Any]) -> Any:
    """The KV cache a forward's keyword arguments pass, under any name of :data:`CACHE_KEYWORDS` (``cache=`` from
    transformers 5.24, ``past_key_values=`` before and as 5.24's deprecated alias); ``None`` when none is passed.
    A hook that reads the cache must read it with this, never by one name (tests/test_cache_keyword.py)."""
    return next((kwargs[k] for k in CACHE_KEYWORDS if kwargs.get(k) is not None), None)


def output_cache(outputs: Any) -> Any:
    """The KV cache a model output carries, under whichever name this release uses (``cache`` on 5.24,
    ``past_key_values`` before); ``None`` when it has none. Reads the fields without the deprecation
    warning 5.24's alias attribute logs."""
    for name in CACHE_KEYWORDS[:2]:
        if isinstance(outputs, dict) and name in outputs:
            return outputs[name]
    return None


def cache_output_field(output_cls: type) -> str | None:
    """The name of the KV-cache field of a ``ModelOutput`` dataclass (``cache`` from 5.24,
    ``past_key_values`` before), or ``None`` when it has none."""
    fields = getattr(output_cls, "__dataclass_fields__", {})
    return next((n for n in CACHE_KEYWORDS[:2] if n in fields), None)


def causal_lm_loss_function() -> Callable[..., Any]:
    """transformers' causal-LM loss (``transformers.loss.loss_utils.ForCausalLMLoss``, 5.x): a model whose
    ``loss_function`` is this object computes the stock shifted cross-entropy."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


def forward_source(cls: type) -> str:
    """Source text of ``cls.forward`` (the token-wise and loss-head detectors read its shape)."""
    import inspect
    import textwrap

    return textwrap.dedent(inspect.getsource(cls.forward))


# --------------------------------------------------------------------------------------------------
# Image features of vision-language models
# --------------------------------------------------------------------------------------------------


def output_field(out: Any, name: str) -> Any:
    """Field ``name`` of a model output, whether the release stored it as a ``ModelOutput`` key or only as
    an attribute; ``None`` when absent.

    transformers 5.0 (to at least 5.2) ``get_image_features`` assigns ``outputs.pooler_output = features``
    on the tower's output after the fact: on a ``BaseModelOutput`` (no such field) or one whose
    ``pooler_output`` was ``None``, ``ModelOutput.__setattr__`` keeps it as a plain attribute, not a key,
    so ``out.get("pooler_output")`` / ``out.keys()`` miss it while the model's own forward (which reads
    ``.pooler_output``) sees it. 5.23 / 5.24 return it as a key. Reads the attribute, then the key.
    """
    if not isinstance(out, dict):  # ModelOutput is an OrderedDict
        return None
    if out.get(name) is not None:
        return out[name]
    return getattr(out, name, None)


def image_features(out: Any) -> Any:
    """The projected image features a ``get_image_features(pixel_values=..., return_dict=True)`` call
    returned, as the model's forward uses them (a tensor, or one tensor per image), or ``None``.

    5.x: the output's ``pooler_output`` (:func:`output_field`: a key on 5.23 / 5.24, possibly only an
    attribute on 5.0). A bare tensor or a list / tuple of tensors (releases whose ``get_image_features``
    returns the features themselves) is the features.

    Guarantees: equal to ``get_image_features(...).pooler_output`` of the installed release
    (tests/test_upstream_contracts.py::test_image_features_reads_what_the_model_forward_uses).
    """
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (list, tuple)) and not isinstance(out, dict):
        return out if out and all(isinstance(t, torch.Tensor) for t in out) else None
    return output_field(out, "pooler_output")


# --------------------------------------------------------------------------------------------------
# Generation of vision-language models
# --------------------------------------------------------------------------------------------------

#: The keyword through which ``GenerationMixin.generate`` hands pre-encoded image features to ``forward``
#: (transformers 5.23 ``_prepare_multimodal_encoder_kwargs_for_generation``: the vision tower runs *before*
#: the prefill forward, via ``base_model.get_image_features``, on ranks that pass pixels only).
MM_ENCODER_OUTPUTS_KWARG = "mm_encoder_outputs"


def generate_pre_encodes_images(model: nn.Module) -> bool:
    """True when ``model.generate`` runs the vision tower before the prefill forward (the model's
    ``forward`` takes ``mm_encoder_outputs`` and its ``base_model`` has ``get_image_features``), as
    transformers 5.23 does; False where the tower runs inside the prefill forward (older versions)."""
    import inspect

    forward = getattr(model, "forward", None)
    if forward is None or MM_ENCODER_OUTPUTS_KWARG not in inspect.signature(forward).parameters:
        return False
    return callable(getattr(getattr(model, "base_model", None), "get_image_features", None))


# --------------------------------------------------------------------------------------------------
# Auto classes
# --------------------------------------------------------------------------------------------------


def auto_model_class(auto_cls: Any, config: Any) -> Any:
    """The concrete model class an ``AutoModel*`` class builds for ``config`` (its private ``_model_mapping``,
    transformers 5.0-5.24), or ``None`` when the auto class has no entry for the config's type.

    Guarantees: ``auto_model_class(AutoModelForCausalLM, LlamaConfig()) is LlamaForCausalLM``
    (tests/test_rehearse.py::test_auto_model_class_contract).
    """
    mapping = getattr(auto_cls, "_model_mapping", None)
    if mapping is None:
        return None
    try:
        found = mapping[type(config)]
    except KeyError:
        return None
    return found[0] if isinstance(found, list | tuple) else found


def auto_model_base(auto_module: Any) -> Any:
    """The base class of every ``AutoModel*`` class (``transformers.models.auto.auto_factory._BaseAutoModelClass``,
    transformers 5.0-5.24): patching its ``from_pretrained`` reaches every auto class at once.

    Guarantees: ``issubclass(AutoModelForCausalLM, auto_model_base(auto_factory))`` (tests/test_rehearse.py).
    """
    return auto_module._BaseAutoModelClass


def per_layer_overrides(config: Any) -> dict[int, dict[str, Any]] | None:
    """A heterogeneous config's per-layer overrides (transformers 5.23 ``config._heterogeneity_spec.
    per_layer_overrides``: ``{layer: {attribute: value}}``, e.g. Gemma 4's ``head_dim`` 512 on its full-attention
    layers beside a global 256), or ``None`` for a homogeneous config (and on releases without the feature).
    Read from ``vars(config)``: the global value of such an attribute raises on a plain ``getattr``."""
    spec = vars(config).get("_heterogeneity_spec")
    overrides = getattr(spec, "per_layer_overrides", None)
    return overrides if isinstance(overrides, dict) else None


def set_per_layer_overrides(config: Any, overrides: dict[int, dict[str, Any]]) -> None:
    """Replace the per-layer overrides :func:`per_layer_overrides` reads (in place; the spec keeps its other
    fields). A no-op on a homogeneous config."""
    import dataclasses

    spec = vars(config).get("_heterogeneity_spec")
    if spec is None:
        return
    try:
        spec.per_layer_overrides = overrides
    except dataclasses.FrozenInstanceError:
        vars(config)["_heterogeneity_spec"] = dataclasses.replace(spec, per_layer_overrides=overrides)
