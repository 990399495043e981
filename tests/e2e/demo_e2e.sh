#!/usr/bin/env bash
# The README's main job as a test: the demo data set and configs/demo.yaml on 2 CPU ranks.
# Verification accuracy on the held-out synthetic pairs must rise well above where the
# untrained network starts, and faceshard-verify on the exported model must print the
# accuracy the trainer logged last.
# usage: demo_e2e.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$bin/faceshard-synth" --output "$work/data" > /dev/null || fail "faceshard-synth"
"$root/tools/launch.sh" --nproc 2 -- "$bin/faceshard-train" --config "$root/configs/demo.yaml" \
  --set output="$work/out" --set data.rec="$work/data" > "$work/log" 2>&1 || { cat "$work/log"; fail "demo training"; }
grep -E "Accuracy-Flip|done" "$work/log"
"$bin/faceshard-verify" --model "$work/out" --bin "$work/data/synth.bin" --device cpu --output "$work/eval" \
  --json "$work/verify.json" > "$work/vlog" 2>&1 || { cat "$work/vlog"; fail "faceshard-verify"; }
cat "$work/vlog"
"$py" - "$work/out/metrics.jsonl" "$work/verify.json" <<'PY' || exit 1
import json, sys
curve = [(r['step'], r['val/synth/accuracy']) for r in map(json.loads, open(sys.argv[1])) if 'val/synth/accuracy' in r]
print('verification curve', curve)
(s0, first), (_, last) = curve[0], curve[-1]
assert s0 == 0, 'no verification before training'
assert first < 0.7, 'the untrained network already solves the pairs (%.3f)' % first
assert last >= 0.75 and last - first >= 0.15, 'accuracy did not rise well above chance: %.3f -> %.3f' % (first, last)
got = json.load(open(sys.argv[2]))['sets'][0]['accuracy']
assert got == last, 'faceshard-verify %r != trainer %r' % (got, last)
print('faceshard-verify %.5f == trainer %.5f' % (got, last))
PY
echo PASS
