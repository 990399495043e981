#!/usr/bin/env bash
# Your own data, first time right, as a newcomer walks it: a folder of face JPEGs with bad
# files and an empty identity folder -> faceshard-pack (every problem listed at once and
# nothing written; --skip-bad leaves them out; the label table) -> a verification .bin of
# held-out identities (faceshard-pack pairs, read back by Python's pickle) -> training from a
# preset with the data's own counts (no data.num_classes/num_images given) -> the refused
# mixed run, --overwrite, --resume RUN_DIR -> faceshard-verify -> faceshard-export ->
# onnxruntime against faceshard-extract.
# usage: own_data.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export OMP_NUM_THREADS=1 FACESHARD_PROGRESS_AFTER_S=0
# A listing of a tree with every file's hash: what "nothing touched" compares.
tree_hash() { (cd "$1" && find . -type f ! -path './replaced-*' -print0 | sort -z | xargs -0 sha1sum); }

# 1. Face images in folders: 24 training identities x 12, 12 held-out identities x 6.
"$bin/faceshard-synth" --output "$work/s1" --identities 24 --images 12 --holdout 0 --pairs 0 --seed 5 > /dev/null &&
  "$bin/faceshard-pack" unpack "$work/s1/train.rec" "$work/faces" > /dev/null &&
  "$bin/faceshard-synth" --output "$work/s2" --identities 12 --images 6 --holdout 0 --pairs 0 --seed 6 > /dev/null &&
  "$bin/faceshard-pack" unpack "$work/s2/train.rec" "$work/heldout" > /dev/null || fail "making the image folders"
# The mistakes of a real folder: a file cut short, a text file named .jpg, a 128x128 face,
# an empty identity folder, and a file that is no image at all by its name.
first=$(ls "$work/faces/3" | head -1)
head -c 1500 "$work/faces/3/$first" > "$work/faces/3/cut_short.jpg"
echo "not an image" > "$work/faces/5/notes.jpg"
"$py" -c "import cv2, numpy as np, sys; cv2.imwrite(sys.argv[1], np.full((128, 128, 3), 90, np.uint8))" \
  "$work/faces/7/big.jpg" || fail "writing a 128x128 JPEG"
mkdir "$work/faces/empty_person"
echo "readme" > "$work/faces/4/readme.txt"

# 2. pack lists every problem at once and writes nothing.
mkdir "$work/data"
if "$bin/faceshard-pack" pack "$work/faces" "$work/data/train" > "$work/pack1.log" 2>&1; then
  cat "$work/pack1.log"; fail "pack accepted bad files"
fi
cat "$work/pack1.log"
for what in "faces/3/cut_short.jpg: cut short" "faces/5/notes.jpg: " "faces/7/big.jpg: image is 128x128, expected 112x112" \
            "faces/empty_person: empty identity folder" "4 problems found (listed above)" "--skip-bad"; do
  grep -qF -- "$what" "$work/pack1.log" || fail "pack's report lacks '$what'"
done
[ -z "$(ls -A "$work/data")" ] || fail "a refused pack wrote: $(ls "$work/data")"
# --skip-bad leaves them out and says so; progress is reported in a log.
"$bin/faceshard-pack" pack "$work/faces" "$work/data/train" --skip-bad > "$work/pack2.log" 2>&1 ||
  { cat "$work/pack2.log"; fail "pack --skip-bad"; }
