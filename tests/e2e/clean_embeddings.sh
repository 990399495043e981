#!/usr/bin/env bash
# faceshard-clean --embeddings on CPU: the reports from embeddings written by faceshard-extract
# equal, row for row, the reports of the clean that embeds the images itself (a tiny run with
# three sub-centres, so all five reports have rows to compare); then the refusals of a file
# that does not match the set: too few rows, rows of another dimension, not a .npy, a
# truncated copy, a value that is not finite, names of another order. Each refusal is one
# error line and a non-zero exit, and leaves the reports already in the folder as they were.
# usage: clean_embeddings.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
work=$(mktemp -d); [ -n "${KEEP_WORK:-}" ] || trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3

source "$root/tests/e2e/clean_run.sh"
trained_k3_run 5 1

clean() { "$bin/faceshard-clean" --device cpu --run "$work/out" --rec "$work/data" --bin "$work/data/synth.bin" \
  --near-duplicate-cos 0.9 "$@"; }
clean --output "$work/images" > "$work/images.log" 2>&1 || { cat "$work/images.log"; fail "faceshard-clean from the images"; }
"$bin/faceshard-extract" --device cpu --model "$work/out" --rec "$work/data" --output "$work/emb" > "$work/extract.log" 2>&1 \
  || { cat "$work/extract.log"; fail "faceshard-extract"; }
clean --embeddings "$work/emb.npy" --output "$work/file" > "$work/file.log" 2>&1 \
  || { cat "$work/file.log"; fail "faceshard-clean --embeddings"; }
grep -q "^# embeddings: $work/emb.npy" "$work/file/mislabeled.tsv" || fail "the reports do not name the embeddings file"
rows=0
for r in mislabeled duplicate_identities overlap near_duplicates dropped_subcenters; do
  # The headers differ by the embeddings line only; every row must be the same.
  diff <(grep -v '^#' "$work/images/$r.tsv") <(grep -v '^#' "$work/file/$r.tsv") > "$work/$r.diff" \
    || { head -20 "$work/$r.diff"; fail "$r.tsv from --embeddings differs from the images' (above)"; }
  rows=$((rows + $(grep -vc '^#' "$work/images/$r.tsv") - 1))
done
[ "$rows" -ge 20 ] || fail "only $rows report rows to compare: the comparison shows nothing"

# Refusals, each against a folder holding the reports of the good run.
cp -r "$work/file" "$work/kept"
sum() { cat "$work/kept"/*.tsv | md5sum; }
before=$(sum)
refused() {  # refused NAME PATTERN FILE: one error line matching PATTERN, non-zero exit, reports kept
  local name="$1" pattern="$2" file="$3"
  clean --embeddings "$file" --output "$work/kept" > "$work/$name.out" 2> "$work/$name.err" \
    && fail "$name: accepted"
  [ "$(wc -l < "$work/$name.err")" -eq 1 ] || { cat "$work/$name.err"; fail "$name: not one error line"; }
  grep -q -- "$pattern" "$work/$name.err" || { cat "$work/$name.err"; fail "$name: expected /$pattern/"; }
  [ "$(sum)" = "$before" ] || fail "$name: the reports already there were changed"
  [ -z "$(ls -A "$work/kept" | grep -v '\.tsv$')" ] || fail "$name: left behind: $(ls -A "$work/kept")"
}
"$py" - "$work" <<'PY' || fail "writing the mismatched files"
import numpy as np, sys, shutil
w = sys.argv[1]
e = np.load(w + "/emb.npy")
assert e.shape == (128, 64) and e.dtype == np.float32, e.shape
np.save(w + "/rows.npy", e[:-1])                                              # one image short
np.save(w + "/dims.npy", np.concatenate([e, e[:, :1]], axis=1))               # 65 dimensions
np.save(w + "/f64.npy", e.astype(np.float64))                                 # float64
open(w + "/corrupt.npy", "wb").write(b"PK\x03\x04" + open(w + "/emb.npy", "rb").read()[4:])  # a zip, not a .npy
b = open(w + "/emb.npy", "rb").read(); open(w + "/cut.npy", "wb").write(b[:-100])           # truncated copy
n = e.copy(); n[77, 5] = np.nan; np.save(w + "/nan.npy", n)                   # a row that is not finite
shutil.copy(w + "/emb.npy", w + "/order.npy")                                 # names of another order
names = open(w + "/emb.txt").read().splitlines()
names[8], names[16] = names[16], names[8]
open(w + "/order.txt", "w").write("\n".join(names) + "\n")
PY
refused rows "has 127 rows, .* has 128 images" "$work/rows.npy"
refused dims "rows of 65 dimensions, the run's embeddings have 64" "$work/dims.npy"
refused dtype "expected a C-order float32 (N, E) matrix" "$work/f64.npy"
refused corrupt "not a .npy file" "$work/corrupt.npy"
refused truncated "announces 32768 (a truncated or damaged copy)" "$work/cut.npy"
refused nan "nan.npy' row 77 holds a value that is not finite" "$work/nan.npy"
refused order "order.txt' line 9 is '16 2', image 8 of .* is '8 1'" "$work/order.npy"
refused missing "cannot open embeddings file" "$work/none.npy"
echo "PASS: reports from --embeddings equal the images' ($rows rows); 7 refusals"
