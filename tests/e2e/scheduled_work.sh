#!/usr/bin/env bash
# Scheduled work is not a network problem: two CPU ranks on one host, rank 0 verifying for
# seconds every 10 steps (rank 1 waits for it in the verification's barrier) and saving a
# checkpoint at each of those steps. Neither rank may report a step held up in collectives for
# that (the straggler windows' side: tests/test_user_reports.cpp). Then rank 1 really freezes
# (SIGSTOP, 2.5 s, between verifications): rank 0 still names it, silent, in its
# "network: step N waited" line, and rank 1, stopped itself (inside a collective or not: its
# own heartbeat thread's sleep overran), reports no wait.
# usage: scheduled_work.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
work=$(mktemp -d)
log="$work/train.log"
launcher=""; rank1=""
cleanup() {
  [ -n "$rank1" ] && kill -CONT "$rank1" 2>/dev/null
  [ -n "$launcher" ] && kill "$launcher" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; grep -E "network:|straggler|slow link|error" "$log" | head -20; exit 1; }
export OMP_NUM_THREADS=1 FACESHARD_PROGRESS_AFTER_S=0

# 100 verification pairs: 400 forward passes of the network on one thread, seconds against a
# step's fraction of a second.
"$bin/faceshard-synth" --output "$work/data" --identities 16 --images 8 --holdout 12 --pairs 100 --seed 2 \
  > /dev/null || fail "faceshard-synth"
"$root/tools/launch.sh" --nproc 2 -- "$bin/faceshard-train" --config "$root/configs/demo.yaml" \
  --set data.rec="$work/data" --set output="$work/run" --set data.batch_size=8 --set data.num_workers=1 \
  --set optim.total_steps=40 --set train.log_every=1 --set train.verify_every=10 --set train.checkpoint_every=10 \
  > "$log" 2>&1 &
launcher=$!
# The ranks' processes, by their RANK.
for _ in $(seq 1 600); do
  for p in $(pgrep -P "$launcher" -f faceshard-train); do
    [ "$(tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep '^RANK=')" = "RANK=1" ] && rank1=$p
  done
  [ -n "$rank1" ] && break
  sleep 0.1
done
[ -n "$rank1" ] || fail "rank 1's process not found"
# Past the second verification (step 20) and its checkpoint, between verifications: freeze
# rank 1 for 2.5 s (well under the hang limit of 3 x the median step + 5 s).
for _ in $(seq 1 3000); do grep -q "step 23/40" "$log" && break; sleep 0.1; done
grep -q "step 23/40" "$log" || fail "the run did not reach step 23"
kill -STOP "$rank1"
sleep 2.5
kill -CONT "$rank1"
wait "$launcher"; rc=$?; launcher=""; rank1=""
[ $rc -eq 0 ] || { tail -30 "$log"; fail "training exited $rc"; }
grep -q "\[synth\]\[20\] Accuracy-Flip" "$log" || fail "no verification at step 20"
grep -q "checkpoint saved: .* step 20" "$log" || fail "no checkpoint at step 20"
grep "network:" "$log"
# Rank 1 never waited for anything but rank 0's verification and checkpoints: no line.
grep -q "\[rank 1/2\].*network: step" "$log" && fail "rank 1 reported rank 0's scheduled work as a network stall"
# Rank 0 waited for the frozen rank 1: named, silent, at a step after 23 (no verification).
line=$(grep "\[rank 0/2\].*network: step" "$log" | head -1)
[ -n "$line" ] || fail "rank 0 did not report the frozen rank 1"
echo "$line" | grep -qE "network: step (2[3-9]|3[1-9]) waited .* rank 1 \(host [^)]*\) was silent for" ||
  fail "rank 0's line does not name the frozen rank 1: $line"
echo "PASS: no stall for verification and checkpoints; the frozen rank 1 named: ${line#*network: }"
