#!/usr/bin/env bash
# One run per output folder (app/train/run_lock.h), with real processes:
#   together:  two runs into one folder started at the same moment, once with the fresh run
#              launched first and once with the --resume run first: one trains, the other
#              exits 2 with one line naming the trainer's pid and host; the folder holds the
#              trainer's files only, and its clean end (SIGTERM) removes the lock file.
#   live:      a run that has no checkpoint yet, then into its folder: a fresh run, --resume,
#              --overwrite and a 2-rank job (tools/launch.sh): each refused in one line naming
#              the first's pid, exit 2, nothing of the first's files moved, replaced or cut
#              short (the same inodes, sizes that only grow, no replaced-* folder); the first
#              trains on. The same when the first is a 2-rank job: its rank 0 holds the lock.
#   stale:     a run killed with SIGKILL leaves its lock file: the next run (--resume) names
#              the dead run's pid in one line, takes the lock over and trains.
# usage: run_lock.sh SOURCE_DIR BIN_DIR together|live|stale
set -u
root="$1"; bin="$2"; case_name="$3"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
unset GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK
export OMP_NUM_THREADS=1 FACESHARD_PROGRESS_AFTER_S=0
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; [ -n "${KEEP:-}" ] && echo "work: $work" || rm -rf "$work"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -5 "$f"; done; exit 1; }
host=$(hostname)

"$bin/faceshard-synth" --output "$work/data" --identities 24 --images 8 --holdout 0 --pairs 0 --seed 5 > /dev/null \
  || fail "faceshard-synth"
# A long run without checkpoints (only its end or a stop writes one).
cat > "$work/run.yaml" <<YAML
base: $root/configs/base.yaml
output: $work/out
seed: 3
data: {rec: $work/data, num_classes: 24, batch_size: 8, num_workers: 1}
model: {backbone: mbf_small, embedding_size: 32}
loss: {margin: [1.0, 0.0, 0.4], scale: 16}
optim: {lr: 0.01, epochs: 1000, warmup_epochs: 0}
train: {log_every: 1, verify_every: 0, checkpoint_every: 0, tensorboard: false}
dist: {timeout_s: 30}
YAML
train() { "$bin/faceshard-train" --config "$work/run.yaml" "$@"; }
# start LOG ARGS...: faceshard-train in the background, its own pid in $!.
start() { local log="$1"; shift; "$bin/faceshard-train" --config "$work/run.yaml" "$@" > "$log" 2>&1 & }
# wait_for SECONDS COMMAND...: polls the condition every 0.1 s.
wait_for() {
  local limit="$1"; shift
  local end=$(( $(date +%s) + limit ))
  while [ "$(date +%s)" -lt "$end" ]; do "$@" && return 0; sleep 0.1; done
  return 1
}
steps() { local n; n=$(grep -c '"loss"' "$work/out/metrics.jsonl" 2>/dev/null); echo "${n:-0}"; }
past() { [ "$(steps)" -ge "$1" ]; }
exited() { ! kill -0 "$1" 2>/dev/null; }
# What "nothing moved or cut short" compares: each entry's inode and size.
listing() { (cd "$work/out" && find . -path ./trace -prune -o -type f ! -name .faceshard-train.lock -printf '%p %i %s\n' | sort); }
unchanged_or_grown() {  # BEFORE AFTER: same files, same inodes, sizes not smaller
  "$py" - "$1" "$2" <<'PY'
import sys
def rows(t):
    return {l.split()[0]: (int(l.split()[1]), int(l.split()[2])) for l in t.splitlines() if l.strip()}
a, b = rows(sys.argv[1]), rows(sys.argv[2])
bad = [p for p in a if p not in b or b[p][0] != a[p][0] or b[p][1] < a[p][1]]
if bad: print("moved, replaced or cut short: %s" % bad); sys.exit(1)
PY
}
# refused LOG PID: exit 2 was checked by the caller; one error line naming PID on this host.
refused() {
  local n
  n=$(grep -c "error: output '$work/out' is in use by another training run (pid $2 on host $host, started " "$1")
  [ "$n" -eq 1 ] || { cat "$1"; fail "$1: not one line naming pid $2 on host $host"; }
}
stop() {  # stop PID: SIGTERM, exit 0 (a checkpoint), the lock file gone
  kill -TERM "$1"; wait "$1"; local rc=$?
  [ $rc -eq 0 ] || fail "the run stopped with SIGTERM exited $rc"
  [ ! -e "$work/out/.faceshard-train.lock" ] || fail "a clean end left the lock file"
}

case "$case_name" in
together)
  for first in fresh resume; do
    rm -rf "$work/out"
    if [ $first = fresh ]; then
      start "$work/a.log"; pa=$!; start "$work/b.log" --resume; pb=$!
    else
      start "$work/a.log" --resume; pa=$!; start "$work/b.log"; pb=$!
    fi
    pids+=("$pa" "$pb")
    wait_for 120 bash -c "! kill -0 $pa 2>/dev/null || ! kill -0 $pb 2>/dev/null" || fail "neither run was refused"
    if exited "$pa"; then loser=$pa; lose_log=a.log; winner=$pb; else loser=$pb; lose_log=b.log; winner=$pa; fi
    wait "$loser"; rc=$?
    [ $rc -eq 2 ] || { cat "$work/$lose_log"; fail "the refused run exited $rc, expected 2"; }
    refused "$work/$lose_log" "$winner"
    wait_for 120 past 3 || fail "the remaining run does not train"
    # The folder is the winner's alone: its log names its own pid's lock, every step once.
    stop "$winner"
    "$py" - "$work/out/metrics.jsonl" <<'PY' || fail "metrics.jsonl mixes runs"
