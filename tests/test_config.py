"""DDPFixConfig: sources, precedence, validation, compatibility variables."""

import pytest

from hf_ddpfix.config.options import OPTIONS, DDPFixConfig, env_name, env_table


def test_unset_environment_leaves_every_option_unset():
    cfg = DDPFixConfig.from_env({})
    assert all(getattr(cfg, name) is None for name in OPTIONS)
    assert cfg.source("static_graph") == "default"


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("ON", True), ("0", False),
                                          ("no", False), ("auto", None), ("", None)])
def test_boolean_spellings(raw, expected):
    assert DDPFixConfig.from_env({"HF_DDPFIX_STATIC_GRAPH": raw}).static_graph is expected


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_every_option_rejects_garbage_naming_the_variable(option):
    var = env_name(option)
    with pytest.raises(ValueError) as err:
        DDPFixConfig.from_env({var: "maybe?"})
    assert var in str(err.value) and "allowed" in str(err.value).lower()


def test_unsloth_disable_static_graph_maps_to_static_graph_off():
    cfg = DDPFixConfig.from_env({"UNSLOTH_DISABLE_DDP_STATIC_GRAPH": "1"})
    assert cfg.static_graph is False and cfg.source("static_graph") == "UNSLOTH_DISABLE_DDP_STATIC_GRAPH"
    # "=0" asks for nothing
    assert DDPFixConfig.from_env({"UNSLOTH_DISABLE_DDP_STATIC_GRAPH": "0"}).static_graph is None


def test_unsloth_compat_variables():
    cfg = DDPFixConfig.from_env({
        "UNSLOTH_DISABLE_DDP_STATIC_GRAPH_FOR_GRAD_CHECKPOINT": "1",
        "UNSLOTH_USE_GRADIENT_CHECKPOINTING": "1",
        "UNSLOTH_TILED_MLP": "target:2.5",
    })
    assert cfg.static_graph_with_checkpointing is False
    assert cfg.assume_checkpointing is True
    assert cfg.tiled_mlp == "target:2.5"


def test_bad_unsloth_value_names_the_unsloth_variable():
    with pytest.raises(ValueError, match="UNSLOTH_DISABLE_DDP_STATIC_GRAPH"):
        DDPFixConfig.from_env({"UNSLOTH_DISABLE_DDP_STATIC_GRAPH": "sometimes"})
    with pytest.raises(ValueError, match="UNSLOTH_TILED_MLP"):
        DDPFixConfig.from_env({"UNSLOTH_TILED_MLP": "target:-1"})


def test_contradicting_variables_are_reported_not_resolved():
    with pytest.raises(ValueError) as err:
        DDPFixConfig.from_env({"HF_DDPFIX_STATIC_GRAPH": "1", "UNSLOTH_DISABLE_DDP_STATIC_GRAPH": "1"})
    assert "HF_DDPFIX_STATIC_GRAPH" in str(err.value) and "UNSLOTH_DISABLE_DDP_STATIC_GRAPH" in str(err.value)


def test_agreeing_variables_are_fine():
    cfg = DDPFixConfig.from_env({"HF_DDPFIX_STATIC_GRAPH": "0", "UNSLOTH_DISABLE_DDP_STATIC_GRAPH": "1"})
    assert cfg.static_graph is False


def test_static_forced_on_while_forbidden_with_assumed_checkpointing_is_a_conflict():
    with pytest.raises(ValueError, match="contradicts"):
        DDPFixConfig.from_env({"HF_DDPFIX_STATIC_GRAPH": "1",
                               "UNSLOTH_DISABLE_DDP_STATIC_GRAPH_FOR_GRAD_CHECKPOINT": "1",
                               "UNSLOTH_USE_GRADIENT_CHECKPOINTING": "1"})


def test_explicit_argument_beats_environment_and_records_source():
    cfg = DDPFixConfig.from_env({"HF_DDPFIX_STATIC_GRAPH": "0"}, static_graph=True)
    assert cfg.static_graph is True and cfg.source("static_graph") == "argument"
    assert "static_graph=True (argument)" in cfg.describe()


def test_unknown_option_and_bad_explicit_value():
    with pytest.raises(ValueError, match="unknown hf_ddpfix option"):
        DDPFixConfig.from_env({}, static_grahp=True)
    with pytest.raises(ValueError, match="checkpointing"):
        DDPFixConfig(checkpointing="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sync_check_steps"):
        DDPFixConfig(sync_check_steps=-3)


