#!/usr/bin/env bash
# Loose photos in a verification set: 250x250 faces packed by `faceshard-pack pairs --size
# 250` are written with a warning that names the size and how to align them; with --resize
# 112 (as `pack` takes it) the .bin holds 112x112 JPEGs and nothing is said; --landmarks
# and --resize together are refused, as `pack` refuses them.
# usage: pairs_sizes.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$bin/faceshard-synth" --output "$work/data" --identities 6 --images 4 --holdout 0 --pairs 0 --size 250 --seed 3 > /dev/null ||
  fail "faceshard-synth --size 250"
"$bin/faceshard-pack" unpack "$work/data/train.rec" "$work/photos" > /dev/null || fail "unpack"
"$bin/faceshard-pack" pairs "$work/photos" "$work/loose.bin" --pairs 20 --size 250 > "$work/loose.out" 2> "$work/loose.err" ||
  { cat "$work/loose.err"; fail "pairs --size 250"; }
grep -q "warning: $work/loose.bin holds 250x250 images, not the networks' 112x112: .*--landmarks FILE (or --resize 112)" "$work/loose.err" ||
  { cat "$work/loose.err"; fail "no warning for 250x250 pairs"; }
"$bin/faceshard-pack" pairs "$work/photos" "$work/resized.bin" --pairs 20 --resize 112 > "$work/resized.out" 2> "$work/resized.err" ||
  { cat "$work/resized.err"; fail "pairs --resize 112"; }
! grep -q "warning" "$work/resized.err" || { cat "$work/resized.err"; fail "a warning for 112x112 pairs"; }
out=$("$bin/faceshard-pack" pairs "$work/photos" "$work/x.bin" --resize 112 --landmarks "$work/none.txt" 2>&1)
[ $? = 2 ] && [[ "$out" == *"--resize and --landmarks: give one"* ]] || fail "--resize with --landmarks: $out"
[ ! -e "$work/x.bin" ] || fail "x.bin written"

# The images' sizes as their JPEG headers say (SOF markers), read from the pickled .bin.
"$py" - "$work/loose.bin" "$work/resized.bin" <<'PY' || fail "image sizes"
import pickle, struct, sys

def size(jpeg):
    i = 2
    while i < len(jpeg):
        marker, length = jpeg[i + 1], struct.unpack(">H", jpeg[i + 2:i + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            h, w = struct.unpack(">HH", jpeg[i + 5:i + 9])
            return w, h
        i += 2 + length
    raise ValueError("no SOF marker")

for path, want in zip(sys.argv[1:], [(250, 250), (112, 112)]):
    with open(path, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    got = {size(bytes(b)) for b in bins}
    assert got == {want}, (path, got)
    assert len(bins) == 2 * len(issame) == 40, (path, len(bins), len(issame))
print("sizes checked")
PY
echo "PASS: pairs warns about 250x250 photos and makes 112x112 faces with --resize"
