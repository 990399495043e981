#!/usr/bin/env bash
# End-to-end tests of faceshard-train on CPU with 2 ranks and a tiny synthetic data set.
# usage: train_e2e.sh SOURCE_DIR BIN_DIR CASE
#   CASE: loss_falls | resume_exact | resume_auto | global_batch | resume_accumulate | reshard | crash_in_save | sigterm | peer_stop | fp16_skip | nan_stop |
#         verify_tool | bad_input | bf16 | vit_t | stop_in_flight | skip_when_busy
set -u
root="$1"; bin="$2"; case_name="$3"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); [ -n "${KEEP_WORK:-}" ] || trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$bin/faceshard-synth" --output "$work/data" --identities 16 --images 8 --holdout 8 --pairs 40 --seed 3 > /dev/null \
  || fail "faceshard-synth"
cat > "$work/tiny.yaml" <<YAML
base: $root/configs/base.yaml
output: $work/out
seed: 7
data: {rec: $work/data, num_classes: 16, batch_size: 8, num_workers: 1, val_targets: [synth]}
model: {backbone: mbf, embedding_size: 64}
loss: {margin: [1.0, 0.0, 0.4], scale: 16}
optim: {lr: 0.05, epochs: 2, warmup_epochs: 0}
train: {log_every: 1, verify_every: 0, checkpoint_every: 4, keep_checkpoints: 5}
YAML
train() { "$root/tools/launch.sh" --nproc "${NPROC:-2}" --grace-s 20 -- "$bin/faceshard-train" --config "$work/tiny.yaml" "$@"; }
losses() { "$py" -c "
import json,sys
for l in open(sys.argv[1]):
    o=json.loads(l)
    if 'loss' in o: print(o['step'], repr(o['loss']))" "$1"; }

# The stop's step and its checkpoint's step, from a log's stop line ($2: who was signalled):
# "stop requested (WHO): checkpointing at step N and exiting", or "stop requested (WHO) at
# step N: the checkpoint of step Q, being written in the background, is the stop's checkpoint".
stop_step() { sed -n -e "s/.*stop requested ($2): checkpointing at step \([0-9]*\) and exiting.*/\1/p" \
                     -e "s/.*stop requested ($2) at step \([0-9]*\): the checkpoint of step [0-9]*, being written.*/\1/p" "$1" | head -1; }
stop_checkpoint_step() { sed -n -e "s/.*stop requested ($2): checkpointing at step \([0-9]*\) and exiting.*/\1/p" \
                     -e "s/.*stop requested ($2) at step [0-9]*: the checkpoint of step \([0-9]*\), being written.*/\1/p" "$1" | head -1; }

case "$case_name" in
loss_falls)
  train --set optim.total_steps=16 --set train.keep_checkpoints=2 > "$work/log" 2>&1 || { cat "$work/log"; fail "training failed"; }
  # Checkpoints at steps 4, 8, 12 and 16; the last two are kept.
  kept=$(cd "$work/out/checkpoints" && echo step_*)
  [ "$kept" = "step_00000012 step_00000016" ] || fail "keep_checkpoints=2 left: $kept"
  "$py" - "$work/out/metrics.jsonl" <<'PY' || exit 1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if 'loss' in r]
for key in ('step', 'epoch', 'loss', 'lr', 'fc_lr', 'samples_per_sec', 'accuracy'):
    assert all(key in r for r in steps), key
val = [r for r in rows if 'val/synth/accuracy' in r]
assert val, 'no verification result in metrics.jsonl'
first = sum(r['loss'] for r in steps[:3]) / 3
last = sum(r['loss'] for r in steps[-3:]) / 3
print('loss first 3 steps %.4f, last 3 steps %.4f' % (first, last))
assert last < 0.9 * first, 'loss did not fall'
PY
  # The TensorBoard file, read back with a reader written from the format (stdlib only).
  "$py" - "$work/out/tensorboard" <<'PY' || exit 1
import os, struct, sys
def crc32c(data):
    crc = 0xffffffff
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82f63b78 if crc & 1 else 0)
    return crc ^ 0xffffffff
def masked(c): return ((((c >> 15) | (c << 17)) & 0xffffffff) + 0xa282ead8) & 0xffffffff
def varint(b, i):
    x = s = 0
    while True:
        c = b[i]; i += 1; x |= (c & 0x7f) << s; s += 7
        if c < 128: return x, i
def fields(b):
    i = 0
    while i < len(b):
        key, i = varint(b, i); f, t = key >> 3, key & 7
        if t == 0: v, i = varint(b, i)
        elif t == 1: v = b[i:i+8]; i += 8
        elif t == 5: v = b[i:i+4]; i += 4
        elif t == 2:
            n, i = varint(b, i); v = b[i:i+n]; i += n
        else: raise ValueError('wire type %d' % t)
        yield f, v
d = sys.argv[1]
files = [f for f in os.listdir(d) if f.startswith('events.out.tfevents.')]
assert len(files) == 1, files
raw = open(os.path.join(d, files[0]), 'rb').read()
i, scalars = 0, {}
while i < len(raw):
    n = struct.unpack('<Q', raw[i:i+8])[0]
    assert struct.unpack('<I', raw[i+8:i+12])[0] == masked(crc32c(raw[i:i+8])), 'length crc'
    data = raw[i+12:i+12+n]
    assert struct.unpack('<I', raw[i+12+n:i+16+n])[0] == masked(crc32c(data)), 'data crc'
    i += 16 + n
    ev = dict(fields(data)); step = ev.get(2, 0)
    if 5 in ev:
        for f, v in fields(ev[5]):
            val = dict(fields(v))
            scalars.setdefault(val[1].decode(), []).append((step, struct.unpack('<f', val[2])[0]))
