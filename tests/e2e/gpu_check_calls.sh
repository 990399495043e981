#!/usr/bin/env bash
# The GPU check's calls of a GPU lease (docs/gpu.md: a = env,tests,train; b = step;
# c = tworanks,classifier,capacity; d = checkpoint) run through the real script on the CPU at tiny sizes
# (--device cpu), and what each call's results.json must show for the check to have checked
# something: the GPU tests the binary lists all ran (the CUDA ones skip on the CPU); the resume
# said where it resumed and its losses equal the uninterrupted run's at the same steps; the
# graph cell reports train.cuda_graph asked, not captured, and why (the CPU), is no "graph"
# cell, and its losses equal its eager cell's; the classifier and capacity measured. "budget":
# the step call with a 1-second budget: the cells not started are reported as skipped, and
# the required ones make the check fail. CI runs c and budget here; a and b run as sections
# of e2e.bundle's one check run, which asserts the same (gpu_check_expect.py); each call can
# still be run on its own here by hand.
# usage: gpu_check_calls.sh SOURCE_DIR BIN_DIR a|b|c|d|budget
set -u
root="$1"; bin="$2"; call="$3"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
case "$call" in
  a) args=(--sections env,tests,train --budget-s 600); want_rc=0 ;;
  b) args=(--sections step --budget-s 600); want_rc=0 ;;
  c) args=(--sections tworanks,classifier,capacity --budget-s 600); want_rc=0 ;;
  d) args=(--sections checkpoint --budget-s 600); want_rc=0 ;;
  budget) args=(--sections step --budget-s 1); want_rc=1 ;;
  *) fail "unknown call '$call' (a, b, c, d, budget)" ;;
esac
export FACESHARD_BUILD_DIR="$(cd "$bin/.." && pwd)" FACESHARD_PYTHON="$py" FACESHARD_TEST_PYTHON="$py"
"$root/tools/gpu_check.sh" "$work/out" --device cpu "${args[@]}" > "$work/check.log" 2>&1
rc=$?
tail -30 "$work/check.log"
[ "$rc" = "$want_rc" ] || fail "gpu_check.sh ${args[*]} exited $rc, expected $want_rc"
for f in results.json summary.txt logs.tar.gz; do [ -s "$work/out/$f" ] || fail "gpu_check wrote no $f"; done
"$py" "$root/tests/e2e/gpu_check_expect.py" "$work/out/results.json" "$call" "$root" || exit 1
echo PASS