cat "$work/pack2.log"
grep -qF "left out 3 bad files and 1 folders (empty, or inside an identity folder" "$work/pack2.log" || fail "pack --skip-bad did not say what it left out"
grep -qF "288 images of 24 identities" "$work/pack2.log" || fail "pack packed the wrong count"
grep -qE "^packing: 288/288 images \(100%\)" "$work/pack2.log" || fail "pack showed no progress"
grep -qF "1 files without an image extension ignored" "$work/pack2.log" || fail "pack did not count the ignored file"
# The label table maps each class to its folder: unpacking the new .rec gives, for every
# label, exactly the files of the folder the table names (bad files left out).
"$bin/faceshard-pack" unpack "$work/data/train.rec" "$work/check" > /dev/null || fail "unpacking the packed data"
"$py" - "$work/data/train.labels.tsv" "$work/faces" "$work/check" <<'PY' || fail "the label table"
import hashlib, os, sys
table, faces, check = sys.argv[1:]
rows = [l.rstrip("\n").split("\t") for l in open(table)]
assert rows[0] == ["label", "identity", "images"], rows[0]
rows = rows[1:]
assert [int(r[0]) for r in rows] == list(range(24)), rows
digest = lambda p: hashlib.sha1(open(p, "rb").read()).hexdigest()
bad = {"cut_short.jpg", "notes.jpg", "big.jpg", "readme.txt"}
for label, name, n in rows:
    want = sorted(digest(os.path.join(faces, name, f)) for f in os.listdir(os.path.join(faces, name)) if f not in bad)
    got = sorted(digest(os.path.join(check, label, f)) for f in os.listdir(os.path.join(check, label)))
    assert got == want and int(n) == len(want), (label, name, n, len(got), len(want))
print("label table: 24 identities, each label holds exactly its folder's good images")
PY

# 3. A verification set of the held-out identities, in insightface's format.
"$bin/faceshard-pack" pairs "$work/heldout" "$work/data/mine.bin" --pairs 120 --seed 3 > "$work/pairs.log" 2>&1 ||
  { cat "$work/pairs.log"; fail "pack pairs"; }
cat "$work/pairs.log"
"$bin/faceshard-pack" pairs "$work/heldout" "$work/again.bin" --pairs 120 --seed 3 > /dev/null 2>&1 &&
  cmp -s "$work/data/mine.bin" "$work/again.bin" || fail "the same seed gave other pairs"
"$bin/faceshard-pack" pairs "$work/heldout" "$work/other.bin" --pairs 120 --seed 4 > /dev/null 2>&1 &&
  ! cmp -s "$work/data/mine.bin" "$work/other.bin" || fail "another seed gave the same pairs"
"$py" - "$work/data/mine.bin" "$work/heldout" <<'PY' || fail "the pairs .bin"
import hashlib, os, pickle, sys
bins, issame = pickle.load(open(sys.argv[1], "rb"), encoding="bytes")
assert len(bins) == 240 and len(issame) == 120 and sum(issame) == 60, (len(bins), len(issame), sum(issame))
assert issame[0::2] == [True] * 60 and issame[1::2] == [False] * 60, "pairs do not alternate same/different"
owner = {}
for d in os.listdir(sys.argv[2]):
    for f in os.listdir(os.path.join(sys.argv[2], d)):
        owner[hashlib.sha1(open(os.path.join(sys.argv[2], d, f), "rb").read()).hexdigest()] = (d, f)
seen = set()
for i, same in enumerate(issame):
    a, b = (owner[hashlib.sha1(bytes(x)).hexdigest()] for x in bins[2 * i:2 * i + 2])
    assert (a[0] == b[0]) == same and a != b, (i, a, b, same)
    key = tuple(sorted((a, b)))
    assert key not in seen, ("pair repeated", key)
    seen.add(key)
print("pairs: 120 distinct pairs, 60 of one identity, 60 of two, each image a held-out file")
PY

# 4. Train from a preset with the data's own counts. (The backbone, batch and epochs are
# the CPU test's; the preset's data.num_classes and num_images are not given.)
train() { "$bin/faceshard-train" --config "$root/configs/ms1mv3_r50.yaml" --set data.rec="$work/data" \
  --set output="$work/run" --set model.backbone=mbf_small --set train.precision=fp32 --set data.batch_size=32 \
  --set data.num_workers=1 --set optim.epochs=1 --set "data.val_targets=[mine]" --set train.verify_every=4 \
  --set train.checkpoint_every=4 "$@"; }