assert 'loss' in scalars and len(scalars['loss']) >= 10, scalars.keys()
print('tensorboard: %d tags, %d loss points' % (len(scalars), len(scalars['loss'])))
PY
  [ -f "$work/out/model.pt" ] && [ -f "$work/out/model.json" ] || fail "no exported model"
  echo PASS ;;
resume_exact)
  train --set optim.total_steps=8 > "$work/a.log" 2>&1 || { cat "$work/a.log"; fail "run A"; }
  losses "$work/out/metrics.jsonl" > "$work/a.txt"; mv "$work/out" "$work/outA"
  train --set optim.total_steps=8 --set train.max_steps=4 > "$work/b1.log" 2>&1 || { cat "$work/b1.log"; fail "run B part 1"; }
  train --set optim.total_steps=8 --resume > "$work/b2.log" 2>&1 || { cat "$work/b2.log"; fail "run B part 2"; }
  grep -q "resumed from .*step_00000004 at step 4" "$work/b2.log" || { cat "$work/b2.log"; fail "did not resume at step 4"; }
  losses "$work/out/metrics.jsonl" > "$work/b.txt"
  [ "$(wc -l < "$work/a.txt")" -eq 8 ] || { cat "$work/a.txt"; fail "run A logged $(wc -l < "$work/a.txt") losses, not 8"; }
  diff "$work/a.txt" "$work/b.txt" > /dev/null || { paste "$work/a.txt" "$work/b.txt"; fail "losses differ after resume"; }
  echo "PASS: steps 1-8 identical, bit for bit:"; cat "$work/b.txt" ;;
resume_heads)
  # The heads with state (AdaFace's norm statistics, CurricularFace's t) and with per-step
  # draws (ElasticFace+), sampled: stopping at step 3 and resuming gives the uninterrupted
  # run's losses and head state bit for bit.
  for h in adaface curricularface elasticface_arc; do
    hs=(--set optim.total_steps=6 --set loss.sample_rate=0.5 --set loss.head=$h --set train.checkpoint_every=3)
    [ $h = elasticface_arc ] && hs+=(--set loss.elasticface_arc.plus=true)
    rm -rf "$work/out" "$work/outA"
    train "${hs[@]}" > "$work/a.log" 2>&1 || { cat "$work/a.log"; fail "$h run A"; }
    mv "$work/out" "$work/outA"
    train "${hs[@]}" --set train.max_steps=3 > "$work/b1.log" 2>&1 || { cat "$work/b1.log"; fail "$h run B part 1"; }
    train "${hs[@]}" --resume > "$work/b2.log" 2>&1 || { cat "$work/b2.log"; fail "$h run B part 2"; }
    for run in outA out; do
      "$py" -c "
import json,sys
for l in open(sys.argv[1]):
    o=json.loads(l)
    if 'loss' in o: print(o['step'], repr(o['loss']), sorted((k, repr(v)) for k, v in o.items() if k.startswith('head/')))" \
        "$work/$run/metrics.jsonl" > "$work/$run.txt"
    done
    [ "$(wc -l < "$work/outA.txt")" -eq 6 ] || fail "$h: expected 6 logged steps"
    diff "$work/outA.txt" "$work/out.txt" > /dev/null || { paste "$work/outA.txt" "$work/out.txt"; fail "$h: losses or head state differ after resume"; }
    echo "$h: steps 1-6 identical after resume at step 3:"; cat "$work/out.txt"
  done
  # A resume under another loss.head: one line naming both heads, in either direction (from
  # a head with state to one without, and back), exit status 2.
  for pair in "adaface combined" "combined adaface"; do
    set -- $pair
    rm -rf "$work/out"
    train --set optim.total_steps=6 --set loss.head=$1 --set train.checkpoint_every=3 --set train.max_steps=3 \
      > "$work/h1.log" 2>&1 || { cat "$work/h1.log"; fail "$1 run to step 3"; }
    train --set optim.total_steps=6 --set loss.head=$2 --set train.checkpoint_every=3 --resume > "$work/h2.log" 2>&1
    rc=$?
    [ $rc -eq 2 ] && grep -qF "the checkpoint was trained with loss.head $1, this run has loss.head $2; a resume continues its run with the run's own head: resume with --set loss.head=$1" "$work/h2.log" ||
      { cat "$work/h2.log"; fail "a resume from $1 under $2 (exit $rc) did not name both heads"; }
  done
  echo PASS ;;
