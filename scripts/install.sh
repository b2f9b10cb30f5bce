#!/usr/bin/env bash
# Install hf_ddpfix with the pinned, tested stack. torch first: `torch==2.13.0` is the CPU build on this
# kind of machine; a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# A warning, not a stop: CI installs into its container's python on purpose.
if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ] \
    && python -c 'import sys; sys.exit(sys.prefix != sys.base_prefix)'; then
  echo "install.sh: warning: no virtual environment active; installing into $(command -v python)" \
       "(python -m venv .venv && . .venv/bin/activate first to keep it apart)" >&2
fi
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev,vlm,qlora]"
# DeepSpeed without its CUDA ops (they are JIT-built when used); on CPU it uses its own gloo-backed accelerator.
DS_BUILD_OPS=0 python -m pip install --quiet --disable-pip-version-check -c constraints.txt "deepspeed"
# Pre-build DeepSpeed's CPU shared-memory op once (45-210 s, cached in ~/.cache/torch_extensions), so the
# multi-process tests do not each pay or race for the compile.
DS_ACCELERATOR=cpu python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
python -c "import torch, transformers, accelerate, peft, hf_ddpfix; print('installed: torch', torch.__version__, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__)"
