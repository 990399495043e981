#!/usr/bin/env bash
# Jobs across several hosts: each host is a network namespace of its own (ip netns), the
# hosts joined by a veth pair (netns_hosts.sh). Nothing names an interface
# (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME unset) and this machine's hostname may resolve to
# 127.0.0.1, as in many containers: the ranks must find the address that reaches the master.
# usage: multihost.sh SOURCE_DIR BIN_DIR CASE
#   CASE: dist_check_2x1 | dist_check_2x2 | train_resume | host_killed | host_frozen_traced | straggler_cpu_quota |
#         rendezvous_fails | torchrun | listeners
# Exits 77 (skipped) when namespaces cannot be created here (no privilege).
set -u
root="$1"; bin="$2"; case_name="$3"
source "$root/tests/e2e/netns_hosts.sh"
# two_hosts NPROC LOG0 LOG1 PROGRAM... : the same job on both hosts; fails unless both exit 0.
two_hosts() {
  local nproc="$1" l0="$2" l1="$3"; shift 3
  launch "$h1" 1 "$nproc" "$l1" "$@"; local p1=$!
  launch "$h0" 0 "$nproc" "$l0" "$@"; local p0=$!
  wait "$p0"; local r0=$?
  wait "$p1"; local r1=$?
  [ "$r0" -eq 0 ] && [ "$r1" -eq 0 ] || { echo "--- host 0:"; cat "$l0"; echo "--- host 1:"; cat "$l1"; fail "exit $r0 / $r1"; }
}
check_network_lines() {  # each host logged its choice: its own veth address
  grep -q "network: Gloo on $a0: the local end of the route to MASTER_ADDR $a0" "$1" || { cat "$1"; fail "host 0's choice"; }
  grep -q "network: Gloo on $a1: the local end of the route to MASTER_ADDR $a0" "$2" || { cat "$2"; fail "host 1's choice"; }
}

case "$case_name" in
dist_check_2x1|dist_check_2x2)
  n=1; [ "$case_name" = dist_check_2x2 ] && n=2
  two_hosts "$n" "$work/h0.log" "$work/h1.log" "$bin/faceshard-dist-check" --rounds 10 --interval-ms 1 --timeout-s 10 \
    --rendezvous-timeout-s 20
  grep -q "all 10 rounds verified on $((2 * n)) ranks" "$work/h0.log" || { cat "$work/h0.log"; fail "no verified rounds"; }
  check_network_lines "$work/h0.log" "$work/h1.log"
  echo "PASS: 2 hosts x $n ranks, no interface named" ;;
train_resume)
  # A: uninterrupted 2-host run. B: 2 hosts to step 4, then resumed on 2 hosts: its losses
  # equal A's bit for bit. C: B's step-4 checkpoint resumed by one rank on one host (the two
  # classifier shards become one).
  two_hosts 1 "$work/a0.log" "$work/a1.log" "${train_args[@]}" --set output="$work/A"
  check_network_lines "$work/a0.log" "$work/a1.log"
  two_hosts 1 "$work/b0.log" "$work/b1.log" "${train_args[@]}" --set output="$work/B" --set train.max_steps=4
  cp -r "$work/B/checkpoints/step_00000004" "$work/saved"
  two_hosts 1 "$work/b2.log" "$work/b3.log" "${train_args[@]}" --set output="$work/B" --resume
  grep -q "resumed from .*step_00000004 at step 4" "$work/b2.log" || { cat "$work/b2.log"; fail "did not resume at 4"; }
  losses "$work/A/metrics.jsonl" > "$work/a.txt"; losses "$work/B/metrics.jsonl" > "$work/b.txt"
  [ "$(wc -l < "$work/a.txt")" -eq 8 ] || fail "expected 8 logged steps"
  diff "$work/a.txt" "$work/b.txt" > /dev/null || { paste "$work/a.txt" "$work/b.txt"; fail "losses differ after the 2-host resume"; }
  # One host, one rank: the two shards of the checkpoint become one.
  on "$h0" "$root/tools/launch.sh" --nproc 1 -- "${train_args[@]}" --set output="$work/C" --resume "$work/saved" \
    > "$work/c.log" 2>&1 || { cat "$work/c.log"; fail "resume on one host"; }
  grep -q "resharded from 2 to 1 ranks" "$work/c.log" || { cat "$work/c.log"; fail "no reshard on one host"; }
  losses "$work/C/metrics.jsonl" > "$work/c.txt"
  [ "$(wc -l < "$work/c.txt")" -eq 4 ] || { cat "$work/c.txt"; fail "the one-host resume logged no steps 5-8"; }
  echo "PASS: 2-host resume equals the uninterrupted 2-host run bit for bit:"; paste "$work/a.txt" "$work/b.txt"
  echo "one-host resume (resharded):"; cat "$work/c.txt" ;;
