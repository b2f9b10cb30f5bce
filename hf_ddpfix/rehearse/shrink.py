"""The shrunk model: a checkpoint's config with layers and widths cut, keeping what decides the collectives.

Rule, for the config and every sub-config in it (``text_config``, ``vision_config``, ...):

- **kept**: the vocabulary size, every token id (``*_token_id``, ``*_token_index``), tied embeddings, the image /
  patch / window geometry (``image_size``, ``patch_size``, ``spatial_merge_size``, ``window_size`` ...), MoE expert
  counts and routing (``num_experts``, ``num_local_experts``, ``n_routed_experts``, ``num_experts_per_tok`` ...),
  the attention kind per layer (``layer_types``: the pattern's period, e.g. Gemma 3's 5 sliding + 1 full), the
  positions of special layers (``cross_attention_layers``, ``fullatt_block_indexes``, ...: the pattern up to its
  second occurrence, e.g. Mllama's cross-attention at 3 and 8 of every 5), the "every k layers" settings
  (``decoder_sparse_step``, ``first_k_dense_replace`` ...), and the number of layer taps a tower feeds on
  (``intermediate_layers_indices``: same count, spread over the cut stack);
- **cut**: attention heads to at most :data:`MAX_HEADS` (the key/value grouping kept: 32 heads / 8 kv become 4 / 1),
  head width to :data:`HEAD_DIM`, hidden sizes to heads x head width, every width that was k x hidden to k x the
  new hidden (and a width equal to another sub-config's hidden, e.g. a projector's output, to that one's new
  hidden), MLP / expert widths to 2 x hidden, layer counts to the smallest stack that still holds the patterns
  above (at least :data:`MIN_LAYERS`), M-RoPE sections rescaled to the new head width;
- **relations**: one width map for the whole config, the language model's hidden cut first: a width equal to one
  already cut (a tower's output ``hidden_size`` / ``out_hidden_size`` equal to the text width, a projector's
  dims; a list of channel widths ending in one) gets the same new value, and a hidden of at most ``MAX_HEADS x
  HEAD_DIM`` is kept with its heads (a Qwen2-VL tower of output width 64 beside a text width of 64 stays 64). What
  only the built model shows (default M-RoPE sections, token ids past the embedding) is repaired, and the result
  built and run, by :mod:`hf_ddpfix.rehearse.shrink_check`.

Guarantees: :func:`shrink_config` never mutates its argument; every kept field above is equal in the result
(tests/test_rehearse.py checks four real shapes); the report lines say every field it changed, old -> new.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HEAD_DIM", "MAX_HEADS", "MIN_LAYERS", "Shrunk", "shrink_config"]

HEAD_DIM = 16  # per-head width of the shrunk model: the smallest that keeps rotary sections and GQA meaningful
MAX_HEADS = 4  # heads per attention: enough for a key/value grouping of 4 (Llama/Mllama GQA 32/8 -> 4/1)
MIN_LAYERS = 2  # a stack of one block hides the order of per-layer collectives

_HIDDEN = ("hidden_size", "d_model", "n_embd", "embed_dim")
_HEADS = ("num_attention_heads", "num_heads", "attention_heads", "n_head", "encoder_attention_heads",
          "decoder_attention_heads")
_KV = ("num_key_value_heads", "n_head_kv", "num_kv_heads")
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "depth")
_OTHER_LAYERS = ("num_global_layers", "encoder_layers", "decoder_layers", "num_encoder_layers", "num_decoder_layers")
_MLP = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "moe_intermediate_size",
        "shared_expert_intermediate_size", "expert_intermediate_size", "intermediate_size_mlp", "dense_intermediate_size")
#: Multi-latent attention and similar per-head widths, cut to fixed small values.
_HEAD_WIDTHS = {"head_dim": HEAD_DIM, "qk_rope_head_dim": HEAD_DIM // 2, "qk_nope_head_dim": HEAD_DIM // 2,
                "v_head_dim": HEAD_DIM, "kv_lora_rank": 2 * HEAD_DIM, "q_lora_rank": 2 * HEAD_DIM,
                "global_head_dim": HEAD_DIM, "attention_head_dim": HEAD_DIM,
                "hidden_size_per_layer_input": HEAD_DIM,  # Gemma 3n / 4: a per-layer embedding width
                "d_kv": HEAD_DIM}  # T5-style (Pix2Struct, UDOP): heads x d_kv is the attention's inner width
#: "Every k layers" settings: the cut stack keeps at least k (+1) layers so the kind still alternates.
_EVERY = ("decoder_sparse_step", "moe_layer_freq", "interleave_moe_layer_step", "global_attn_every_n_layers",
          "full_attention_interval", "sliding_window_pattern", "first_k_dense_replace", "cross_attention_frequency")
#: Words that mark a field as geometry, a count or an id: never rescaled as a width.
_NOT_WIDTH = frozenset(("token", "tokens", "vocab", "position", "positions", "image", "patch", "window", "merge",
                        "channel", "channels", "batch", "num", "n", "layer", "layers", "expert", "experts", "tile",
                        "tiles", "frame", "frames", "sample", "samples", "length", "bucket", "rank", "seq", "max",
                        "id", "ids", "index", "idx"))


def _geometry_or_count(key: str) -> bool:
    """True for a field named as geometry, a count or an id (its ``_``-separated words; see ``_NOT_WIDTH``)."""
    return bool(_NOT_WIDTH & set(key.lower().split("_")))


@dataclass
class Shrunk:
    """The shrunk config and what changed (``lines``: ``"<path>.<field>: old -> new"``, one per change)."""

    config: Any
    lines: list[str] = field(default_factory=list)


def _subconfigs(cfg: Any, path: str = "") -> list[tuple[str, Any]]:
    from transformers import PretrainedConfig

    out = [(path, cfg)]
    for key, value in list(vars(cfg).items()):
        if isinstance(value, PretrainedConfig):
            out += _subconfigs(value, f"{path}.{key}" if path else key)
    return out


def _get(cfg: Any, name: str) -> Any:
    """``getattr(cfg, name, None)``; the stored global value where the config refuses a global read
    (transformers 5.23's per-layer attributes raise on ``config.head_dim``: Gemma 4)."""
    if name in vars(cfg):
        return vars(cfg)[name]
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - a refused read is an absent field here
        return None


def _first(cfg: Any, names: tuple[str, ...]) -> str | None:
    for n in names:
        v = _get(cfg, n)
        if isinstance(v, int) and not isinstance(v, bool):
            return n
    return None


def _period(seq: list[Any]) -> int:
    for p in range(1, len(seq) + 1):
        if all(seq[i] == seq[i % p] for i in range(len(seq))):
            return p
    return len(seq)


def _index_lists(cfg: Any, n_layers: int) -> dict[str, list[int]]:
    """Fields holding layer positions: lists of distinct ints in [0, n_layers), named for layers or indexes."""
    out = {}
    for key, value in vars(cfg).items():
        if key == "layer_types" or not isinstance(value, list | tuple) or not value:
            continue
        if not any(w in key for w in ("layer", "index", "indexes", "indices", "block")):
            continue
        if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n_layers for v in value) and \
                len(set(value)) == len(value) and len(value) < n_layers:
            out[key] = sorted(value)
    return out


