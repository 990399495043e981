#!/usr/bin/env bash
# Hostile files through the real binaries: a torch.save state_dict of 200k nested tuples,
# a verification .bin that references one 500 KB image 7000 times through the pickle memo,
# corrupt .idx files (keys swapped, every key at one offset) and malformed or hostile YAML
# configs. Each must end with ONE error line naming the file
# (and for YAML the line and key path), exit status 1 (runtime) or 2 (config), and a peak
# resident memory below PEAK_MB (the binaries with LibTorch loaded take about 400-500 MB).
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
PY
"$bin/faceshard-synth" --output "$work/data" --identities 16 --images 4 --holdout 4 --pairs 8 --seed 3 > /dev/null \
  || { echo "FAIL: faceshard-synth"; exit 1; }
printf 'base: %s/configs/base.yaml\noutput: %s/run\ndata: {rec: %s/data, num_classes: 16, batch_size: 8, num_workers: 1}\nmodel: {backbone: mbf, embedding_size: 32}\ntrain: {verify_every: 0, tensorboard: false}\ndist: {device: cpu}\n' \
  "$root" "$work" "$work" > "$work/tiny.yaml"
"$bin/faceshard-train" --config "$work/tiny.yaml" --set optim.total_steps=1 > "$work/train.log" 2>&1 \
  || { cat "$work/train.log"; echo "FAIL: training the model the .bin case needs"; exit 1; }

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
    rc = subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=err).returncode
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
}

check 1 deep.pt "deep.pt" "data.pkl offset 42" "nested more than 32 deep" -- \
  "$bin/faceshard-verify" --model "$work/deep.pt" --network r18 --bin "$work/data/synth.bin" --device cpu
check 1 deep2.pt "deep2.pt" "nested more than 32 deep" -- \
  "$bin/faceshard-verify" --model "$work/deep2.pt" --network r18 --bin "$work/data/synth.bin" --device cpu
check 1 memo.bin "memo.bin" "counted with repeats" -- \
  "$bin/faceshard-verify" --model "$work/run" --bin "$work/memo.bin" --device cpu
check 1 model.init "deep.pt" "nested more than 32 deep" -- \
  "$bin/faceshard-train" --config "$work/tiny.yaml" --set model.init="$work/deep.pt" --set output="$work/run2"
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
[ "$fail" -eq 0 ] && echo "PASS"
exit "$fail"
