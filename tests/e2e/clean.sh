#!/usr/bin/env bash
# faceshard-clean end to end on CPU: a tiny run trained on 2 ranks with three sub-centres per
# class (loss.subcenters: 3; the centres read from both shards, K from them), cleaned over its .rec and over its images unpacked to a folder with one
# image stored twice (which near_duplicates.tsv must name, bytes identical), with a .bin;
# then the refusals: a missing run, a checkpoint without its classifier shards, a .bin that
# does not parse, a K the checkpoint does not have, a report folder that cannot be made. Each refusal is one error line and a
# non-zero exit, and leaves the reports already in the folder as they were.
# Then the recipe's last step: K = 1 on a cleaned copy starting at each class's dominant
# sub-centre (loss.init_centres), the rows checked against the K = 3 checkpoint in Python.
# usage: clean.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
work=$(mktemp -d); [ -n "${KEEP_WORK:-}" ] || trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

source "$root/tests/e2e/clean_run.sh"
trained_k3_run 3 2

# The training log says K.
grep -q "classifier 16 classes x 3 sub-centres (loss.subcenters)" "$work/train.log" || fail "the training log does not say K"
clean() { "$bin/faceshard-clean" --device cpu --run "$work/out" "$@"; }
# The test sets' embeddings are kept between passes over one run (this test's own cache).
export FACESHARD_EMBEDDING_CACHE="$work/ecache"
clean --rec "$work/data" --bin "$work/data/synth.bin" --output "$work/reports" > "$work/clean.log" 2>&1 \
  || { cat "$work/clean.log"; fail "faceshard-clean on the .rec"; }
grep -q "saved on 2 ranks" "$work/clean.log" || { cat "$work/clean.log"; fail "the run's 2 shards were not read"; }
for r in mislabeled duplicate_identities overlap near_duplicates dropped_subcenters; do
  f="$work/reports/$r.tsv"
  [ -f "$f" ] || fail "$r.tsv missing"
  # Each threshold as its flag and value (dropped_subcenters.tsv has none, and says so).
  if [ "$r" = dropped_subcenters ]; then want="^# thresholds: none"; else want="^# thresholds: --"; fi
  grep -q "$want" "$f" || fail "$r.tsv: no thresholds in its header"
  grep -q "^# images: 128, classes: 16, sub-centres per class: 3" "$f" || fail "$r.tsv: wrong counts in its header"
  [ "$(grep -vc '^#' "$f")" -ge 1 ] || fail "$r.tsv: no column line"
done
# The defaults come from the set's own cosines (the fit said in each header and in the log);
# a flag sets each.
grep -qE "^# thresholds: --mislabeled-angle [0-9.]+ degrees \(from the data: cos -?[0-9.]+ = mean -?[0-9.]+ \+ 3.09 sd [0-9.]+ of 128 image-to-other-class cosines \(of 1920\)" \
  "$work/reports/mislabeled.tsv" || { grep '^# thr' "$work/reports/mislabeled.tsv"; fail "the mislabeled angle's default is not the data's"; }
grep -qE "^# thresholds: --identity-cos -?[0-9.]+ .*from the data: cos .* of 120 class-pair cosines \(of 120\)" "$work/reports/duplicate_identities.tsv" ||
  { grep '^# thr' "$work/reports/duplicate_identities.tsv"; fail "the identity cosine's default is not the data's"; }
for k in mislabeled-angle identity-cos overlap-cos; do
  grep -q "thresholds: --$k .* from the data: cos " "$work/clean.log" || { cat "$work/clean.log"; fail "the log does not say where --$k comes from"; }
done
# Each flag decides what is flagged, at its extremes: an angle of 0.01 degrees flags every
# image and 179.9 none; a cosine of -0.99 pairs every two classes (16 x 15 / 2) and every test
# identity with every class, 1.0 none.
clean --rec "$work/data" --bin "$work/data/synth.bin" --output "$work/low" --mislabeled-angle 0.01 --identity-cos -0.99 \
  --overlap-cos -0.99 > "$work/low.log" 2>&1 || { cat "$work/low.log"; fail "faceshard-clean at the low extremes"; }