resume_auto)
  # --resume auto as a scheduler reruns it: on an empty output it starts fresh; stopped at step
  # 3, it continues from that checkpoint; once the run is finished (train.resume: auto, the
  # config key) it says so and exits 0 without training. train.checkpoint_every_s adds
  # checkpoints that the step cadence (here: epoch ends, none within 6 steps) does not.
  a=(--set optim.total_steps=6 --set train.checkpoint_every=0 --set train.keep_checkpoints=10)
  train "${a[@]}" --set train.max_steps=3 --resume auto > "$work/a1.log" 2>&1 || { cat "$work/a1.log"; fail "run 1"; }
  grep -q "no committed checkpoint under .*, starting fresh" "$work/a1.log" || { cat "$work/a1.log"; fail "run 1 did not say it starts fresh"; }
  train "${a[@]}" --set train.checkpoint_every_s=1e-6 --resume auto > "$work/a2.log" 2>&1 || { cat "$work/a2.log"; fail "run 2"; }
  grep -q "resumed from .*step_00000003 at step 3" "$work/a2.log" || { cat "$work/a2.log"; fail "run 2 did not resume at step 3"; }
  kept=$(cd "$work/out/checkpoints" && echo step_*)
  [ "$kept" = "step_00000003 step_00000004 step_00000005 step_00000006" ] || fail "checkpoints after run 2: $kept"
  before=$(wc -l < "$work/out/metrics.jsonl")
  train "${a[@]}" --set train.resume=auto > "$work/a3.log" 2>&1 || { cat "$work/a3.log"; fail "run 3 (finished run) exited non-zero"; }
  grep -q "the run already finished at step 6 of 6" "$work/a3.log" || { cat "$work/a3.log"; fail "run 3 did not say the run is finished"; }
  [ "$(wc -l < "$work/out/metrics.jsonl")" = "$before" ] || fail "run 3 logged steps"
  [ -f "$work/out/model.pt" ] || fail "no export"
  grep -E "starting fresh|resumed from|already finished" "$work"/a[123].log
  echo PASS ;;
global_batch)
  # data.global_batch_size decides the per-rank batch from the number of ranks (data.batch_size
  # 8 of the config is not used), and a global batch the ranks cannot share evenly is refused
  # naming the key.
  NPROC=2 train --set data.global_batch_size=12 --set optim.total_steps=1 > "$work/g1.log" 2>&1 || { cat "$work/g1.log"; fail "global batch 12 on 2 ranks"; }
  grep -q "data.global_batch_size 12: 6 images per rank and micro-batch on 2 ranks x 1 micro-batches (data.batch_size 8 is not used)" "$work/g1.log" \
    || { cat "$work/g1.log"; fail "per-rank batch not logged"; }
  grep -q "global batch 12;" "$work/g1.log" || { cat "$work/g1.log"; fail "the job's global batch is not 12"; }
  rm -rf "$work/out"
  NPROC=2 train --set data.global_batch_size=13 > "$work/g2.log" 2>&1
  rc=$?
  [ $rc = 2 ] || { cat "$work/g2.log"; fail "global batch 13 on 2 ranks: exit $rc, expected 2"; }
  grep -q "key 'data.global_batch_size': 13 cannot be split evenly over 2 ranks x 1 micro-batches" "$work/g2.log" || { cat "$work/g2.log"; fail "no error naming the key"; }
  echo PASS ;;
resume_accumulate)
  # Partial FC sampling with 3 micro-batches per step: 8 batches per epoch make 2 steps and 2
  # batches that are never read. Stopping at the end of epoch 0 and resuming must give the
  # uninterrupted run's losses bit for bit (no leftover gradient, same sampled rows).
  acc=(--set optim.total_steps=6 --set loss.sample_rate=0.5 --set optim.grad_accumulation=3)
  train "${acc[@]}" > "$work/a.log" 2>&1 || { cat "$work/a.log"; fail "run A"; }
  grep -q "2 steps/epoch" "$work/a.log" || { cat "$work/a.log"; fail "expected 2 steps per epoch"; }
  losses "$work/out/metrics.jsonl" > "$work/a.txt"; mv "$work/out" "$work/outA"
  train "${acc[@]}" --set train.max_steps=2 > "$work/b1.log" 2>&1 || { cat "$work/b1.log"; fail "run B part 1"; }
  train "${acc[@]}" --resume > "$work/b2.log" 2>&1 || { cat "$work/b2.log"; fail "run B part 2"; }
  grep -q "resumed from .*step_00000002 at step 2" "$work/b2.log" || { cat "$work/b2.log"; fail "did not resume at step 2"; }
  losses "$work/out/metrics.jsonl" > "$work/b.txt"
  [ "$(wc -l < "$work/a.txt")" -eq 6 ] || fail "expected 6 logged steps"
  diff "$work/a.txt" "$work/b.txt" > /dev/null || { paste "$work/a.txt" "$work/b.txt"; fail "losses differ after resume"; }
  echo "PASS: steps 1-6 identical, bit for bit:"; cat "$work/b.txt" ;;
reshard)
  train --set optim.total_steps=8 --set train.max_steps=4 > "$work/a.log" 2>&1 || { cat "$work/a.log"; fail "2-rank run"; }
  cp -r "$work/out/checkpoints/step_00000004" "$work/saved"
  # (The 2-rank run's global batch, 16, does not split over 3 ranks: 24, on purpose.)
  NPROC=3 train --set optim.total_steps=8 --set data.global_batch_size=24 --resume "$work/saved" --set train.max_steps=5 > "$work/b.log" 2>&1 \
    || { cat "$work/b.log"; fail "3-rank resume"; }
  grep -q "resharded from 2 to 3 ranks" "$work/b.log" || { cat "$work/b.log"; fail "no reshard message"; }
  # Resume onto 3 ranks and save at once (no step): rows must equal the 2-rank checkpoint's.
  NPROC=3 train --set optim.total_steps=8 --set data.global_batch_size=24 --resume "$work/saved" --set train.max_steps=4 --set output="$work/out3" \
    > "$work/c.log" 2>&1 || { cat "$work/c.log"; fail "3-rank resume without steps"; }
  "$py" "$root/tests/e2e/same_rows.py" "$work/saved" "$work/out3/checkpoints/step_00000004" || exit 1
  echo PASS ;;
