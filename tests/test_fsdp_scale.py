"""FSDP2 at the size people shard, without a cluster (issue 36 item 4): real-size VLM configs on the meta device.

Each family is a hand-written config dict with the numbers of the public ``config.json`` it mirrors (no network),
saved with ``save_pretrained`` and read back the way ``hf-ddpfix plan --model DIR`` reads it. For each family and
world size N (8, 64) the test goes through the CLI's own path (``hf_ddpfix.offline_plan``: the meta-device model in bf16,
the plugin ``accelerate launch --config_file accelerate_configs/fsdp.yaml`` builds, the run's fact functions,
``resolve_plan``), hands accelerate the plan's unit classes as the run's applier does, and shards the model with
accelerate 1.15's own ``fsdp2_prepare_model`` inside torch's fake process group of N ranks
(``hf_ddpfix.integrations.fsdp.scale.shard_layout``); every FSDP2 parameter group is then read back (full bytes,
rank 0's padded shard, whether it stays gathered from forward to backward).

Asserted per family and N:

- every parameter is really sharded: rank 0 stores at most ``1.1 x total / N`` (padding only above ``1/N``);
- **the budget**: the root unit (what stays gathered for the whole forward, and where folded subtrees go) holds no
  more than :func:`budget` bytes, and the peak in a forward stays within ``1.1 x total / N + budget + accelerate's
  own held [norm, head] unit + the largest other unit``.

The budget and the units come from the plan: :func:`plan_decides_by_cost` says whether the plan already chooses
between folding and sharding by cost (issue 36 item 2, the ``fsdp_skippable`` option). Until it does, the plan folds
every skippable subtree into the root and the budget test fails where the issue says (Mllama-90B: 18.0 B
parameters, 33.6 GiB, in the root at any N): those cases are marked ``xfail`` (not strict: families whose folded
tower fits pass), and the same test run with the stand-in units :func:`sharded_stand_in` (every skippable subtree a
unit of its own: what ``fsdp_wrap_plan(fold_skippable=False)`` lists) passes, which shows the harness measures what
the plan will change. ``python tests/test_fsdp_scale.py`` prints the table (docs/fsdp.md, "At scale").

Measured (2 cores, torch 2.13, transformers 5.23, accelerate 1.15, 2026-11-28): see docs/fsdp.md; wall ~40-60 s
for the whole file (model builds on the meta device ~3-6 s per family, sharding at N=64 ~1-2 s).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import pytest

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Qwen/Qwen2.5-VL-72B-Instruct config.json
    "qwen2_5_vl_72b": ("Qwen2.5-VL-72B-Instruct", "qwen2_5_vl", dict(
        text_config=dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-6,
                         max_position_embeddings=128000, tie_word_embeddings=False,
                         rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, rope_theta=1000000.0),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3456, num_heads=16, out_hidden_size=8192,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_chans=3),
        tie_word_embeddings=False)),
    # meta-llama/Llama-3.2-90B-Vision-Instruct config.json: 100 text layers, 20 of them cross-attention
    "mllama_90b": ("Llama-3.2-90B-Vision-Instruct", "mllama", dict(
        text_config=dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=100,
                         num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=False,
                         cross_attention_layers=[3 + 5 * i for i in range(20)]),
        vision_config=dict(hidden_size=1280, num_hidden_layers=32, num_global_layers=8, attention_heads=16,
                           intermediate_size=5120, image_size=560, patch_size=14, max_num_tiles=4,
                           vision_output_dim=7680, intermediate_layers_indices=[3, 7, 15, 23, 30]))),
    # OpenGVLab/InternVL3-78B-hf config.json: InternViT-6B-448px-V2_5 (45 layers, hidden 3200) + Qwen2.5-72B
    "internvl_78b": ("InternVL3-78B-hf", "internvl", dict(
        vision_config=dict(hidden_size=3200, num_hidden_layers=45, num_attention_heads=25, intermediate_size=12800,
                           use_qk_norm=True, norm_type="rms_norm", layer_norm_eps=1e-6, image_size=[448, 448],
                           patch_size=[14, 14], use_mean_pooling=False, layer_scale_init_value=0.1),
        text_config=dict(model_type="qwen2", vocab_size=151674, hidden_size=8192, intermediate_size=29568,
                         num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, tie_word_embeddings=False),
        downsample_ratio=0.5, projector_hidden_act="gelu", tie_word_embeddings=False)),
    # Qwen/Qwen3-VL-235B-A22B-Instruct config.json: 94 MoE layers of 128 experts
    "qwen3_vl_moe_235b": ("Qwen3-VL-235B-A22B-Instruct", "qwen3_vl_moe", dict(
        text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                         num_attention_heads=64, num_key_value_heads=4, head_dim=128, moe_intermediate_size=1536,
                         num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, rms_norm_eps=1e-6,
                         max_position_embeddings=262144, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[8, 16, 24]),
        tie_word_embeddings=False)),
}
WORLD_SIZES = (8, 64)
#: The stand-in budget while the plan has none: a quarter of the per-rank parameter shard (total / N). Folding a
#: subtree costs its whole bytes on every rank for the whole forward; a quarter of the shard keeps that cost
#: below the sharded parameters' own and still folds a 0.7 B tower at 8 ranks of a 72 B model.
STAND_IN_FRACTION = 0.25
#: The option issue 36 item 2 adds (fsdp-units): its presence says the plan chooses fold or shard by cost.
COST_OPTION = "fsdp_skippable"
GiB = 2**30

# accelerate before 1.15 makes no embedding and [norm, head] units of its own (measured on the oldest stack, 1.11:
# its layout keeps them in the root, which then exceeds any per-rank budget at 72 B+ whatever the plan folds); the
# budget and the layout contract are checked where accelerate carves them: the pinned and newest stacks.
import accelerate  # noqa: E402
from packaging.version import Version  # noqa: E402

pytestmark = pytest.mark.skipif(Version(accelerate.__version__) < Version("1.15"),
                                reason="accelerate < 1.15 keeps the embedding and [norm, head] in the root unit "
                                       "(its own layout): budget checked on accelerate >= 1.15")


def plan_decides_by_cost() -> bool:
    from hf_ddpfix.config import OPTIONS

    return COST_OPTION in OPTIONS


def budget(facts: Any, total_bytes: int) -> int:
    """Bytes the root unit may hold gathered for a whole forward: the plan's own budget where it has one
    (``hf_ddpfix.plan.fsdp_skippable.fold_budget(total, N)``, issue 36 item 2: max(64 MiB, 10 % of the shard)),
    else the stand-in ``STAND_IN_FRACTION x total / N``."""
    try:
        from hf_ddpfix.plan.fsdp_skippable import fold_budget
    except ImportError:  # the plan before its cost decision
        return int(STAND_IN_FRACTION * total_bytes / facts.world_size)
    return int(fold_budget(total_bytes, facts.world_size))


@functools.cache
def _saved(family: str, root: str) -> str:
    import os

    from transformers import AutoConfig

    _, model_type, kwargs = FAMILIES[family]
    path = os.path.join(root, family)
    AutoConfig.for_model(model_type, **kwargs).save_pretrained(path)
    return path


@functools.cache
def _built(family: str, root: str) -> tuple[Any, Any, Any]:
    """``(args, info, meta model)`` as ``hf-ddpfix plan --model DIR --parallel fsdp --full --dtype bfloat16 --cpu``
    builds them (the model once per family)."""
    from hf_ddpfix import cli, offline_plan

    args = cli._parser().parse_args(["plan", "--model", _saved(family, root), "--parallel", "fsdp", "--full",
                                     "--dtype", "bfloat16", "--cpu", "--checkpointing", "non_reentrant"])
    offline_plan.launch_config(args)
    info, model, error = offline_plan.meta_model(args)
    assert error is None, error
    return args, info, model


def sharded_stand_in(model: Any) -> tuple[str, ...]:
    """The unit classes of the plan once it shards what it folds today: the classes of every module
    ``fsdp_wrap_plan(model, fold_skippable=False)`` makes a unit (block classes, the vision tower's and the
    projector's own classes), keeping only classes whose every instance is such a unit (a projector that is a
    plain ``nn.Linear`` stays in the root)."""
    from hf_ddpfix.integrations.fsdp import fsdp_wrap_plan

    units = [m for name, m in fsdp_wrap_plan(model, fold_skippable=False) if name]
    ids = {id(m) for m in units}
    out: list[str] = []
    for mod in units:
        name = type(mod).__name__
        if name not in out and all(id(m) in ids for m in model.modules() if type(m).__name__ == name):
            out.append(name)
    return tuple(out)


@functools.cache
def measure(family: str, world: int, root: str, stand_in: bool = False) -> dict[str, Any]:
    """The plan for ``family`` at ``world`` ranks (the CLI's path) and rank 0's units as accelerate shards them with
    the plan's classes (``stand_in``: :func:`sharded_stand_in`'s classes instead)."""
    import copy

    from hf_ddpfix import offline_plan
    from hf_ddpfix.config import DDPFixConfig
    from hf_ddpfix.plan.resolve import resolve_plan

    args, info, model = _built(family, root)
    args = copy.copy(args)
    args.world_size = world
    from hf_ddpfix._compat import fsdp_plugin_from_launch

    plugin = fsdp_plugin_from_launch(args.fsdp_config)
    facts = offline_plan.build_facts(args, info, model, plugin)
    plan = resolve_plan(facts, DDPFixConfig())
    if stand_in:
        from dataclasses import replace

        from hf_ddpfix.plan.types import Decision

        plan = replace(plan, fsdp_units=Decision(",".join(sharded_stand_in(model)), "stand-in", changed=True))
    layout = offline_plan.fsdp_layout(plan, facts, model, plugin, world)
    assert layout is not None
    return {"family": family, "world": world, "plan": plan, "facts": facts, "layout": layout,
            "budget": budget(facts, layout.total_bytes), "params": info.num_params}


def check(m: dict[str, Any]) -> list[str]:
    """The assertions of the module docstring, as a list of what fails (empty: all hold)."""
    lay, n, cap = m["layout"], m["world"], m["budget"]
    root = lay.root.full_bytes if lay.root else 0
    tail = sum(u.full_bytes - u.local_bytes for u in lay.units if u.held and u is not lay.root)
    bad = []
    if lay.shard_bytes > 1.1 * lay.total_bytes / n:
        bad.append(f"shard {lay.shard_bytes / GiB:.2f} GiB > 1.1 x total/N {1.1 * lay.total_bytes / n / GiB:.2f} GiB")
    if root > cap:
        bad.append(f"root unit {root / GiB:.2f} GiB gathered for the whole forward > budget {cap / GiB:.2f} GiB")
    bound = 1.1 * lay.total_bytes / n + cap + tail + lay.largest_transient_bytes
    if lay.peak_bytes > bound:
        bad.append(f"peak {lay.peak_bytes / GiB:.2f} GiB > bound {bound / GiB:.2f} GiB")
    return bad


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("scale_configs"))


#: the fast tier keeps Mllama-90B (the issue's case, ~10 s); the other families run in the full suite (~35 s)
FAST_FAMILY = "mllama_90b"
CASES = [pytest.param(f, n, id=f"{f}-{n}", marks=() if f == FAST_FAMILY else pytest.mark.slow)
         for f in FAMILIES for n in WORLD_SIZES]


@pytest.mark.parametrize(("family", "world"), CASES)
def test_plan_units_stay_within_the_budget(family, world, root, request):
    if not plan_decides_by_cost():
        request.applymarker(pytest.mark.xfail(reason="the plan folds every skippable subtree into the root until it "
                                              "decides by cost (issue 36 item 2)", strict=False))
    m = measure(family, world, root)
    print(_row(m, "plan"))
    if family == "mllama_90b":  # the cross-attention layers and the tower are units (the cross-attention dummy)
        assert m["plan"].fsdp_skippable.value == "shard", m["plan"].fsdp_skippable
        assert "MllamaCrossAttentionDecoderLayer" in m["plan"].fsdp_units.value, m["plan"].fsdp_units
    assert not check(m), (family, world, check(m), m["plan"].fsdp_units.reason[:300])


@pytest.mark.parametrize(("family", "world"), CASES)
def test_sharded_stand_in_stays_within_the_budget(family, world, root):
    """The harness passes once the skippable subtrees are units of their own (the stand-in for the plan's cost
    decision), and the stand-in really changed the units: the root is smaller than the plan's folded root
    wherever the plan folded something."""
    m = measure(family, world, root, stand_in=True)
    print(_row(m, "sharded"))
    assert not check(m), (family, world, check(m))
    if not plan_decides_by_cost():
        folded = measure(family, world, root)
        assert folded["facts"].fsdp.folded and folded["layout"].root.full_bytes > m["layout"].root.full_bytes
        if family == "mllama_90b":  # the figure: 20 cross-attention layers + the tower (carved: embeddings)
            assert check(folded) and folded["layout"].root.full_bytes > 30 * GiB, check(folded)


def test_shard_layout_matches_fully_shard_to_local_on_every_rank():
    """`shard_layout`'s per-rank bytes are what ``fully_shard`` stores on each rank (``to_local()`` padded to the
    chunk size: exactly ``ceil(rows / N)`` rows of every parameter), the ``to_local()`` sizes of all ranks add up to
    the model, and the model passed in is left as it was (a tiny Llama on the meta device, 5 ranks)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_ddpfix._compat import fake_process_group, fsdp_plugin_from_launch, prepare_like_accelerate
    from hf_ddpfix.integrations.fsdp.scale import shard_layout

    cfg = LlamaConfig(vocab_size=130, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    plugin = fsdp_plugin_from_launch({"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    world, exact = 5, 0
    for rank in range(world):
        lay = shard_layout(model, plugin, world, rank)
        assert lay.total_bytes == total and sum(u.full_bytes for u in lay.units) == total
        import copy

        work = copy.deepcopy(model)
        with fake_process_group(world, rank):
            prepare_like_accelerate(work, plugin)
            local = sum(p.to_local().numel() * p.element_size() for p in work.parameters())
        # FSDP2 stores every rank's dim-0 chunk padded to ceil(rows / N) rows: exact arithmetic over the parameters
        padded = sum(-(-p.shape[0] // world) * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters())
        assert local <= lay.shard_bytes == padded, (rank, local, lay.shard_bytes, padded)
        exact += local
        # 3 layers, the embedding, [norm, head] (held gathered: accelerate 1.15); the root holds no parameter of its own
        assert [(u.name, u.held) for u in lay.units] == [("model.embed_tokens", False)] + [
            (f"model.layers.{i}", False) for i in range(3)] + [("model.norm, lm_head", True)], lay.units
        assert lay.root is None
    assert exact == total
    assert all(p.device.type == "meta" and not hasattr(p, "to_local") for p in model.parameters())  # untouched


def _row(m: dict[str, Any], mode: str) -> str:
    lay = m["layout"]
    root = lay.root.full_bytes if lay.root else 0
    return (f"{m['family']:<18} N={m['world']:<3} {mode:<8} params {m['params'] / 1e9:6.1f} B  shard "
            f"{lay.shard_bytes / GiB:6.2f} GiB  root {root / GiB:6.2f} GiB  peak {lay.peak_bytes / GiB:6.2f} GiB  "
            f"largest unit {lay.largest_unit.full_bytes / GiB:5.2f} GiB  budget {m['budget'] / GiB:5.2f} GiB  "
            f"units {len(lay.units)}" + ("" if not check(m) else "  OVER"))


if __name__ == "__main__":  # the table of docs/fsdp.md
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as tmp:
        for fam in (sys.argv[1:] or FAMILIES):
            for n in WORLD_SIZES:
                for sharded in (False, True):
                    t = time.time()
                    print(_row(measure(fam, n, tmp, stand_in=sharded), "sharded" if sharded else "folded"),
                          f"({time.time() - t:.1f} s)", flush=True)