host_killed)
  # Kill every process of host K mid-run (SIGKILL: its connections close), or freeze them
  # (SIGSTOP: a host that hangs or drops off the network, noticed by the collective timeout
  # of 10 s); the other host's ranks exit non-zero within that timeout (plus diagnosis)
  # naming the lost ranks, and nothing of that host is left running.
  for victim in 1 0 stop1; do
    rm -rf "$work/out"
    launch "$h1" 1 2 "$work/k1.log" "${train_args[@]}" --set optim.total_steps=100000
    launch "$h0" 0 2 "$work/k0.log" "${train_args[@]}" --set optim.total_steps=100000
    for _ in $(seq 600); do grep -q "step 3/" "$work/k0.log" && break; sleep 0.1; done
    grep -q "step 3/" "$work/k0.log" || { cat "$work/k0.log" "$work/k1.log"; fail "the job did not start"; }
    sig=-9
    case "$victim" in
      1) dead="$h1"; live="$h0"; log="$work/k0.log"; lost="rank [23] died" ;;
      0) dead="$h0"; live="$h1"; log="$work/k1.log"; lost="rank 0 died\|rank 0 hosts it" ;;
      stop1) dead="$h1"; live="$h0"; log="$work/k0.log"; lost="rank [23] died (no heartbeat"; sig=-STOP ;;
    esac
    alive "$dead" | xargs -r kill "$sig"
    t0=$(now)
    for _ in $(seq 600); do [ -z "$(alive "$live")" ] && break; sleep 0.1; done
    t1=$(now)
    [ -z "$(alive "$live")" ] || { alive "$live" | xargs -r ps -o pid,args -p; fail "$live still running after 60 s"; }
    elapsed_below "$t0" "$t1" 30 || { tail -5 "$log"; fail "$live took longer than 30 s to stop"; }
    alive "$dead" | xargs -r kill -9
    wait
    grep -q "$lost" "$log" || { cat "$log"; fail "the surviving ranks did not name the lost ones"; }
    grep -q "launch.sh: rank .* exited with status [1-9]" "$log" || { cat "$log"; fail "no non-zero exit on the surviving host"; }
    echo "host ${victim#stop} $([ "$sig" = -9 ] && echo killed || echo stopped): the other host stopped in $("$py" -c "print(round($t1 - $t0, 1))") s:"
    grep "error:" "$log" | head -2
  done
  echo "PASS" ;;