clean --rec "$work/data" --bin "$work/data/synth.bin" --output "$work/high" --mislabeled-angle 179.9 --identity-cos 1.0 \
  --overlap-cos 1.0 > "$work/high.log" 2>&1 || { cat "$work/high.log"; fail "faceshard-clean at the high extremes"; }
rows() { grep -vc '^#' "$1" | awk '{print $1 - 1}'; }
[ "$(rows "$work/low/mislabeled.tsv")" = 128 ] && [ "$(rows "$work/high/mislabeled.tsv")" = 0 ] ||
  fail "--mislabeled-angle 0.01 / 179.9 flagged $(rows "$work/low/mislabeled.tsv") / $(rows "$work/high/mislabeled.tsv") of 128"
[ "$(rows "$work/low/duplicate_identities.tsv")" = 120 ] && [ "$(rows "$work/high/duplicate_identities.tsv")" = 0 ] ||
  fail "--identity-cos -0.99 / 1.0 paired $(rows "$work/low/duplicate_identities.tsv") / $(rows "$work/high/duplicate_identities.tsv") of 120"
ov=$(rows "$work/low/overlap.tsv")
[ "$ov" -gt 0 ] && [ $((ov % 16)) = 0 ] && [ "$(rows "$work/high/overlap.tsv")" = 0 ] ||
  fail "--overlap-cos -0.99 / 1.0 gave $ov / $(rows "$work/high/overlap.tsv") rows (every test identity x 16 classes / none)"
grep -q "thresholds: --identity-cos -0.99 from --identity-cos" "$work/low.log" || { cat "$work/low.log"; fail "a given flag is not named as given"; }
# The first pass embedded the .bin and kept it; the later passes over the same run and file
# took it from the cache; a file changed since (its time) is embedded again.
grep -q "test set synth: [0-9]* images embedded in .* s (kept for the next pass)" "$work/clean.log" &&
  grep -q "test set synth: embeddings from the cache" "$work/low.log" &&
  grep -q "test set synth: embeddings from the cache" "$work/high.log" || { cat "$work/clean.log" "$work/low.log"; fail "the test set was not kept between passes"; }
[ "$(ls "$work/ecache" | wc -l)" = 1 ] || fail "the cache holds $(ls "$work/ecache")"
touch "$work/data/synth.bin"
clean --rec "$work/data" --bin "$work/data/synth.bin" --output "$work/again" > "$work/again.log" 2>&1 || { cat "$work/again.log"; fail "faceshard-clean after touching the .bin"; }
grep -q "test set synth: [0-9]* images embedded in" "$work/again.log" || { cat "$work/again.log"; fail "a changed .bin was taken from the cache"; }
cmp -s "$work/reports/overlap.tsv" "$work/again/overlap.tsv" || { diff "$work/reports/overlap.tsv" "$work/again/overlap.tsv" | head; fail "the cached pass's overlap report differs from the embedded one's"; }
[ -z "$(ls -A "$work/reports" | grep -v '\.tsv$')" ] || fail "left behind: $(ls -A "$work/reports")"

# A set packed from photos names them: the same images unpacked, their names zero-padded so
# that pack keeps the order, packed again (the same set: the same identity) write
# train.sources.tsv beside the .rec, and the reports on it name each image by its photo, their
# other columns those of the reports on the original .rec.
"$bin/faceshard-pack" unpack "$work/data/train.rec" "$work/same_src" > /dev/null 2>&1 || fail "unpack for the sources"
(cd "$work/same_src" && for d in *; do
   (cd "$d" && for f in *.jpg; do mv "$f" "$(printf %04d "${f%.jpg}").jpg"; done) && mv "$d" "c$(printf %02d "$d")"
 done) || fail "renaming for the sources"
"$bin/faceshard-pack" pack "$work/same_src" "$work/same/train" > "$work/same_pack.log" 2>&1 || { cat "$work/same_pack.log"; fail "re-packing the same images"; }
[ -f "$work/same/train.sources.tsv" ] && grep -qF "$work/same/train.sources.tsv" "$work/same_pack.log" || fail "pack wrote no sources list"
clean --rec "$work/same" --bin "$work/data/synth.bin" --output "$work/same_reports" > "$work/same_clean.log" 2>&1 \
  || { cat "$work/same_clean.log"; fail "faceshard-clean on the re-packed set"; }
