#!/usr/bin/env bash
# CI, third stack: the unit tests (not multiprocess) and a few 2-process cells on the NEWEST releases of
# transformers, accelerate, peft, trl, deepspeed and bitsandbytes, resolved when the venv is built
# (unpinned; torch stays 2.13.0, the CPU build CI uses everywhere), in a venv of its own.
#
# The venv is cached under ~/.cache/hf_ddpfix/ (or $XDG_CACHE_HOME), keyed by the install lines of this
# script (the lines between the INSTALL markers), so a machine that ran CI before only reinstalls hf_ddpfix
# itself (editable, --no-deps) and editing the list of cells does not rebuild it. A venv is used only when its
# install finished (.complete marker). HF_DDPFIX_NEWEST_REFRESH=1 rebuilds it (picks up new releases);
# HF_DDPFIX_NEWEST_VENV overrides the place. The versions it resolved are printed first.
set -euo pipefail
cd "$(dirname "$0")/.."

key=$(sed -n '/^# INSTALL-BEGIN/,/^# INSTALL-END/p' scripts/test_newest.sh | sha256sum | cut -c1-12)
venv=${HF_DDPFIX_NEWEST_VENV:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/hf_ddpfix/venv-newest-$key}
pip_q=(--quiet --disable-pip-version-check)
if [[ "${HF_DDPFIX_NEWEST_REFRESH:-0}" == 1 ]]; then rm -rf "$venv"; fi
# INSTALL-BEGIN
if [[ ! -f "$venv/.complete" ]]; then
  rm -rf "$venv"
  python -m venv "$venv"  # a plain venv: it must not see the pinned stack of the main environment
  # torch first and exactly (a bare `torch` requirement would pull a multi-GB CUDA build); the rest newest
  "$venv/bin/python" -m pip install "${pip_q[@]}" "torch==2.13.0"
  DS_BUILD_OPS=0 "$venv/bin/python" -m pip install "${pip_q[@]}" "torch==2.13.0" \
    transformers accelerate peft trl deepspeed bitsandbytes datasets evaluate pillow pytest pytest-timeout
  # DeepSpeed's CPU shared-memory op, built once into this venv's own extension cache
  TORCH_EXTENSIONS_DIR="$venv/torch_extensions" DS_ACCELERATOR=cpu \
    "$venv/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
  touch "$venv/.complete"
fi
# INSTALL-END
export TORCH_EXTENSIONS_DIR="$venv/torch_extensions"
"$venv/bin/python" -m pip install "${pip_q[@]}" --no-deps -e .
"$venv/bin/python" -m pip check >/dev/null
"$venv/bin/python" -c "import torch, transformers, accelerate, peft, trl, deepspeed, bitsandbytes, hf_ddpfix; \
print('newest stack: torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', \
accelerate.__version__, 'peft', peft.__version__, 'trl', trl.__version__, 'deepspeed', deepspeed.__version__, \
'bitsandbytes', bitsandbytes.__version__)"

export OMP_NUM_THREADS=1
py=("$venv/bin/python" -m pytest -q -p no:cacheprovider)
"${py[@]}" tests -m "not multiprocess"
# 2-process cells (gloo): long context under DDP vs a single-process stock reference, TiledMLP + tiled loss
# under DDP (patched calls counted: MLPs x steps x passes, no fallback), the reentrant-checkpointing fix
# through the Trainer, and a VLM matrix cell with gradient accumulation.
"${py[@]}" \
  "tests/test_long_context.py::test_two_process_ddp_equals_single_process_stock_reference" \
  "tests/test_tiled.py::test_two_process_training_equals_single_process_reference[tiled_ddp.py-TILED_DDP]" \
  "tests/test_trainer_entry_points.py::test_ddp_with_reentrant_checkpointing_matches_single_process[patch]" \
  "tests/test_matrix.py::test_cell_trains_in_sync_with_stock_loss[vlm-ckpt-nonreentrant-ga-2]"
bash scripts/run_examples.sh "$venv/bin/python"