rendezvous_fails)
  # (a) host 1 never starts: host 0 names the ranks that never joined, within the timeout.
  t0=$(now)
  on "$h0" "$root/tools/launch.sh" --nproc 1 --nnodes 2 --node-rank 0 --master-addr "$a0" --master-port 29500 -- \
    "$bin/faceshard-dist-check" --rendezvous-timeout-s 5 > "$work/a.log" 2>&1 && fail "(a) exit 0"
  elapsed_below "$t0" "$(now)" 25 || fail "(a) took too long"
  grep -q "ranks never joined: 1" "$work/a.log" || { cat "$work/a.log"; fail "(a) missing ranks not named"; }
  [ "$(grep -c 'error:' "$work/a.log")" -eq 1 ] || { cat "$work/a.log"; fail "(a) not one line"; }
  # (b) host 1 is given an address where no master listens: it says it cannot reach the store.
  t0=$(now)
  on "$h1" "$root/tools/launch.sh" --nproc 1 --nnodes 2 --node-rank 1 --master-addr 10.78.0.9 --master-port 29500 -- \
    "$bin/faceshard-dist-check" --rendezvous-timeout-s 5 > "$work/b.log" 2>&1 && fail "(b) exit 0"
  elapsed_below "$t0" "$(now)" 25 || fail "(b) took too long"
  grep -q "cannot reach the rendezvous store at 10.78.0.9:29500" "$work/b.log" || { cat "$work/b.log"; fail "(b) cause not named"; }
  # (c) a user-set GLOO_SOCKET_IFNAME wins, here a wrong one: both hosts advertise loopback
  # (what a hostname resolving to 127.0.0.1 used to cause), so the full mesh cannot connect.
  # Both hosts fail within the timeout, each with one line naming the rendezvous step.
  t0=$(now)
  GLOO_SOCKET_IFNAME=lo launch "$h0" 0 1 "$work/c0.log" "$bin/faceshard-dist-check" --rendezvous-timeout-s 8; p0=$!
  GLOO_SOCKET_IFNAME=lo launch "$h1" 1 1 "$work/c1.log" "$bin/faceshard-dist-check" --rendezvous-timeout-s 8; p1=$!
  wait "$p0"; r0=$?; wait "$p1"; r1=$?
  [ "$r0" -ne 0 ] && [ "$r1" -ne 0 ] || { echo "--- c0"; cat "$work/c0.log"; echo "--- c1"; cat "$work/c1.log"; fail "(c) exit $r0 / $r1"; }
  elapsed_below "$t0" "$(now)" 40 || { cat "$work/c0.log" "$work/c1.log"; fail "(c) took too long"; }
  grep -q "GLOO_SOCKET_IFNAME=lo" "$work/c0.log" || { cat "$work/c0.log"; fail "(c) the user's variable did not win"; }
  grep -q "rendezvous at $a0:29500 failed on rank 1" "$work/c1.log" || { cat "$work/c1.log"; fail "(c) host 1's cause"; }
  grep -q "rendezvous at $a0:29500 failed on rank 0" "$work/c0.log" || { cat "$work/c0.log"; fail "(c) host 0's cause"; }
  [ -z "$(alive "$h0")$(alive "$h1")" ] || fail "processes left running"
  for f in a b c0 c1; do echo "$f: $(grep 'error:' "$work/$f.log" | head -1)"; done
  echo "PASS" ;;
torchrun)
  # torchrun's c10d rendezvous (its agents host the stores) across the two hosts. This
  # machine's hostname resolves to 127.0.0.1, so torchrun cannot tell by itself which host is
  # the endpoint (is_host) nor which address to give the workers as MASTER_ADDR (--local-addr).
  torchrun="$root/.venv/bin/torchrun"
  [ -x "$torchrun" ] || fail "no torchrun in .venv"
  for k in 1 0; do
    ns="$h0"; [ "$k" = 1 ] && ns="$h1"
    addr="$a0"; [ "$k" = 1 ] && addr="$a1"
    is_host=$((1 - k))
    on "$ns" env OMP_NUM_THREADS=1 "$torchrun" --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
      --rdzv-endpoint "$a0:29400" --rdzv-id fs --rdzv-conf "is_host=$is_host" --local-addr "$addr" --no-python \
      "${train_args[@]}" --set output="$work/T" > "$work/t$k.log" 2>&1 &
    eval "pt$k=\$!"
  done
  wait "$pt0"; r0=$?; wait "$pt1"; r1=$?
  [ "$r0" -eq 0 ] && [ "$r1" -eq 0 ] || { cat "$work/t0.log" "$work/t1.log"; fail "torchrun exit $r0 / $r1"; }
  grep -q "done: 8 steps" "$work/t0.log" "$work/t1.log" || { cat "$work/t0.log"; fail "no finished run"; }
  losses "$work/T/metrics.jsonl" | tail -2
  echo "PASS: torchrun across 2 hosts" ;;