train > "$work/train1.log" 2>&1 || { cat "$work/train1.log"; fail "training from the preset"; }
grep -E "data|schedule|classifier|done" "$work/train1.log"
grep -qF "data.num_classes: 24 (24 identities counted in '$work/data')" "$work/train1.log" || fail "classes not counted"
grep -qF "288 images; 9 steps/epoch" "$work/train1.log" && grep -qF "schedule: 9 steps" "$work/train1.log" ||
  fail "the schedule is not the data's (288 images / 32 = 9 steps)"
grep -qF "classifier 24 classes" "$work/train1.log" || fail "the classifier is not the data's size"
[ -f "$work/run/training.log" ] && grep -qF "schedule: 9 steps" "$work/run/training.log" || fail "no training.log"
# The planning tools count the same data as the trainer did (no --classes needed): 24
# identities, 288 images; the plan's header names the classes, K and the head, and the time
# plan takes the images counted.
"$bin/faceshard-plan" --config "$root/configs/ms1mv3_r50.yaml" --set data.rec="$work/data" --set loss.subcenters=3 \
  --set loss.head=adaface --set train.precision=auto --ranks 2 > "$work/plan_data.log" 2>&1 || { cat "$work/plan_data.log"; fail "faceshard-plan on the data"; }
for line in "data: 24 identities, 288 images counted in '$work/data' (as faceshard-train counts them)" \
            "24 classes x 3 sub-centres (12 on rank 0, 12 per step), head adaface" \
            "bf16 (train.precision auto: bf16, as on a GPU with bf16 arithmetic)" "2 bits: adaface's codes"; do
  grep -qF "$line" "$work/plan_data.log" || { cat "$work/plan_data.log"; fail "faceshard-plan did not say: $line"; }
done
grep -q "288 images" "$work/plan_data.log" && ! grep -q "5179510 images\|5,179,510 images" "$work/plan_data.log" ||
  { cat "$work/plan_data.log"; fail "the time plan did not take the images counted"; }
"$bin/faceshard-config" --config "$root/configs/ms1mv3_r50.yaml" --set data.rec="$work/data" --set loss.subcenters=3 \
  > "$work/config_data.log" 2>&1 || { cat "$work/config_data.log"; fail "faceshard-config on the data"; }
grep -qF "classifier: 24 classes x 3 sub-centres x 512 fp32: 147456 bytes" "$work/config_data.log" ||
  { cat "$work/config_data.log"; fail "faceshard-config did not count the data's classes with their sub-centres"; }
# A preset's published counts against other data: one line naming both numbers and the fix.
train --set data.num_classes=93431 --set output="$work/bad" > "$work/bad1.log" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -qF "data.num_classes': 93431 but '$work/data' has 24 identities" "$work/bad1.log" &&
  grep -qF "data.spare_classes: 93407" "$work/bad1.log" || { cat "$work/bad1.log"; fail "num_classes mismatch (rc $rc)"; }
train --set data.num_images=5179510 --set output="$work/bad" > "$work/bad2.log" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -qF "data.num_images': 5179510 but '$work/data' has 288 images" "$work/bad2.log" ||
  { cat "$work/bad2.log"; fail "num_images mismatch (rc $rc)"; }
train --set data.spare_classes=6 --set output="$work/spare" --set train.max_steps=1 > "$work/spare.log" 2>&1 &&
  grep -qF "classifier 30 classes" "$work/spare.log" || { cat "$work/spare.log"; fail "data.spare_classes"; }

# 5. Runs never mix: a fresh run into the finished run's folder is refused and touches nothing.
before=$(tree_hash "$work/run")
train --set train.max_steps=4 > "$work/mix.log" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -qF "already holds a run" "$work/mix.log" && grep -qF -- "--overwrite" "$work/mix.log" ||
  { cat "$work/mix.log"; fail "a fresh run into a run's folder was not refused (rc $rc)"; }