crash_in_save)
  FACESHARD_FAULTS=crash_in_save@1:8 train --set optim.total_steps=12 > "$work/a.log" 2>&1 && fail "the crashed run exited 0"
  [ -f "$work/out/checkpoints/step_00000004/COMMITTED" ] || fail "step 4 checkpoint missing"
  [ -f "$work/out/checkpoints/step_00000008/COMMITTED" ] && fail "step 8 committed although rank 1 died while saving"
  train --set optim.total_steps=12 --set train.max_steps=5 --resume > "$work/b.log" 2>&1 || { cat "$work/b.log"; fail "resume after crash"; }
  grep -q "resumed from .*step_00000004 at step 4" "$work/b.log" || { cat "$work/b.log"; fail "did not resume from step 4"; }
  echo PASS ;;
sigterm)
  "$root/tools/launch.sh" --nproc 2 --grace-s 20 -- "$bin/faceshard-train" --config "$work/tiny.yaml" \
    --set optim.total_steps=1000 > "$work/a.log" 2>&1 &
  pid=$!   # the launcher itself: it forwards SIGTERM to the ranks
  for _ in $(seq 1 600); do grep -q "step 3/" "$work/a.log" && break; sleep 0.2; done
  kill -TERM "$pid"; wait "$pid"; rc=$?
  [ "$rc" -eq 0 ] || { cat "$work/a.log"; fail "exit status $rc after SIGTERM"; }
  # The stop's checkpoint: the stop's own step, or the one of an earlier step still being
  # written in the background when the stop came (its step then said in parentheses).
  at=$(stop_step "$work/a.log" signal); n=$(stop_checkpoint_step "$work/a.log" signal)
  [ -n "$n" ] || { cat "$work/a.log"; fail "no stop message"; }
  dir=$(printf "%s/out/checkpoints/step_%08d" "$work" "$n")
  [ -f "$dir/COMMITTED" ] || fail "the stop checkpoint $dir is not committed"
  # It says how to go on.
  of=""; [ "$n" = "$at" ] || of=" (of step $n)"
  grep -qF "stopped at step $at of 1000; checkpoint $dir$of; to continue, run the same command with --resume" "$work/a.log" ||
    { cat "$work/a.log"; fail "the stop did not say how to continue"; }
  # The run continues from exactly that step.
  train --set optim.total_steps=1000 --set train.max_steps=$((n + 1)) --resume > "$work/b.log" 2>&1 \
    || { cat "$work/b.log"; fail "resume after SIGTERM"; }
  grep -q "resumed from .*step_$(printf %08d "$n") at step $n" "$work/b.log" || { cat "$work/b.log"; fail "did not resume at step $n"; }
  # A run started with --overwrite is continued with --resume in its place: the stop says so.
  "$root/tools/launch.sh" --nproc 2 --grace-s 20 -- "$bin/faceshard-train" --config "$work/tiny.yaml" \
    --set optim.total_steps=1000 --overwrite > "$work/c.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do grep -q "step 2/" "$work/c.log" && break; sleep 0.2; done
  kill -TERM "$pid"; wait "$pid"; rc=$?
  [ "$rc" -eq 0 ] || { cat "$work/c.log"; fail "exit status $rc after SIGTERM of the --overwrite run"; }
  grep -qF "to continue, run the same command with --resume in place of --overwrite" "$work/c.log" ||
    { cat "$work/c.log"; fail "the stop of an --overwrite run did not say to drop --overwrite"; }
  echo "PASS: stopped and checkpointed at step $n, resumed there; an --overwrite run's stop names --resume in its place" ;;
peer_stop)
  # Under torchrun's agent store (a store hosted outside the ranks, as torchrun's agent hosts
  # it): SIGTERM to rank 0 alone stops both ranks at the same step with one checkpoint; rank 0,
  # signalled, exits 0; rank 1, whose own agent sent nothing, exits 75 so that its agent
  # restarts it into the next round instead of taking the run for finished.
  port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$py" -c "
