#!/usr/bin/env bash
# CI, third stack: the unit tests (not multiprocess), the 2-process cells that matter most and every example under
# every launch config (2 processes) on the NEWEST releases of torch, transformers, accelerate, peft, trl,
# deepspeed and bitsandbytes (unpinned), in a venv of its own. torch is the newest release the package index
# serves (2.15.0 on 2026-12-02: a CUDA 13.2 build, several GB with its nvidia packages; it runs on the CPU.
# Without its nvidia packages it does not import: libcudnn.so.9 missing, so it is installed whole). These
# machines cap pip at the torch that lies on their disk (/etc/xdg/pip: torch<=2.14.1, a pip config file): every
# pip command that installs into this venv runs with PIP_CONFIG_FILE=/dev/null, so the cap is lifted for this
# venv only (the main environment and the oldest stack keep the machine's config).
#
# The venv is cached under ~/.cache/hf_ddpfix/ (or $XDG_CACHE_HOME), keyed by the install lines of this
# script (the lines between the INSTALL markers); a venv is used only when its install finished (.complete
# marker). Every run re-resolves the versions first: a `pip install --upgrade --dry-run` of the same
# requirements into the cached venv (~10 s) says which newer releases exist; only then are they installed in
# place (and DeepSpeed's CPU op rebuilt when DeepSpeed moved). No index reachable: it says so and tests the
# cached versions. HF_DDPFIX_NEWEST_REFRESH=1 rebuilds the venv from scratch; HF_DDPFIX_NEWEST_VENV overrides
# the place. The versions under test are printed before any test. `--install-only`: build or refresh the venv,
# test nothing (.ci/run builds it in the background while the pinned stack tests).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ci_lib.sh

key=$(sed -n '/^# INSTALL-BEGIN/,/^# INSTALL-END/p' scripts/test_newest.sh | sha256sum | cut -c1-12)
venv=${HF_DDPFIX_NEWEST_VENV:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/hf_ddpfix/venv-newest-$key}
pip_q=(--quiet --disable-pip-version-check)
if [[ "${HF_DDPFIX_NEWEST_REFRESH:-0}" == 1 ]]; then rm -rf "$venv"; fi
# INSTALL-BEGIN
# everything newest, torch included (the registry's newest is a CUDA build: it runs on the CPU), without the
# machine's pip config (its torch cap)
newest=(torch transformers accelerate peft trl deepspeed bitsandbytes datasets evaluate pillow pytest
        pytest-timeout)
vpip() { PIP_CONFIG_FILE=/dev/null DS_BUILD_OPS=0 "$venv/bin/python" -m pip "$@"; }
build_shm_op() {  # DeepSpeed's CPU shared-memory op, built into this venv's own extension cache
  rm -rf "$venv/torch_extensions"
  TORCH_EXTENSIONS_DIR="$venv/torch_extensions" DS_ACCELERATOR=cpu \
    "$venv/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
}
if [[ ! -f "$venv/.complete" ]]; then
  rm -rf "$venv"
  python -m venv "$venv"  # a plain venv: it must not see the pinned stack of the main environment
  vpip install "${pip_q[@]}" "${newest[@]}"
  build_shm_op
  touch "$venv/.complete"
fi
# INSTALL-END
# Re-resolve: what would upgrading the same requirements change in the cached venv? (new releases since it was
# built, or since the last CI run that upgraded it)
report=$(mktemp)
trap 'rm -f "$report"' EXIT
resolve_start=$SECONDS
if vpip install "${pip_q[@]}" --upgrade --dry-run --report "$report" \
     "${newest[@]}" >/dev/null 2>&1; then
  moved=$("$venv/bin/python" -c "import json, sys; r = json.load(open(sys.argv[1])); \
print(' '.join(i['metadata']['name'] + '==' + i['metadata']['version'] for i in r['install']))" "$report")
  if [[ -n "$moved" ]]; then
    echo "newest stack: newer releases than the cached venv: $moved (installing them in place)"
    vpip install "${pip_q[@]}" --upgrade "${newest[@]}"
    if [[ " ${moved,,} " == *" deepspeed=="* ]]; then build_shm_op; fi
  else
    echo "newest stack: re-resolved in $((SECONDS - resolve_start))s, no newer release than the cached venv"
  fi