@pytest.mark.parametrize("raw,expected", [("on", "on"), ("1", "on"), ("TRUE", "on"), ("auto", "auto"), ("4", "4"),
                                          ("arctic", "arctic"), ("off", "off"), ("0", "off"), ("Target", "target"),
                                          ("target:1.5", "target:1.5")])
def test_tiling_spellings(raw, expected):
    """An explicit on/1/true asks for tiling ("on"), never a spelling of auto (which the memory plan may leave off)."""
    assert DDPFixConfig.from_env({"HF_DDPFIX_TILED_MLP": raw}).tiled_mlp == expected


@pytest.mark.parametrize("raw,expected", [("1", "arctic"), ("true", "arctic"), ("arctic", "arctic"), ("0", "off"),
                                          ("target", "target"), ("target:2", "target:2"), ("auto", "auto")])
def test_unsloth_tiled_mlp_means_what_unsloth_means(raw, expected):
    """unsloth_zoo's patch_tiled_mlp reads UNSLOTH_TILED_MLP=1 as "arctic": a request to tile with that rule."""
    cfg = DDPFixConfig.from_env({"UNSLOTH_TILED_MLP": raw})
    assert cfg.tiled_mlp == expected and cfg.source("tiled_mlp") == "UNSLOTH_TILED_MLP"


def test_unsloth_tiled_mlp_against_hf_ddpfix_variable():
    assert DDPFixConfig.from_env({"UNSLOTH_TILED_MLP": "1", "HF_DDPFIX_TILED_MLP": "arctic"}).tiled_mlp == "arctic"
    with pytest.raises(ValueError, match="HF_DDPFIX_TILED_MLP='on' contradicts UNSLOTH_TILED_MLP='1'"):
        DDPFixConfig.from_env({"UNSLOTH_TILED_MLP": "1", "HF_DDPFIX_TILED_MLP": "on"})


@pytest.mark.parametrize("var,raw", [("HF_DDPFIX_TILED_MLP", "sometimes"), ("UNSLOTH_TILED_MLP", "sometimes"),
                                     ("HF_DDPFIX_TILED_LOSS", "maybe"), ("HF_DDPFIX_LONG_CONTEXT", "most"),
                                     ("HF_DDPFIX_OFFLOAD_ACTIVATIONS", "perhaps")])
def test_bad_memory_setting_names_the_variable_and_the_allowed_values(var, raw):
    with pytest.raises(ValueError, match=rf"{var}='{raw}'.*(?i:allowed).*\bon\b.*"):
        DDPFixConfig.from_env({var: raw})


def test_checkpointing_choice_accepts_dash_spelling():
    assert DDPFixConfig.from_env({"HF_DDPFIX_CHECKPOINTING": "non-reentrant"}).checkpointing == "non_reentrant"


def test_env_table_covers_every_option():
    names = [row[0] for row in env_table()]
    assert names == [env_name(o) for o in OPTIONS]


def test_options_page_documents_every_variable():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "options.md").read_text()
    for var, aliases, _ in env_table():
        assert f"`{var}`" in readme, var
        for alias in filter(None, aliases.split(", ")):
            assert f"`{alias}`" in readme, alias


def test_options_page_table_is_rendered_from_the_config():
    """docs/options.md's table is what scripts/options_table.py renders from DDPFixConfig's fields: a doc or
    alias changed in config/options.py without `python scripts/options_table.py --readme` fails here."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "options_table.py"
    spec = importlib.util.spec_from_file_location("options_table", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    block = table.page_block(Path(table.PAGE).read_text())
    assert block == table.render(), "docs/options.md is stale: python scripts/options_table.py --readme"
    # the compatibility variable reads as what it does: UNSLOTH_DISABLE_DDP_STATIC_GRAPH=1 turns static graph off
    assert "`UNSLOTH_DISABLE_DDP_STATIC_GRAPH`=1 means 0" in block
    # HF_DDPFIX_TILED_LOSS=auto is accepted: say what it means (the memory plan decides, plan/memory_fit.py)
    assert "auto (on where the memory plan needs it; on when device memory or length is unknown)" in block


def test_every_variable_named_in_the_package_is_an_option():
    """Messages and docstrings may spell `HF_DDPFIX_<OPTION>=value`; a renamed option must not leave a stale hint."""
    import re
    from pathlib import Path

    import hf_ddpfix

    known = {env_name(o) for o in OPTIONS} | {"HF_DDPFIX_DISABLE", "HF_DDPFIX_OLDEST_VENV"}
    root = Path(hf_ddpfix.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for var in re.findall(r"HF_DDPFIX_[A-Z0-9_]*[A-Z0-9]", path.read_text()):
            assert var in known, f"{path.name} names {var}, which is not an option (known: {sorted(known)})"
