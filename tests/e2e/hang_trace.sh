#!/usr/bin/env bash
# A rank that freezes (SIGSTOP) inside a run of 3 ranks: the others stop within 3 x the
# median step + 5 s (not the 120 s collective timeout), each naming the frozen rank; each
# wrote its collective trace, and faceshard-dist-check --trace names the rank that never
# entered the collective the others waited in. SIGUSR1 writes a rank's trace while it runs.
set -u
root="$1"; bin="$2"
work=$(mktemp -d)
log="$work/log"
victim=""
cleanup() { [ -n "$victim" ] && kill -9 "$victim" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; grep -v " ok: " "$log" | tail -20; exit 1; }
"$root/tools/launch.sh" --nproc 3 --grace-s 30 -- "$bin/faceshard-dist-check" --rounds 100000 --interval-ms 50 \
  --timeout-s 120 --output "$work" > "$log" 2>&1 &
launcher=$!
for _ in $(seq 1 300); do grep -q "faceshard-dist-check: .* rounds" "$log" && break; sleep 0.1; done
# Each rank's process by the rank it runs as (its RANK, as launch.sh started it), not by the
# order of the process ids.
rank_pid() {
  local p
  for p in $(pgrep -P "$launcher" -f faceshard-dist-check); do
    [ "$(tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null | sed -n 's/^RANK=//p')" = "$1" ] && { echo "$p"; return; }
  done
}
rank0=$(rank_pid 0); victim=$(rank_pid 1)
[ -n "$rank0" ] && [ -n "$victim" ] || fail "no rank processes found (rank 0: '$rank0', rank 1: '$victim')"
# SIGUSR1: rank 0 writes its trace; asked again until it holds round 10 (the hang limit is
# scaled from the median of the rounds from the fifth on).
trace0="$work/trace/rank0.jsonl"
for _ in $(seq 1 300); do
  kill -USR1 "$rank0"
  sleep 0.1
  [ -s "$trace0" ] && grep -q '"step":1[0-9]' "$trace0" && break
done
grep -q '"reason":"SIGUSR1"' "$trace0" || fail "SIGUSR1 wrote no trace"
grep -q '"step":1[0-9]' "$trace0" || fail "the trace does not reach round 10"
# This machine's reaction time now, under whatever else runs: from SIGUSR1 to rank 0's trace
# written anew (the trace is written by rank 0's own threads, as the hang's error is). It is
# part of the slack of the time bounds below.
m0=$(stat -c %Y.%y "$trace0"); a=$(date +%s.%N)
kill -USR1 "$rank0"
for _ in $(seq 1 400); do [ "$(stat -c %Y.%y "$trace0" 2> /dev/null)" != "$m0" ] && break; sleep 0.005; done
react=$(python3 -c "import time; print(round(time.time() - $a, 3))")
[ "$(stat -c %Y.%y "$trace0")" != "$m0" ] || fail "SIGUSR1 wrote no new trace within 2 s"
start=$(date +%s.%N)
kill -STOP "$victim"
for _ in $(seq 1 600); do kill -0 "$rank0" 2>/dev/null || break; sleep 0.05; done
took=$(python3 -c "import time; print(round(time.time() - $start, 1))")
# When rank 0 named it: its trace file's time (written with the error line).
named=$(python3 -c "import json; print(round(json.loads(open('$work/trace/rank0.jsonl').readline())['written_ms'] / 1000 - $start, 1))")
kill -9 "$victim" 2>/dev/null; victim=""
wait "$launcher"; rc=$?
[ "$rc" -ne 0 ] || fail "launcher exited 0"
# The bounds come from the run's own figures: the hang limit L = 3 x the median round + 5 s
# (rank 0's error line), the heartbeat interval h = 0.5 s (DistOptions' default: the beats and
# the hang watch's pace), and the slack s = h + 4 x the median round + the reaction time
# measured above. Rank 0 names the frozen rank by L + s: the freeze comes at most a round
# before the collective that waits; the watch looks every half a beat. Rank 0 then exits
# by 2 x its linger window (it waits until every other rank has published its error or
# stopped beating for 3 h) + s after the later of the two survivors named rank 1.
e0=$(grep "\[rank 0/3\].*error: .*more than 3 x the median step" "$log" | head -1)
[ -n "$e0" ] || fail "rank 0 wrote no hang error"
limit=$(echo "$e0" | sed -E 's/.*\+ 5 s = ([0-9.]+) s.*/\1/'); median=$(echo "$e0" | sed -E 's/.*the median step \(([0-9.]+) s\).*/\1/')
# The printed limit is its formula's (3 x the printed median + 5 s, to the digits printed),
# and the median is a round's: at least the 50 ms the rounds are paced at, at most the few
# hundred ms a loaded 2-core machine adds to one.
python3 -c "
limit, median = $limit, $median
assert abs(limit - (3 * median + 5)) <= 0.052, ('limit', limit, '3 x median + 5', 3 * median + 5)
assert 0.049 <= median <= 0.5, ('median round', median, 'paced at 0.05 s')" ||
  fail "the printed hang limit $limit s or median $median s is not the formula's or a round's"
named2=$(python3 -c "import json; print(round(json.loads(open('$work/trace/rank2.jsonl').readline())['written_ms'] / 1000 - $start, 1))")
read -r named_bound took_bound <<< "$(python3 -c "
h = 0.5; s = h + 4 * $median + $react
print(round($limit + s, 2), round(max($named, $named2) + 2 * 3 * h + s, 2))")"
late=""
python3 -c "import sys; sys.exit(0 if $named < $named_bound else 1)" ||
  late="rank 0 named the frozen rank after ${named} s (bound $named_bound s: limit $limit s, reaction $react s). "
python3 -c "import sys; sys.exit(0 if $took < $took_bound else 1)" ||
  late="${late}rank 0 stopped after ${took} s (bound $took_bound s; rank 2 named rank 1 after $named2 s)"
[ -z "$late" ] || fail "$late"
# The first survivor to judge the hang names rank 1 and the collective; the other may learn
# of it from the first one's exit first, and names rank 1 through the heartbeats as well.
grep -qE "error: .*more than 3 x the median step .*rank 1 died \(no heartbeat.*(never entered|stopped inside) it" "$log" ||
  fail "no survivor named rank 1 against the scaled limit"
for r in 0 2; do
  grep -q "\[rank $r/3\].*error: .*rank 1 died (no heartbeat" "$log" || fail "rank $r did not name rank 1"
  [ -s "$work/trace/rank$r.jsonl" ] || fail "rank $r wrote no trace"
done
verdict=$("$bin/faceshard-dist-check" --trace "$work/trace" 2>&1) || fail "faceshard-dist-check --trace: $verdict"
echo "$verdict"
echo "$verdict" | grep -q "rank 1 (no trace file" || fail "the verdict does not name rank 1"
echo "$verdict" | grep -q "rank 0 (host .*) wrote its trace: .*rank 1 died" || fail "rank 0's reason is missing"
# Bad input: one line, non-zero.
echo "garbage" > "$work/trace/rank2.jsonl"
out=$("$bin/faceshard-dist-check" --trace "$work/trace" 2>&1) && fail "a garbage trace was accepted"
[ "$(echo "$out" | wc -l)" -eq 1 ] && echo "$out" | grep -q "rank2.jsonl:1: not a trace line" || fail "bad trace: $out"
echo "PASS: rank 0 named the frozen rank 1 after ${named} s (bound $named_bound s) and exited after ${took} s (bound $took_bound s; collective timeout 120 s, hang limit $limit s, reaction $react s)"
