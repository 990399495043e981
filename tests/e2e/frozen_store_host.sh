#!/usr/bin/env bash
# Rank 0 hosts the rendezvous store. Frozen (SIGSTOP) before rank 1 joins, it accepts the
# connection but never answers: rank 1 must still end, non-zero, within the rendezvous
# timeout plus the 5 s backstop, with one line naming the stage and the store host.
# usage: frozen_store_host.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d)
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
rank() {  # exec: the background job is the rank process itself, which SIGSTOP must reach
  exec env RANK=$1 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$bin/faceshard-dist-check" --rendezvous-timeout-s 4
}
rank 0 > "$work/r0.log" 2>&1 &
host=$!
trap 'kill -9 $host 2>/dev/null; rm -rf "$work"' EXIT
# The store listens once rank 0 has created it.
for _ in $(seq 1 300); do ss -ltn "sport = :$port" | grep -q ":$port" && break; sleep 0.05; done
ss -ltn "sport = :$port" | grep -q ":$port" || { echo "FAIL: rank 0 never listened on $port"; cat "$work/r0.log"; exit 1; }
kill -STOP $host
t0=$(date +%s.%N)
(rank 1) > "$work/r1.log" 2>&1 &
joiner=$!
for _ in $(seq 1 600); do kill -0 $joiner 2>/dev/null || break; sleep 0.1; done
kill -0 $joiner 2>/dev/null && { kill -9 $joiner; echo "FAIL: rank 1 still running after 60 s"; exit 1; }
wait $joiner
rc=$?
took=$("$py" -c "print(round($(date +%s.%N) - $t0, 1))")
cat "$work/r1.log"
fail=0
[ "$rc" -ne 0 ] || { echo "FAIL: rank 1 exit status 0"; fail=1; }
"$py" -c "import sys; sys.exit(0 if $took <= 4 + 5 + 5 else 1)" || { echo "FAIL: rank 1 took $took s (limit 14 s)"; fail=1; }
[ "$(grep -c 'error:' "$work/r1.log")" -eq 1 ] || { echo "FAIL: not one error line"; fail=1; }
grep -q 'error: rendezvous at 127.0.0.1:'"$port"' failed on rank 1 (store connect): .*rank 0' "$work/r1.log" \
  || { echo "FAIL: the error does not name the stage and rank 0"; fail=1; }
[ "$fail" -eq 0 ] && echo "PASS: rank 1 ended with exit $rc after $took s"
exit "$fail"
