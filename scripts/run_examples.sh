#!/usr/bin/env bash
# The three examples as a user runs them, one process, a few steps, with the given python (a stack's venv):
# every example must run on every tested release (transformers 5.23 renamed TrainingArguments switches, and
# an example written with the new names failed on 5.0-5.22 while the suite, on 5.23, stayed green).
#   bash scripts/run_examples.sh /path/to/venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:?usage: run_examples.sh PYTHON}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() {  # name, then the command; its output is shown only when it fails
  local name=$1; shift
  if ! OMP_NUM_THREADS=1 "$@" >"$tmp/$name.log" 2>&1; then
    tail -40 "$tmp/$name.log"; echo "example $name FAILED: $*"; return 1
  fi
  echo "example $name: ok ($(grep -E '^(RESULT|DONE|trained)' "$tmp/$name.log" | tail -1 | cut -c1-120))"
}
run qwen_vl_lora "$python" examples/qwen_vl_lora.py --max-steps 3 --train-size 32 --eval-size 16 \
  --per-device-batch-size 4 --output-dir "$tmp/vl"
run trl_sft "$python" examples/trl_sft.py --steps 2 --output-dir "$tmp/sft"
run long_context_lora "$python" examples/long_context_lora.py --tiny --seq 256 --max-steps 2 --output-dir "$tmp/lc"
