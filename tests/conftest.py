import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from launch import torchrun`

import ci_record  # noqa: E402


def pytest_configure(config):
    ci_record.register(config)  # seconds per file, counts, versions: only under CI (DDPFIX_CI_DIR)
    if hasattr(config.option, "loadscopereorder"):  # xdist's loadfile: keep the order below, not "most tests first"
        config.option.loadscopereorder = False


def pytest_collection_finish(session):
    """Freeze what the collection imported (torch, transformers, every test module) for the garbage collector: the
    suite's one-process Trainer runs each make an explicit full collection (accelerate's ``clear_device_cache``),
    which otherwise walks that heap every time (the fast tier: 34 of them, 20.3 CPU-s; frozen 7.5 CPU-s, 2026-12-03).
    What a test creates is collected as before; only objects older than the first test are never collected."""
    import gc

    gc.collect()
    gc.freeze()


# ---- the order: the slowest files first --------------------------------------------------------------------------
# Under `-n 2 --dist loadfile` a worker takes the next file when it is free. xdist's default queue puts the files
# with the most tests first, so the few-test, many-minute launch files (test_rehearse_examples, test_fsdp_skippable,
# ...) could come last, with one worker running them alone at the end. The queue now starts with the slowest files, by the seconds
# the last kept CI run measured per file (tests/results/stacks/pinned.json, `python scripts/ci_report.py keep`);
# files it does not name follow in collection order.
def _file_seconds() -> dict[str, float]:
    import json

    kept = Path(__file__).resolve().parent / "results" / "stacks" / "pinned.json"
    try:
        return {str(k): float(v) for k, v in json.loads(kept.read_text()).get("files", {}).items()}
    except (OSError, ValueError, AttributeError):
        return {}


# ---- the fast tier: `python -m pytest -m "not slow" tests` (docs/testing.md) ----------------------------------
# Every test that starts processes is `slow`: the multiprocess-marked ones (2 gloo ranks each) and the ones below,
# which launch a Python that imports torch/transformers (30-80 s each on a loaded 2-core machine), or measure
# memory on a Llama-8B-shaped layer. What stays fast: every plan rule, option, parser, contract and one-process
# parity test, plus ONE two-process cell (FAST_MULTIPROCESS: the headline case, a VLM with LoRA on the vision
# tower and reentrant checkpointing under DDP, trained in sync to the stock loss). CI runs everything.
FAST_MULTIPROCESS = {
    "tests/test_matrix.py::test_cell_trains_in_sync_with_stock_loss[vlm-ckpt-reentrant-find-unused-auto]",
}
SLOW = (  # node id prefixes, relative to the repository root
    "tests/test_example_long_context.py::",
    "tests/test_patches.py::",
    "tests/test_dist_teardown.py::test_default_group_destroyed_at_exit_once_and_usable_until_then",
    "tests/test_dist_teardown.py::test_without_registration_the_group_outlives_the_script",
    "tests/test_usage_at_loss.py::test_an_accelerate_loop_gets_the_plan_through_one_call_and_trains_like_stock",
    "tests/test_cli.py::test_python_dash_m_entry_point",
    "tests/test_layer_ledger.py::test_llama8b_layer_hf_ddpfix_is_at_most_100_kib_per_token_and_below_stock",
    "tests/test_layer_ledger.py::test_each_feature_alone_never_costs_memory",
    "tests/test_layer_ledger.py::test_gemma3_12b_global_layer_is_the_readme_ceiling",
    "tests/test_asked_options.py::test_an_option_asked_on_in_a_trainer_run_is_applied_exactly_when_its_counters_moved",
)


def _node_id(item) -> str:
    root = Path(__file__).resolve().parent.parent
    path = Path(str(item.fspath)).resolve()
    rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
    return rel + "::" + item.nodeid.split("::", 1)[1]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be on the item by then
def pytest_collection_modifyitems(config, items):
    for item in items:
        node = _node_id(item)
        if node in FAST_MULTIPROCESS:
            continue
        if item.get_closest_marker("multiprocess") is not None or node.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
    seconds = _file_seconds()  # the slowest files first (above); stable: ties keep the collection order
    items.sort(key=lambda item: -seconds.get(_node_id(item).split("::", 1)[0], 0.0))
