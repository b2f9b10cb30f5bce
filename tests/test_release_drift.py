"""What the newest releases deprecate or refuse, kept out of the project's own code (issue 47, item 4 and 5):

- torch 2.15 deprecates ``torch.distributed.nn.functional`` (its differentiable collectives warn); the Ulysses
  exchange has its own autograd function around ``dist.all_to_all_single`` (ops/sequence_parallel/ulysses.py,
  exact and differentiable on 2.13-2.15: tests/test_sequence_parallel.py's parity and gradcheck launches);
- transformers 5.24 refuses ``model.add_adapter`` / ``load_adapter`` / ``set_adapter`` / ``enable_adapters`` /
  ``disable_adapters`` / ``active_adapters`` / ``get_adapter_state_dict`` / ``delete_adapter`` below PEFT 0.22
  (newest: 0.21.2); ``peft.get_peft_model``, which the package, its examples and the tests use, is not affected.

Source scans of hf_ddpfix/, patches/, examples/ and benchmarks/: they fail on the first such call added.
Shown failing (2026-12-02): with ``from torch.distributed.nn.functional import all_to_all_single`` back in
ulysses.py, ``test_no_deprecated_torch_collectives`` names the file.
"""

from __future__ import annotations

import re

from launch import ROOT

FOLDERS = ("hf_ddpfix", "patches", "examples", "benchmarks")


def _sources():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT), path.read_text()


def test_no_deprecated_torch_collectives():
    used = re.compile(r"^\s*(from|import)\s+torch\.distributed\.nn\b|torch\.distributed\.nn\.functional\.\w+\(", re.M)
    found = [str(p) for p, text in _sources() if used.search(text)]
    assert not found, f"torch.distributed.nn.functional is deprecated in torch 2.15: {found}"


#: PeftAdapterMixin's methods transformers 5.24 gates on PEFT >= 0.22 (MIN_PEFT_VERSION)
GATED = ("add_adapter", "load_adapter", "set_adapter", "enable_adapters", "disable_adapters", "active_adapters",
         "get_adapter_state_dict", "delete_adapter")


def test_no_call_of_the_adapter_methods_transformers_5_24_gates_on_peft_0_22():
    pattern = re.compile(rf"\.({'|'.join(GATED)})\(")
    found = [f"{p}: {m.group(1)}" for p, text in _sources() for m in pattern.finditer(text)]
    assert not found, ("transformers 5.24 refuses these below PEFT 0.22 (not released as of 2026-12-02); use "
                       f"peft.get_peft_model / PeftModel methods: {found}")
