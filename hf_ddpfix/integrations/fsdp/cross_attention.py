"""The dummy for cross-attention VLMs (Mllama / Llama-3.2-Vision) under FSDP2 with the tower and the
cross-attention decoder layers as units of their own (``fsdp_skippable = shard``).

Why: on a rank whose batch has no image, Mllama skips the vision model, the projector and every cross-attention
decoder layer (transformers 5.23 ``MllamaTextModel.forward``: ``continue`` when ``cross_attention_states`` is
``None`` and nothing is cached). With those as FSDP2 units, ranks all-gather different units: a gloo size
mismatch, an NCCL hang.

What it does: a forward pre-hook on the language model (where an image rank's model has just run its tower and
projector) on a rank called without ``cross_attention_states``:

- runs a dummy image (zeros, one image of ``max_num_tiles`` tiles, aspect ratio id 1) through the vision model
  and the projector, as the model does;
- passes ``cross_attention_states = 0 * features`` and ``full_text_row_masked_out_mask = 0``, so every
  cross-attention decoder layer runs at its own place in the layer order (its own units, in the same order as
  an image rank), with an **exactly zero** contribution: keys and values of zero states are zero (no bias in
  ``k_proj`` / ``v_proj`` / ``o_proj``, LoRA of zero is zero), so the attention adds ``gate * 0``; the MLP is
  multiplied by the zero row mask. Gradients: the cross layers' and the tower's are exactly zero, the hidden
  stream's are stock's (every path through a cross layer carries an exact zero).

During ``generate()`` a text rank's prefill caches zero keys/values; its decode steps (cross-attention states
cached, so the model runs the cross layers from the cache, as on an image rank) get the zero row mask again.

Optimizer semantics: as :class:`~hf_ddpfix.integrations.fsdp.dummy.FsdpDummy` — in a step where no rank passed
an image, :meth:`finalize` resets the tower's, the projector's and the cross layers' gradients to ``None``
(stock DDP ``find_unused_parameters=True``: those parameters went unused, AdamW skips them, no weight decay).

Guarantees (tests/test_fsdp_skippable.py): the logits of a text-only forward equal stock's bit for bit with the
dummy attached (``test_cross_attention_dummy_is_exactly_zero``); through the FSDP test device, Mllama with
tower and cross-attention units trains, evaluates and predicts like stock DDP with mixed and all-text steps
(``test_tower_units_with_the_dummy_like_stock_ddp``).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn

from ..._compat import passed_cache, unwrap_model
from ..vision.parts import get_submodule, vlm_parts
from .grad_reset import StepImages

__all__ = ["CrossAttentionDummy", "cross_attention_parts", "kept_cross_attention_dummy", "nonzero_contribution"]

_KEPT = "_hf_ddpfix_cross_attention_dummy"
#: the keywords the dummy calls the tower with (:meth:`CrossAttentionDummy._features`; Mllama, transformers 5.23)
_TOWER_INPUTS = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")


def cross_attention_parts(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module] | None:
    """``(root, tower, projector, language_model)`` of a cross-attention VLM, or ``None``: the parts
    :func:`~hf_ddpfix.integrations.vision.parts.vlm_parts` finds when its features enter by cross-attention (the
    language model lists ``cross_attention_layers``: Mllama's ``model.vision_model``, ``model.multi_modal_projector``,
    ``model.language_model``) and it has a tower that takes the inputs the dummy passes (Mllama's
    ``pixel_values`` / ``aspect_ratio_ids`` / ``aspect_ratio_mask``) and a projector; ``root`` is the module holding
    the language model (Mllama's ``model``: its forward takes the pixels and runs the tower)."""
    hf = unwrap_model(model)
    parts = vlm_parts(hf)
    if parts.entry != "cross_attention" or parts.tower is None or parts.projector is None:
        return None
    lm_path = str(parts.language_model)
    owner = get_submodule(hf, lm_path.rpartition(".")[0]) if "." in lm_path else hf
    tower, projector, lm = (get_submodule(hf, p) for p in (parts.tower, parts.projector, lm_path))
    if owner is None or tower is None or projector is None or lm is None:
        return None
    if not set(_TOWER_INPUTS) <= set(inspect.signature(tower.forward).parameters):
        return None
    return owner, tower, projector, lm


def nonzero_contribution(language_model: nn.Module) -> str:
    """Why zero cross-attention states would NOT add exactly zero through ``language_model``'s cross-attention
    layers, or ``""``: a value or output projection with a bias (``v_proj(0)`` / ``o_proj(0)`` would not be 0).
    The plan folds such a model instead of running the dummy (checked on the model as loaded)."""
    layers = getattr(language_model, "layers", [])
    for i in getattr(language_model, "cross_attention_layers", []):
        if i >= len(layers):
            continue
        for name, mod in layers[i].named_modules():
            if name.rsplit(".", 1)[-1] in ("v_proj", "o_proj") and getattr(mod, "bias", None) is not None:
                return f"cross-attention {name.rsplit('.', 1)[-1]} has a bias (zero states add non-zero)"
    return ""


def _vision_config(vision: nn.Module) -> Any:
    return getattr(vision, "config", None)


def dummy_tokens(vision: nn.Module) -> int:
    """Tokens the dummy image runs through the tower: ``num_patches`` per tile times ``max_num_tiles``."""
    vc = _vision_config(vision)
    tiles = int(getattr(vc, "max_num_tiles", 1) or 1)
    patches = getattr(vision, "num_patches", None)
    if patches is None:
        size, patch = int(getattr(vc, "image_size", 224)), int(getattr(vc, "patch_size", 14))
        patches = (size // patch) ** 2 + 1
    return int(patches) * tiles


class CrossAttentionDummy(StepImages):
    """Runs the tower, the projector and every cross-attention layer on a rank without an image.

    Args:
        model: the HF model (or a PeftModel / wrapper), before or after accelerate wraps it.

    Raises:
        ValueError: the model is no cross-attention VLM (:func:`cross_attention_parts`).
    """

    def __init__(self, model: nn.Module, *, process_group: Any = None) -> None:
        parts = cross_attention_parts(model)
        if parts is None:
            raise ValueError(f"{type(unwrap_model(model)).__name__}: no vision tower / projector / language model "
                             "with cross_attention_layers")
        self.root, self.vision, self.projector, self.language_model = parts
        self.process_group = process_group
        self.dummy_runs = 0
        self._handles: list[Any] = []
        self._caches: weakref.WeakSet[Any] = weakref.WeakSet()
        self._step_images = False
        self._step_forwards = 0

    def attach(self) -> CrossAttentionDummy:
        """Register the hooks (idempotent)."""
        if not self._handles:
            self._handles = [
                self.language_model.register_forward_pre_hook(self._inject, with_kwargs=True),
                self.root.register_forward_pre_hook(self._record, with_kwargs=True),
            ]
        return self

    def remove(self) -> None:
        """Remove the hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._step_images, self._step_forwards = False, 0

    def parts(self) -> list[nn.Module]:
        """The modules a text-only forward skips: the tower, the projector, the cross-attention layers."""
        layers = getattr(self.language_model, "layers", [])
        cross = [layers[i] for i in self.language_model.cross_attention_layers if i < len(layers)]
        return [self.vision, self.projector, *cross]

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module.training and torch.is_grad_enabled():
            self._step_forwards += 1
            pixels = kwargs.get("pixel_values", args[1] if len(args) > 1 else None)
            states = kwargs.get("cross_attention_states")
            self._step_images = self._step_images or pixels is not None or states is not None

    def _features(self, batch: int) -> torch.Tensor:
        vc = _vision_config(self.vision)
        tiles = int(getattr(vc, "max_num_tiles", 1) or 1)
        size = int(getattr(vc, "image_size", 224))
        channels = int(getattr(vc, "num_channels", 3))
        p = next(self.vision.parameters())
        device = p.device if p.device.type != "meta" else torch.device("cpu")
        pixels = torch.zeros(1, 1, tiles, channels, size, size, dtype=p.dtype, device=device)
        ids = torch.ones(1, 1, dtype=torch.long, device=device)
        mask = torch.zeros(1, 1, tiles, dtype=torch.long, device=device)
        mask[..., 0] = 1
        out = self.vision(pixel_values=pixels, aspect_ratio_ids=ids, aspect_ratio_mask=mask).last_hidden_state
        out = self.projector(out)
        hidden = out.shape[-1]
        out = out.reshape(-1, out.shape[-2], hidden) * 0  # exactly zero, still tied to the tower's graph
        self.dummy_runs += 1
        return out.reshape(1, -1, hidden).expand(batch, -1, -1)

    def _inject(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs.get("cross_attention_states") is not None:
            return None
        ref = kwargs.get("input_ids", args[0] if args else None)
        if ref is None:
            ref = kwargs.get("inputs_embeds")
        if ref is None:
            return None
        cache = passed_cache(kwargs)  # `cache=` from transformers 5.24, `past_key_values=` before
        seen = int(cache.get_seq_length()) if cache is not None else 0
        batch, seq = ref.shape[0], ref.shape[1]
        rows = torch.zeros(batch, 1, seq, 1, dtype=next(self.language_model.parameters()).dtype, device=ref.device)
        new = dict(kwargs)
        if seen == 0:  # training, evaluation, a prefill: the tower runs here on an image rank
            new["cross_attention_states"] = self._features(batch).to(rows.device)
            if cache is not None:
                self._caches.add(cache)
        elif cache in self._caches:  # a decode step after our prefill: zero keys/values cached; mask the MLP
            pass
        else:  # an image rank's decode step (the model runs the cross layers from its cache)
            return None
        new["cross_attention_mask"] = None
        new["full_text_row_masked_out_mask"] = rows
        return args, new

    def _reset_modules(self) -> list[nn.Module]:
        return self.parts()

    def finalize(self) -> bool | None:
        """Before clipping, once per optimizer step: where no rank passed an image in any micro-batch, every
        gradient of :meth:`parts` becomes ``None``. Returns whether some rank saw an image; ``None`` (no
        collective) when no training forward ran since the last call. The flag rides in the usage agreement where
        :meth:`fold_into` was called (:class:`.grad_reset.StepImages`)."""
        return self.finalize_step()


def keep_cross_attention_dummy(model: nn.Module) -> CrossAttentionDummy | None:
    """After ``train()``: leave a dummy attached (one per model, idempotent), so ``evaluate()``, ``predict()``
    and ``generate()`` on the sharded model run the same units on every rank. It changes no output (exact
    zeros). ``None`` for a model that is no cross-attention VLM."""
    try:
        dummy = CrossAttentionDummy(model)
    except ValueError:
        return None
    kept = getattr(dummy.root, _KEPT, None)
    if kept is not None:
        return kept
    dummy.attach()
    setattr(dummy.root, _KEPT, dummy)
    return dummy


def kept_cross_attention_dummy(model: nn.Module) -> CrossAttentionDummy | None:
    """The dummy :func:`keep_cross_attention_dummy` left on ``model``, or ``None``."""
    parts = cross_attention_parts(model)
    return None if parts is None else getattr(parts[0], _KEPT, None)