def _is_periodic(idx: list[int]) -> bool:
    steps = {b - a for a, b in zip(idx, idx[1:], strict=False)}
    return len(idx) >= 2 and len(steps) == 1


def _kind_lists(cfg: Any, n: int) -> dict[str, list[Any]]:
    """Per-layer kind lists: ``layer_types`` and every other ``*layer_types`` field with one entry per layer
    (Step-3.7's ``mlp_layer_types``: 3 dense then sparse MLPs beside the attention kinds)."""
    out = {}
    for key, value in vars(cfg).items():
        if key.endswith("layer_types") and isinstance(value, list | tuple) and len(value) == n and \
                all(isinstance(v, str) for v in value):
            out[key] = list(value)
    return out


def _layers_needed(cfg: Any, n: int, lists: dict[str, list[int]]) -> tuple[int, list[str]]:
    need, why = MIN_LAYERS, []
    for key, types in _kind_lists(cfg, n).items():
        if len(set(types)) <= 1:
            continue
        p = _period(types)
        if p < n:
            need = max(need, p)
            why.append(f"{key} period {p}")
        else:
            first = max(types.index(k) for k in set(types)) + 1
            need = max(need, first)
            why.append(f"{key}: every kind by layer {first}")
    for key, idx in lists.items():
        if _is_periodic(idx) or len(idx) == 1:
            k = min(len(idx), 2)
            need = max(need, idx[k - 1] + 1)
            why.append(f"{key} {idx[:k]} kept")
        else:
            need = max(need, len(idx) + 1)
            why.append(f"{key}: {len(idx)} taps kept")
    for key in _EVERY:
        v = _get(cfg, key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            extra = 1 if key == "first_k_dense_replace" else 0
            need = max(need, v + extra)
            why.append(f"{key}={v}")
    return min(n, need), why


def _rescale_sections(sections: list[int], total: int) -> list[int]:
    """Integer sections proportional to ``sections`` summing to ``total`` (each at least 1)."""
    s = sum(sections)
    out = [max(1, round(x * total / s)) for x in sections]
    out[-1] += total - sum(out)
    if out[-1] < 1:
        raise ValueError(f"cannot rescale sections {sections} to {total}")
    return out


def _fix_rope(cfg: Any, path: str, head_dim: int, lines: list[str]) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        rope = _get(cfg, key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list | tuple):
            old = list(rope["mrope_section"])
            if sum(old) != head_dim // 2:
                new = _rescale_sections(old, head_dim // 2)
                setattr(cfg, key, {**rope, "mrope_section": new})
                lines.append(f"{path}{key}.mrope_section: {old} -> {new}")


def _set(cfg: Any, path: str, key: str, new: Any, lines: list[str]) -> None:
    old = vars(cfg)[key] if key in vars(cfg) else getattr(cfg, key)
    if old != new:
        setattr(cfg, key, new)
        shown = (lambda v: f"{v[:6]}... ({len(v)})" if isinstance(v, list) and len(v) > 8 else v)  # noqa: E731
        lines.append(f"{path}{key}: {shown(old)} -> {shown(new)}")


def _divisor_at_most(n: int, cap: int) -> int:
    d = max(1, cap)
    while n % d:
        d -= 1
    return d


def _shrink_node(cfg: Any, path: str, lines: list[str], widths: dict[int, int],
                 keep: bool = False) -> tuple[int | None, int | None]:
    """Cut one (sub-)config in place; returns (old hidden, new hidden).

    ``widths`` maps every width already cut (old -> new) across the whole config, so equal widths stay equal (a
    tower's output width that is the text width, a projector's dims); a hidden of at most ``MAX_HEADS x HEAD_DIM``
    is kept as is (a small model is not reshaped: its towers and projector already agree)."""
    p = f"{path}." if path else ""
    hkey, headkey = _first(cfg, _HIDDEN), _first(cfg, _HEADS)
    old_h = new_h = None
    if hkey is not None:
        old_h = getattr(cfg, hkey)
        heads = getattr(cfg, headkey) if headkey else None
        if (keep or old_h <= MAX_HEADS * HEAD_DIM) and old_h not in widths:
            widths[old_h] = old_h
        new_h = widths.get(old_h, MAX_HEADS * HEAD_DIM)
        if new_h == old_h:  # already small (or tied to a kept width): only the layers are cut below
            heads = None
            headkey = None
        new_heads = _divisor_at_most(new_h, min(heads, MAX_HEADS)) if heads else MAX_HEADS
        if headkey:
            kvkey = _first(cfg, _KV)
            if kvkey:
                kv = getattr(cfg, kvkey)
                group = max(1, heads // max(kv, 1))
                new_kv = max(1, new_heads // group)
                while new_heads % new_kv:
                    new_kv -= 1
                _set(cfg, p, kvkey, new_kv, lines)
            _set(cfg, p, headkey, new_heads, lines)
        if new_h != old_h:
            widths[old_h] = new_h
            _set(cfg, p, hkey, new_h, lines)
            for key, value in list(vars(cfg).items()):
                if key in _HEAD_WIDTHS and isinstance(value, int) and not isinstance(value, bool):
                    _OLD_GLOBAL.setdefault(id(cfg), {})[key] = value
                    _set(cfg, p, key, _HEAD_WIDTHS[key], lines)
            _keep_head_relations(cfg, p, lines)
            for key in _MLP:
                if isinstance(_get(cfg, key), int) and not isinstance(_get(cfg, key), bool):
                    _set(cfg, p, key, 2 * new_h, lines)
            for key, value in list(vars(cfg).items()):  # k x hidden widths (e.g. Mllama's vision_output_dim)
                if key in _MLP or key == hkey or key in _HEAD_WIDTHS or not isinstance(value, int) or \
                        isinstance(value, bool) or _geometry_or_count(key):
                    continue
                if not any(w in key for w in ("size", "dim", "hidden", "width")):
                    continue
                if value in widths:
                    _set(cfg, p, key, widths[value], lines)
                elif value and value % old_h == 0 and 1 <= value // old_h <= 8:
                    _set(cfg, p, key, value // old_h * new_h, lines)
            for key in _HIDDEN:  # a second width field (Qwen2-VL's tower: embed_dim beside hidden_size)
                v = _get(cfg, key)
                if key != hkey and isinstance(v, int) and not isinstance(v, bool) and v > MAX_HEADS * HEAD_DIM:
                    widths.setdefault(v, MAX_HEADS * HEAD_DIM)
                    _set(cfg, p, key, widths[v], lines)
            head_dim = _get(cfg, "head_dim") or (new_h // new_heads)
            _fix_rope(cfg, p, int(head_dim), lines)
    lkey = _first(cfg, _LAYERS)
    if lkey is not None:
        n = getattr(cfg, lkey)
        lists = _index_lists(cfg, n)
        need, why = _layers_needed(cfg, n, lists)
        if need < n:
            _set(cfg, p, lkey, need, lines)
            if why:
                lines[-1] += f" ({'; '.join(why)})"
            for key, types in _kind_lists(cfg, n).items():
                setattr(cfg, key, types[:need])
            for key, idx in lists.items():
                if _is_periodic(idx) or len(idx) == 1:
                    new = [i for i in idx if i < need]
                else:  # taps: same count, spread over the cut stack, last one last
                    new = [need - len(idx) + j for j in range(len(idx))]
                _set(cfg, p, key, new, lines)
            for key in ("max_window_layers",):
                if isinstance(getattr(cfg, key, None), int) and getattr(cfg, key) > need:
                    _set(cfg, p, key, need, lines)
    _cut_per_layer(cfg, p, lines)
    for key in _OTHER_LAYERS:
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > MIN_LAYERS:
            _set(cfg, p, key, MIN_LAYERS, lines)
    return old_h, new_h


#: Multi-latent attention's parts: a per-head width equal to one of them (DeepSeek-V3's ``head_dim`` is its
#: ``qk_rope_head_dim``: the rotary width) or the sum of two (``qk_head_dim`` = nope + rope) stays so when cut.
_LATENT_PARTS = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank")


def _keep_head_relations(cfg: Any, p: str, lines: list[str]) -> None:
    """After the per-head widths are cut to their fixed values: every other per-head width the original config
    derived from the latent-attention parts keeps that relation. A ``head_dim`` (or any width in
    :data:`_HEAD_WIDTHS`) that equalled a part takes that part's new width; an integer ``*head_dim`` field that is
    no cut width and equalled the sum of two parts (``qk_head_dim``, an indexer's ``index_head_dim``) takes the
    sum of their new widths. Without it Kimi-K2.5 and Mistral-Large-4 (DeepSeek-V3 attention) cut ``head_dim``
    64 -> 16 beside ``qk_rope_head_dim`` 64 -> 8 and their rotary embedding no longer fits (issue 45)."""
    old = _OLD_GLOBAL.get(id(cfg), {})
    parts = [k for k in _LATENT_PARTS if k in old]
    if not parts:
        return
    for key in _HEAD_WIDTHS:
        if key in old and key not in parts:
            same = next((k for k in parts if old[k] == old[key]), None)
            if same is not None:
                _set(cfg, p, key, _get(cfg, same), lines)
    for key, value in list(vars(cfg).items()):
        if key in _HEAD_WIDTHS or not key.endswith("head_dim") or not isinstance(value, int) or \
                isinstance(value, bool):
            continue
        pair = next(((a, b) for i, a in enumerate(parts) for b in parts[i + 1:] if old[a] + old[b] == value), None)
        if pair is not None:
            _set(cfg, p, key, _get(cfg, pair[0]) + _get(cfg, pair[1]), lines)


def _cut_per_layer(cfg: Any, p: str, lines: list[str]) -> None:
    """A heterogeneous config's per-layer overrides (Gemma 4: ``head_dim`` 512 on every 6th layer beside 256):
    layers past the cut stack dropped, a per-head width scaled as its global value was (512 / 256 x 16 = 32)."""
    from .._compat import per_layer_overrides, set_per_layer_overrides

    over = per_layer_overrides(cfg)
    if not over:
        return
    n = _get(cfg, _first(cfg, _LAYERS) or "num_hidden_layers")
    new: dict[int, dict[str, Any]] = {}
    for layer, attrs in over.items():
        if isinstance(n, int) and layer >= n:
            continue
        out = dict(attrs)
        for key, value in attrs.items():
            if key in _HEAD_WIDTHS and isinstance(value, int) and key in _OLD_GLOBAL.get(id(cfg), {}):
                old = _OLD_GLOBAL[id(cfg)][key]
                out[key] = max(2, value * _HEAD_WIDTHS[key] // max(old, 1)) if old else value
        new[layer] = out
    if new != over:
        set_per_layer_overrides(cfg, new)
        lines.append(f"{p}per-layer overrides: {len(over)} layers -> {len(new)} ({new})")


#: id(config) -> the global per-head widths before the cut (read by :func:`_cut_per_layer`)
_OLD_GLOBAL: dict[int, dict[str, int]] = {}


def shrink_config(config: Any, *, keep_widths: tuple[str, ...] = ()) -> Shrunk:
    """A copy of ``config`` cut as the module docstring says, and the list of changes.

    Args:
        config: a ``transformers.PretrainedConfig`` (its sub-configs are cut too).
        keep_widths: top-level sub-config names (``"vision_config"``) whose widths stay (only their layers are
            cut); :func:`hf_ddpfix.rehearse.shrink_check.shrink_checked` uses it where the full cut fails.

    Returns :class:`Shrunk` with the new config and one line per changed field."""
    cfg = copy.deepcopy(config)
    _OLD_GLOBAL.clear()
    lines: list[str] = []
    hiddens: dict[int, int] = {}
    nodes = _subconfigs(cfg)
    text = _text_node(cfg, nodes)
    old_text_h = _get(text, _first(text, _HIDDEN) or "hidden_size")
    # the language model first: every other width equal to its hidden (a tower's output, a projector) follows it
    order = [n for n in nodes if n[1] is text] + [n for n in reversed(nodes) if n[1] is not text]
    for path, node in order:
        _shrink_node(node, path, lines, hiddens, keep=bool(path) and path.split(".")[0] in keep_widths)
    _keep_feature_taps(nodes, lines)
    _keep_text_widths(nodes, text, old_text_h, lines)
    for path, node in nodes:  # a width equal to another sub-config's hidden (projector outputs, text widths); a
        p = f"{path}." if path else ""  # list of channel widths ending in one scales with it (Unlimited-OCR's SAM)
        for key, value in list(vars(node).items()):
            if isinstance(value, int) and not isinstance(value, bool) and value in hiddens and \
                    value != hiddens[value] and any(w in key for w in ("size", "dim", "hidden")) and \
                    not _geometry_or_count(key) and value > 64:
                _set(node, p, key, hiddens[value], lines)
            elif key.endswith("channels") and isinstance(value, list | tuple) and value and \
                    all(isinstance(v, int) for v in value) and hiddens.get(top := max(value), top) != top:
                _set(node, p, key, [max(1, v * hiddens[top] // top) for v in value], lines)
    return Shrunk(cfg, lines)


def _keep_feature_taps(nodes: list[tuple[str, Any]], lines: list[str]) -> None:
    """A config that reads its tower's hidden states by index (``vision_feature_layer``: VipLLaVA's
    ``(-2, -5, -8, -11, 6)``) needs that many layers in the tower: the cut stack grows back to the deepest tap
    (``hidden_states`` holds the embeddings and one entry per layer: index ``i >= 0`` needs ``i`` layers, ``i + 1``
    where the model reads ``layers[i]``'s output, Molmo2, so ``i + 1`` is kept; ``i < 0`` needs ``-i - 1``). Taps on
    a sibling of the tower's config (Molmo2's ``adapter_config``) grow the top config's ``vision_config``."""
    for path, node in nodes:
        taps = vars(node).get("vision_feature_layer", vars(node).get("vision_feature_layers"))
        taps = [taps] if isinstance(taps, int) and not isinstance(taps, bool) else taps
        if not isinstance(taps, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in taps):
            continue
        need = max((t + 1 if t >= 0 else -t - 1) for t in taps) if taps else 0
        tower = getattr(node, "vision_config", None)
        if tower is None and path:  # taps on a sibling of the tower (Molmo2's adapter_config)
            tower = getattr(nodes[0][1], "vision_config", None)
            path = ""
        lkey = _first(tower, _LAYERS) if tower is not None else None
        if lkey is None or getattr(tower, lkey) >= need:
            continue
        p = f"{path}.vision_config." if path else "vision_config."
        _set(tower, p, lkey, need, lines)
        lines[-1] += f" (vision_feature_layer {list(taps)} read)"


_MERGE_KEYS = ("spatial_merge_size", "merge_size")


def _keep_text_widths(nodes: list[tuple[str, Any]], text: Any, old_h: Any, lines: list[str]) -> None:
    """Widths other configs derive from the text hidden follow its cut: a ``text_hidden_size`` (the text hidden by
    name: HunYuan-VL and Inkling sync it, Molmo2's default 3584 beside a text width of 4096 does not), and, on a
    node with no hidden of its own, a width equal to the old text hidden x ``m**2`` (``m`` a tower's
    ``spatial_merge_size``: ``m x m`` patches concatenated, MiniMax-M3-VL's ``merged_hidden_size``)."""
    hkey = _first(text, _HIDDEN)
    new_h = getattr(text, hkey) if hkey is not None else None
    if not isinstance(new_h, int) or not isinstance(old_h, int):
        return
    merges = {v for _, n in nodes for k in _MERGE_KEYS if isinstance(v := _get(n, k), int) and not isinstance(v, bool)
              and v > 1}
    for path, node in nodes:
        p = f"{path}." if path else ""
        v = vars(node).get("text_hidden_size")
        if node is not text and isinstance(v, int) and not isinstance(v, bool):
            _set(node, p, "text_hidden_size", new_h, lines)
        if _first(node, _HIDDEN) is not None or old_h == new_h:
            continue
        for key, value in list(vars(node).items()):
            if not isinstance(value, int) or isinstance(value, bool) or _geometry_or_count(key) or \
                    not any(w in key for w in ("size", "dim", "hidden")):
                continue
            m = next((m for m in sorted(merges) if value == old_h * m * m), None)
            if m is not None:
                _set(node, p, key, new_h * m * m, lines)
                lines[-1] += f" (text hidden x {m}^2 merged patches)"


def _text_node(cfg: Any, nodes: list[tuple[str, Any]]) -> Any:
    try:
        text = cfg.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        return cfg
    return text if any(n is text for _, n in nodes) else cfg
