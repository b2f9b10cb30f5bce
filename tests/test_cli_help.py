"""What `hf-ddpfix plan` says about its defaults (issue 40, item 6): `--fsdp-version` and `--zero-stage` name their
defaults, and a `--model` that is a model type (or a config class) says its size is that type's default config
(`qwen2_5_vl` is 75.8 B), not the user's checkpoint."""

from __future__ import annotations

from hf_ddpfix.cli import _default_config_note, _parser


def _plan_help() -> str:
    sub = next(a for a in _parser()._actions if a.dest == "command")
    return " ".join(sub.choices["plan"].format_help().split())


def test_plan_help_names_the_defaults():
    text = _plan_help()
    assert "--fsdp-version {1,2} under --parallel fsdp (default: 2)" in text, text
    assert "under --parallel deepspeed (default: 3)" in text and "qwen2_5_vl is 75.8 B" in text, text


def test_a_model_type_says_it_is_the_default_config(tmp_path):
    for spec in ("qwen2_5_vl", "LlamaConfig"):
        assert "the default config of" in _default_config_note(spec) and "--config-kwargs" in _default_config_note(spec)
    for spec in ("Qwen/Qwen2.5-VL-3B-Instruct", str(tmp_path)):  # a Hub id, a folder: the user's own model
        assert _default_config_note(spec) == ""
    assert _default_config_note("qwen2_5_vl", '{"hidden_size": 64}') == ""  # sized by the user
