#!/usr/bin/env bash
# The GPU check's calls of the GPU leases as docs/gpu.md gives them: the call's own
# gpu_check.sh arguments, read from the page (so that the test cannot drift from what a
# reader runs), with --device cuda made --device cpu (the plumbing at tiny sizes), its
# sections and --budget-s as documented; then what each of its sections' results must show
# for the check to have checked something (tests/e2e/gpu_check_expect.py). "budget": the
# check asked for call d's old --sections checkpoint --budget-s 60, where the budget would cut
# the checkpoint measurement's time limit: it must refuse before running anything, naming the
# item, rather than kill it later.
# usage: gpu_check_calls.sh SOURCE_DIR BIN_DIR CALL|budget   (CALL: a letter of docs/gpu.md's calls)
set -u
root="$1"; bin="$2"; call="$3"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
if [ "$call" = budget ]; then
  args=(--device cpu --sections checkpoint --budget-s 60); want_rc=1
else
  mapfile -t doc < <("$py" "$root/tools/gpu_check_report.py" --calls "$root/docs/gpu.md" --call "$call") ||
    fail "no call '$call' in docs/gpu.md"
  [ "${#doc[@]}" -gt 0 ] || fail "no call '$call' in docs/gpu.md"
  args=(); cuda=0
  for ((i = 0; i < ${#doc[@]}; i++)); do
    if [ "${doc[$i]}" = --device ] && [ "${doc[$((i + 1))]:-}" = cuda ]; then
      args+=(--device cpu); cuda=1; i=$((i + 1))
    else
      args+=("${doc[$i]}")
    fi
  done
  [ "$cuda" = 1 ] || fail "call $call's documented command has no --device cuda: ${doc[*]}"
  want_rc=0
fi
echo "gpu_check.sh OUT ${args[*]}"
export FACESHARD_BUILD_DIR="$(cd "$bin/.." && pwd)" FACESHARD_PYTHON="$py" FACESHARD_TEST_PYTHON="$py"
t0=$(date +%s)
"$root/tools/gpu_check.sh" "$work/out" "${args[@]}" > "$work/check.log" 2>&1
rc=$?
tail -30 "$work/check.log"
echo "gpu_check.sh exited $rc after $(( $(date +%s) - t0 )) s"
[ "$rc" = "$want_rc" ] || fail "gpu_check.sh ${args[*]} exited $rc, expected $want_rc"
for f in results.json summary.txt logs.tar.gz; do [ -s "$work/out/$f" ] || fail "gpu_check wrote no $f"; done
"$py" "$root/tests/e2e/gpu_check_expect.py" "$work/out/results.json" "$call" "$root" || exit 1
echo PASS
