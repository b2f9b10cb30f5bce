"""patches/sitecustomize.py: PYTHONPATH=patches patches every Trainer with no code change (TRL included)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import ROOT, torchrun

PATCHES = ROOT / "patches"
EXAMPLE = ROOT / "examples" / "trl_sft.py"

_PROBE = """
import sys
print("AT_START", "transformers" in sys.modules, "hf_ddpfix" in sys.modules, "torch" in sys.modules)
from transformers import Trainer
import hf_ddpfix.trainer as t
print("PATCHED", t.is_patched(), t._layer is not None and Trainer._inner_training_loop is t._layer.inner_training_loop)
"""


def _python(code: str, pythonpath: list[Path], **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_DDPFIX_DISABLE")}
    full.update(PYTHONPATH=os.pathsep.join(map(str, pythonpath)), OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120,
                          cwd=str(ROOT))


def test_sitecustomize_patches_trainer_lazily_on_first_import():
    done = _python(_PROBE, [PATCHES, ROOT])
    assert done.returncode == 0, done.stderr
    assert "AT_START False False False" in done.stdout  # nothing heavy imported at interpreter start
    assert "PATCHED True True" in done.stdout


def test_disable_env_var_turns_the_patch_off():
    done = _python(_PROBE, [PATCHES, ROOT], HF_DDPFIX_DISABLE="1")
    assert done.returncode == 0, done.stderr
    assert "PATCHED False False" in done.stdout


def test_unrecognised_disable_value_fails_at_trainer_import_naming_the_variable_and_values():
    done = _python(_PROBE, [PATCHES, ROOT], HF_DDPFIX_DISABLE="banana")
    assert done.returncode != 0, done.stdout
    assert "HF_DDPFIX_DISABLE='banana' is not a recognised value; allowed: 1/true/yes/on" in done.stderr
    assert "0/false/no/off" in done.stderr
    off = _python(_PROBE, [PATCHES, ROOT], HF_DDPFIX_DISABLE="off")
    assert off.returncode == 0 and "PATCHED True True" in off.stdout, off.stderr


def test_chains_to_the_sitecustomize_it_shadows(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE_RAN'] = 'yes'\n")
    code = "import os\nprint('OTHER', os.environ.get('OTHER_SITECUSTOMIZE_RAN'))\n" + _PROBE
    done = _python(code, [PATCHES, other, ROOT])
    assert done.returncode == 0, done.stderr
    assert "OTHER yes" in done.stdout and "PATCHED True True" in done.stdout


def test_invalid_setting_fails_at_trainer_import_naming_the_variable():
    done = _python(_PROBE, [PATCHES, ROOT], HF_DDPFIX_STATIC_GRAPH="sometimes")
    assert done.returncode != 0 and "HF_DDPFIX_STATIC_GRAPH='sometimes'" in done.stderr


@pytest.mark.multiprocess
def test_unmodified_trl_sft_script_stock_fails_and_trains_with_patches(tmp_path):
    """Stock DDP: 'ready only once' (reentrant checkpointing + LoRA). PYTHONPATH=patches: trains, ranks equal."""
    stock = torchrun(EXAMPLE, "--output-dir", str(tmp_path / "stock"), timeout=150, check=False,
                     env={"HF_DDPFIX_DISABLE": "1"})
    assert stock.returncode != 0 and "Expected to mark a variable ready only once" in stock.stdout

    out = tmp_path / "weights"
    path = os.pathsep.join([str(PATCHES), str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = torchrun(EXAMPLE, "--output-dir", str(tmp_path / "patched"), "--dump-weights", str(out),
                    timeout=150, env={"PYTHONPATH": path})
    assert done.stdout.count("hf_ddpfix=on") == 2, done.stdout[-3000:]
    r0, r1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert r0.keys() == r1.keys() and len(r0) > 0
    for name in r0:
        assert torch.equal(r0[name], r1[name]), name
