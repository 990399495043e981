#!/usr/bin/env bash
# tools/launch.sh with 3 ranks: killing one rank mid-run must end the others with a
# non-zero exit and a message naming the killed rank, within the collective timeout.
set -u
root="$1"; bin="$2"
log=$(mktemp)
"$root/tools/launch.sh" --nproc 3 --grace-s 30 -- "$bin/faceshard-dist-check" --rounds 100000 --interval-ms 20 --timeout-s 10 > "$log" 2>&1 &
launcher=$!
for _ in $(seq 1 200); do grep -q "round" "$log" && break; sleep 0.1; done
victim=$(pgrep -P "$launcher" -f faceshard-dist-check | sort -n | sed -n 2p)   # rank 1
[ -n "$victim" ] || { echo "FAIL: no rank process found"; cat "$log"; exit 1; }
start=$(date +%s)
kill -9 "$victim"
wait "$launcher"; rc=$?
took=$(( $(date +%s) - start ))
cat "$log" | grep -v " ok: "
fail=0
[ "$rc" -ne 0 ] || { echo "FAIL: launcher exited 0"; fail=1; }
[ "$took" -lt 15 ] || { echo "FAIL: took ${took}s, more than the 10 s collective timeout + diagnosis"; fail=1; }
for r in 0 2; do
  grep -q "\[rank $r/3\].*error: .*rank 1 died" "$log" || { echo "FAIL: rank $r did not name rank 1"; fail=1; }
done
rm -f "$log"
[ "$fail" -eq 0 ] && echo "PASS: launcher exit $rc after ${took}s, ranks 0 and 2 named rank 1"
exit "$fail"
