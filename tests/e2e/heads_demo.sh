#!/usr/bin/env bash
# The demo with one margin head: the synthetic faces of the README's demo, the small
# MobileFaceNet, one CPU rank, 80 steps of 32 images. Verification accuracy on the held-out
# pairs must rise well above where the untrained network starts, and the head's state (where
# it has one) must be logged with every step.
# usage: heads_demo.sh SOURCE_DIR BIN_DIR HEAD
set -u
root="$1"; bin="$2"; head="$3"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$bin/faceshard-synth" --output "$work/data" > /dev/null || fail "faceshard-synth"
OMP_NUM_THREADS=1 "$root/tools/launch.sh" --nproc 1 -- "$bin/faceshard-train" --config "$root/configs/demo.yaml" \
  --set output="$work/out" --set data.rec="$work/data" --set model.backbone=mbf_small \
  --set loss.head="$head" --set "loss.$head.s=32" \
  --set optim.total_steps=80 --set optim.warmup_epochs=0 --set train.verify_every=80 --set train.checkpoint_every=0 \
  > "$work/log" 2>&1 || { cat "$work/log"; fail "training with $head"; }
grep -E "head |Accuracy-Flip|done" "$work/log"
"$py" - "$work/out/metrics.jsonl" "$head" <<'PY' || exit 1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
head = sys.argv[2]
curve = [(r['step'], r['val/synth/accuracy']) for r in rows if 'val/synth/accuracy' in r]
print(head, 'verification curve', curve)
(s0, first), (s1, last) = curve[0], curve[-1]
assert s0 == 0 and s1 == 80, 'expected verification at steps 0 and 80, got %r' % curve
assert first < 0.7, 'the untrained network already solves the pairs (%.3f)' % first
assert last >= 0.75 and last - first >= 0.15, '%s: accuracy did not rise well above chance: %.3f -> %.3f' % (head, first, last)
state = {'adaface': ['batch_mean', 'batch_std'], 'curricularface': ['t']}.get(head, [])
steps = [r for r in rows if 'loss' in r]
for k in state:
    key = 'head/%s/%s' % (head, k)
    assert all(key in r for r in steps), '%s missing from the logged steps' % key
    print(key, [round(r[key], 5) for r in steps[::20]])
PY
echo PASS
