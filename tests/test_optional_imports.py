"""Optional packages stay out of paths that do not use them (issue 40, item 2).

DeepSpeed prints "Setting accelerator to CPU" when it is imported and bitsandbytes logs a kernels notice: a plain
DDP run must not pay for either because of hf_ddpfix. One fresh interpreter (a subprocess: the test process has
both imported already): bitsandbytes is made unimportable (`sys.modules[...] = None`, as if not installed), every
module of the package is imported, a DDP plan is resolved and `hf-ddpfix plan` runs; then DeepSpeed (installed,
importable) must not have been imported by any of it. (accelerate's `unwrap_model`, which every `Trainer` calls,
imports DeepSpeed whenever it is installed: upstream, listed in docs/examples.md.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from launch import ROOT

CHECK = """
import importlib, pkgutil, sys
sys.modules["bitsandbytes"] = None  # as if not installed: `import bitsandbytes` raises ImportError
import hf_ddpfix
names = [m.name for m in pkgutil.walk_packages(hf_ddpfix.__path__, "hf_ddpfix.") if m.name != "hf_ddpfix.__main__"]
for name in names:
    importlib.import_module(name)
from hf_ddpfix import DDPFixConfig, RunFacts, resolve_plan
from hf_ddpfix.cli import main
resolve_plan(RunFacts(parallel="ddp", world_size=2, is_peft=True, checkpointing="non_reentrant"),
             DDPFixConfig.from_env({}))
main(["plan", "--params", "1e9", "--checkpointing", "reentrant"])
print("IMPORTED", len(names), "DEEPSPEED", "deepspeed" in sys.modules)
"""


@pytest.mark.multiprocess
def test_no_module_of_the_package_needs_bitsandbytes_or_imports_deepspeed():
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               "HOME": str(ROOT / "tests")})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("IMPORTED ") and int(last.split()[1]) > 50 and last.endswith("DEEPSPEED False"), last
