#!/usr/bin/env bash
# The plan of the GPU leases (tools/gpu_check.sh --plan): the calls docs/gpu.md gives, each
# call's items (gpu_check.sh --dry-run) timed from the newest GPU results in docs/benchmarks/,
# must fit: every call within its timeout_s and budget, every lease's timeout_s values plus a
# start of 240 s within 900 s. Then the plan must refuse, with one line, a lease that does not
# fit and a call whose budget would cut a required item (call d's old --budget-s 60); and a
# call's items run required first (the optional ones of its first sections after the required
# ones of its last).
# usage: gpu_check_plan.sh SOURCE_DIR
set -u
root="$1"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export FACESHARD_PYTHON="${FACESHARD_PYTHON:-$root/.venv/bin/python}"

"$root/tools/gpu_check.sh" --plan > "$work/plan.txt" 2> "$work/plan.err"; rc=$?
cat "$work/plan.txt" "$work/plan.err"
[ "$rc" = 0 ] || fail "gpu_check.sh --plan exited $rc on docs/gpu.md's calls"
grep -q '^-- every call and every lease fits$' "$work/plan.txt" || fail "the plan does not say every call fits"
[ "$(grep -c '^-- lease [0-9]*: calls .* of 900: fits$' "$work/plan.txt")" = 2 ] || fail "not two leases that fit"
[ "$(grep -c '^   call [a-z]: .*: fits$' "$work/plan.txt")" = 4 ] || fail "not four calls that fit"
# Lease 1: the GPU tests, the training and the step cells; lease 2: checkpoints, classifier,
# capacity, two ranks.
grep -q '^-- lease 1: .*' "$work/plan.txt" && grep -A200 '^-- lease 1' "$work/plan.txt" | sed '/^-- lease 2/,$d' |
  grep -q 'call [a-z]: env,tests,train,' || fail "lease 1 has no call of env,tests,train"
for s in capacity checkpoint classifier tworanks; do
  sed -n '/^-- lease 2/,$p' "$work/plan.txt" | grep -q "^   call [a-z]: .*$s" || fail "lease 2 has no $s"
done

# A lease past 900 s, and call d's old budget: refused, one line each time.
head='set -o pipefail; /tmp/fs/faceshard-*/tools/gpu_check.sh $OUT --device cuda'
printf '### Lease 1: too long\n\n**a**: tests\n\n```\ncommand:   %s --sections env,tests,train --budget-s 200 2>&1 | tee $OUT/console.log\ntimeout_s: 270\n```\n\n**b**: step\n\n```\ncommand:   %s --sections step,loader --budget-s 280 2>&1 | tee $OUT/console.log\ntimeout_s: 450\n```\n' \
  "$head" "$head" > "$work/long.md"
printf '### Lease 2: the old call d\n\n**d**: checkpoints\n\n```\ncommand:   %s --sections checkpoint --budget-s 60 2>&1 | tee $OUT/console.log\ntimeout_s: 420\n```\n' \
  "$head" > "$work/cut.md"
for doc in long cut; do
  "$root/tools/gpu_check.sh" --plan "$work/$doc.md" > /dev/null 2> "$work/$doc.err"; rc=$?
  cat "$work/$doc.err"
  [ "$rc" = 1 ] || fail "--plan $doc.md exited $rc, expected 1"
  [ "$(wc -l < "$work/$doc.err")" = 1 ] || fail "--plan $doc.md: not one line"
done
grep -q '^gpu_check.sh --plan: refused: lease 1: its calls.* make 960 s, past 900' "$work/long.err" || fail "long.md: no lease named"
grep -q "^gpu_check.sh --plan: refused: call d: checkpoint_stall's limit of 240 s is past --budget-s 60" "$work/cut.err" ||
  fail "cut.md: the cut item is not named"

# Required first: in lease 2's call of the classifier and two ranks (and in all four
# sections at once), no required item after an optional one.
for s in classifier,tworanks tworanks,classifier,capacity,checkpoint env,tests,train,step,loader; do
  bash "$root/tools/gpu_check.sh" --dry-run --device cuda --sections "$s" --budget-s 600 > "$work/dry.tsv" ||
    fail "--dry-run --sections $s"
  awk -F'\t' '$2 == "optional" { opt = 1 } $2 == "required" && opt { print "required after optional: " $1; bad = 1 }
              END { exit bad }' "$work/dry.tsv" || fail "--sections $s: a required item after an optional one"
  echo "--sections $s: $(grep -c $'\trequired\t' "$work/dry.tsv") required items, then $(grep -c $'\toptional\t' "$work/dry.tsv") optional"
done
echo PASS
