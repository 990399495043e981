#!/usr/bin/env bash
# faceshard-clean's measurement on synthetic noise (tools/clean_eval.py, docs/cleaning.md):
# 1. faceshard-synth --noise-*: the truth it writes checked against the files it wrote, read
#    back with faceshard-pack unpack and compared with the noise-free set of the same seed
#    (every image's bytes those of the view the truth names, labels moved as stated, copies
#    byte-identical, the counts); the same seed gives the same files, another seed others.
# 2. clean_eval.py score on hand-written reports with known precision and recall, wrong rows
#    among them; --sweep's curve; a missing report or column refused in one line.
# 3. clean_eval.py run at a tiny size: the whole loop, its score the reports' own, the cleaned
#    .rec what faceshard-pack clean said, an accuracy for each K = 1 run.
# usage: clean_eval.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
work=$(mktemp -d); [ -n "${KEEP_WORK:-}" ] || trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
ce="$root/tools/clean_eval.py"

# --- 1. the injector -----------------------------------------------------------------------
synth() { "$bin/faceshard-synth" --identities 24 --images 8 --holdout 8 --pairs 40 "$@" > /dev/null; }
noise=(--noise-mislabel 0.1 --noise-split 0.125 --noise-duplicate 0.05 --noise-overlap 3 --noise-overlap-images 4)
synth --output "$work/n1" --seed 5 "${noise[@]}" --truth "$work/t1" || fail "faceshard-synth --noise-*"
synth --output "$work/n2" --seed 5 "${noise[@]}" --truth "$work/t2" || fail "faceshard-synth --noise-* again"
synth --output "$work/n3" --seed 6 "${noise[@]}" --truth "$work/t3" || fail "faceshard-synth --noise-* seed 6"
synth --output "$work/c" --seed 5 || fail "faceshard-synth without noise"
cmp -s "$work/n1/train.rec" "$work/n2/train.rec" && diff -r "$work/t1" "$work/t2" > /dev/null \
  && diff -r "$work/n1/test_identities" "$work/n2/test_identities" > /dev/null || fail "the same seed wrote other noise"
cmp -s "$work/n1/train.rec" "$work/n3/train.rec" && fail "another seed wrote the same noisy set"
cmp -s "$work/n1/synth.bin" "$work/c/synth.bin" || fail "the held-out pairs differ from the noise-free set's"
[ -z "$(ls -A "$work/n1" | grep -v -e '^train\.rec$' -e '^train\.idx$' -e '^synth\.bin$' -e '^test_identities$')" ] \
  || fail "left behind: $(ls -A "$work/n1")"
for d in n1 c; do
  "$bin/faceshard-pack" unpack "$work/$d/train.rec" "$work/$d.img" > /dev/null 2>&1 || fail "unpack $d"
done
python3 - "$work" 24 8 <<'PY' || fail "the truth does not describe the noisy set"
import hashlib, os, sys
w, I, M = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def unpacked(d):  # [(label, bytes)] in image order (the keys' order)
    files = [(int(f[:-4]), int(c), os.path.join(d, c, f)) for c in os.listdir(d) for f in os.listdir(os.path.join(d, c))]
    return [(c, open(p, 'rb').read()) for _, c, p in sorted(files)]
def tsv(name):
    lines = [l.rstrip('\n').split('\t') for l in open(os.path.join(w, 't1', name)) if not l.startswith('#')]
    return [dict(zip(lines[0], r)) for r in lines[1:]]
