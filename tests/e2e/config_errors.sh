#!/usr/bin/env bash
# A config with an unknown key, a wrong type, or a missing base file: one line on stderr
# naming the file and the key, exit status 2.
set -u
bin="$1"
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
printf 'data:\n  num_classes: 10\n' > "$dir/base.yaml"
printf 'base: base.yaml\noptim:\n  lr_rate: 0.1\n' > "$dir/unknown.yaml"
printf 'base: base.yaml\ndata:\n  batch_size: big\n' > "$dir/wrongtype.yaml"
printf 'base: missing.yaml\n' > "$dir/nobase.yaml"
fail=0
check() {  # file, expected fragments...
  local f="$1"; shift
  "$bin/faceshard-config" --config "$dir/$f" > "$dir/out" 2> "$dir/err"; local rc=$?
  local lines; lines=$(wc -l < "$dir/err")
  echo "$f -> exit $rc: $(cat "$dir/err")"
  [ "$rc" -eq 2 ] || { echo "FAIL: $f exit $rc, expected 2"; fail=1; }
  [ "$lines" -eq 1 ] || { echo "FAIL: $f printed $lines lines"; fail=1; }
  for frag in "$@"; do grep -qF -- "$frag" "$dir/err" || { echo "FAIL: $f: '$frag' missing"; fail=1; }; done
}
check unknown.yaml "unknown.yaml" "'optim.lr_rate'"
check wrongtype.yaml "wrongtype.yaml" "'data.batch_size'" "expected an integer"
check nobase.yaml "nobase.yaml" "'base'" "missing.yaml"
"$bin/faceshard-config" --config "$dir/base.yaml" --set optim.lr=0.5 --print-config > "$dir/out" || fail=1
grep -q "lr: 0.5" "$dir/out" || { echo "FAIL: --print-config does not show the override"; fail=1; }
[ "$fail" -eq 0 ] && echo "PASS"
exit "$fail"