grep -qF "the reports name each image by the photo it was packed from ($work/same/train.sources.tsv)" "$work/same_clean.log" ||
  { cat "$work/same_clean.log"; fail "faceshard-clean did not take the sources list"; }
python3 - "$work" <<'PY' || fail "the reports on the re-packed set"
import os, sys
w = sys.argv[1]
src = [l.rstrip('\n').split('\t') for l in open(w + '/same/train.sources.tsv')][1:]
assert [int(r[0]) for r in src] == list(range(128)), 'sources.tsv: not one row per image in order'
# Each listed photo holds the bytes the re-packed .rec holds for that image (pack stores bytes as
# stored): the original .rec's record of the same index, unpacked as <key>.jpg with key = index + 1.
for i, label, path in src:
    a = open(path, 'rb').read()
    b = open(os.path.join(w, 'same_src', 'c%02d' % int(label), '%04d.jpg' % (int(i) + 1)), 'rb').read()
    assert a == b and path.startswith(w + '/same_src/'), (i, path)
def rows(d, name):
    lines = [l.rstrip('\n').split('\t') for l in open(os.path.join(d, name)) if not l.startswith('#')]
    return lines[0], lines[1:]
for name in ('mislabeled.tsv', 'near_duplicates.tsv'):
    h, orig = rows(w + '/reports', name)
    _, same = rows(w + '/same_reports', name)
    assert len(orig) == len(same), (name, len(orig), len(same))
    cols = [k for k, c in enumerate(h) if c.startswith('image')]
    idx = [k for k, c in enumerate(h) if c.startswith('index')]
    for a, b in zip(orig, same):
        for k in range(len(h)):
            if k in cols: continue
            assert a[k] == b[k], (name, h[k], a, b)
        for c, i in zip(cols, idx):
            assert b[c] == src[int(b[i])][2], (name, b)
            assert a[c] != b[c] and 'key' in a[c], (name, a[c])
print('the re-packed set\'s reports name the photos: %d mislabeled rows' % len(rows(w + '/same_reports', 'mislabeled.tsv')[1]))
PY

# The images as a folder (class folders numbered as the run's labels), one stored twice.
"$bin/faceshard-pack" unpack "$work/data/train.rec" "$work/img" > /dev/null 2>&1 || fail "faceshard-pack unpack"
(cd "$work/img" && for d in *; do mv "$d" "c$(printf %02d "$d")"; done) || fail "renaming the class folders"
first=$(ls "$work/img/c05" | head -1)
cp "$work/img/c05/$first" "$work/img/c05/zz_copy.jpg"
clean --images "$work/img" --output "$work/folder" > "$work/folder.log" 2>&1 || { cat "$work/folder.log"; fail "faceshard-clean on a folder"; }
grep -P "^\d+\t[^\t]*c05/$first\t5\t\d+\t[^\t]*c05/zz_copy.jpg\t5\t1\.0000\d*\tyes\t" "$work/folder/near_duplicates.tsv" > /dev/null \
  || { cat "$work/folder/near_duplicates.tsv"; fail "the copied image is not in near_duplicates.tsv"; }

# faceshard-pack clean, from reports written here (the tiny run's own reports list nearly
# everything): every listed image and overlapping class gone, classes 1 and 2 merged, the
# rest byte for byte under renumbered classes; then from a keep-list.
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
mkdir -p "$work/hand"
# Each report names the set it was made from (the real reports' line: the same set).
set_line=$(grep -m1 '^# set: sha256:[0-9a-f]\{64\} (rec: 128 images, 16 classes)$' "$work/reports/mislabeled.tsv") ||
  fail "mislabeled.tsv does not name its set: $(grep -m1 '^# set' "$work/reports/mislabeled.tsv")"