import sys, time, torch.distributed as d
s = d.TCPStore('127.0.0.1', $port, is_master=True, wait_for_workers=False)
time.sleep(300)" > "$work/store.log" 2>&1 &
  store=$!
  for r in 0 1; do
    env RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      TORCHELASTIC_USE_AGENT_STORE=True TORCHELASTIC_RUN_ID=peer TORCHELASTIC_RESTART_COUNT=0 FACESHARD_LOG_ALL_RANKS=1 \
      "$bin/faceshard-train" --config "$work/tiny.yaml" --set optim.total_steps=1000 > "$work/r$r.log" 2>&1 &
    eval "pid$r=\$!"
  done
  for _ in $(seq 1 600); do grep -q "step 3/" "$work/r0.log" && break; sleep 0.2; done
  kill -TERM "$pid0"; wait "$pid0"; rc0=$?; wait "$pid1"; rc1=$?; kill "$store" 2>/dev/null
  [ "$rc0" -eq 0 ] || { cat "$work/r0.log"; fail "the signalled rank exited $rc0"; }
  [ "$rc1" -eq 75 ] || { cat "$work/r1.log"; fail "the rank stopped by its peer exited $rc1, not 75"; }
  n0=$(stop_checkpoint_step "$work/r0.log" signal)
  n1=$(stop_checkpoint_step "$work/r1.log" "signal to another rank")
  [ -n "$n0" ] && [ "$n0" = "$n1" ] || { cat "$work/r0.log" "$work/r1.log"; fail "the ranks did not stop at one step ($n0, $n1)"; }
  grep -q "exit status 75" "$work/r1.log" || { cat "$work/r1.log"; fail "rank 1 did not say why it exits 75"; }
  [ -f "$(printf "%s/out/checkpoints/step_%08d/COMMITTED" "$work" "$n0")" ] || fail "the stop checkpoint is not committed"
  echo "PASS: both ranks stopped at step $n0; rank 0 exited 0, rank 1 exited 75" ;;
fp16_skip)
  # The scaler's decision path in fp32 arithmetic (fp16 convolutions are impractically slow on
  # CPU): the inf lands in rank 1's gradients only; rank 0 must skip the same step.
  FACESHARD_FAULTS=inf_gradient@1:3 train --set optim.total_steps=5 --set train.loss_scaling=on \
    --set train.loss_scale_init=1024 > "$work/a.log" 2>&1 || { cat "$work/a.log"; fail "loss-scaled run"; }
  grep -q "\[rank 0/2\] loss scaling: non-finite gradients at step 3, step skipped" "$work/a.log" \
    || { cat "$work/a.log"; fail "rank 0 did not skip step 3"; }
  [ "$(grep -c "step skipped" "$work/a.log")" -eq 1 ] || { cat "$work/a.log"; fail "expected exactly one skipped step"; }
  "$py" - "$work/out/metrics.jsonl" <<'PY' || exit 1
import json, sys
s = {r['step']: r['loss_scale'] for r in map(json.loads, open(sys.argv[1])) if 'loss_scale' in r}
assert s == {1: 1024, 2: 1024, 3: 512, 4: 512, 5: 512}, s
print('loss scale per step', s)
PY
  echo PASS ;;
nan_stop)
  # An inf in rank 0's gradients at step 6 makes the weights, and so step 7's loss, NaN.
  FACESHARD_FAULTS=inf_gradient@0:6 train --set optim.total_steps=12 > "$work/a.log" 2>&1 && fail "exit 0 despite NaN"
  grep -q "error: the loss became NaN/inf at step 7; stopping. Last good checkpoint: .*step_00000004" "$work/a.log" \
    || { cat "$work/a.log"; fail "no one-line NaN error naming step and checkpoint"; }
  echo PASS ;;
stop_in_flight)
  # A stop (Ctrl-C) while the checkpoint of step 3 is still being written in the background
  # (held half-way by the fault hold_save until the test releases it): the stop takes that
  # checkpoint as its own instead of writing a second one, says what it waits for while it
  # waits, answers a second Ctrl-C with one line, exits 0; the resume from step 3 continues
  # the run exactly as the same run uninterrupted.
  rel="$work/release"
  one() { "$bin/faceshard-train" --config "$work/tiny.yaml" --set optim.total_steps=12 --set train.checkpoint_every=3 "$@"; }
  # (The process itself in the background, not a function's subshell: the signals are its.)
  FACESHARD_FAULTS=hold_save@0:3 FACESHARD_FAULTS_RELEASE="$rel" "$bin/faceshard-train" --config "$work/tiny.yaml" \
    --set optim.total_steps=12 --set train.checkpoint_every=3 --set train.checkpoint_async=on \
    --set train.checkpoint_when_busy=skip > "$work/a.log" 2>&1 &
  pid=$!
  wait_for() {  # a line in the log, while the run lives (5 minutes at most)
    for _ in $(seq 1 1500); do grep -q "$1" "$work/a.log" && return 0; kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    grep -q "$1" "$work/a.log" || { touch "$rel"; wait "$pid"; cat "$work/a.log"; fail "$2"; }
  }
  wait_for "step 4/" "the run did not reach step 4"
  kill -INT "$pid"
  wait_for "waiting for the checkpoint of step 3, written in the background since" "the stop did not say what it waits for"
  kill -INT "$pid"
  wait_for "a stop is already under way" "a second Ctrl-C got no answer"
  touch "$rel"
  wait "$pid"; rc=$?
  [ "$rc" -eq 0 ] || { cat "$work/a.log"; fail "exit status $rc after the stop"; }
  at=$(stop_step "$work/a.log" signal); n=$(stop_checkpoint_step "$work/a.log" signal)
  [ "$n" = 3 ] && [ -n "$at" ] && [ "$at" -gt 3 ] || { cat "$work/a.log"; fail "the stop at step '$at' did not take the checkpoint of step 3 in flight (took '$n')"; }
  grep -q "the checkpoint of step 3 is written: the training waited" "$work/a.log" || { cat "$work/a.log"; fail "no line when the wait ended"; }
  [ "$(grep -c "a stop is already under way" "$work/a.log")" = 1 ] || { cat "$work/a.log"; fail "the second Ctrl-C was not answered with one line"; }
  kept=$(cd "$work/out/checkpoints" && echo step_*)
  [ "$kept" = "step_00000003" ] || { cat "$work/a.log"; fail "the stop wrote a second checkpoint: $kept"; }
  dir="$work/out/checkpoints/step_00000003"
  grep -qF "stopped at step $at of 12; checkpoint $dir (of step 3); to continue, run the same command with --resume" "$work/a.log" ||
    { cat "$work/a.log"; fail "the stop did not name its checkpoint's step"; }
  one --set train.max_steps=8 --resume > "$work/b.log" 2>&1 || { cat "$work/b.log"; fail "resume after the stop"; }
  grep -q "resumed from .*step_00000003 at step 3" "$work/b.log" || { cat "$work/b.log"; fail "did not resume at step 3"; }
  one --set train.max_steps=8 --set output="$work/full" > "$work/c.log" 2>&1 || { cat "$work/c.log"; fail "the uninterrupted run"; }
  # The last line of each step (the resumed run's come after the stopped run's).
  "$py" - "$work/out/metrics.jsonl" "$work/full/metrics.jsonl" <<'PY' || exit 1
