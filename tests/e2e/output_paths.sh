#!/usr/bin/env bash
# Every tool that writes a file the user names, with each form of the name: a bare name (a
# file of the working folder), ./name and an absolute path. Each run starts in a fresh working
# folder; it must exit 0, and the files must be where the name says, with no temporary file
# left beside them. (faceshard-dist-check --output writes only when a collective fails.)
# usage: output_paths.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 FACESHARD_PROGRESS_AFTER_S=0
fail() { echo "FAIL: $*"; exit 1; }

# Inputs, all by absolute path: a synthetic data set with its verification pairs, its images
# as identity folders, a tiny IJB layout of those faces, and a classifier head's tensors.
in="$work/in"
"$bin/faceshard-synth" --output "$in/data" --identities 8 --images 6 --holdout 6 --pairs 40 --seed 1 > /dev/null &&
  "$bin/faceshard-pack" unpack "$in/data/train.rec" "$in/faces" > /dev/null || fail "making the inputs"
mkdir -p "$in/ijb/loose_crop" "$in/ijb/meta"
lmk=" 38.2946 51.6963 73.5318 51.5014 56.0252 71.7366 41.5493 92.3655 70.7299 92.2041 0.9"
n=0
for id in 0 1; do
  for f in $(ls "$in/faces/$id" | head -2); do
    n=$((n + 1))
    cp "$in/faces/$id/$f" "$in/ijb/loose_crop/$n.jpg"
    echo "$n.jpg$lmk" >> "$in/ijb/meta/ijbc_name_5pts_score.txt"
    echo "$n.jpg $n $n" >> "$in/ijb/meta/ijbc_face_tid_mid.txt"
  done
done
printf '1 2 1\n3 4 1\n1 3 0\n2 4 0\n1 4 0\n' > "$in/ijb/meta/ijbc_template_pair_label.txt"
"$py" - "$in" <<'PY' || fail "writing the head's tensors"
import sys, numpy as np
g = np.random.default_rng(0)
np.save(sys.argv[1] + "/E.npy", g.standard_normal((6, 16)).astype(np.float32))
np.save(sys.argv[1] + "/L.npy", np.arange(6, dtype=np.int64) % 4)
np.save(sys.argv[1] + "/C.npy", g.standard_normal((4, 16)).astype(np.float32))
PY

# One case: case LABEL FORM FILES... -- COMMAND... ; '@' in the command's words is the path
# prefix of the form ("", "./" or an absolute folder's), FILES are relative to it.
cases=0
case_() {
  local label="$1" form="$2"; shift 2
  local files=()
  while [ "$1" != "--" ]; do files+=("$1"); shift; done
  shift
  local cwd="$work/$label.$form" at=""
  mkdir -p "$cwd"
  case "$form" in
    bare) at="" ;;
    dot) at="./" ;;
    abs) at="$work/abs.$label/"; mkdir -p "$at" ;;
  esac
  local args=()
  for a in "$@"; do args+=("${a//@/$at}"); done
  (cd "$cwd" && "${args[@]}") > "$cwd.log" 2>&1; local rc=$?
  [ $rc -eq 0 ] || { cat "$cwd.log"; fail "$label with a $form name: exit $rc"; }
  local base="$cwd/"; [ "$form" = abs ] && base="$at"
  for f in "${files[@]}"; do
    [ -e "$base$f" ] || { ls -R "$base"; cat "$cwd.log"; fail "$label with a $form name: no $base$f"; }
  done
  local stray; stray=$(find "$base" -name '*.tmp*' | head -3)
  [ -z "$stray" ] || fail "$label with a $form name left temporary files: $stray"
  echo "ok: $label ($form)"
  cases=$((cases + 1))
}

for form in bare dot abs; do
  # faceshard-train's output folder; the absolute run is the model of the tools below.
  case_ train "$form" run/config.yaml run/model.pt run/metrics.jsonl run/training.log run/checkpoints -- \
    "$bin/faceshard-train" --config "$root/configs/demo.yaml" --set data.rec="$in/data" --set output=@run \
    --set data.batch_size=8 --set data.num_workers=1 --set train.max_steps=2 --set train.log_every=1
done
model="$work/abs.train/run"
for form in bare dot abs; do
  case_ synth "$form" s/train.rec s/train.idx s/synth.bin -- \
    "$bin/faceshard-synth" --output @s --identities 3 --images 2 --holdout 2 --pairs 4
  case_ pack "$form" p.rec p.idx p.labels.tsv -- "$bin/faceshard-pack" pack "$in/faces" @p
  case_ pairs "$form" b.bin -- "$bin/faceshard-pack" pairs "$in/faces" @b.bin --pairs 10
  case_ unpack "$form" u/0 -- "$bin/faceshard-pack" unpack "$in/data/train.rec" @u
  case_ index "$form" i.idx -- "$bin/faceshard-pack" index "$in/data/train.rec" @i.idx
  case_ extract "$form" emb.npy emb.txt -- "$bin/faceshard-extract" --model "$model" --images "$in/faces/0" \
    --device cpu --output @emb
  case_ extract_npy "$form" e2.npy e2.txt -- "$bin/faceshard-extract" --model "$model" --images "$in/faces/1" \
    --device cpu --output @e2.npy
  case_ export "$form" m.onnx -- "$bin/faceshard-export" --model "$model" --onnx @m.onnx
  case_ verify "$form" v/synth_roc.csv v/roc.png v.json -- "$bin/faceshard-verify" --model "$model" \
    --bin "$in/data/synth.bin" --device cpu --output @v --json @v.json
  case_ ijb "$form" j/IJBC_roc.csv j/IJBC_roc.png j/IJBC_scores.npy j.json f.npy -- "$bin/faceshard-ijb" \
    --model "$model" --root "$in/ijb" --device cpu --output @j --json @j.json --image-features @f.npy
  case_ plan "$form" plan.json -- "$bin/faceshard-plan" --network mbf --classes 1000 --json @plan.json
  case_ head "$form" h/grad_embeddings.npy h/grad_centres.npy h/state.json -- "$bin/faceshard-head" \
    --head combined --embeddings "$in/E.npy" --labels "$in/L.npy" --centres "$in/C.npy" --out @h
  case_ bench "$form" bench.json -- "$bin/faceshard-bench" --mode classifier --classes-per-shard 200 \
    --sample-rate 1.0 --precision fp32 --batch 8 --dim 16 --steps 1 --windows 1 --warmup 1 --json @bench.json
done
[ "$cases" -eq 42 ] || fail "$cases cases ran, expected 42"
echo "PASS: $cases cases (14 writers x bare, ./ and absolute names)"