host_frozen_traced)
  # Training on 2 hosts x 2 ranks with the default collective timeout's scale (120 s here):
  # host 1 freezes (SIGSTOP) after step 20. Host 0's ranks name a rank of host 1 within 3 x
  # the median step + 5 s (not the 120 s), each writes its collective trace, and
  # faceshard-dist-check --trace names the ranks that never entered the collective.
  rm -rf "$work/out"
  args=("${train_args[@]}" --set optim.total_steps=100000 --set dist.timeout_s=120)
  launch "$h1" 1 2 "$work/f1.log" "${args[@]}"
  launch "$h0" 0 2 "$work/f0.log" "${args[@]}"
  for _ in $(seq 1200); do grep -q "step 20/" "$work/f0.log" && break; sleep 0.1; done
  grep -q "step 20/" "$work/f0.log" || { cat "$work/f0.log" "$work/f1.log"; fail "the job did not reach step 20"; }
  t0=$(now)
  alive "$h1" | xargs -r kill -STOP
  for _ in $(seq 600); do [ -z "$(alive "$h0")" ] && break; sleep 0.1; done
  t1=$(now)
  alive "$h1" | xargs -r kill -9
  wait
  [ -z "$(alive "$h0")" ] || fail "host 0 still running after 60 s"
  grep -qE "error: .*more than 3 x the median step \(.*rank [23] died \(no heartbeat.*(never entered|stopped inside) it" "$work/f0.log" ||
    { cat "$work/f0.log"; fail "host 0 did not name a rank of host 1 against the scaled limit"; }
  line=$(grep -m1 "more than 3 x the median step" "$work/f0.log")
  limit=$(echo "$line" | sed -E 's/.*\+ 5 s = ([0-9.]+) s.*/\1/')
  for r in 0 1; do [ -s "$work/out/trace/rank$r.jsonl" ] || fail "rank $r wrote no trace"; done
  named=$("$py" -c "
import json, sys
t = min(json.loads(open(f'$work/out/trace/rank{r}.jsonl').readline())['written_ms'] for r in (0, 1))
print(round(t / 1000 - float(sys.argv[1]), 1))" "$t0")
  "$py" -c "import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) + 1.5 else 1)" "$named" "$limit" ||
    fail "named after $named s, the limit is $limit s"
  verdict=$("$bin/faceshard-dist-check" --trace "$work/out/trace") || fail "faceshard-dist-check --trace: $verdict"
  echo "$verdict" | grep -qE "never entered by rank [23]|rank [23] \(no trace file" || { echo "$verdict"; fail "the verdict names no rank of host 1"; }
  echo "host 1 frozen after step 20: named after $named s (limit $limit s = 3 x the median step + 5 s), host 0 stopped after $("$py" -c "print(round($t1 - $t0, 1))") s"
  echo "$line" | sed 's/.*error: //'
  echo "$verdict"
  echo "PASS" ;;
straggler_cpu_quota)
  # Training on 2 hosts x 1 rank at the default straggler windows (dist.straggler_window: 50
  # steps, or 10 s of steps, whichever comes first). After two healthy windows host 1's rank
  # gets 15% of a CPU (a cgroup CPU quota: v1's cfs_quota_us or v2's cpu.max) for 60 s at
  # most: the monitor names rank 1 within those 60 s (host 0's log, straggler/1 in
  # metrics.jsonl), names nobody before the quota, and never names rank 0. Then the quota is
  # lifted and both hosts are stopped (SIGTERM: a checkpoint and exit 0 on each).
  source "$root/tests/e2e/cpu_quota.sh"
  quota_make 15 || { echo "SKIP: no CPU quota can be made here: $quota_why"; exit 77; }
  trap 'quota_remove; cleanup' EXIT
  rm -rf "$work/out"
  args=("${train_args[@]}" --set optim.total_steps=1000000 --set dist.timeout_s=120)
  # Debug lines: rank 0 logs every window it judges ("straggler window N (to step S)").
  export FACESHARD_LOG_LEVEL=debug
  launch "$h1" 1 1 "$work/s1.log" "${args[@]}"; p1=$!
  launch "$h0" 0 1 "$work/s0.log" "${args[@]}"; p0=$!
  show() { echo "--- host 0:"; grep -v "debug:.*heartbeat\|debug: collective" "$work/s0.log" | tail -40; echo "--- host 1:"; tail -20 "$work/s1.log"; }
  wait_for_line "$work/s0.log" "straggler window 1 " 300 || { show; fail "rank 0 judged no two windows"; }
  grep -q "straggler:" "$work/s0.log" && { show; fail "a straggler named before any was made"; }
  step0=$(grep -o "step [0-9]*/" "$work/s0.log" | tail -1 | tr -dc 0-9)
  t0=$(now)
  quota_add $(alive "$h1") || { show; fail "could not move host 1's processes into $quota_dir"; }
  wait_for_line "$work/s0.log" "straggler: rank 1 " 60; named=$?
  t1=$(now)
  quota_lift
  step1=$(grep -o "step [0-9]*/" "$work/s0.log" | tail -1 | tr -dc 0-9)
  # SIGTERM to each host's launch.sh (it forwards it to its ranks; $p0 and $p1 are the
  # `ip netns exec` around it, which would die of it instead).
  for ns in "$h0" "$h1"; do
    for p in $(alive "$ns"); do grep -q "tools/launch.sh" "/proc/$p/cmdline" 2> /dev/null && kill -TERM "$p"; done
  done
  wait "$p0"; rc0=$?
  wait "$p1"; rc1=$?
  [ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] || { show; fail "exit $rc0 / $rc1 after the quota and SIGTERM"; }
  [ "$named" -eq 0 ] || { show; fail "rank 1, at 15% of a CPU for 60 s (steps $step0-$step1), was not named"; }
  grep -q "straggler: rank 1 (host .*) is slow in [a-z]*:" "$work/s0.log" || { show; fail "rank 1 named without its host and phase"; }
  # Every straggler line, not only the first: none names the healthy rank.
  others=$(grep "straggler: rank" "$work/s0.log" | grep -v "straggler: rank 1 ")
  [ -z "$others" ] || { echo "$others"; fail "a rank other than the throttled one was named"; }
  grep -q '"straggler/1"' "$work/out/metrics.jsonl" || fail "no straggler/1 in metrics.jsonl"
  grep -q '"straggler/0"' "$work/out/metrics.jsonl" && fail "straggler/0 in metrics.jsonl"
  echo "$quota_kind quota 15% from step $step0: $(grep -m1 "straggler: rank 1" "$work/s0.log" | sed 's/.*straggler:/straggler:/')"
  echo "named after $("$py" -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$t0" "$t1") s of the quota"
  echo "PASS" ;;
