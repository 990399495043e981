#!/usr/bin/env bash
# Hostile files through the real binaries: a torch.save state_dict of 200k nested tuples,
# a verification .bin that references one 500 KB image 7000 times through the pickle memo,
# corrupt .idx files (keys swapped, every key at one offset), malformed or hostile YAML
# configs (and bases that fan out to 10^9 files), checkpoints whose values are wrong (a
# generator state of 7 bytes, a NaN centre, a step the marker does not say), a classifier
# too big for the machine, IJB meta files that name a file outside loose_crop/ or a
# faceness of 0, verification sets with no pairs or fewer pairs than folds, and hostile
# images: .bin files that reference tiny JPEGs 18,000-20,000 times (3 GB as decoded
# floats), JPEGs and PNGs whose headers declare 30000x30000 (decompression bombs),
# truncated and corrupt JPEGs, through faceshard-verify, faceshard-pack verify --decode,
# faceshard-train's loader and faceshard-ijb. Each must end with ONE error line naming the
# file (and for YAML the line and key path; for images the pair, record or file) and no
# library text, exit status 1 (runtime) or 2 (config), and a peak resident memory below
# PEAK_MB (the binaries with LibTorch loaded take about 400-500 MB).
# usage: hostile_inputs.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
PEAK_MB=1000
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }

"$py" - "$work" <<'PY' || exit 1
import struct, sys, zipfile
d = sys.argv[1]
def torch_zip(path, pkl):
    with zipfile.ZipFile(path, 'w', zipfile.ZIP_STORED) as z:
        z.writestr('deep/data.pkl', pkl)
        z.writestr('deep/byteorder', b'little')
        z.writestr('deep/version', b'3\n')
head = b'\x80\x02}X\x01\x00\x00\x00w'
torch_zip(d + '/deep.pt', head + b'N' + b'\x85' * 200000 + b's.')              # 200 KB of TUPLE1
torch_zip(d + '/deep2.pt', head + b'(' * 100000 + b'N' + b't' * 100000 + b's.')  # 200 KB of MARK ... TUPLE
big = 500000
out = bytearray(b'\x80\x02]q\x00(B' + struct.pack('<I', big) + b'\xff' * big + b'q\x01')
out += b'h\x01' * 6999 + b'e]q\x02(' + b'\x88' * 3500 + b'e\x86.'
open(d + '/memo.bin', 'wb').write(bytes(out))
head = 'data:\n  num_classes: 16\n  batch_size: 8\nmodel:\n  backbone: mbf\n  embedding_size: 32\n'
yaml = {
    'badkey': head + 'loss:\n  scale: 16\ntrain:\n  log_every: 1\n  verify_every: 0\noptim:\n  [lr, momentum]: 0.1\n',
    'deep': head + 'loss:\n  margin: ' + '[' * 20000 + '\n',
    'bomb': ''.join('l%d: &l%d {%s}\n' % (i, i, ', '.join('k%d: %s' % (j, '*l%d' % (i - 1) if i else '1') for j in range(9)))
                    for i in range(10)) + head,
    'dup': head + 'optim:\n  lr: 0.1\n  lr: 0.2\n',
    'quote': head + "optim:\n  lr: '0.1\n  momentum: 0.9\n",
    'nullkey': head + '  ~: 3\n',
    'value': head + 'optim:\n  lr: "0.1\n    fast"\n',
}
for k, v in yaml.items():
    open('%s/%s.yaml' % (d, k), 'w').write(v)
# Bases that fan out: each of 9 levels names the next level's file 10 times (10^9 loads).
for i in range(1, 10):
    body = 'base: [%s]\n' % ', '.join(['fan%d.yaml' % (i + 1)] * 10) if i < 9 else head
    open('%s/fan%d.yaml' % (d, i), 'w').write(body)
open(d + '/fanout.yaml', 'w').write('base: [%s]\n' % ', '.join(['fan1.yaml'] * 10))
# IJB meta files: an image name that leaves loose_crop/, and a faceness of 0.
import os
for name, (img, score) in {'ijb_path': ('../../../../etc/passwd', '0.8'), 'ijb_face': ('2.jpg', '0')}.items():
    os.makedirs('%s/%s/meta' % (d, name))
    os.makedirs('%s/%s/loose_crop' % (d, name))
    open('%s/%s/meta/ijbc_name_5pts_score.txt' % (d, name), 'w').write(
        '1.jpg 38 51 73 51 56 71 41 92 70 92 0.9\n%s 38 51 73 51 56 71 41 92 70 92 %s\n' % (img, score))
    open('%s/%s/meta/ijbc_face_tid_mid.txt' % (d, name), 'w').write('1.jpg 1 1\n%s 2 2\n' % img)
    open('%s/%s/meta/ijbc_template_pair_label.txt' % (d, name), 'w').write('1 2 0\n')