else
  echo "newest stack: could NOT re-resolve (package index unreachable): testing the cached versions below"
fi
if [[ "${1:-}" == --install-only ]]; then exit 0; fi  # hf_ddpfix itself: when testing (one stack at a time)
export TORCH_EXTENSIONS_DIR="$venv/torch_extensions"
vpip install "${pip_q[@]}" --no-deps -e .
vpip check >/dev/null
"$venv/bin/python" -c "import torch, transformers, accelerate, peft, trl, deepspeed, bitsandbytes, hf_ddpfix; \
print('newest stack: torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', \
accelerate.__version__, 'peft', peft.__version__, 'trl', trl.__version__, 'deepspeed', deepspeed.__version__, \
'bitsandbytes', bitsandbytes.__version__)"

export OMP_NUM_THREADS=1 DDPFIX_CI_STACK=newest
py=("$venv/bin/python" -m pytest -q -p no:cacheprovider)
failed=0
# patches/'s start-up probes (five fresh interpreters: lazy hook, HF_DDPFIX_DISABLE, bad values, chaining) test
# hf_ddpfix's own hook logic, on the pinned stack; here patches/ runs on this stack's Trainer in the TRL launch below
# (stock failing, patched training: "hf_ddpfix=on" on both ranks). ~80 CPU-s idle, ~300 s in CI beside the suite.
probes=("tests/test_patches.py")
echo "newest stack: NOT RUN (patches/ start-up probes: the pinned stack; the TRL launch below runs patches/ here): ${probes[*]}"
run_tests unit "${py[@]}" tests -m "not multiprocess" "${probes[@]/#/--deselect=}" || failed=1
# 2-process cells (gloo): long context under DDP vs a single-process stock reference, TiledMLP + tiled loss
# under DDP (patched calls counted: MLPs x steps x passes, no fallback), the reentrant-checkpointing fix
# through the Trainer, and a VLM matrix cell with gradient accumulation; then the cells that matter most on new
# releases: sequence parallelism through the Trainer (world 2: + composition, patches/, Qwen2.5-VL; its predict()
# names the outputs that are not predictions in ignore_keys, as a user of transformers 5.24 must: the KV cache is
# `cache` there and Qwen-VL adds `image_outputs` on image batches) and its Ulysses parity, the trainer zoo (TRL's
# newest trainers, ZeRO-2/3: its README table is not compared off the pinned stack, its cell classes are), and
# ZeRO skip-unused with accumulation 2 and reentrant checkpointing.
run_tests cells "${py[@]}" \
  "tests/test_long_context.py::test_two_process_ddp_equals_single_process_stock_reference" \
  "tests/test_tiled.py::test_two_process_training_equals_single_process_reference[tiled_ddp.py-TILED_DDP]" \
  "tests/test_trainer_entry_points.py::test_ddp_with_reentrant_checkpointing_matches_single_process[patch]" \
  "tests/test_matrix.py::test_cell_trains_in_sync_with_stock_loss[vlm-ckpt-nonreentrant-ga-2]" \
  "tests/test_sequence_parallel.py::test_trainer_with_sequence_parallel_equals_the_run_without_it_and_one_process[2-2]" \
  "tests/test_sequence_parallel.py::test_ulysses_attention_and_a_lora_llama_match_one_process_on_the_full_sequence[2]" \
  tests/test_trainer_zoo.py \
  "tests/test_deepspeed.py::test_zero_skip_unused_with_accumulation_2_and_reentrant_checkpointing_matches_stock_ddp" \
  "tests/test_eval_outputs.py::test_vlm_outputs_that_differ_by_rank_evaluate_and_predict_as_stock_ddp_under_ddp_fsdp2_and_zero3" \
  || failed=1
# every example under every launch config, 2 processes (README example: DDP, FSDP2 test device, ZeRO-2/3, QLoRA;
# long context under DDP; the unchanged TRL script under DDP, stock failing and patched training)
run_tests examples "${py[@]}" tests/test_examples_launched.py \
  "tests/test_patches.py::test_unmodified_trl_sft_script_stock_fails_and_trains_with_patches" || failed=1
exit $failed
