"""The shrunk model, checked: :func:`~hf_ddpfix.rehearse.shrink.shrink_config`, then the relations only a built
model shows repaired, then the model built and run with and without an image.

What a built model shows that the config alone does not (both read on the meta device, no memory):

- **M-RoPE sections**: a rotary module holding ``mrope_section`` splits its ``inv_freq`` by it, so the sections
  must sum to ``inv_freq``'s length. Many configs carry no ``mrope_section`` and the module takes a default
  (Qwen2.5-VL ``[16, 24, 24]``, GLM-4V ``[8, 12, 12]``, transformers 5.23) that only fits the real head width:
  the shrunk config gets sections rescaled to its own rotary width.
- **token ids**: an image / video token id the batch carries must be a row of the input embedding (a stock
  default config may name ``image_token_index`` = ``vocab_size``: LLaVA's 32000); the vocabulary grows to hold it.

:func:`shrink_checked` then builds the model (seeded) and runs it on :func:`~hf_ddpfix.integrations.vision.sample.
sample_batch` without and with an image; where the fully cut model fails and a copy with the vision sub-configs'
widths kept (layers still cut) runs, that copy is used and the lines say why.

Guarantees: the returned config builds; ``Checked.text`` / ``Checked.image`` say whether the forward ran
(``"ok"``) or the error (tests/test_vlm_families.py, every family transformers ships).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .shrink import Shrunk, _rescale_sections, _subconfigs, shrink_config

__all__ = ["Checked", "repair_shrunk", "repaired_meta", "run_checks", "shrink_checked"]

#: above this many parameters (meta count) a fallback candidate is not built: a rehearsal model stays small
MAX_PARAMS = 150_000_000


@dataclass
class Checked:
    """A checked shrink: the config and its lines, the built model, and what ran (``"ok"`` or the error)."""

    shrunk: Shrunk
    model: Any = None
    text: str = ""
    image: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def runs(self) -> bool:
        """The text-only forward ran and the image forward ran or has no layout the config describes."""
        return self.text == "ok" and (self.image == "ok" or self.image.startswith("no image layout"))


def _meta(model_cls: Any, config: Any) -> Any:
    import torch

    with torch.device("meta"):
        return model_cls(config)


def _rope_owner(module: Any, config: Any) -> Any:
    own = getattr(module, "config", None)
    nodes = [n for _, n in _subconfigs(config)]
    if own is not None and any(own is n for n in nodes):
        return own
    try:
        text = config.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        text = config
    return text


def _repair_once(config: Any, model: Any, lines: list[str]) -> bool:
    import torch

    changed = False
    for _, mod in model.named_modules():
        sec, inv = getattr(mod, "mrope_section", None), getattr(mod, "inv_freq", None)
        if not (isinstance(sec, list | tuple) and sec and isinstance(inv, torch.Tensor)):
            continue
        want = int(inv.shape[-1])
        if sum(sec) == want:
            continue
        owner = _rope_owner(mod, config)
        rope = getattr(owner, "rope_parameters", None)
        if not isinstance(rope, dict):
            continue
        try:
            new = _rescale_sections(list(sec), want)
        except ValueError:  # fewer rotary pairs than sections: left to the run to show
            continue
        owner.rope_parameters = {**rope, "mrope_section": new}
        lines.append(f"rope_parameters.mrope_section: {list(sec)} -> {new} (the rotary width of the cut model)")
        changed = True
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    if isinstance(rows, int):
        from ..integrations.vision.sample import image_token_id

        tok = image_token_id(config)
        if tok is not None and rows <= tok < rows + 1024:
            text = _rope_owner(None, config)
            if isinstance(getattr(text, "vocab_size", None), int):
                old = text.vocab_size
                text.vocab_size = old + tok + 1 - rows
                lines.append(f"vocab_size: {old} -> {text.vocab_size} (image token id {tok} must be embedded)")
                changed = True
    return changed


def repair_shrunk(shrunk: Shrunk, model_cls: Any) -> Shrunk:
    """Repair, in place, the relations of :attr:`shrunk.config` only the built model shows (module docstring);
    returns ``shrunk``. A config the class cannot build on the meta device is returned as is (the caller's real
    build names the error)."""
    repaired_meta(shrunk, model_cls)
    return shrunk


def repaired_meta(shrunk: Shrunk, model_cls: Any) -> Any:
    """:func:`repair_shrunk`, returning the meta-device model of the repaired config (``None`` where the class
    cannot build it)."""
    model = None
    for _ in range(3):
        try:
            model = _meta(model_cls, shrunk.config)
        except Exception:  # noqa: BLE001 - the real build reports it
            return None
        if not _repair_once(shrunk.config, model, shrunk.lines):
            return model
    return _meta(model_cls, shrunk.config)


def run_checks(model: Any, *, backward: bool = True) -> tuple[str, str]:
    """``(text, image)``: ``"ok"`` where a forward (and backward) on a text-only / an image batch ran, else the
    error (an image batch the config describes no layout for: ``"no image layout: ..."``)."""
    import torch

    from ..integrations.vision.sample import SampleError, sample_batch

    out = []
    for image in (False, True):
        try:
            batch = sample_batch(model, image=image)
        except SampleError as e:
            out.append(f"no image layout: {str(e)[:300]}")
            continue
        try:
            with torch.set_grad_enabled(backward):
                res = model(**batch)
            loss = getattr(res, "loss", None)
            if backward:
                if loss is None:
                    raise ValueError("the forward returned no loss for labels=input_ids")
                loss.backward()
            out.append("ok")
        except Exception as e:  # noqa: BLE001 - reported as the family's outcome
            out.append(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    model.zero_grad(set_to_none=True)
    return out[0], out[1]


_TOKEN_COUNTS = ("mm_tokens_per_image", "image_seq_length", "num_image_tokens", "image_token_count", "num_query_tokens")


def shrink_images(config: Any, lines: list[str]) -> bool:
    """Cut, in place, every ``image_size`` to a patch grid ``g`` times smaller per side (``g`` in 8, 4, 2: the
    largest that divides the grid and leaves at least 4 patches per side) and every image-token count that the
    grid fills (``mm_tokens_per_image``, ``image_seq_length`` ...) by ``g**2`` where it divides. For the sweep only:
    a rehearsal keeps the image geometry (the user's processor makes images of the real size). Returns whether
    anything changed; the caller runs the model to check the cut."""
    changed, factor = False, 0
    for path, node in _subconfigs(config):
        size, patch = getattr(node, "image_size", None), getattr(node, "patch_size", None)
        if isinstance(patch, list | tuple) and patch:
            patch = patch[0]
        if not (isinstance(size, int) and isinstance(patch, int) and patch > 0 and size % patch == 0):
            continue
        side = size // patch
        g = next((g for g in (8, 4, 2) if side % g == 0 and side // g >= 4), 0)
        if g:
            node.image_size = size // g
            lines.append(f"{path + '.' if path else ''}image_size: {size} -> {size // g} (sweep: {g}x fewer patches "
                         "per side)")
            factor, changed = max(factor, g), True
    if factor:
        for path, node in _subconfigs(config):
            for key in _TOKEN_COUNTS:
                v = getattr(node, key, None)
                if isinstance(v, int) and not isinstance(v, bool) and v % (factor * factor) == 0 and \
                        v // (factor * factor) >= 1 and key != "num_query_tokens":
                    setattr(node, key, v // (factor * factor))
                    lines.append(f"{path + '.' if path else ''}{key}: {v} -> {v // (factor * factor)}")
    return changed


def _kept_vision(config: Any) -> tuple[str, ...]:
    return tuple(p for p, _ in _subconfigs(config) if p and "text" not in p and "." not in p)


def shrink_checked(config: Any, model_cls: Any, *, seed: int = 0, backward: bool = False,
                   small_images: bool = False) -> Checked:
    """Shrink ``config`` for ``model_cls``, repair, build seeded and run (module docstring).

    Raises:
        Exception: the class cannot build the shrunk config (the caller names the step).
    """
    import torch

    plain: Checked | None = None  # the plain cut's result: what is returned when no candidate runs
    kept = _kept_vision(config)
    tries = ([((), True)] if small_images else []) + [((), False)] + ([(kept, False)] if kept else [])
    for keep, images in tries:
        if keep and (plain is None or plain.text != "ok"):  # widths kept help an image path, not a text failure
            break
        shrunk = shrink_config(config, keep_widths=keep)
        if images and not shrink_images(shrunk.config, shrunk.lines):
            continue
        shrunk = repair_shrunk(shrunk, model_cls)
        if keep:
            try:
                n = sum(p.numel() for p in _meta(model_cls, shrunk.config).parameters())
            except Exception:  # noqa: BLE001 - no fallback then
                break
            if n > MAX_PARAMS:
                break
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(shrunk.config)
        text, image = run_checks(model, backward=backward)
        got = Checked(shrunk, model, text, image)
        if got.runs:
            if keep and plain is not None:
                got.shrunk.lines.append(f"widths of {', '.join(keep)} kept (the fully cut model failed: "
                                        f"{plain.text if plain.text != 'ok' else plain.image})")
            return got
        if not keep and not images:
            plain = got
    assert plain is not None
    plain.shrunk.lines.append(f"check: the shrunk model does not run (text: {plain.text[:120]}; image: "
                              f"{plain.image[:120]})")
    return plain