# A verification set without pairs.
import pickle
open(d + '/empty.bin', 'wb').write(pickle.dumps(([], []), protocol=2))
PY
"$bin/faceshard-synth" --output "$work/data" --identities 16 --images 4 --holdout 4 --pairs 8 --seed 3 > /dev/null \
  || { echo "FAIL: faceshard-synth"; exit 1; }
printf 'base: %s/configs/base.yaml\noutput: %s/run\ndata: {rec: %s/data, num_classes: 16, batch_size: 8, num_workers: 1}\nmodel: {backbone: mbf, embedding_size: 32}\ntrain: {verify_every: 0, tensorboard: false}\ndist: {device: cpu}\n' \
  "$root" "$work" "$work" > "$work/tiny.yaml"
"$bin/faceshard-train" --config "$work/tiny.yaml" --set optim.total_steps=1 > "$work/train.log" 2>&1 \
  || { cat "$work/train.log"; echo "FAIL: training the model the .bin case needs"; exit 1; }
# Checkpoints with one wrong value each, rewritten by torch from the run's own.
"$py" - "$work/run/checkpoints/step_00000001" "$work" <<'PY' || { echo "FAIL: writing the bad checkpoints"; exit 1; }
import shutil, sys, torch
ck, d = sys.argv[1], sys.argv[2]
def variant(name, file, change):
    shutil.copytree(ck, '%s/%s' % (d, name))
    path = '%s/%s/%s' % (d, name, file)
    sd = torch.load(path, weights_only=True)
    change(sd)
    torch.save(sd, path)
variant('ck_rng', 'fc_shard_0.pt', lambda sd: sd.__setitem__('rng.cpu', sd['rng.cpu'][:7].clone()))
variant('ck_nan', 'fc_shard_0.pt', lambda sd: sd['rows/weight'].__setitem__((3, 0), float('nan')))
variant('ck_step', 'train_state.pt', lambda sd: sd.__setitem__('step', torch.tensor([-5])))
PY

# Corrupt indexes of a good .rec: keys 1 and 64 swapped (every offset still a distinct record
# start), and every key at key 1's offset.
for bad in swap same; do mkdir -p "$work/$bad"; cp "$work/data/train.rec" "$work/$bad/"; done
"$py" - "$work" <<'PY' || exit 1
import sys
d = sys.argv[1]
lines = [l.split('\t') for l in open(d + '/data/train.idx').read().split('\n') if l]
off = {int(k): v for k, v in lines}
swap = {1: off[64], 64: off[1]}
open(d + '/swap/train.idx', 'w').write(''.join('%s\t%s\n' % (k, swap.get(int(k), v)) for k, v in lines))
open(d + '/same/train.idx', 'w').write(''.join('%s\t%s\n' % (k, off[1]) for k, v in lines))
PY

# Hostile images. A tiny JPEG written by hand (8x8 grey, one Huffman code per table), a
# face from the synthetic set, and the hostile kinds made from them.
"$bin/faceshard-pack" unpack "$work/data/train.rec" "$work/faces" > /dev/null || { echo "FAIL: faceshard-pack unpack"; exit 1; }
"$py" - "$work" <<'PY' || exit 1
import glob, os, struct, sys, zlib
d = sys.argv[1]
faces = sorted(glob.glob(d + '/faces/*/*.jpg'))
face = open(faces[0], 'rb').read()
def seg(marker, body): return b'\xff' + bytes([marker]) + struct.pack('>H', len(body) + 2) + body
tiny = (b'\xff\xd8' + seg(0xDB, b'\x00' + b'\x01' * 64) + seg(0xC0, b'\x08\x00\x08\x00\x08\x01\x01\x11\x00')
        + seg(0xC4, b'\x00' + b'\x01' + b'\x00' * 15 + b'\x00') + seg(0xC4, b'\x10' + b'\x01' + b'\x00' * 15 + b'\x00')
        + seg(0xDA, b'\x01\x01\x00\x00\x3f\x00') + b'\x3f\xff\xd9')