printf '# hand\n%s\nindex\timage\tlabel\n3\tx\t0\n17\tx\t2\n' "$set_line" > "$work/hand/mislabeled.tsv"
printf '%s\nindex_a\tindex_b\n19\t20\n' "$set_line" > "$work/hand/near_duplicates.tsv"
printf '%s\nset\tclass\nlfw\t5\n' "$set_line" > "$work/hand/overlap.tsv"
printf '%s\nclass_a\tclass_b\n1\t2\n' "$set_line" > "$work/hand/duplicate_identities.tsv"
"$bin/faceshard-pack" clean "$work/data/train.rec" "$work/cleaned/train" --reports "$work/hand" --merge > "$work/pack.log" 2>&1 \
  || { cat "$work/pack.log"; fail "faceshard-pack clean --reports"; }
grep -q "117 images kept, 11 dropped (2 mislabeled, 1 duplicates, 1 classes in test sets), 14 classes (1 merged)" "$work/pack.log" \
  || { cat "$work/pack.log"; fail "faceshard-pack clean's counts"; }
# The recipe's last step: K = 1 on the cleaned set from the K = 3 run, each class starting at
# its dominant sub-centre (the report's dropped_subcenters.tsv), classes matched through the
# cleaned set's labels.tsv (classes renumbered, 1 and 2 merged: the one with more images at
# its dominant sub-centre gives the centre), on 2 ranks from the 2 saved shards. A learning
# rate of 1e-30 leaves the rows as they started, so the run's checkpoint shows them.
k3_step=$(ls -d "$work/out/checkpoints/step_"* | tail -1)
"$root/tools/launch.sh" --nproc 2 --grace-s 20 -- "$bin/faceshard-train" --config "$work/tiny.yaml" \
  --set output="$work/k1" --set data.rec="$work/cleaned" --set data.num_classes=14 --set loss.subcenters=1 \
  --set loss.init_centres="$work/out" --set loss.init_centres_report="$work/reports" --set optim.lr=1e-30 \
  --set optim.total_steps=1 --set train.checkpoint_every=1 --set model.init="$k3_step/backbone.pt" \
  > "$work/k1.log" 2>&1 || { tail -20 "$work/k1.log"; fail "K = 1 from the K = 3 run's dominant sub-centres"; }
grep -qF "loss.init_centres: 14 classes' centres from '$k3_step' (step 4, classes matched by '$work/cleaned/train.labels.tsv' (source_classes), 1 of them merged from several; of its 3 sub-centres per class each keeps its dominant one" "$work/k1.log" \
  || { grep init_centres "$work/k1.log"; fail "the K = 1 run does not say where its centres come from"; }
"$py" - "$k3_step" "$work/reports/dropped_subcenters.tsv" "$work/cleaned/train.labels.tsv" "$work/k1/checkpoints" <<'PY' || fail "the K = 1 run's centres are not the dominant sub-centres"
import glob, sys, torch
k3, dropped, labels, k1 = sys.argv[1:]
def rows(step):
    return torch.cat([torch.load(f, weights_only=False)["rows/weight"].float()
                      for f in sorted(glob.glob(step + "/fc_shard_*.pt"), key=lambda f: int(f.split("_")[-1][:-3]))])
old = rows(k3).view(16, 3, -1)
dom, n = {}, {}
for line in open(dropped):
    if line.startswith("#") or line.startswith("class\t"): continue
    c, k, imgs, d, dimgs, ang = line.rstrip("\n").split("\t")
    dom[int(c)], n[int(c)] = int(d), int(dimgs)
want = []
for line in list(open(labels))[1:]:
    src = [int(x) for x in line.split("\t")[1].split(",")]
    best = max(src, key=lambda x: (n.get(x, 0), -x))
    want.append(old[best, dom.get(best, 0)])