import json, sys
def losses(p):
    out = {}
    for l in open(p):
        o = json.loads(l)
        if 'loss' in o: out[o['step']] = o['loss']
    return out
a, b = losses(sys.argv[1]), losses(sys.argv[2])
steps = [s for s in range(4, 9)]
bad = [(s, a.get(s), b.get(s)) for s in steps if a.get(s) != b.get(s)]
assert not bad, 'resumed vs uninterrupted (step, resumed, uninterrupted): %r' % bad
print('steps 4-8 equal to the uninterrupted run')
PY
  echo "PASS: stopped at step $at with the checkpoint of step 3 in flight as its own; resumed there, equal to the run uninterrupted" ;;
skip_when_busy)
  # train.checkpoint_when_busy skip on 2 ranks, through the real writer: rank 1's background
  # write of step 2 is kept in flight after it committed (the fault hold_written) while rank
  # 0's is done, so at step 4 only the ranks' all-reduce knows that a write is in flight:
  # every rank skips step 4 (one line each, no step_4 folder); once released, a later due
  # checkpoint is taken by every rank alike, the last one always.
  rel="$work/release"
  # (Every rank logs: FACESHARD_LOG_ALL_RANKS.)
  FACESHARD_LOG_ALL_RANKS=1 FACESHARD_FAULTS=hold_written@1:2 FACESHARD_FAULTS_RELEASE="$rel" "$root/tools/launch.sh" --nproc 2 --grace-s 20 -- \
    "$bin/faceshard-train" --config "$work/tiny.yaml" --set optim.total_steps=10 --set train.checkpoint_every=2 \
    --set train.checkpoint_async=on --set train.checkpoint_when_busy=skip > "$work/a.log" 2>&1 &
  pid=$!
  skipped4="checkpoint step 4 skipped: the one of step 2 is still being written in the background"
  for _ in $(seq 1 1500); do
    [ "$(grep -c "$skipped4" "$work/a.log")" -ge 2 ] && break
    kill -0 "$pid" 2>/dev/null || break; sleep 0.2
  done
  touch "$rel"
  wait "$pid"; rc=$?
  [ "$rc" -eq 0 ] || { cat "$work/a.log"; fail "exit status $rc"; }
  [ "$(grep -c "$skipped4" "$work/a.log")" = 2 ] || { cat "$work/a.log"; fail "step 4 was not skipped by both ranks"; }
  [ ! -e "$work/out/checkpoints/step_00000004" ] || fail "a step_00000004 folder was written"
  [ -f "$work/out/checkpoints/step_00000002/COMMITTED" ] || { cat "$work/a.log"; fail "step 2 did not commit"; }
  [ -f "$work/out/checkpoints/step_00000010/COMMITTED" ] || { cat "$work/a.log"; fail "the last checkpoint was not taken"; }
  # Steps 6 and 8: skipped by both ranks (no folder) or taken by both (committed).
  for s in 6 8; do
    n=$(grep -c "checkpoint step $s skipped" "$work/a.log")
    f="$work/out/checkpoints/step_$(printf '%08d' "$s")"
    if [ "$n" = 0 ]; then [ -f "$f/COMMITTED" ] || { cat "$work/a.log"; fail "step $s neither skipped nor committed"; }
    elif [ "$n" = 2 ]; then [ ! -e "$f" ] || fail "step $s skipped but written"
    else cat "$work/a.log"; fail "step $s skipped by $n of 2 ranks"; fi
  done
  echo "PASS: step 4 skipped by both ranks while rank 1's write of step 2 was held in flight (rank 0's done); the last checkpoint taken" ;;
