#!/usr/bin/env bash
# Resuming costs no more memory than training. A classifier of 200,000 classes x 512 (fp32
# weight + SGD momentum: 820 MB of shard files) trains one step with a checkpoint; each
# run's peak RSS is its own child process's (getrusage of the waited-for children, the
# largest rank for several ranks). The resumed run may peak at most 10% above the
# training run, whose peak the classifier dominates (weight, momentum and gradient); a
# resume that held the file's bytes, or random initial rows, beside the shard's own
# exceeds it (reading whole files did: 1.22x on one rank, 1.16x resharded).
#   resume:  1 rank; trains 2 steps (checkpoints 1 and 2), then resumes from step 1 and
#            trains step 2 again: its loss equals the uninterrupted run's bit for bit.
#   reshard: 2 ranks train 1 step; 3 ranks resume from that checkpoint and save at once:
#            the rows and momentum, read back with Python's torch.load, equal the 2-rank
#            checkpoint's; each of the 3 ranks reads only the rows it owns. The bound is a
#            3-rank training run's peak (the shard size a 3-rank resume holds). Then the
#            load's own peak on every rank: at most 64 MB beyond the rows it read.
# usage: checkpoint_memory.sh SOURCE_DIR BIN_DIR CASE
set -u
root="$1"; bin="$2"; case_name="$3"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
BOUND=1.10

cat > "$work/job.yaml" <<YAML
base: $root/configs/base.yaml
output: $work/out
seed: 11
data: {rec: synthetic, num_classes: 200000, batch_size: 8, num_workers: 1, prefetch: 1}
model: {backbone: mbf, embedding_size: 512}
optim: {lr: 0.1, total_steps: 8, warmup_steps: 0}
train: {log_every: 1, verify_every: 0, checkpoint_every: 1, keep_checkpoints: 5, tensorboard: false}
dist: {device: cpu}
YAML

# Runs a command (its output to LOG) and prints its peak RSS in MB: the largest of the
# processes it started, each waited for (launch.sh waits for its ranks).
peak_mb() {  # LOG command...
  local log="$1"; shift
  "$py" - "$log" "$@" <<'PY'
import resource, subprocess, sys
with open(sys.argv[1], 'wb') as out:
    rc = subprocess.run(sys.argv[2:], stdout=out, stderr=subprocess.STDOUT).returncode
if rc != 0:
    sys.stdout.write(open(sys.argv[1], errors='replace').read()[-4000:])
    sys.exit('exit status %d' % rc)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
PY
}
train=("$bin/faceshard-train" --config "$work/job.yaml")
launch2=("$root/tools/launch.sh" --nproc 2 --grace-s 20 -- "${train[@]}")
launch3=("$root/tools/launch.sh" --nproc 3 --grace-s 20 -- "${train[@]}")
losses() { "$py" -c "
import json,sys
for l in open(sys.argv[1]):
    o=json.loads(l)
    if 'loss' in o: print(o['step'], repr(o['loss']))" "$1"; }
within_bound() {  # what peak reference
  "$py" -c "import sys; p, r, b = map(float, sys.argv[1:4]); print('%s: peak RSS %d MB, %.3f x the training run (%d MB), bound %.2f' % (sys.argv[4], p, p / r, r, b)); sys.exit(p > b * r)" \
    "$2" "$3" "$BOUND" "$1"
}

case "$case_name" in
resume)
  a=$(peak_mb "$work/a.log" "${train[@]}" --set train.max_steps=2) || { echo "$a"; fail "training run"; }
  losses "$work/out/metrics.jsonl" > "$work/a.txt"
  b=$(peak_mb "$work/b.log" "${train[@]}" --set train.max_steps=2 --set output="$work/outB" \
      --resume "$work/out/checkpoints/step_00000001") || { echo "$b"; fail "resumed run"; }
  grep -q "resumed from .*step_00000001 at step 1" "$work/b.log" || { cat "$work/b.log"; fail "did not resume at step 1"; }
  losses "$work/outB/metrics.jsonl" > "$work/b.txt"
  [ "$(wc -l < "$work/b.txt")" -eq 1 ] || { cat "$work/b.txt"; fail "the resumed run logged no single step 2"; }
  grep -qxF "$(cat "$work/b.txt")" "$work/a.txt" || { paste "$work/a.txt" "$work/b.txt"; fail "step 2 differs after resume"; }
  echo "step 2 loss equals the uninterrupted run's: $(cat "$work/b.txt")"
  within_bound "resume on 1 rank" "$b" "$a" || fail "the resumed run peaked more than ${BOUND}x the training run"
  echo PASS ;;