want = torch.stack(want)
got = rows(sorted(glob.glob(k1 + "/step_*"))[-1])
assert got.shape == want.shape, (got.shape, want.shape)
err = (got - want).abs().max().item()
assert err < 1e-6, f"max difference {err}"
assert any(len(l.split("\t")[1].split(",")) > 1 for l in list(open(labels))[1:]), "no merged class"
print(f"K = 1 centres: the dominant sub-centres of {len(want)} classes (max difference {err:.1e})")
PY
# What each report removes, chains of merges named, a share above --warn-above warned about;
# with --merge an image whose "relabel C" names its own merged identity is kept.
mkdir -p "$work/hand2"
cp "$work/hand/near_duplicates.tsv" "$work/hand/overlap.tsv" "$work/hand2/"
printf '%s\nindex\timage\tlabel\tsuggestion\n3\tx\t0\tdrop\n9\tx\t1\trelabel 3\n17\tx\t2\trelabel 9\n' "$set_line" > "$work/hand2/mislabeled.tsv"
printf '%s\nclass_a\tclass_b\n1\t2\n3\t2\n' "$set_line" > "$work/hand2/duplicate_identities.tsv"
"$bin/faceshard-pack" clean "$work/data/train.rec" "$work/cleaned2/train" --reports "$work/hand2" --merge --warn-above 0.05 \
  > "$work/pack2.log" 2>&1 || { cat "$work/pack2.log"; fail "faceshard-pack clean --reports hand2"; }
for line in "mislabeled.tsv: 2 images dropped, 1 kept (nearest to a class merged with their own" \
            "near_duplicates.tsv: 1 images dropped" "overlap.tsv: 1 classes dropped with every class merged into them, 8 images" \
            "duplicate_identities.tsv: 2 classes merged into others, 1 of the identities made of more than two classes" \
            "warning: classes 1, 2, 3 become one identity (3 classes joined by a chain" \
            "warning: the cleaning drops 8.6% of the images, more than 5.0% (--warn-above)"; do
  grep -qF "$line" "$work/pack2.log" || { cat "$work/pack2.log"; fail "pack clean did not say: $line"; }
done
"$bin/faceshard-pack" clean "$work/data/train.rec" "$work/cleaned3/train" --reports "$work/hand2" --merge --warn-above 1.5 \
  > "$work/pack3.log" 2>&1 && fail "--warn-above 1.5 was accepted"
grep -q "warn-above" "$work/pack3.log" || { cat "$work/pack3.log"; fail "--warn-above 1.5 refused without naming it"; }
# A clean copy of the set packed from photos keeps the identity names and the photos: its
# labels.tsv names the identities of each new class (three merged into one), its sources.tsv
# lists each kept image's photo, whose bytes are the clean .rec's record.
"$bin/faceshard-pack" clean "$work/same/train.rec" "$work/same_clean/train" --reports "$work/hand2" --merge \
  > "$work/same_clean_pack.log" 2>&1 || { cat "$work/same_clean_pack.log"; fail "pack clean of the set packed from photos"; }
grep -qF "labels.tsv names each class's identities" "$work/same_clean_pack.log" &&
  grep -qF "lists each kept image's photo" "$work/same_clean_pack.log" || { cat "$work/same_clean_pack.log"; fail "pack clean did not carry the names"; }
"$bin/faceshard-pack" unpack "$work/same_clean/train.rec" "$work/same_clean_img" > /dev/null 2>&1 || fail "unpack the clean copy"
python3 - "$work" <<'PY' || fail "the clean copy's names"
import os, sys
w = sys.argv[1]
lab = [l.rstrip('\n').split('\t') for l in open(w + '/same_clean/train.labels.tsv')]
assert lab[0] == ['label', 'source_classes', 'images', 'identities'], lab[0]
rows = {r[1]: r[3] for r in lab[1:]}
assert rows['1,2,3'] == 'c01,c02,c03' and rows['0'] == 'c00' and '5' not in rows, rows
src = [l.rstrip('\n').split('\t') for l in open(w + '/same_clean/train.sources.tsv')][1:]
assert len(src) == 117 and [int(r[0]) for r in src] == list(range(117)), len(src)
for i, label, path in src:  # key = index + 1 in the clean .rec
    got = open(os.path.join(w, 'same_clean_img', label, '%d.jpg' % (int(i) + 1)), 'rb').read()
    assert got == open(path, 'rb').read(), (i, path)
print('the clean copy names its identities and photos')
PY
printf '# the first class but its third image\n%s\n0\n1\n3 4 5 6 7\n' "$set_line" > "$work/keep.txt"
"$bin/faceshard-pack" clean "$work/data/train.rec" "$work/kept/train" --keep "$work/keep.txt" > "$work/keep.log" 2>&1 \
  || { cat "$work/keep.log"; fail "faceshard-pack clean --keep"; }
