#!/usr/bin/env bash
# A resume on another number of ranks keeps the run's arithmetic: the checkpoint's global
# batch (data.batch_size per rank, no data.global_batch_size), so the schedule's length and
# every step's learning rate stay the run's.
#   world:   a 2-rank run (8 per rank: global batch 16, a schedule of 1 epoch, 12 steps with
#            6 of warm-up) stopped at its step-5 checkpoint and resumed on 1 rank, and a 1-rank run (16)
#            resumed on 2 ranks: per-step losses equal the uninterrupted runs' to 1e-5
#            (relative; SyncBatchNorm, all classes: the step is the same on any number of
#            ranks), learning rates to 1e-12, the same schedule length, and the line that
#            says the batch was kept.
#   change:  the global batch changed on purpose on a resume (--set data.batch_size=4 on 1
#            rank, then data.global_batch_size=32 on 2): one line saying global batch, schedule
#            and the learning rate of the first resumed step before and after, checked
#            against the schedule's formula computed here, and the resumed steps' learning
#            rates those of the new schedule. A world size that cannot split the kept global
#            batch (3 ranks, 16): one error line naming the keys, exit 2, nothing trained.
# usage: resume_batch.sh SOURCE_DIR BIN_DIR world|change
set -u
root="$1"; bin="$2"; case_name="$3"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
unset GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK
export OMP_NUM_THREADS=1
work=$(mktemp -d)
[ -n "${KEEP:-}" ] && echo "work: $work" || trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$bin/faceshard-synth" --output "$work/data" --identities 24 --images 8 --holdout 0 --pairs 0 --seed 5 > /dev/null \
  || fail "faceshard-synth"
# 192 images; lr 1e-4 keeps the ranks' fp32 summation orders from growing apart
# (tests/e2e/elastic.sh invariance); NCHW for the same reason.
cat > "$work/run.yaml" <<YAML
base: $root/configs/base.yaml
seed: 11
data: {rec: $work/data, num_classes: 24, batch_size: 8, num_workers: 1}
model: {backbone: mbf_small, embedding_size: 64, sync_bn: true, channels_last: false}
loss: {margin: [1.0, 0.0, 0.4], scale: 16, sample_rate: 1.0}
optim: {lr: 0.0001, epochs: 1, warmup_epochs: 0.5}
train: {log_every: 1, verify_every: 0, checkpoint_every: 5, keep_checkpoints: 4, tensorboard: false}
dist: {timeout_s: 60}
YAML
# run NAME NPROC [ARGS...]: faceshard-train on NPROC local ranks into $work/NAME (log appended).
run() {
  local name="$1" n="$2"; shift 2
  "$root/tools/launch.sh" --nproc "$n" --grace-s 20 -- "$bin/faceshard-train" --config "$work/run.yaml" \
    --set output="$work/$name" "$@" >> "$work/$name.log" 2>&1
}
# steps NAME: "step loss lr" per logged step (a resumed run's rows replace the repeated ones).
compare() {
  "$py" - "$work" "$@" <<'PY'
import json, os, sys
work, pairs = sys.argv[1], sys.argv[2:]
def rows(name):
    got = {}
    for line in open(os.path.join(work, name, "metrics.jsonl")):
        r = json.loads(line)
        if "loss" in r:
            got[r["step"]] = (r["loss"], r["lr"])
    return got
bad = []
for pair in pairs:
    a, b = pair.split(":")
    ra, rb = rows(a), rows(b)
    if sorted(ra) != sorted(rb):
        bad.append("%s has steps %s, %s has %s" % (a, sorted(ra), b, sorted(rb)))
        continue
    dl = max(abs(ra[s][0] - rb[s][0]) / abs(rb[s][0]) for s in rb)
    dr = max(abs(ra[s][1] - rb[s][1]) / max(abs(rb[s][1]), 1e-30) for s in rb)
    print("%-8s against %-8s %d steps: max relative difference of the loss %.2e, of the learning rate %.2e"
          % (a, b, len(rb), dl, dr))
    for s in sorted(rb):
        if s in (1, 5, 6, 7, 10) or s == max(rb):
            print("  step %2d  loss %.6f / %.6f  lr %.9g / %.9g" % (s, ra[s][0], rb[s][0], ra[s][1], rb[s][1]))
    if dl > 1e-5: bad.append("%s against %s: losses differ by %.2e" % (a, b, dl))
    if dr > 1e-12: bad.append("%s against %s: learning rates differ by %.2e" % (a, b, dr))
if bad:
    print("FAIL: " + "; ".join(bad)); sys.exit(1)
PY
}