clean, noisy = unpacked(w + '/c.img'), unpacked(w + '/n1.img')
assert len(clean) == I * M and [c for c, _ in clean] == [i // M for i in range(I * M)], 'the noise-free set'
rows = tsv('images.tsv')
assert [int(r['index']) for r in rows] == list(range(len(noisy))), 'images.tsv does not list every image once'
N = I * M
copies = [r for r in rows if r['noise'] == 'copy']
assert len(copies) == round(0.05 * N) and len(rows) == N + len(copies), (len(copies), len(rows))
# Every image the view the truth names (bytes), stored under the label the truth says.
for r in rows:
    i, label, true, view = int(r['index']), int(r['label']), int(r['true_label']), int(r['view'])
    assert noisy[i][0] == label, ('label', i, noisy[i][0], label)
    assert noisy[i][1] == clean[true * M + view][1], ('bytes', i)
# Nothing lost: each view of the noise-free set once among the originals.
assert sorted((int(r['true_label']), int(r['view'])) for r in rows if r['noise'] != 'copy') == \
    [(i, v) for i in range(I) for v in range(M)], 'views lost or doubled'
split = {int(r['class_a']): (int(r['class_b']), int(r['images_b'])) for r in tsv('duplicate_identities.tsv')}
assert len(split) == round(0.125 * I) and sorted(b for b, _ in split.values()) == list(range(I, I + len(split)))
for a, (b, n) in split.items():
    under_b = [r for r in rows if int(r['label']) == b]
    assert len(under_b) - sum(r['noise'] == 'copy' for r in under_b) == n == M // 2, ('split size', a, b)
    assert all(int(r['true_label']) == a for r in under_b), ('split', a, b)
mis = [(int(r['index']), int(r['label']), int(r['true_label'])) for r in tsv('mislabeled.tsv')]
assert len(mis) == round(0.1 * N), len(mis)
assert sorted(mis) == sorted((int(r['index']), int(r['label']), int(r['true_label'])) for r in rows
                             if r['noise'] == 'mislabeled'), 'mislabeled.tsv != images.tsv'
assert all(l != t and l < I for _, l, t in mis), 'a mislabeled image under its own label or a split label'
for r in rows:  # the rest under their own label (or its split)
    if r['noise'] in ('clean', 'split'):
        l, t = int(r['label']), int(r['true_label'])
        assert l == t or (r['noise'] == 'split' and split[t][0] == l), ('moved but not recorded', r)
# Each identity keeps a majority of its own images under its own label.
for t in range(I):
    own = [r for r in rows if int(r['true_label']) == t and r['noise'] != 'copy' and int(r['label']) == t]
    out = [r for r in rows if int(r['true_label']) == t and r['noise'] == 'mislabeled']
    assert len(own) > len(out), ('majority', t)
# Copies: the same bytes and label as the image they copy, which is not mislabeled.
pairs = sorted((int(a['index_a']), int(a['index_b'])) for a in tsv('near_duplicates.tsv'))
want = []
for r in copies:
    i, j = int(r['index']), int(r['copy_of'])
    assert noisy[i] == noisy[j], ('copy differs', i, j)
    assert rows[j]['noise'] != 'mislabeled' and rows[j]['noise'] != 'copy'
    want.append((min(i, j), max(i, j)))
assert pairs == sorted(want), 'near_duplicates.tsv != the copies'
# Test identities: 3 in the training set (not split), 3 held out; new views, not copies.
ov = tsv('overlap.tsv')
assert sorted(r['class'] for r in ov).count('-') == 3 and len(ov) == 6
inside = [int(r['class']) for r in ov if r['class'] != '-']
assert len(set(inside)) == 3 and not set(inside) & set(split), inside
stored = {b for _, b in noisy}
for r in ov:
    d = os.path.join(w, 'n1', 'test_identities', r['test_identity'])
    files = sorted(os.listdir(d))
    assert len(files) == int(r['images']) == 4, (d, files)
    assert not any(open(os.path.join(d, f), 'rb').read() in stored for f in files), ('a test image is in train.rec', d)
assert sorted(os.listdir(os.path.join(w, 'n1', 'test_identities'))) == sorted(r['test_identity'] for r in ov)
print('truth checked: %d images, %d mislabeled, %d split, %d copies, %d test identities' %
      (len(rows), len(mis), len(split), len(copies), len(ov)))
PY
# Its usage errors: one line, non-zero.
refused() {  # expected-message command...
  local want="$1"; shift
  "$@" > "$work/err.log" 2>&1 && fail "accepted: $*"
  [ "$(wc -l < "$work/err.log")" -eq 1 ] || { cat "$work/err.log"; fail "not one line: $*"; }
  grep -Fq -- "$want" "$work/err.log" || { cat "$work/err.log"; fail "message: $(cat "$work/err.log")"; }
}
refused "--truth DIR is required" "$bin/faceshard-synth" --output "$work/x" --noise-mislabel 0.1
refused "--noise-split: expected a fraction in [0, 1], got '1.5'" "$bin/faceshard-synth" --output "$work/x" --noise-split 1.5 --truth "$work/xt"
refused "more than the 4 there are" "$bin/faceshard-synth" --output "$work/x" --identities 4 --noise-overlap 5 --truth "$work/xt"
refused "--noise-mislabel: at most" "$bin/faceshard-synth" --output "$work/x" --identities 4 --noise-mislabel 0.9 --truth "$work/xt"

# --- 2. the scorer on hand-written reports ---------------------------------------------------
h="$work/hand"; mkdir -p "$h/truth" "$h/rep"
printf '# truth\nindex\tlabel\ttrue_label\n3\t0\t1\n7\t0\t2\n11\t1\t0\n20\t2\t1\n' > "$h/truth/mislabeled.tsv"
printf 'class_a\tclass_b\timages_b\n4\t30\t5\n9\t31\t5\n' > "$h/truth/duplicate_identities.tsv"
printf 'test_identity\tclass\timages\nperson_000\t5\t5\nperson_001\t-\t5\nperson_002\t8\t5\n' > "$h/truth/overlap.tsv"
printf 'index_a\tindex_b\n1\t2\n10\t15\n40\t41\n' > "$h/truth/near_duplicates.tsv"
# The reports: 50 is not mislabeled; 30/4 is a truth pair in the other order, 9/12 is not;
# person_001 is held out (class 13 is not it), person_002 is class 8 and not class 5 (which is
# a true class, but another test identity's); 10/14 is the wrong partner.
printf '# report\nindex\timage\tlabel\tangle_deg\n3\tx\t0\t80.0\n7\tx\t0\t70.0\n50\tx\t3\t65.0\n11\tx\t1\t60.0\n' > "$h/rep/mislabeled.tsv"
printf 'class_a\tclass_b\tcos\n30\t4\t0.95\n9\t12\t0.70\n' > "$h/rep/duplicate_identities.tsv"
printf 'set\ttest_identity\tclass\tcos\nT\tperson_000\t5\t0.9\nT\tperson_001\t13\t0.6\nT\tperson_002\t8\t0.8\nT\tperson_002\t5\t0.55\n' > "$h/rep/overlap.tsv"
printf 'index_a\tindex_b\tcos\n1\t2\t1.0\n10\t14\t0.97\n40\t41\t0.99\n' > "$h/rep/near_duplicates.tsv"
python3 "$ce" score --reports "$h/rep" --truth "$h/truth" --json "$h/s.json" --sweep > "$h/out.txt" 2>&1 \
  || { cat "$h/out.txt"; fail "clean_eval.py score"; }
python3 - "$h/s.json" <<'PY' || { cat "$h/out.txt"; fail "clean_eval.py score's figures"; }
import json, sys
s = json.load(open(sys.argv[1]))
want = {'mislabeled': (4, 4, 3), 'duplicate_identities': (2, 2, 1), 'overlap': (4, 2, 2), 'near_duplicates': (3, 3, 2)}
for r, (flagged, true, hits) in want.items():
    got = s[r]
    assert (got['flagged'], got['true'], got['hits']) == (flagged, true, hits), (r, got)
    assert abs(got['precision'] - hits / flagged) < 1e-12 and abs(got['recall'] - hits / true) < 1e-12, (r, got)
print('score checked')
PY
# The sweep: mislabeled by angle, largest first (80: 1 of 1; 65: 2 of 3; 60: 3 of 4).
grep -Eq '^ +80\.0000 +1 +1 +1\.000 +0\.250$' "$h/out.txt" && grep -Eq '^ +65\.0000 +3 +2 +0\.667 +0\.500$' "$h/out.txt" \
  && grep -Eq '^ +60\.0000 +4 +3 +0\.750 +0\.750$' "$h/out.txt" || { cat "$h/out.txt"; fail "--sweep's curve"; }
grep -Eq '^overlap +4 +2 +2 +0\.500 +1\.000$' "$h/out.txt" || { cat "$h/out.txt"; fail "the printed table"; }
grep -Fq 'true findings: 3 from 80.0000 to 60.0000 (median 70.0000); false findings: 1 from 65.0000 to 65.0000' "$h/out.txt" \
  || { cat "$h/out.txt"; fail "--sweep's true and false findings"; }
rm "$h/rep/overlap.tsv"
refused "overlap.tsv: missing" python3 "$ce" score --reports "$h/rep" --truth "$h/truth"
printf 'set\ttest_identity\tcos\nT\tperson_000\t0.9\n' > "$h/rep/overlap.tsv"
refused "overlap.tsv: no column class" python3 "$ce" score --reports "$h/rep" --truth "$h/truth"

# --- 3. the driver, tiny, on one rank. A run this short embeds every image alike (cosines of
# 1.0000 between any two): the classes are compared by their centres and the near duplicates
# kept, or nothing would be left to train on.
python3 "$ce" run --work "$work/run" --bin "$bin" --nproc 1 --identities 24 --images 8 --holdout 8 --pairs 40 \
  --seed 2 --noise-split 0.1 --noise-duplicate 0.05 --noise-overlap 2 --set optim.epochs=1 --set data.batch_size=16 \
  --clean-args "--identity-by centres --mislabeled-angle 89 --identity-cos 0.9 --overlap-cos 0.9" \
  --pack-args=--keep-near-duplicates \
  > "$work/run.log" 2>&1 || { cat "$work/run.log"; fail "clean_eval.py run"; }
python3 "$ce" score --reports "$work/run/reports" --truth "$work/run/truth" --json "$work/rescore.json" > /dev/null \
  || fail "scoring the driver's reports"
"$bin/faceshard-pack" verify "$work/run/cleaned/train.rec" > "$work/verify.log" 2>&1 || fail "the cleaned .rec does not verify"
python3 - "$work/run" "$work/rescore.json" "$work/verify.log" <<'PY' || { cat "$work/run.log"; fail "the driver's results"; }
import json, re, sys
w = sys.argv[1]
res = json.load(open(w + '/result.json'))
assert res['score'] == json.load(open(sys.argv[2])), 'the driver scored something else than its reports'
# Byte-identical copies count whatever the threshold: every copy found.
nd = res['score']['near_duplicates']
assert nd['true'] == 10 and nd['hits'] == 10, nd
assert res['score']['overlap']['true'] == 2 and res['score']['duplicate_identities']['true'] == 2, res['score']
kept = int(re.search(r'(\d+) images kept', res['pack']).group(1))
images = int(re.search(r'(\d+) images', open(sys.argv[3]).read().split('OK:')[1]).group(1))
assert kept == images and 0 < kept < 24 * 8 + 10, (kept, images)
# The K = 1 runs trained on what they say: the cleaned one on the cleaned .rec.
for name, n in (('noisy', 24 * 8 + 10), ('cleaned', kept)):
    assert re.search(r'(?m)^(\[rank [^]]*\] )?data: %d images' % n, open('%s/%s_k1.log' % (w, name)).read()), (name, n)
# Each accuracy the driver reports is its run's own: the last val/synth/accuracy (and its
# step) of that run's metrics.jsonl, read here.
for name, folder in (('noisy_k3', 'noisy_k3'), ('noisy', 'noisy_k1'), ('cleaned', 'cleaned_k1')):
    v = res['verification'][name]
    last = None
    for line in open('%s/%s/metrics.jsonl' % (w, folder)):
        r = json.loads(line)
        if 'val/synth/accuracy' in r:
            last = (r['val/synth/accuracy'], int(r['step']))
    assert last is not None and (v['accuracy'], v['step']) == last, (name, v, last)
# Every K = 1 run as many steps as the K = 3 one (the cleaned set's epochs are shorter).
for name in ('noisy', 'cleaned'):
    assert res['verification'][name]['step'] == res['verification']['noisy_k3']['step'], res['verification']
print('driver checked: %d images kept, accuracies %s' % (kept, {k: v['accuracy'] for k, v in res['verification'].items()}))
PY
grep -Eq '^cleaned, K = 1 +[01]\.[0-9]{4} +[0-9]+$' "$work/run.log" && grep -Eq '^noisy, K = 3 +[01]\.[0-9]{4} +[0-9]+$' "$work/run.log" || { cat "$work/run.log"; fail "the driver's table"; }
echo "clean_eval: the injector's truth, the scorer and the driver checked"
