#!/usr/bin/env bash
# The network-fault suite: a training job on two hosts (network namespaces joined by a veth
# pair, netns_hosts.sh, one rank each) meets a fault after step 12, with the default
# collective timeout's scale (dist.timeout_s 120: the hang limit is 3 x the median step + 5 s).
# usage: net_faults.sh SOURCE_DIR BIN_DIR CASE
#   throttle         both ends of the link limited to 8 Mbit/s (tbf) until the slow link is
#                    named, then freed: the run slows down, names the host pair, finishes.
#   partition_short  the link down for 2 s (under the hang limit): the run rides through and
#                    names who fell silent during the stalled step.
#   partition_long   the link down for good: every rank exits non-zero within the hang limit
#                    (plus the exit), each naming the host it cannot reach; no checkpoint is
#                    half-written or committed by one side alone; after the link is up again
#                    --resume auto continues from the last committed step and finishes.
#   netem_loss       1% loss and 20 ms delay each way (netem): rides through. Skipped (77)
#                    where the kernel has no netem qdisc.
#   cpu_quota        host 1's rank gets a quarter of a CPU (a cgroup v1 or v2 CPU quota) until
#                    it is named a straggler, then all of it: the run finishes, rank 0 is never
#                    named.
# Each case ends with one "RESULT |" table row: fault, what the run did, slowdown, what was
# logged, steps lost. Exits 77 (skipped) without namespaces.
set -u
root="$1"; bin="$2"; case_name="$3"
source "$root/tests/e2e/netns_hosts.sh"
total=40
args=("${train_args[@]}" --set optim.total_steps=$total --set train.checkpoint_every=10 --set dist.timeout_s=120
      --set dist.straggler_window=3)
start_job() {  # start_job TAG [ARGS...]: both hosts, logs $work/TAG.h0.log / .h1.log
  local tag="$1"; shift
  launch "$h1" 1 1 "$work/$tag.h1.log" "${args[@]}" "$@"; pid1=$!
  launch "$h0" 0 1 "$work/$tag.h0.log" "${args[@]}" "$@"; pid0=$!
}
wait_job() { wait "$pid0"; rc0=$?; wait "$pid1"; rc1=$?; }
show() { echo "--- host 0:"; cat "$work/$1.h0.log"; echo "--- host 1:"; cat "$work/$1.h1.log"; }
step_of() { grep -o "step [0-9]*/" "$1" | tail -1 | tr -dc 0-9; }
# Step times from metrics.jsonl (global batch 16 / samples per second of each logged step):
# "median_before median_from_A_to_B longest".
step_times() { "$py" - "$work/out/metrics.jsonl" "$1" "$2" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"samples_per_sec"' in l]
t = {r["step"]: 16.0 / r["samples_per_sec"] for r in rows if r.get("samples_per_sec")}
a, b = int(sys.argv[2]), int(sys.argv[3])
med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
before = [s for k, s in t.items() if 3 <= k < a]
during = [s for k, s in t.items() if a <= k <= b]
print("%.3f %.3f %.3f" % (med(before), med(during), max(during or [float("nan")])))
PY
}
calc() { "$py" -c "import sys; print(round(eval(sys.argv[1]), 1))" "$1"; }
ratio() { "$py" -c "import sys; print('%.1fx' % (float(sys.argv[2]) / float(sys.argv[1])))" "$1" "$2"; }
committed() { for d in "$work"/out/checkpoints/step_*; do [ -f "$d/COMMITTED" ] && basename "$d"; done | tr -dc '0-9\n' | sed 's/^0*//'; }
# Every committed checkpoint holds both ranks' shards (neither side committed alone), and
# nothing else under checkpoints/ is named like a checkpoint.
check_checkpoints() {
  local d
  for d in "$work"/out/checkpoints/step_*; do
    [ -e "$d" ] || continue
    [ -f "$d/COMMITTED" ] || fail "$(basename "$d") is there without its commit marker (half-written)"
    for f in backbone.pt fc_shard_0.pt fc_shard_1.pt train_state.pt; do
      [ -s "$d/$f" ] || fail "$(basename "$d") is committed without $f"
    done
  done
}