[ "$(tree_hash "$work/run")" = "$before" ] || fail "the refused run changed the old run's files"
train --resume "$work/nowhere" > "$work/nowhere.log" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -qF "$work/nowhere': does not exist" "$work/nowhere.log" ||
  { cat "$work/nowhere.log"; fail "--resume of a missing folder (rc $rc)"; }
# --overwrite moves the old run aside, whole, and starts afresh.
train --overwrite --set train.max_steps=4 > "$work/over.log" 2>&1 || { cat "$work/over.log"; fail "--overwrite"; }
aside=$(ls -d "$work/run"/replaced-* | head -1)
[ -n "$aside" ] && [ "$(tree_hash "$aside")" = "$before" ] || fail "--overwrite did not keep the old run whole"
[ ! -e "$work/run/checkpoints/step_00000008" ] && [ -e "$work/run/checkpoints/step_00000004" ] ||
  fail "the new run's checkpoints are mixed with the old: $(ls "$work/run/checkpoints")"
# --resume RUN_DIR: the run folder's newest checkpoint.
train --resume "$work/run" --set output="$work/run2" > "$work/resume.log" 2>&1 ||
  { cat "$work/resume.log"; fail "--resume RUN_DIR"; }
grep -qF "resumed from $work/run/checkpoints/step_00000004 at step 4" "$work/resume.log" ||
  { cat "$work/resume.log"; fail "--resume RUN_DIR did not take the newest checkpoint"; }

# An image list (.lst, MXNet's and insightface's forms) packs as a folder does; a line that is
# neither form is a problem listed with its line number.
ls "$work/heldout/2" | head -3 | sed "s|^|heldout/2/|" > "$work/names2"
ls "$work/heldout/9" | head -2 | sed "s|^|heldout/9/|" > "$work/names9"
{ awk '{printf "%d\t7\t%s\n", NR, $0}' "$work/names2"; awk '{printf "1\t%s\t3\n", $0}' "$work/names9"; } > "$work/mine.lst"
"$bin/faceshard-pack" pack "$work/mine.lst" "$work/lst/train" > "$work/lst.log" 2>&1 &&
  grep -qF "5 images of 2 identities" "$work/lst.log" || { cat "$work/lst.log"; fail "packing a .lst"; }
printf 'what is this\n' >> "$work/mine.lst"
"$bin/faceshard-pack" pack "$work/mine.lst" "$work/lst2/train" > "$work/lst2.log" 2>&1 && fail "a bad .lst line was taken"
grep -qF "mine.lst:6: expected 'index<TAB>label<TAB>path' or 'aligned<TAB>path<TAB>label'" "$work/lst2.log" ||
  { cat "$work/lst2.log"; fail "the bad .lst line is not named"; }
# Paths that are missing or of the wrong kind say which, with the absolute path.
train --set data.rec="$work/nodata" --set output="$work/x" > "$work/nodata.log" 2>&1
grep -qF "data.rec '$work/nodata': does not exist" "$work/nodata.log" || { cat "$work/nodata.log"; fail "missing data.rec"; }
train --set data.rec="$work/data/train.rec" --set output="$work/x" > "$work/recfile.log" 2>&1
grep -qF "is the .rec file itself; data.rec is the folder that holds train.rec and train.idx: $work/data" \
  "$work/recfile.log" || { cat "$work/recfile.log"; fail "data.rec naming the .rec file"; }
# faceshard-config refuses what the trainer refuses; faceshard-plan finds the largest count
# of a preset that leaves it to the data.
"$bin/faceshard-config" --config "$root/configs/ms1mv3_r50.yaml" --set model.backbone=r51 > "$work/cfg.log" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -qF "'r51' is not a network faceshard knows (did you mean 'r50'?)" "$work/cfg.log" ||
  { cat "$work/cfg.log"; fail "faceshard-config took model.backbone r51 (rc $rc)"; }