verify_tool)
  # faceshard-verify on the exported model reports what the trainer logged last, and the
  # checkpoint folder the same: trained far enough that the accuracy says something (an
  # untrained or collapsed network scores 0.5 at threshold 0, the value any model gives),
  # and compared by the embeddings themselves (raw, unflipped, to 1e-6), which a checkpoint
  # read wrongly or another step's weights cannot match.
  train --set optim.total_steps=48 --set optim.lr=0.1 > "$work/log" 2>&1 || { cat "$work/log"; fail "training failed"; }
  "$bin/faceshard-verify" --model "$work/out" --bin "$work/data/synth.bin" --device cpu --output "$work/eval" \
    --json "$work/verify.json" > "$work/vlog" 2>&1 || { cat "$work/vlog"; fail "faceshard-verify failed"; }
  cat "$work/vlog"
  step_dir=$(ls -d "$work/out/checkpoints"/step_* | sort -V | tail -1)
  first_dir=$(ls -d "$work/out/checkpoints"/step_* | sort -V | head -1)
  [ "$step_dir" != "$first_dir" ] || fail "one checkpoint only: no other step to tell apart"
  "$bin/faceshard-verify" --model "$step_dir" --bin "$work/data/synth.bin" --device cpu --output "$work/eval2" \
    --json "$work/verify2.json" > /dev/null 2>&1 || fail "faceshard-verify on $step_dir failed"
  for m in out:"$work/out" last:"$step_dir" first:"$first_dir"; do
    "$bin/faceshard-extract" --model "${m#*:}" --rec "$work/data" --no-flip --no-normalize --device cpu \
      --output "$work/emb_${m%%:*}" > "$work/elog" 2>&1 || { cat "$work/elog"; fail "faceshard-extract on ${m#*:}"; }
  done
  "$py" - "$work/out/metrics.jsonl" "$work/verify.json" "$work/eval" "$work/log" "$work/verify2.json" "$work" <<'PY' || exit 1
import json, os, re, sys
import numpy as np
rows = [json.loads(l) for l in open(sys.argv[1])]
logged = [r['val/synth/accuracy'] for r in rows if 'val/synth/accuracy' in r]
assert logged, 'the trainer logged no verification'
got = json.load(open(sys.argv[2]))['sets'][0]
print('trainer final %r, faceshard-verify %r (AUC %.4f, threshold %.5f)' % (logged[-1], got['accuracy'], got['auc'],
      got['best_threshold']))
assert got['accuracy'] == logged[-1], 'faceshard-verify differs from the trainer'
# Trained far enough that the figures carry information.
assert got['accuracy'] >= 0.6 and got['auc'] >= 0.65 and got['best_threshold'] > 0, \
    'the accuracy says nothing (%.3f, AUC %.3f, threshold %.3f)' % (got['accuracy'], got['auc'], got['best_threshold'])
# The trainer's last printed XNorm and threshold (5 decimals).
line = re.findall(r'\[synth\]\[\d+\] Accuracy-Flip: \S+  Accuracy-Highest: \S+  XNorm: (\S+)  threshold: (\S+)',
                  open(sys.argv[4]).read())
assert line, 'no verification line in the training log'
print('trainer final XNorm %s threshold %s; faceshard-verify %.5f %.5f' % (line[-1] + (got['xnorm'], got['best_threshold'])))
assert '%.5f' % got['xnorm'] == line[-1][0], 'XNorm differs'
assert '%.5f' % got['best_threshold'] == line[-1][1], 'threshold differs'
lines = open(os.path.join(sys.argv[3], 'synth_roc.csv')).read().split()
assert lines[0] == 'fpr,tpr,cosine_threshold' and len(lines) > 2, lines[:3]
png = open(os.path.join(sys.argv[3], 'roc.png'), 'rb').read()
assert png[:8] == b'\x89PNG\r\n\x1a\n', 'roc.png is not a PNG'
# The checkpoint folder: every metric equal.
ck = json.load(open(sys.argv[5]))['sets'][0]
for k in ('accuracy', 'accuracy_std', 'auc', 'best_threshold', 'xnorm', 'tar_at_far_1e-3', 'tar_at_far_1e-4'):
    assert ck[k] == got[k], 'checkpoint and export disagree on %s: %r vs %r' % (k, ck[k], got[k])
# The embeddings: export and last checkpoint equal to 1e-6; the first checkpoint far off.
w = sys.argv[6]
e_out, e_last, e_first = (np.load(os.path.join(w, 'emb_%s.npy' % n)) for n in ('out', 'last', 'first'))
assert e_out.shape == e_last.shape and e_out.shape[0] == 128, e_out.shape
rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())
print('raw embeddings of %d images: export vs last checkpoint %.2e, vs first checkpoint %.2e' %
      (e_out.shape[0], rel(e_out, e_last), rel(e_out, e_first)))
assert rel(e_out, e_last) <= 1e-6, 'the export and the last checkpoint embed differently'
assert rel(e_out, e_first) > 1e-2, 'the first checkpoint embeds as the last: the comparison cannot tell steps apart'
PY
  # Bad input: one line, exit 2, nothing written.
  out=$("$bin/faceshard-verify" --model "$work/nope" --bin "$work/data/synth.bin" 2>&1); rc=$?
  [ $rc -eq 2 ] && [ "$(echo "$out" | wc -l)" -eq 1 ] || fail "missing model: rc=$rc: $out"
  head -c 100 "$work/data/train.rec" > "$work/garbage.bin"
  out=$("$bin/faceshard-verify" --model "$work/out" --bin "$work/garbage.bin" --output "$work/eval3" 2>&1); rc=$?
  [ $rc -ne 0 ] && [ "$(echo "$out" | grep -c error)" -eq 1 ] || fail "garbage .bin: rc=$rc: $out"
  [ ! -e "$work/eval3/roc.png" ] || fail "garbage .bin still wrote a plot"
  out=$("$bin/faceshard-verify" --model "$work/out/model.pt" --network r50 --bin "$work/data/synth.bin" 2>&1); rc=$?
  [ $rc -eq 2 ] || fail "wrong --network accepted: $out"
  echo "$out"
  echo PASS ;;