reshard)
  a=$(peak_mb "$work/a.log" "${launch2[@]}" --set train.max_steps=1) || { echo "$a"; fail "2-rank training run"; }
  # The reference: training one step on 3 ranks (the shards a 3-rank resume holds).
  t=$(peak_mb "$work/t.log" "${launch3[@]}" --set train.max_steps=1 --set output="$work/train3") \
    || { echo "$t"; fail "3-rank training run"; }
  # The 2-rank run's global batch, 16, does not split over 3 ranks: 24 (8 a rank, as in the
  # 3-rank training run), on purpose.
  b=$(peak_mb "$work/b.log" "${launch3[@]}" --set train.max_steps=1 --set output="$work/out3" --set data.global_batch_size=24 \
      --resume "$work/out/checkpoints/step_00000001") || { echo "$b"; fail "3-rank resume"; }
  grep -q "resharded from 2 to 3 ranks" "$work/b.log" || { cat "$work/b.log"; fail "no reshard message"; }
  "$py" "$root/tests/e2e/same_rows.py" "$work/out/checkpoints/step_00000001" "$work/out3/checkpoints/step_00000001" || fail "rows differ"
  # Resharded and trained one step: the whole resumed run against the 3-rank training run.
  c=$(peak_mb "$work/c.log" "${launch3[@]}" --set train.max_steps=2 --set output="$work/out3s" --set data.global_batch_size=24 \
      --resume "$work/out/checkpoints/step_00000001") || { echo "$c"; fail "3-rank resume and step"; }
  within_bound "resharded 2 -> 3 ranks, no step (largest rank)" "$b" "$t" || fail "a resharding rank peaked more than ${BOUND}x a training rank"
  within_bound "resharded 2 -> 3 ranks and one step (largest rank)" "$c" "$t" || fail "a resharded rank peaked more than ${BOUND}x a training rank"
  # The load's own memory on every rank (the trainer's "resume memory" line): its peak over
  # what it held when it ended (a transient), the freed blocks it left to the CPU block cache
  # (temporaries kept for the training step to reuse), and the private memory it added beyond
  # the rows it read into the shard and those blocks: each at most 64 MB. Reading a part of
  # a shard file into a temporary first (130 MB per part here), a whole 2-rank shard file
  # (410 MB), or drawing initial rows (273 MB) is far outside these.
  FACESHARD_LOG_ALL_RANKS=1 "${launch3[@]}" --set train.max_steps=1 --set output="$work/out3m" --set data.global_batch_size=24 \
    --resume "$work/out/checkpoints/step_00000001" > "$work/m.log" 2>&1 || { cat "$work/m.log"; fail "3-rank resume (all ranks logging)"; }
  grep "resume memory" "$work/m.log"
  "$py" - "$work/m.log" <<'PY' || fail "the load needed memory beyond the rows it read"
import re, sys
lines = re.findall(r"\[rank (\d)/3\] resume memory: resident (\d+) MB before the load, (\d+) MB after it, peak (\d+) MB; "
                   r"private memory \+(-?\d+) MB for (\d+) MB of classifier rows read \(the CPU block cache keeps (-?\d+) MB",
                   open(sys.argv[1]).read())
assert sorted(int(l[0]) for l in lines) == [0, 1, 2], "not every rank logged its resume memory: %s" % lines
for r, before, after, peak, anon, rows, cached in lines:
    transient, extra = int(peak) - int(after), int(anon) - int(rows) - int(cached)
    print("rank %s: peak %s MB, %d MB above the end of the load; %s MB of freed blocks kept; private +%s MB for %s MB"
          " of rows: %d MB beyond rows and blocks (bounds 64)" % (r, peak, transient, cached, anon, rows, extra))
    assert int(rows) > 200, "rank %s read only %s MB of rows" % (r, rows)
    assert transient <= 64 and int(cached) <= 64 and extra <= 64, "rank %s: the load took more than the rows it read" % r
PY
  echo PASS ;;
*) fail "unknown case $case_name" ;;
esac