for out in cleaned kept; do
  "$bin/faceshard-pack" verify "$work/$out/train.rec" --decode > /dev/null 2>&1 || fail "$out/train.rec does not verify"
  "$bin/faceshard-pack" unpack "$work/$out/train.rec" "$work/$out/img" > /dev/null 2>&1 || fail "unpack $out"
done
"$bin/faceshard-pack" unpack "$work/data/train.rec" "$work/src" > /dev/null 2>&1 || fail "unpack the source"
"$py" - "$work" <<'PY' || fail "a cleaned .rec holds other images than the plan leaves"
import hashlib, os, sys
w = sys.argv[1]
def images(d):  # {(class, key): md5}
    return {(int(c), int(f[:-4])): hashlib.md5(open(os.path.join(d, c, f), 'rb').read()).hexdigest()
            for c in os.listdir(d) for f in os.listdir(os.path.join(d, c))}
src = images(w + '/src')
keys = sorted(k for _, k in src)
label = {i: c for c, k in src for i in [keys.index(k)]}  # image index = order of keys
def check(out, kept, merged):
    new = images(w + '/' + out + '/img')
    table = [l.rstrip('\n').split('\t') for l in open(w + '/' + out + '/train.labels.tsv')][1:]
    source_of = {int(r[0]): [int(x) for x in r[1].split(',')] for r in table}
    group = lambda c: merged.get(c, c)
    want = sorted((group(label[i]), src[(label[i], keys[i])]) for i in kept)
    got = sorted((min(source_of[c]), md5) for (c, _), md5 in new.items())
    assert got == want, (out, len(got), len(want))
    classes = sorted({group(label[i]) for i in kept})
    assert [min(source_of[c]) for c in range(len(classes))] == classes, out   # renumbered in order
    assert all(int(r[2]) == sum(1 for (c, _) in new if c == int(r[0])) for r in table), out
    print(out, len(got), 'images in', len(classes), 'classes')