case "$case_name" in
throttle)
  start_job t
  wait_for_line "$work/t.h0.log" "step 12/" 120 || { show t; fail "the job did not reach step 12"; }
  s0=$(step_of "$work/t.h0.log")
  for side in "$h0 $if0" "$h1 $if1"; do
    set -- $side; on "$1" tc qdisc add dev "$2" root tbf rate 8mbit burst 32kbit latency 400ms || fail "tc tbf"
  done
  wait_for_line "$work/t.h0.log" "slow link:" 240; named=$?
  s1=$(step_of "$work/t.h0.log")
  on "$h0" tc qdisc del dev "$if0" root; on "$h1" tc qdisc del dev "$if1" root
  wait_job
  [ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] || { show t; fail "exit $rc0 / $rc1 under a throttled link"; }
  [ "$named" -eq 0 ] || { show t; fail "the slow link was never named"; }
  line=$(grep -m1 "slow link:" "$work/t.h0.log" | sed 's/.*slow link:/slow link:/')
  echo "$line" | grep -q "host [^ ]* ($a1) (rank 1) <-> host [^ ]* ($a0) (the store's)" || fail "the wrong pair: $line"
  grep -q '"slow_link/1"' "$work/out/metrics.jsonl" || fail "no slow_link/1 in metrics.jsonl"
  grep -q "straggler:" "$work/t.h0.log" && { grep "straggler:" "$work/t.h0.log"; fail "a rank was called a straggler for a slow link"; }
  read -r before during longest <<< "$(step_times $((s0 + 1)) "$s1")"
  echo "RESULT | tbf 8 Mbit/s both ways, steps $((s0 + 1))-$s1 | finished all $total steps, exit 0/0 | $(ratio "$before" "$during") (median step $before s -> $during s) | $line | 0"
  echo "PASS" ;;
partition_short)
  start_job s
  wait_for_line "$work/s.h0.log" "step 12/" 120 || { show s; fail "the job did not reach step 12"; }
  s0=$(step_of "$work/s.h0.log")
  on "$h1" ip link set "$if1" down; sleep 2; on "$h1" ip link set "$if1" up
  wait_job
  [ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] || { show s; fail "exit $rc0 / $rc1 after a 2 s partition"; }
  logged=$(grep -h "network: step" "$work/s.h0.log" "$work/s.h1.log" | sed 's/.*network: /network: /')
  [ -n "$logged" ] || { show s; fail "the stalled step was not reported"; }
  echo "$logged" | grep -q "rank 1 (host [^ ]* ($a1)) was silent\|rendezvous store (host [^ ]* ($a0)) did not answer" ||
    { echo "$logged"; fail "the stall names nobody who fell silent"; }
  read -r before during longest <<< "$(step_times $((s0 + 1)) $((s0 + 4)))"
  echo "RESULT | link down 2 s after step $s0 | rode through, all $total steps, exit 0/0 | longest step $longest s against a median of $before s | $(echo "$logged" | head -2 | tr '\n' ' ') | 0"
  echo "PASS" ;;