listeners)
  # Every socket a job listens on, per host, while faceshard-dist-check runs: on one host
  # (MASTER_ADDR 127.0.0.1) all on loopback; on two hosts x 2 ranks each on its host's own
  # address. None on every interface (0.0.0.0 or *), which TCPStore alone would choose.
  table() {  # table NS LOG: "address:port owner" of each listener in NS (the store is port 29500)
    on "$1" ss -Hltnp | "$py" -c "
import re, sys
for l in sys.stdin:
    f = l.split()
    local, who = f[3], re.search(r'\(\(\"([^\"]+)', l)
    port = local.rsplit(':', 1)[1]
    print(local, 'store' if port == '29500' else (who.group(1) if who else '?'))"
  }
  on "$h0" "$root/tools/launch.sh" --nproc 2 --master-addr 127.0.0.1 --master-port 29500 -- "$bin/faceshard-dist-check" \
    --rounds 400 --interval-ms 20 > "$work/one.log" 2>&1 &
  wait_for_line "$work/one.log" "round 80/" 60 || { cat "$work/one.log"; fail "the one-host job did not start"; }
  table "$h0" > "$work/one.txt"
  wait
  launch "$h1" 1 2 "$work/l1.log" "$bin/faceshard-dist-check" --rounds 400 --interval-ms 20
  launch "$h0" 0 2 "$work/l0.log" "$bin/faceshard-dist-check" --rounds 400 --interval-ms 20
  wait_for_line "$work/l0.log" "round 80/" 60 || { cat "$work/l0.log" "$work/l1.log"; fail "the two-host job did not start"; }
  table "$h0" > "$work/h0.txt"; table "$h1" > "$work/h1.txt"
  wait
  echo "one host (MASTER_ADDR 127.0.0.1):"; cat "$work/one.txt"
  echo "host 0 ($a0):"; cat "$work/h0.txt"; echo "host 1 ($a1):"; cat "$work/h1.txt"
  grep -q "^127.0.0.1:29500 store" "$work/one.txt" || fail "the one-host store is not on 127.0.0.1:29500"
  grep -qv "^127.0.0.1:" "$work/one.txt" && fail "a one-host listener off loopback"
  grep -q "^$a0:29500 store" "$work/h0.txt" || fail "host 0's store is not on $a0:29500"
  [ "$(wc -l < "$work/h1.txt")" -ge 2 ] || fail "host 1 lists fewer than its 2 ranks' listeners"
  grep -qv "^$a0:" "$work/h0.txt" && fail "a host 0 listener off $a0"
  grep -qv "^$a1:" "$work/h1.txt" && fail "a host 1 listener off $a1"
  echo "PASS" ;;
*) fail "unknown case $case_name" ;;
esac