import json, sys
steps = [json.loads(l)["step"] for l in open(sys.argv[1]) if '"loss"' in l]
assert steps == list(range(1, len(steps) + 1)), steps
PY
    [ -z "$(ls -d "$work/out"/replaced-* 2>/dev/null)" ] || fail "files were moved aside"
    echo "$first launched first: pid $winner trained, pid $loser refused: $(grep -h "error:" "$work/$lose_log" | sed 's/^.*error: //')"
  done
  echo "PASS: two runs started together: one trains, the other is refused naming its pid (both orders)" ;;
live)
  for first_ranks in 1 2; do
    rm -rf "$work/out"
    if [ $first_ranks = 1 ]; then
      start "$work/first.log"; pa=$!
    else
      "$root/tools/launch.sh" --nproc 2 -- "$bin/faceshard-train" --config "$work/run.yaml" > "$work/first.log" 2>&1 & pa=$!
    fi
    pids+=("$pa")
    wait_for 120 past 2 || fail "the first run does not train"
    # The lock's holder: the first run's rank 0.
    holder=$(sed -n 's/^pid=//p' "$work/out/.faceshard-train.lock")
    if [ $first_ranks = 1 ]; then [ "$holder" = "$pa" ] || fail "the lock names pid $holder, not $pa"
    else grep -qx "RANK=0" <(tr '\0' '\n' < "/proc/$holder/environ") || fail "pid $holder is not the job's rank 0"; fi
    [ -z "$(ls "$work/out/checkpoints" 2>/dev/null)" ] || fail "the first run has a checkpoint already"
    before=$(listing)
    for how in "" "--resume" "--overwrite" "launch2"; do
      log="$work/second${how}.log"
      if [ "$how" = launch2 ]; then
        "$root/tools/launch.sh" --nproc 2 -- "$bin/faceshard-train" --config "$work/run.yaml" --set dist.rendezvous_timeout_s=20 > "$log" 2>&1; rc=$?
        [ $rc -ne 0 ] || fail "a 2-rank job into a live run's folder exited 0"
        [ "$(grep -c "error: output '$work/out' is in use by another training run (pid $holder on host $host" "$log")" -eq 1 ] ||
          { cat "$log"; fail "the 2-rank job's refusal does not name pid $holder once"; }
      else
        train $how > "$log" 2>&1; rc=$?
        [ $rc -eq 2 ] || { cat "$log"; fail "'$how' into a live run's folder exited $rc, expected 2"; }
        refused "$log" "$holder"
      fi
      grep -q "starting fresh\|moved into\|step 1/" "$log" && fail "'$how' started training"
    done
    unchanged_or_grown "$before" "$(listing)" || fail "the first run's files changed"
    [ -z "$(ls -d "$work/out"/replaced-* 2>/dev/null)" ] || fail "--overwrite moved a live run's files"
    [ "$(sed -n 's/^pid=//p' "$work/out/.faceshard-train.lock")" = "$holder" ] || fail "the lock changed hands"
    n=$(steps); wait_for 120 past $((n + 2)) || fail "the first run stopped training"
    stop "$pa"
    echo "first run on $first_ranks rank(s), holder pid $holder: fresh, --resume, --overwrite and a 2-rank job refused; its files untouched"
  done
  grep -h "error:" "$work/second--resume.log" | sed 's/^.*error: /  --resume: /'
  echo "PASS: a live run's folder refuses a fresh run, --resume, --overwrite and another job, naming its pid" ;;
stale)
  start "$work/first.log"; pa=$!
  pids+=("$pa")
  wait_for 120 past 2 || fail "the first run does not train"
  kill -KILL "$pa"; wait "$pa" 2>/dev/null
  [ "$(sed -n 's/^pid=//p' "$work/out/.faceshard-train.lock")" = "$pa" ] || fail "the killed run left no lock naming it"
  train --resume --set train.max_steps=3 > "$work/next.log" 2>&1 || { cat "$work/next.log"; fail "the next run"; }
  n=$(grep -c "took over the stale lock of a run that is gone (pid $pa on host $host, started .*; its process ended without releasing it)" "$work/next.log")
  [ "$n" -eq 1 ] || { cat "$work/next.log"; fail "the stale lock of pid $pa is not named in one line"; }
  grep -q "done: 3 steps" "$work/next.log" || { cat "$work/next.log"; fail "the next run did not train"; }
  [ ! -e "$work/out/.faceshard-train.lock" ] || fail "the next run's clean end left the lock file"
  grep -h "took over" "$work/next.log" | sed 's/^\[rank [0-9/]*\] */  /'
  echo "PASS: a SIGKILLed run's lock is named and taken over" ;;
*) fail "unknown case $case_name" ;;
esac