partition_long)
  start_job p
  wait_for_line "$work/p.h0.log" "step 12/" 120 || { show p; fail "the job did not reach step 12"; }
  s0=$(step_of "$work/p.h0.log")
  t0=$(now)
  on "$h1" ip link set "$if1" down
  for _ in $(seq 900); do [ -z "$(alive "$h0")$(alive "$h1")" ] && break; sleep 0.1; done
  t1=$(now)
  [ -z "$(alive "$h0")$(alive "$h1")" ] || { show p; fail "ranks still running 90 s into the partition"; }
  wait_job
  on "$h1" ip link set "$if1" up
  [ "$rc0" -ne 0 ] && [ "$rc1" -ne 0 ] || { show p; fail "exit $rc0 / $rc1: a partitioned rank exited 0"; }
  codes="$rc0/$rc1"
  e0=$(grep "error:" "$work/p.h0.log"); e1=$(grep "error:" "$work/p.h1.log")
  [ "$(echo "$e0" | wc -l)" -eq 1 ] && [ "$(echo "$e1" | wc -l)" -eq 1 ] || { show p; fail "not one error line per rank"; }
  echo "$e0" | grep -q "rank 1 died (no heartbeat .*host [^ ]* ($a1))" || { show p; fail "host 0 does not name host 1"; }
  echo "$e1" | grep -q "cut off from host [^ ]* ($a0)" || { show p; fail "host 1 does not name host 0"; }
  limit=$(echo "$e0" | sed -E 's/.*\+ 5 s = ([0-9.]+) s.*/\1/')
  elapsed_below "$t0" "$t1" "$(calc "$limit + 15")" || fail "the ranks took $(calc "$t1 - $t0") s to stop (limit $limit s)"
  check_checkpoints
  last=$(committed | tail -1)
  [ -n "$last" ] || fail "no committed checkpoint before the partition"
  lost=$((s0 - last))
  # The network is back: the same command with --resume auto goes on from the last commit.
  start_job r --resume auto --set optim.total_steps=$((last + 6))
  wait_job
  [ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] || { show r; fail "the resumed run: exit $rc0 / $rc1"; }
  grep -q "resumed from .*step_0*$last at step $last" "$work/r.h0.log" || { show r; fail "did not resume from step $last"; }
  check_checkpoints
  echo "RESULT | link down for good after step $s0 | both ranks stopped in $(calc "$t1 - $t0") s (limit $limit s), exit $codes; --resume auto from step $last finished | - | host 0: $(echo "$e0" | sed 's/.*s; //' | cut -c1-110); host 1: $(echo "$e1" | sed 's/.*s; //' | cut -c1-110) | $lost (since the last commit)"
  echo "PASS" ;;
netem_loss)
  on "$h0" tc qdisc add dev "$if0" root netem loss 1% delay 20ms 2> "$work/netem.err" || {
    echo "SKIP: no netem here: $(head -c 200 "$work/netem.err")"; exit 77; }
  on "$h1" tc qdisc add dev "$if1" root netem loss 1% delay 20ms || fail "netem on host 1"
  start_job n
  wait_job
  [ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] || { show n; fail "exit $rc0 / $rc1 under 1% loss"; }
  read -r before during longest <<< "$(step_times 3 $total)"
  echo "RESULT | netem 1% loss + 20 ms each way, all steps | finished, exit 0/0 | median step $during s | $(grep -h 'network: step\|slow link' "$work/n.h0.log" | head -1) | 0"
  echo "PASS" ;;
cpu_quota)
  source "$root/tests/e2e/cpu_quota.sh"
  quota_make 25 || { echo "SKIP: no CPU quota can be made here: $quota_why"; exit 77; }
  trap 'quota_remove; cleanup' EXIT
  start_job c
  wait_for_line "$work/c.h0.log" "step 12/" 120 || { show c; fail "the job did not reach step 12"; }
  s0=$(step_of "$work/c.h0.log")
  quota_add $(alive "$h1") || fail "could not move host 1's processes into $quota_dir"
  wait_for_line "$work/c.h0.log" "straggler: rank 1 " 240; named=$?
  s1=$(step_of "$work/c.h0.log")
  quota_lift
  wait_job
  [ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] || { show c; fail "exit $rc0 / $rc1 with a throttled CPU"; }
  [ "$named" -eq 0 ] || { show c; fail "the slowed rank was never named"; }
  # Every straggler line of the run, not only the first: none names the healthy rank.
  others=$(grep "straggler: rank" "$work/c.h0.log" | grep -v "straggler: rank 1 ")
  [ -z "$others" ] || { echo "$others"; fail "a rank other than the throttled one was named"; }
  line=$(grep -m1 "straggler:" "$work/c.h0.log" | sed 's/.*straggler:/straggler:/')
  read -r before during longest <<< "$(step_times $((s0 + 1)) "$s1")"
  echo "RESULT | host 1's CPU at 25% ($quota_kind), steps $((s0 + 1))-$s1 | finished all $total steps, exit 0/0 | $(ratio "$before" "$during") (median step $before s -> $during s) | $line | 0"
  echo "PASS" ;;
*) fail "unknown case $case_name" ;;
esac