drop = {3, 17, 20} | {i for i, c in label.items() if c == 5}
check('cleaned', [i for i in label if i not in drop], {2: 1})
check('kept', [0, 1, 3, 4, 5, 6, 7], {})
PY
# Reports applied to another set: the same 128 images re-packed with the class folders named
# in the reverse order (every number now names another image), and the same with one more
# identity folder. faceshard-pack clean refuses each with one line naming both sets, exit 2,
# and writes nothing; so does a keep-list naming another set. A report without its set line
# is refused too.
"$bin/faceshard-pack" unpack "$work/data/train.rec" "$work/orig" > /dev/null 2>&1 || fail "unpack for the re-pack"
mkdir -p "$work/reordered"
for d in "$work"/orig/*; do c=$(basename "$d"); cp -r "$d" "$work/reordered/k$(printf %02d $((15 - c)))"; done
"$bin/faceshard-pack" pack "$work/reordered" "$work/repacked/train" > /dev/null 2>&1 || fail "re-packing in another order"
cp -r "$work/reordered" "$work/grown"; cp -r "$work/reordered/k00" "$work/grown/k16"
"$bin/faceshard-pack" pack "$work/grown" "$work/grown_rec/train" > /dev/null 2>&1 || fail "re-packing with one more identity"
another() {  # REC ARGS...: refused, one line naming another set, nothing written
  local rec="$1"; shift
  local out; out=$("$bin/faceshard-pack" clean "$rec" "$work/wrong/train" "$@" 2>&1); local rc=$?
  [ "$rc" = 2 ] || fail "pack clean $rec $*: exit $rc, expected 2: $out"
  [ "$(printf '%s\n' "$out" | wc -l)" = 1 ] || fail "pack clean $rec $*: more than one line: $out"
  [[ "$out" == *"made from another set (rec, 128 images, 16 classes, sha256 "*") than this one ("*"): its image and class numbers would name other images"* ]] ||
    fail "pack clean $rec $*: $out"
  [ ! -e "$work/wrong" ] || fail "pack clean $rec $* wrote $(ls -R "$work/wrong")"
}
another "$work/repacked/train.rec" --reports "$work/reports"
another "$work/grown_rec/train.rec" --reports "$work/reports" --merge
another "$work/repacked/train.rec" --keep "$work/keep.txt"
mkdir -p "$work/unnamed"; cp "$work/reports"/*.tsv "$work/unnamed/"; sed -i '/^# set: /d' "$work/unnamed/overlap.tsv"
out=$("$bin/faceshard-pack" clean "$work/data/train.rec" "$work/wrong/train" --reports "$work/unnamed" 2>&1)
[ $? = 2 ] && [[ "$out" == *"overlap.tsv: says nothing of the set it was made from"* ]] || fail "a report without its set: $out"

# A run audited against other data is refused before the pass (one line naming both sets,
# exit 2, no report written): the run records the data it trained on (data_set.txt).
grep -q '^sha256:[0-9a-f]\{64\} (rec: 128 images, 16 classes)$' "$work/out/data_set.txt" || fail "the run does not record its data"
out=$(clean --rec "$work/repacked" --output "$work/other_reports" 2>&1); rc=$?
[ "$rc" = 2 ] && [[ "$out" == *"is not the data the run trained on ("*"rec, 128 images, 16 classes, sha256 "*")"* ]] ||
  fail "faceshard-clean on another set: exit $rc: $out"
[[ "$out" != *cleaning* ]] || fail "faceshard-clean on another set started its pass: $out"
[ -z "$(ls -A "$work/other_reports" 2>/dev/null)" ] || fail "reports written for another set"

# Refusals: one line, non-zero, the reports already there unchanged.
sums() { (cd "$work/reports" && ls -A && md5sum ./*) ; }
before=$(sums)
refused() {  # expected-message-regex command...
  local want="$1"; shift
  "$@" > "$work/err.log" 2>&1 && fail "accepted: $*"
  [ "$(wc -l < "$work/err.log")" -eq 1 ] || { cat "$work/err.log"; fail "not one line: $*"; }
  grep -Eq -- "$want" "$work/err.log" || { cat "$work/err.log"; fail "message: $(cat "$work/err.log")"; }
  [ "$(sums)" = "$before" ] || fail "reports changed by: $*"
}
refused "--run: '$work/nothing' does not exist" \
  "$bin/faceshard-clean" --device cpu --run "$work/nothing" --rec "$work/data" --output "$work/reports"
step=$(ls -d "$work/out/checkpoints/step_"* | head -1)
cp -r "$step" "$work/bare_step" && rm "$work/bare_step"/fc_shard_*.pt
mkdir -p "$work/bare/checkpoints" && mv "$work/bare_step" "$work/bare/checkpoints/$(basename "$step")"
cp "$work/out/config.yaml" "$work/bare/"
refused "has no fc_shard_0.pt" \
  "$bin/faceshard-clean" --device cpu --run "$work/bare" --rec "$work/data" --output "$work/reports"
head -c 300 /dev/urandom > "$work/bad.bin"
refused "bad.bin" clean --rec "$work/data" --bin "$work/bad.bin" --output "$work/reports"
refused "--subcenters 2: checkpoint .* holds 3 centres per class" clean --rec "$work/data" --subcenters 2 --output "$work/reports"
touch "$work/a_file"
refused "--output: cannot create folder" clean --rec "$work/data" --output "$work/a_file/reports"
refused "would be dropped: nothing to pack" \
  "$bin/faceshard-pack" clean "$work/data/train.rec" "$work/none/train" --keep /dev/null
# A run that does not record its data: labels past its classes are refused before the pass.
mv "$work/out/data_set.txt" "$work/out_data_set.txt"
out=$(clean --rec "$work/grown_rec" --output "$work/other_reports" 2>&1); rc=$?
mv "$work/out_data_set.txt" "$work/out/data_set.txt"
[ "$rc" = 2 ] && [[ "$out" == *"has 17 classes, the run 16: its labels are not the run's classes"* ]] ||
  fail "faceshard-clean with 17 classes against a 16-class run: exit $rc: $out"
echo "faceshard-clean: reports, faceshard-pack clean and refusals checked"