bf16)
  # Real bf16 training (backbone in bf16, the classifier's logits in fp32): no loss scaler,
  # the loss falls, and the export records the precision.
  train --set optim.total_steps=16 --set train.precision=bf16 > "$work/log" 2>&1 || { cat "$work/log"; fail "bf16 training"; }
  grep -q "precision bf16" "$work/log" || fail "not trained in bf16"
  "$py" - "$work/out/metrics.jsonl" "$work/out/model.json" <<'PY' || exit 1
import json, math, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if 'loss' in r]
assert len(steps) == 16 and all(math.isfinite(r['loss']) for r in steps), steps
assert not any('loss_scale' in r for r in steps), 'bf16 must not use the loss scaler'
first = sum(r['loss'] for r in steps[:3]) / 3
last = sum(r['loss'] for r in steps[-3:]) / 3
print('bf16 loss first 3 steps %.4f, last 3 steps %.4f' % (first, last))
assert last < 0.9 * first, 'loss did not fall'
assert json.load(open(sys.argv[2]))['precision'] == 'bf16'
PY
  echo PASS ;;
vit_t)
  # A ViT with its recipe (AdamW lr 1e-3, weight decay 0.1; token masking and drop path on),
  # its blocks checkpointed (recomputed in backward) under 2-rank DataParallel with the
  # unused-parameter walk: the loss falls, and the tools take the export by name.
  train --set model.backbone=vit_t --set model.checkpointing=true --set dist.find_unused_parameters=true \
    --set optim.optimizer=adamw --set optim.lr=0.001 --set optim.weight_decay=0.1 --set optim.total_steps=12 \
    > "$work/log" 2>&1 || { cat "$work/log"; fail "vit_t training"; }
  "$py" - "$work/out/metrics.jsonl" "$work/out/model.json" <<'PY' || exit 1
import json, math, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if 'loss' in r]
assert len(steps) == 12 and all(math.isfinite(r['loss']) for r in steps), steps
first = sum(r['loss'] for r in steps[:3]) / 3
last = sum(r['loss'] for r in steps[-3:]) / 3
print('vit_t loss first 3 steps %.4f, last 3 steps %.4f' % (first, last))
assert last < 0.9 * first, 'loss did not fall'
assert json.load(open(sys.argv[2]))['backbone'] == 'vit_t'
PY
  "$bin/faceshard-verify" --model "$work/out/model.pt" --network vit_t --embedding-size 64 --bin "$work/data/synth.bin" \
    --device cpu --output "$work/eval" > "$work/vlog" 2>&1 || { cat "$work/vlog"; fail "faceshard-verify --network vit_t"; }
  grep -q "synth: accuracy" "$work/vlog" || { cat "$work/vlog"; fail "no accuracy from faceshard-verify"; }
  echo PASS ;;
bad_input)
  # Bad command lines, configs and checkpoints: one error line, the documented exit status,
  # and nothing already written is lost.
  expect() {  # status, fragment, command...
    local want="$1" frag="$2"; shift 2
    "$@" > "$work/o" 2> "$work/e"; local rc=$?
    echo "exit $rc: $(cat "$work/e")"
    [ "$rc" -eq "$want" ] || fail "exit $rc (expected $want): $*"
    [ "$(grep -c "error" "$work/e")" -eq 1 ] || { cat "$work/e"; fail "expected one error line: $*"; }
    grep -qF -- "$frag" "$work/e" || fail "'$frag' not named: $(cat "$work/e")"
  }
  expect 2 "optim.lr_rate" "$bin/faceshard-train" --config "$work/tiny.yaml" --set optim.lr_rate=1
  expect 2 "data.batch_size" "$bin/faceshard-train" --config "$work/tiny.yaml" --set data.batch_size=-3
  expect 2 "--frobnicate" "$bin/faceshard-train" --config "$work/tiny.yaml" --frobnicate
  expect 2 "nope.yaml" "$bin/faceshard-train" --config "$work/nope.yaml"
  train --set optim.total_steps=4 > "$work/a.log" 2>&1 || { cat "$work/a.log"; fail "training failed"; }
  ck="$work/out/checkpoints/step_00000004"
  cp -r "$ck" "$work/uncommitted"; rm "$work/uncommitted/COMMITTED"
  expect 2 "uncommitted" "$bin/faceshard-train" --config "$work/tiny.yaml" --resume "$work/uncommitted"
  cp -r "$ck" "$work/corrupt"; head -c 200 "$ck/fc_shard_0.pt" > "$work/corrupt/fc_shard_0.pt"
  before=$(md5sum "$work/out/metrics.jsonl" "$work/out/model.pt")
  expect 1 "fc_shard_0.pt" "$bin/faceshard-train" --config "$work/tiny.yaml" --resume "$work/corrupt"
  expect 2 "num_classes" "$bin/faceshard-train" --config "$work/tiny.yaml" --set data.num_classes=17 --resume "$ck"
  [ "$before" = "$(md5sum "$work/out/metrics.jsonl" "$work/out/model.pt")" ] || fail "a failed start changed the run's outputs"
  echo PASS ;;
*) fail "unknown case $case_name" ;;
esac
