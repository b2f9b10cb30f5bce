#!/usr/bin/env bash
# Install hf_ddpfix with the pinned, tested stack. torch first: `torch==2.13.0` is the CPU build on this
# kind of machine; a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev,vlm]"
python -c "import torch, transformers, accelerate, peft, hf_ddpfix; print('installed: torch', torch.__version__, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__)"
