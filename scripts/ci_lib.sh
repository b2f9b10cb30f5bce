# Sourced by .ci/run and the stack scripts (scripts/test_oldest.sh, scripts/test_newest.sh).
#
# run_tests LABEL COMMAND...: run a pytest command with DDPFIX_CI_LABEL=LABEL (tests/ci_record.py names its
# record after it) and say how it ended. Returns pytest's exit code; exit 5 (no test collected or all
# deselected) is a failure too: every selection CI runs names tests, so one that runs none is a renamed or
# removed test, not a pass.
run_tests() {
  local label=$1 rc=0 start=$SECONDS
  shift
  DDPFIX_CI_LABEL=$label "$@" || rc=$?
  if ((rc == 5)); then
    echo "CI: '$label' ran NO test (pytest exit 5): its selection names no existing test"
  elif ((rc != 0)); then
    echo "CI: '$label' FAILED (pytest exit $rc)"
  fi
  echo "CI: '${DDPFIX_CI_STACK:-pinned}' $label took $((SECONDS - start)) s"
  return $rc
}