"$bin/faceshard-plan" --config "$root/configs/ms1mv3_r50.yaml" --ranks 8 --device-memory 32510MiB > "$work/plan.log" 2>&1 &&
  grep -qF "classes: none given; planned at the largest number that fits the device" "$work/plan.log" &&
  grep -qE "largest number of classes that fits: [0-9]+" "$work/plan.log" || { cat "$work/plan.log"; fail "faceshard-plan"; }

# 6. Evaluate, export, deploy.
"$bin/faceshard-verify" --model "$work/run2" --bin "$work/data/mine.bin" --device cpu --json "$work/verify.json" \
  --output "$work/verify_out" \
  > "$work/verify.log" 2>&1 || { cat "$work/verify.log"; fail "faceshard-verify"; }
"$bin/faceshard-export" --model "$work/run2" --onnx "$work/mine.onnx" > "$work/export.log" 2>&1 ||
  { cat "$work/export.log"; fail "faceshard-export"; }
"$bin/faceshard-extract" --model "$work/run2" --images "$work/heldout/1" --no-flip --no-normalize --device cpu \
  --output "$work/emb.npy" > "$work/extract.log" 2>&1 || { cat "$work/extract.log"; fail "faceshard-extract"; }
[ -f "$work/emb.npy" ] && [ -f "$work/emb.txt" ] && [ ! -e "$work/emb.npy.npy" ] || fail "--output emb.npy: $(ls "$work")"
"$py" - "$work" <<'PY' || fail "onnxruntime"
import json, os, sys
import cv2, numpy as np, onnxruntime as ort
work = sys.argv[1]
v = json.load(open(os.path.join(work, "verify.json")))["sets"][0]
acc = v["accuracy"]
# The trainer verified the same model on the same set at its last step: faceshard-verify must
# report what the training logged there.
rows = [json.loads(l) for l in open(os.path.join(work, "run2", "metrics.jsonl")) if l.strip()]
last = max(r["step"] for r in rows)
logged = [r["val/mine/accuracy"] for r in rows if "val/mine/accuracy" in r and r["step"] == last]
assert logged, ("no verification logged at the last step", last)
assert abs(acc - logged[-1]) < 1e-9, ("faceshard-verify", acc, "the trainer at step", last, logged[-1])
# The threshold names its unit, and the collapse warning follows the different-identity
# pairs' mean cosine (printed exactly when it is above 0.9).
assert v["best_threshold_unit"] == "squared_l2_distance", v
assert abs(v["best_threshold_cosine"] - (1 - v["best_threshold"] / 2)) < 1e-12, v
log = open(os.path.join(work, "verify.log")).read()
assert "(squared L2) = cosine" in log, log
assert ("embeddings have collapsed" in log) == (v["negative_mean_cosine"] > 0.9), (v["negative_mean_cosine"], log)
names = [l.strip() for l in open(os.path.join(work, "emb.txt")) if l.strip()]
want = np.load(os.path.join(work, "emb.npy"))
imgs = []
for n in names:
    p = n if os.path.isabs(n) else os.path.join(work, "heldout", "1", n)
    imgs.append(cv2.cvtColor(cv2.imread(p), cv2.COLOR_BGR2RGB))
x = ((np.stack(imgs).astype(np.float32) - 127.5) / 127.5).transpose(0, 3, 1, 2)
sess = ort.InferenceSession(os.path.join(work, "mine.onnx"), providers=["CPUExecutionProvider"])
got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
assert got.shape == want.shape and cos.min() > 0.9999, (got.shape, want.shape, cos.min())
print("onnxruntime: %d held-out faces, cosine to faceshard-extract >= %.6f; verify accuracy %.3f" % (len(names), cos.min(), acc))
PY
echo PASS