case "$case_name" in
world)
  # Uninterrupted: 2 ranks x 8 and 1 rank x 16 (global batch 16: 12 steps an epoch).
  run w2 2 || { cat "$work/w2.log"; fail "2-rank run"; }
  run w1 1 --set data.batch_size=16 || { cat "$work/w1.log"; fail "1-rank run"; }
  grep -q "schedule: 12 steps, warm-up 6" "$work/w2.log" || { cat "$work/w2.log"; fail "the 2-rank schedule is not 12 steps"; }
  # 2 ranks to the step-5 checkpoint, then the same command on 1 rank with --resume.
  run w2to1 2 --set train.max_steps=5 || { cat "$work/w2to1.log"; fail "2-rank run to step 5"; }
  run w2to1 1 --resume || { cat "$work/w2to1.log"; fail "resume on 1 rank"; }
  grep -q "resume: the checkpoint's global batch 16 kept: 16 images per rank x 1 micro-batches on 1 ranks (it trained with 8 x 1 on 2)" \
    "$work/w2to1.log" || { cat "$work/w2to1.log"; fail "no line saying the global batch was kept"; }
  grep -q "global batch 16; schedule: 12 steps, warm-up 6" "$work/w2to1.log" ||
    { cat "$work/w2to1.log"; fail "the resumed run's schedule is not the run's"; }
  grep -q "resume: global batch 16 ->" "$work/w2to1.log" && fail "a kept batch was reported as a change"
  # 1 rank x 16 to step 5, resumed on 2 ranks with the 1-rank command.
  run w1to2 1 --set data.batch_size=16 --set train.max_steps=5 || { cat "$work/w1to2.log"; fail "1-rank run to step 5"; }
  run w1to2 2 --set data.batch_size=16 --resume || { cat "$work/w1to2.log"; fail "resume on 2 ranks"; }
  grep -q "global batch 16 kept: 8 images per rank x 1 micro-batches on 2 ranks" "$work/w1to2.log" ||
    { cat "$work/w1to2.log"; fail "no line saying the global batch was kept (1 -> 2)"; }
  compare w2to1:w2 w1to2:w1 || fail "the resumed runs differ from the uninterrupted ones"
  echo "PASS: 2 -> 1 and 1 -> 2 ranks resume with the run's global batch: losses to 1e-5, learning rates exact" ;;
change)
  sed -i "s/epochs: 1,/epochs: 4,/" "$work/run.yaml"   # 48 steps at global batch 16, 24 at 32
  run c 2 --set train.max_steps=10 || { cat "$work/c.log"; fail "2-rank run to step 10"; }
  # 3 ranks cannot split the kept global batch 16: one line naming the keys, nothing trained.
  run c 3 --resume; rc=$?
  [ $rc -ne 0 ] || fail "3 ranks resumed a global batch of 16"
  line=$(grep -h "error:" "$work/c.log" | grep "global batch 16" | head -1)
  case "$line" in
    *"key 'data.batch_size': 8 is the checkpoint's per-rank batch, and its global batch 16 (8 x 2 ranks x 1 micro-batches,"*"cannot be split evenly over 3 ranks x 1 micro-batches (optim.grad_accumulation)"*"data.global_batch_size (a multiple of 3)"*) ;;
    *) cat "$work/c.log"; fail "no one-line error naming the keys for 3 ranks" ;;
  esac
  [ "$(grep -c '"loss"' "$work/c/metrics.jsonl")" -eq 10 ] || fail "the refused resume trained"
  # data.batch_size 4 on 1 rank: global batch 16 -> 4, on purpose.
  run c 1 --resume --set data.batch_size=4 --set train.max_steps=14 || { cat "$work/c.log"; fail "resume with batch 4"; }
  # data.global_batch_size 32 on 2 ranks, from the step-14 checkpoint (global batch 4).
  run c 2 --resume --set data.global_batch_size=32 --set train.max_steps=18 || { cat "$work/c.log"; fail "resume with global batch 32"; }
  "$py" - "$work/c.log" "$work/c/metrics.jsonl" <<'PY' || fail "the change line"
import json, re, sys
log, metrics = open(sys.argv[1]).read(), sys.argv[2]
# lr(t) of tools' PolyWarmupSchedule (app/train/lr_schedule.h), t = steps before this one.
def lr(t, total, warmup, base=1e-4, power=1.0):
    if t >= total: return 0.0
    if t < warmup: return base * (t + 1) / warmup
    return base * (1 - (t - warmup) / (total - warmup)) ** power
images = 192
def sched(g):  # optim.epochs 4, warmup_epochs 0.5
    per_epoch = max(1, images // g)
    return per_epoch * 4, int(0.5 * per_epoch)
lines = re.findall(r"resume: global batch .*", log)
assert len(lines) == 2, lines
rows = {}
for l in open(metrics):
    r = json.loads(l)
    if "loss" in r: rows[r["step"]] = r["lr"]
for line, (g0, g1, step, key, value) in zip(lines, [(16, 4, 10, "data.batch_size", 4), (4, 32, 14, "data.global_batch_size", 32)]):
    print(line)
    (t0, w0), (t1, w1) = sched(g0), sched(g1)
    want = ("resume: global batch %d -> %d (%s %d from --set" % (g0, g1, key, value))
    assert line.startswith(want), (line, want)
    assert ("schedule %d -> %d steps (warm-up %d -> %d), learning rate at step %d " % (t0, t1, w0, w1, step + 1)) in line, line
    m = re.search(r"learning rate at step \d+ (\S+) -> (\S+);", line)
    before, after = float(m.group(1)), float(m.group(2))
    assert abs(before - lr(step, t0, w0)) <= 1e-3 * lr(step, t0, w0), (before, lr(step, t0, w0))
    assert abs(after - lr(step, t1, w1)) <= 1e-3 * lr(step, t1, w1), (after, lr(step, t1, w1))
    assert "the step count stays %d" % step in line, line
    # The resumed steps run on the new schedule.
    for s in range(step + 1, step + 5):
        assert abs(rows[s] - lr(s - 1, t1, w1)) <= 1e-12 * lr(s - 1, t1, w1), (s, rows[s], lr(s - 1, t1, w1))
print("the resumed steps' learning rates are the new schedule's")
PY
  echo "PASS: a changed global batch is said in one line (batch, schedule, learning rate); 3 ranks refused in one line" ;;
*) fail "unknown case $case_name" ;;
esac
