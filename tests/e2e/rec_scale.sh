#!/usr/bin/env bash
# A .rec of Glint360K's size (17,091,657 images, 360,232 identities, 1-byte placeholder
# images) in insightface's layout: its float32 header and identity labels are rounded past
# 2^24. It must open, with the true boundaries (checked against closed forms of the
# generator's classes), share its index through the cache, and fail only at the images.
# usage: rec_scale.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
N=17091657; C=360232

"$bin/faceshard-synth" --scale $N:$C --output "$work/glint" || fail "faceshard-synth --scale"
for pass in 1 2; do
  "$bin/faceshard-bench" --mode data --open-only --data "$work/glint" --index-cache "$work/cache" \
    --json "$work/open$pass.json" > "$work/open$pass.log" 2>&1 || { cat "$work/open$pass.log"; fail "open pass $pass"; }
  cat "$work/open$pass.log"
done
grep -q "(built)" "$work/open1.log" || fail "the first open did not build the cache"
grep -q "(built)" "$work/open2.log" && fail "the second open rebuilt the cache"
"$py" - "$work" $N $C <<'PY' || exit 1
import json, re, sys
work, n, c = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cls = lambda i: i * c // n                      # the generator's class of image i (key i + 1)
first = lambda k: -(-k * n // c)                 # first image index of class k
log = open(work + '/open2.log').read()
assert f'{n} images, {c} identities' in log, log
for i in (0, n - 2, n - 1):
    m = re.search(rf'image {i}: key (\d+), class (\d+), 1 bytes', log)
    assert m and int(m.group(1)) == i + 1 and int(m.group(2)) == cls(i), (i, m and m.groups())
for k in (0, c - 1):
    m = re.search(rf'identity record (\d+) \(class {k}\): images \[(\d+), (\d+)\)', log)
    want = (n + 1 + k, first(k) + 1, first(k + 1) + 1)
    assert m and tuple(map(int, m.groups())) == want, (k, m and m.groups(), want)
o = json.load(open(work + '/open2.json'))
assert o['private_mb'] < 64, o   # the index is mapped, not copied into each rank
assert o['index_bytes'] == 8 * (16 + n + c + 1), o
print('open: %.3f s, private %.1f MB, file-backed %.1f MB' % (o['open_s'], o['private_mb'], o['file_backed_mb']))
PY
# Training gets past the header: the first error is a placeholder payload that is no image.
cat > "$work/job.yaml" <<YAML
base: $root/configs/base.yaml
output: $work/out
data: {rec: $work/glint, num_classes: $C, batch_size: 8, num_workers: 1, max_bad_fraction: 0, index_cache: $work/cache}
model: {backbone: mbf}
YAML
"$bin/faceshard-train" --config "$work/job.yaml" --set dist.device=cpu > "$work/train.log" 2>&1 && fail "training on placeholders succeeded"
tail -1 "$work/train.log" | grep -q "not a JPEG, PNG or BMP image" || { cat "$work/train.log"; fail "the first error is not the image decode"; }
echo PASS
