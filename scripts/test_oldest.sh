#!/usr/bin/env bash
# CI, second stack: the unit tests (not multiprocess) and a few 2-process cells on the OLDEST supported
# stack (constraints-oldest.txt, = pyproject.toml's lower bounds), in a venv of its own.
#
# The venv is cached under ~/.cache/hf_ddpfix/ (or $XDG_CACHE_HOME), keyed by the constraints file and this
# script's install lines (between the INSTALL markers: editing the list of cells does not rebuild it), so a
# machine that ran CI before only reinstalls hf_ddpfix itself (editable; its requirements are already met). A venv is used only when its install finished (.complete marker).
# Override the place with HF_DDPFIX_OLDEST_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."

key=$(cat constraints-oldest.txt <(sed -n '/^# INSTALL-BEGIN/,/^# INSTALL-END/p' scripts/test_oldest.sh) | sha256sum | cut -c1-12)
venv=${HF_DDPFIX_OLDEST_VENV:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/hf_ddpfix/venv-oldest-$key}
pip_q=(--quiet --disable-pip-version-check)
# INSTALL-BEGIN
if [[ ! -f "$venv/.complete" ]]; then
  rm -rf "$venv"
  python -m venv "$venv"  # a plain venv: it must not see the pinned stack of the main environment
  # torch first and exactly (a bare `torch` requirement would pull a multi-GB CUDA build)
  "$venv/bin/python" -m pip install "${pip_q[@]}" "torch==2.13.0"
  "$venv/bin/python" -m pip install "${pip_q[@]}" -c constraints-oldest.txt \
    transformers accelerate peft trl datasets evaluate pillow pytest pytest-timeout
  touch "$venv/.complete"
fi
# INSTALL-END
# hf_ddpfix with its declared lower bounds: pip checks pyproject.toml's requirements against this stack
"$venv/bin/python" -m pip install "${pip_q[@]}" -c constraints-oldest.txt -e .
"$venv/bin/python" -m pip check >/dev/null
"$venv/bin/python" -c "import torch, transformers, accelerate, peft, trl, hf_ddpfix; print('oldest stack: torch', \
torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', \
peft.__version__, 'trl', trl.__version__)"

export OMP_NUM_THREADS=1
py=("$venv/bin/python" -m pytest -q -p no:cacheprovider)
# transformers 5.0.0-5.1's Qwen2.5-VL cannot run a forward from inputs_embeds alone (get_rope_index reads
# input_ids.shape; stock raises the same), so that one input form is not run here (printed, not hidden).
upstream=("tests/test_vlm.py::test_dummy_reaches_every_vision_param_for_every_output_form[inputs_embeds]")
echo "oldest stack: NOT RUN (the stock model cannot run it on this transformers): ${upstream[*]}"
"${py[@]}" tests -m "not multiprocess" "${upstream[@]/#/--deselect=}"
# 2-process cells (gloo): the reentrant-checkpointing fix vs a single-process reference (exact), stock's
# failure on this stack, matrix cells for text / VLM with gradient accumulation, and sequence parallelism
# through the Trainer (2 and 4 processes: this stack's inline clipping and grad_norm logging) and its Ulysses
# parity (text, FSDP2, Qwen2.5-VL / Qwen2-VL at this release). Not here, as the versions do not allow them: the
# trainer zoo (trl 0.24's DPOTrainer cannot process a text-only row of a vision dataset: IndexError in its
# process_row, in its dataset preparation before any training) and ZeRO skip-unused (no DeepSpeed in this stack).
"${py[@]}" \
  "tests/test_sequence_parallel.py::test_trainer_with_sequence_parallel_equals_the_run_without_it_and_one_process" \
  "tests/test_sequence_parallel.py::test_ulysses_attention_and_a_lora_llama_match_one_process_on_the_full_sequence[2]" \
  "tests/test_trainer_entry_points.py::test_ddp_with_reentrant_checkpointing_matches_single_process[patch]" \
  "tests/test_trainer_entry_points.py::test_stock_ddp_with_reentrant_checkpointing_fails" \
  "tests/test_matrix.py::test_cell_trains_in_sync_with_stock_loss[text-ckpt-reentrant-find-unused-auto]" \
  "tests/test_matrix.py::test_cell_trains_in_sync_with_stock_loss[vlm-ckpt-nonreentrant-ga-2]"
bash scripts/run_examples.sh "$venv/bin/python"
