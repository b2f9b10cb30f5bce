"""A script beside the clone imports the package (issue 40, item 1).

A newcomer clones into `~/hf_ddpfix`, installs it (`pip install -e .`), writes `~/train.py` and launches it from
`~`: the script's folder (or the working directory) is `sys.path[0]`, where the clone folder, which has no
`__init__.py`, is a namespace package `hf_ddpfix`. setuptools' default editable install is an import finder
that Python asks only after its path search, so the empty namespace won: "cannot import name
'checkpointing_training_args' from 'hf_ddpfix' (unknown location)". pyproject.toml makes the editable install a
path entry instead; a regular package on any path entry wins over a namespace folder on an earlier one.

The same install exposes only `hf_ddpfix`: `tests`, `scripts`, `benchmarks`, `examples` and `patches` of the
clone are no importable names (issue 49, item 6: the repository root was the path entry; now src/, which holds
only a link to the package). Shown failing (2026-12-02) with pyproject.toml's `package-dir = {"" = "."}` (as
before): "pip install -e . exposes ['tests', 'scripts', 'benchmarks', 'examples', 'patches']".

One test, the real thing: a copy of the package installed editable (`--no-deps`) into a throw-away venv that sees
the system site-packages, then the public API imported from the clone's parent by every launch route: `python
train.py`, `python -c`, `torchrun`, `accelerate launch`, and `PYTHONPATH=hf_ddpfix/patches` (with the install,
and with no install of this copy at all: patches/ then adds its own repository root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch import ROOT

SCRIPT = """
import json, hf_ddpfix
from hf_ddpfix import PlanError, resolve_plan  # a name of the public API (the light ones: no transformers)
print("IMPORTED " + json.dumps(hf_ddpfix.__file__))
"""
PATCHED = """
import json, transformers.trainer, hf_ddpfix
print("IMPORTED " + json.dumps(hf_ddpfix.__file__))
import hf_ddpfix.trainer
print("PATCHED " + json.dumps(hf_ddpfix.trainer.is_patched()))
"""


#: top-level folders of a clone that are not the package: never importable names after `pip install -e .`
NOT_MODULES = ("tests", "scripts", "benchmarks", "examples", "patches")
MARKER = "_hf_ddpfix_clone_marker"


def _copy_clone(parent: Path) -> Path:
    clone = parent / "hf_ddpfix"  # the clone's folder has the package's name, as `git clone .../hf_ddpfix` makes
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("hf_ddpfix", "patches", "src"):
        shutil.copytree(ROOT / name, clone / name, ignore=ignore, symlinks=True)  # src/hf_ddpfix: a link
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, clone / name)
    for name in NOT_MODULES:  # a module in each (the real folders' contents are not needed to show it)
        (clone / name).mkdir(exist_ok=True)
        (clone / name / f"{MARKER}.py").write_text("")
    return clone


# Each `import tests.<marker>` (and the other folders) must fail: the marker exists only in the clone, so it
# imports exactly when the clone's root is on the path (`tests` itself may be importable from another
# environment: this machine's own editable install of the project, a namespace package that merges every
# `tests` folder on the path).
NOT_IMPORTABLE = f"""
import importlib, json, sys
found = {{}}
for name in {NOT_MODULES!r}:
    try:
        importlib.import_module(name + ".{MARKER}")
        found[name] = True
    except ImportError:
        found[name] = False
print("FOUND " + json.dumps(found))
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str], label: str) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=180)
    assert done.returncode == 0, f"{label} exited {done.returncode}\n{done.stdout[-4000:]}"
    return done.stdout


def _imported(out: str, label: str) -> str:
    found = [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines() if ln.startswith("IMPORTED ")]
    assert found, f"{label}: nothing imported\n{out[-3000:]}"
    return found[0]


@pytest.mark.multiprocess
def test_a_script_beside_the_clone_imports_the_installed_package_on_every_launch_route(tmp_path):
    clone = _copy_clone(tmp_path)
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "train_patched.py").write_text(PATCHED)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps", "--no-build-isolation",
          "--disable-pip-version-check", "-e", str(clone)], tmp_path, dict(os.environ), "pip install -e")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no test-suite path: what a user has
    env.update({"OMP_NUM_THREADS": "1", "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"})
    package = str(clone / "hf_ddpfix" / "__init__.py")  # imported through src/hf_ddpfix, a link to it
    routes = {
        "python train.py": [str(py), "train.py"],
        "python -c": [str(py), "-c", SCRIPT],
        "torchrun": [str(py), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"],
        "accelerate launch": [str(py), "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                              "train.py"],
    }
    for label, cmd in routes.items():
        assert os.path.realpath(_imported(_run(cmd, tmp_path, env, label), label)) == package, label
    # only the package is exposed: the clone's other folders are no importable names (from its parent and from
    # elsewhere)
    for cwd in (tmp_path, tmp_path / "venv"):
        out = _run([str(py), "-c", NOT_IMPORTABLE], cwd, env, "import tests")
        found = json.loads(next(ln for ln in out.splitlines() if ln.startswith("FOUND ")).split(" ", 1)[1])
        assert not any(found.values()), f"pip install -e . exposes {[n for n, v in found.items() if v]} ({cwd})"

    # the zero-code route, from the clone's parent: installed, and with no install of this copy at all
    routes_patches = [("patches/ (installed)", str(py))]
    # "not installed" needs an interpreter where no hf_ddpfix is installed: the test's own python has one when
    # README command 2 (install.sh, editable) set it up, as on CI; then the case cannot be built here (said).
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('hf_ddpfix') is None)"],
                           cwd="/", capture_output=True, text=True)
    if probe.stdout.strip() == "True":
        routes_patches.append(("patches/ (not installed)", sys.executable))
    else:
        print("patches/ (not installed): not run, this interpreter has hf_ddpfix installed (README command 2)")
    for label, python in routes_patches:
        out = _run([python, "train_patched.py"], tmp_path, {**env, "PYTHONPATH": "hf_ddpfix/patches"}, label)
        assert os.path.realpath(_imported(out, label)) == package and "PATCHED true" in out, (label, out[-3000:])