def sof_declaring(j, w, h):
    i = 2
    while i + 8 < len(j):
        m, n = j[i + 1], struct.unpack('>H', j[i + 2:i + 4])[0]
        if 0xC0 <= m <= 0xC2:
            return j[:i + 5] + struct.pack('>HH', h, w) + j[i + 9:]
        i += 2 + n
    raise SystemExit('no SOF')
def chunk(t, b): return struct.pack('>I', len(b)) + t + b + struct.pack('>I', zlib.crc32(t + b))
def png(w, h, rows):
    return b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', w, h, 8, 2, 0, 0, 0)) + \
           chunk(b'IDAT', zlib.compress(b''.join(b'\x00' + bytes(3 * w) for _ in range(rows)), 9)) + chunk(b'IEND', b'')
corrupt = bytearray(face)
for i in range(len(face) // 2, len(face) // 2 + 64): corrupt[i] ^= 0x55
imgs = {'tiny.jpg': tiny, 'face.jpg': face, 'bomb.jpg': sof_declaring(face, 30000, 30000),
        'bomb.png': png(30000, 30000, 8), 'cut.jpg': face[:len(face) // 3], 'corrupt.jpg': bytes(corrupt)}
for k, v in imgs.items(): open(d + '/' + k, 'wb').write(v)
# insightface .bin (protocol 2): the images, the first occurrence of each stored once
# (LONG_BINPUT) and repeats as memo references (LONG_BINGET); 'name#k' is another copy
# of image 'name'; pairs alternate same/different.
def bin_file(name, refs):
    out, slot = bytearray(b'\x80\x02]q\x00('), {}
    for r in refs:
        if r in slot: out += b'j' + struct.pack('<I', slot[r]); continue
        slot[r] = len(slot) + 1
        img = imgs[r.split('#')[0]]
        out += b'B' + struct.pack('<I', len(img)) + img + b'r' + struct.pack('<I', slot[r])
    out += b'e]r' + struct.pack('<I', len(slot) + 1) + b'(' + b''.join(b'\x88' if p % 2 == 0 else b'\x89' for p in range(len(refs) // 2)) + b'e\x86.'
    open(d + '/' + name, 'wb').write(bytes(out))
# 20,000 references to one tiny JPEG (3 GB as decoded floats; refused as repeats), and
# 18,000 references to 6,000 copies of it (2.7 GB as decoded floats; accepted, held as
# 0.9 MB of JPEGs) followed by a truncated JPEG.
bin_file('manyref.bin', ['tiny.jpg'] * 20000)
bin_file('manycopies.bin', ['tiny.jpg#%d' % (i // 3) for i in range(18000)] + ['face.jpg', 'cut.jpg'])
bin_file('bomb-jpeg.bin', ['face.jpg', 'bomb.jpg', 'face.jpg', 'face.jpg'])
bin_file('bomb-png.bin', ['bomb.png', 'face.jpg', 'face.jpg', 'face.jpg'])
bin_file('cut.bin', ['face.jpg', 'face.jpg', 'face.jpg', 'cut.jpg'])
bin_file('corrupt.bin', ['face.jpg', 'corrupt.jpg', 'face.jpg', 'face.jpg'])
# Image folders for faceshard-pack: 16 faces of 4 identities, the second of identity 2
# replaced (folder-KIND), or all of them (folder-all-KIND: training fails on its first batch).
for kind in ('bomb.jpg', 'bomb.png', 'cut.jpg', 'corrupt.jpg'):
    for folder, bad in (('folder-' + kind, lambda c, i: c == 2 and i == 1), ('folder-all-' + kind, lambda c, i: True)):
        for c in range(4):
            os.makedirs('%s/%s/id%d' % (d, folder, c), exist_ok=True)
            for i in range(4):
                b = imgs[kind] if bad(c, i) else open(faces[4 * c + i], 'rb').read()
                open('%s/%s/id%d/%d.jpg' % (d, folder, c, i), 'wb').write(b)
# IJB: two loose crops (a face and a bomb), one template each, one pair.
os.makedirs(d + '/ijb/loose_crop'); os.makedirs(d + '/ijb/meta')
open(d + '/ijb/loose_crop/1.jpg', 'wb').write(face)
open(d + '/ijb/loose_crop/2.jpg', 'wb').write(imgs['bomb.jpg'])
lmk = ' 38.3 51.7 73.5 51.5 56.0 71.7 41.5 92.4 70.7 92.2 0.9\n'
open(d + '/ijb/meta/ijbc_name_5pts_score.txt', 'w').write('1.jpg' + lmk + '2.jpg' + lmk)
open(d + '/ijb/meta/ijbc_face_tid_mid.txt', 'w').write('1.jpg 1 1\n2.jpg 2 2\n')
open(d + '/ijb/meta/ijbc_template_pair_label.txt', 'w').write('1 2 0\n1 1 1\n')
PY
for kind in bomb.jpg bomb.png cut.jpg corrupt.jpg all-bomb.jpg all-bomb.png all-cut.jpg all-corrupt.jpg; do
  mkdir -p "$work/rec-$kind"
  # --no-check: these .rec files hold the hostile bytes on purpose, for the readers below.
  "$bin/faceshard-pack" pack "$work/folder-$kind" "$work/rec-$kind/train" --no-check > /dev/null 2>&1 ||
    { echo "FAIL: pack $kind"; exit 1; }
done
# By default pack reads every header first: the bomb is named and nothing is written.
"$bin/faceshard-pack" pack "$work/folder-bomb.jpg" "$work/rec-checked/train" > "$work/packcheck.log" 2>&1 &&
  { echo "FAIL: pack took a bomb"; exit 1; }
grep -q "30000x30000" "$work/packcheck.log" && grep -qF -- "; fix it, or pass --skip-bad to leave it out" "$work/packcheck.log" &&
  [ "$(wc -l < "$work/packcheck.log")" -eq 1 ] &&
  [ ! -e "$work/rec-checked/train.rec" ] || { cat "$work/packcheck.log"; echo "FAIL: pack's check of a bomb"; exit 1; }

# Runs a command; checks its exit status, one stderr line with every fragment, and its peak RSS.
check() {  # status name fragments... -- command...
  local want="$1" name="$2"; shift 2
  local frags=()
  while [ "$1" != "--" ]; do frags+=("$1"); shift; done
  shift
  local res
  res=$("$py" - "$work/err" "$@" <<'PY'
import resource, subprocess, sys
with open(sys.argv[1], 'wb') as err:
    try:  # a hostile file must not keep a binary busy: 120 s, ample on a loaded 2-core machine
        rc = subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=err, timeout=120).returncode
    except subprocess.TimeoutExpired:
        rc = 'timeout'
print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
PY
)
  local rc=${res% *} peak=${res#* }
  local lines; lines=$(wc -l < "$work/err")
  echo "$name: exit $rc, peak RSS $peak MB: $(head -c 300 "$work/err")"
  [ "$rc" = "$want" ] || bad "$name: exit $rc, expected $want"
  [ "$lines" -eq 1 ] || bad "$name: $lines lines on stderr"
  [ "$peak" -lt "$PEAK_MB" ] || bad "$name: peak RSS $peak MB >= $PEAK_MB MB"
  for f in "${frags[@]}"; do grep -qF -- "$f" "$work/err" || bad "$name: '$f' not in the message"; done
  # No library text: the message is faceshard's own, not LibTorch's, the C++ runtime's,
  # yaml-cpp's, libjpeg's, libpng's or OpenCV's.
  if grep -qE 'c10::|Exception raised from|at::|std::|terminate called|what\(\)|yaml-cpp|CPUGeneratorImpl|cannot be converted to Scalar|DefaultCPUAllocator|Corrupt JPEG data|Premature end|libpng|OpenCV\(|Assertion failed|alloc_cpu' "$work/err"; then
    bad "$name: library text in the message"
  fi
}

check 1 deep.pt "deep.pt" "data.pkl offset 42" "nested more than 32 deep" -- \
  "$bin/faceshard-verify" --model "$work/deep.pt" --network r18 --bin "$work/data/synth.bin" --device cpu
check 1 deep2.pt "deep2.pt" "nested more than 32 deep" -- \
  "$bin/faceshard-verify" --model "$work/deep2.pt" --network r18 --bin "$work/data/synth.bin" --device cpu
check 1 memo.bin "memo.bin" "counted with repeats" -- \
  "$bin/faceshard-verify" --model "$work/run" --bin "$work/memo.bin" --device cpu
check 1 model.init "deep.pt" "nested more than 32 deep" -- \
  "$bin/faceshard-train" --config "$work/tiny.yaml" --set model.init="$work/deep.pt" --set output="$work/run2"
# Images: thousands of references to one image are refused, and memory follows the encoded
# bytes (the set stays encoded; each distinct image is checked once, batches are decoded
# as needed); bombs are refused from their headers; a decoder warning is a failed decode.
check 1 manyref.bin "manyref.bin: not an insightface verification .bin: 20000 image references to 1 distinct images" \
  "19999 repeats, at most 2 per distinct image + 1024" -- \
  "$bin/faceshard-verify" --model "$work/run" --bin "$work/manyref.bin" --device cpu
check 1 manycopies.bin "manycopies.bin: pair 9000, image 18001" "truncated" -- \
  "$bin/faceshard-verify" --model "$work/run" --bin "$work/manycopies.bin" --device cpu
check 1 bomb-jpeg.bin "bomb-jpeg.bin: pair 0, image 1" "30000x30000" "at most 8192 pixels a side" -- \
  "$bin/faceshard-verify" --model "$work/run" --bin "$work/bomb-jpeg.bin" --device cpu
check 1 bomb-png.bin "bomb-png.bin: pair 0, image 0" "PNG header declares a 30000x30000 image" -- \
  "$bin/faceshard-verify" --model "$work/run" --bin "$work/bomb-png.bin" --device cpu
check 1 cut.bin "cut.bin: pair 1, image 3" "JPEG data ends before the image does (truncated)" -- \
  "$bin/faceshard-verify" --model "$work/run" --bin "$work/cut.bin" --device cpu
check 1 corrupt.bin "corrupt.bin: pair 0, image 1" "corrupt JPEG data" -- \
  "$bin/faceshard-verify" --model "$work/run" --bin "$work/corrupt.bin" --device cpu
# faceshard-pack pack stores the bytes as they are; verify --decode finds them (key 10:
# identity 2's second image, after the header record).
check 1 "pack verify bomb.jpg" "rec-bomb.jpg/train.rec: key 10" "30000x30000" -- \
  "$bin/faceshard-pack" verify "$work/rec-bomb.jpg/train.rec" --decode
check 1 "pack verify bomb.png" "rec-bomb.png/train.rec: key 10" "PNG header declares a 30000x30000 image" -- \
  "$bin/faceshard-pack" verify "$work/rec-bomb.png/train.rec" --decode
check 1 "pack verify cut.jpg" "rec-cut.jpg/train.rec: key 10" "truncated" -- \
  "$bin/faceshard-pack" verify "$work/rec-cut.jpg/train.rec" --decode
check 1 "pack verify corrupt.jpg" "rec-corrupt.jpg/train.rec: key 10" "corrupt JPEG data" -- \
  "$bin/faceshard-pack" verify "$work/rec-corrupt.jpg/train.rec" --decode
# Training: a bad image is a bad record. With max_bad_fraction 0 the first one ends the
# run (one line naming it, before any step); with 0.1 of 16 samples one bomb is replaced
# (one warning line) and the two steps of the epoch run (a step of the tiny model peaks at
# about 1.1 GB, hence its own bound).
for kind in bomb.jpg bomb.png cut.jpg corrupt.jpg; do
  reason="declares a 30000x30000 image"
  case "$kind" in cut.jpg) reason="truncated" ;; corrupt.jpg) reason="corrupt JPEG data" ;; esac
  check 1 "train $kind" "more than data.max_bad_fraction = 0 allows" "rec-all-$kind/train.rec: key " "$reason" \
    "faceshard-pack verify " "rec-all-$kind/train.rec --decode" -- \
    "$bin/faceshard-train" --config "$work/tiny.yaml" --set data.rec="$work/rec-all-$kind" --set data.max_bad_fraction=0 \
    --set data.spare_classes=12 \
    --set output="$work/run-$kind" --set optim.total_steps=2
done
PEAK_MB=1300 check 0 "train one bomb" "skipping a bad sample" "rec-bomb.jpg/train.rec: key 10" "30000x30000" -- \
  "$bin/faceshard-train" --config "$work/tiny.yaml" --set data.rec="$work/rec-bomb.jpg" --set data.max_bad_fraction=0.1 \
  --set data.spare_classes=12 \
  --set output="$work/run-onebomb" --set optim.total_steps=2
check 1 "ijb bomb" "loose_crop/2.jpg" "30000x30000" -- \
  "$bin/faceshard-ijb" --model "$work/run" --root "$work/ijb" --target IJBC --device cpu --output "$work/ijb-out"
check 2 badkey.yaml "badkey.yaml:13:3" "key 'optim'" "expected a key name, got a list" -- \
  "$bin/faceshard-config" --config "$work/badkey.yaml"
check 2 deep.yaml "deep.yaml:" "key 'loss.margin'" "nested" -- "$bin/faceshard-config" --config "$work/deep.yaml"
check 2 bomb.yaml "bomb.yaml:" "more than 100000 values" -- "$bin/faceshard-config" --config "$work/bomb.yaml"
check 2 dup.yaml "dup.yaml:9:3" "key 'optim.lr' appears twice" -- "$bin/faceshard-config" --config "$work/dup.yaml"
check 2 quote.yaml "quote.yaml:" "key 'optim" -- "$bin/faceshard-config" --config "$work/quote.yaml"
check 2 nullkey.yaml "nullkey.yaml:7:3" "key 'model'" "got an empty key" -- \
  "$bin/faceshard-config" --config "$work/nullkey.yaml"
check 2 value.yaml "value.yaml:8" "key 'optim.lr'" "expected a number" -- "$bin/faceshard-config" --config "$work/value.yaml"
check 1 swap.idx "swap/train.rec: key 1 at offset" "header id is 64, not its key 1" -- \
  "$bin/faceshard-pack" verify "$work/swap/train.rec"
check 1 swap.train "swap/train.rec: key 1 at offset" "header id is 64, not its key 1" -- \
  "$bin/faceshard-train" --config "$work/tiny.yaml" --set data.rec="$work/swap" --set output="$work/run3"
check 1 same.idx "same/train.idx: keys " "both point at offset" -- "$bin/faceshard-pack" verify "$work/same/train.rec"
check 2 fanout.yaml "key 'base'" "more than 64 files" "fanout.yaml -> $work/fan1.yaml -> $work/fan2.yaml" -- \
  "$bin/faceshard-config" --config "$work/fanout.yaml"
ck() { echo "$bin/faceshard-train --config $work/tiny.yaml --set output=$work/$1.out --resume $work/$1"; }
# shellcheck disable=SC2046
check 2 ck_rng "ck_rng/fc_shard_0.pt" "key 'rng.cpu'" "shape [7]" -- $(ck ck_rng)
# shellcheck disable=SC2046
check 2 ck_nan "ck_nan/fc_shard_0.pt" "key 'rows/weight'" "class 3 is nan" -- $(ck ck_nan)
# shellcheck disable=SC2046
check 2 ck_step "ck_step/train_state.pt" "key 'step' is -5" -- $(ck ck_step)
check 2 num_classes "--set: key 'data.num_classes'" "2147483648 classes do not fit" "loss.sample_rate 1" \
  "data.batch_size 8" "world size 1" "bytes available" -- \
  "$bin/faceshard-train" --config "$work/tiny.yaml" --set data.num_classes=2147483648 \
  --set data.spare_classes=2147483632 --set output="$work/big"
check 2 ijb_path "ijb_path/meta/ijbc_name_5pts_score.txt:2" "'../../../../etc/passwd' is not a path inside loose_crop/" -- \
  "$bin/faceshard-ijb" --model "$work/run" --root "$work/ijb_path" --device cpu --output "$work/ijb_out"
check 2 ijb_face "ijb_face/meta/ijbc_name_5pts_score.txt:2" "faceness score must be > 0, got '0'" -- \
  "$bin/faceshard-ijb" --model "$work/run" --root "$work/ijb_face" --device cpu --output "$work/ijb_out"
check 1 empty.bin "empty.bin" "no pairs" -- \
  "$bin/faceshard-verify" --model "$work/run" --bin "$work/empty.bin" --device cpu --output "$work/v0"
check 2 folds "synth.bin" "8 pairs, fewer than the 10 folds" "--folds K takes K <= 8" -- \
  "$bin/faceshard-verify" --model "$work/run" --bin "$work/data/synth.bin" --device cpu --output "$work/v1"
# --folds is honoured on a set of fewer than 10 pairs.
"$bin/faceshard-verify" --model "$work/run" --bin "$work/data/synth.bin" --device cpu --folds 2 --output "$work/v2" \
  > "$work/v2.log" 2>&1 || { cat "$work/v2.log"; bad "faceshard-verify --folds 2 on 8 pairs"; }
grep -qE "\(8 pairs, [0-9]+ negatives\)" "$work/v2.log" || bad "faceshard-verify --folds 2: no result line"
[ "$fail" -eq 0 ] && echo "PASS"
exit "$fail"
