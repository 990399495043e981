#!/usr/bin/env bash
# Elastic and preemptible runs, with the launchers people use.
#   torchrun:       three hosts (network namespaces on one bridge, 10.79.0.1-3, no
#                   *_SOCKET_IFNAME), torchrun --nnodes 2:3 with the c10d rendezvous and
#                   faceshard-train --resume auto. Host 2's agent and workers are killed
#                   mid-run: the agents of hosts 0 and 1 restart their workers on two ranks,
#                   which resume from the last checkpoint, resharded. Host 2 is then started
#                   again: the membership change stops the workers (SIGTERM: checkpoint, exit
#                   0) and the run continues on three ranks to its end. The final checkpoint
#                   is complete and faceshard-verify reads the export. Prints the seconds from
#                   the kill to the next completed step and the steps lost.
#   invariance:     SyncBatchNorm, sample rate 1.0, data.global_batch_size 12: the per-step
#                   losses of 10 steps on 1, 2 and 3 ranks agree to 1e-5 (relative), and a
#                   run that goes from 3 to 2 ranks at its step-5 checkpoint (written in the
#                   background, train.checkpoint_async on) continues with the losses of the
#                   run that does not. Then what still differs when the
#                   run is not made invariant, measured the same way: per-rank BatchNorm
#                   (sync_bn false) and sampled classes (sample rate 0.5), on 2 vs 3 ranks;
#                   and a 2-rank run with 2% larger updates: each must differ by more than
#                   the tolerance (the comparison can tell). The same invariance with bf16
#                   centres and state (stochastic rounding) and streamed logits, on 1 and 3
#                   ranks and across 3 -> 2. lr 1e-4: the ranks' fp32
#                   summation orders differ, and training amplifies any difference (at lr
#                   5e-4 to about 1e-4 in 10 steps; README "Elastic and preemptible runs").
#   slurm_requeue:  srun's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST, ...):
#                   SIGTERM (preemption) finishes the step, checkpoints and exits 0; the
#                   requeued job (SLURM_RESTART_COUNT=1, the same command with --resume auto)
#                   continues there and finishes; a third start says the run is finished.
# usage: elastic.sh SOURCE_DIR BIN_DIR CASE      (exit 77: namespaces cannot be made here)
set -u
root="$1"; bin="$2"; case_name="$3"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
unset GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK
work=$(mktemp -d)
fail() { echo "FAIL: $*"; exit 1; }
now() { date +%s.%N; }
# Steps in metrics.jsonl (one row per step: log_every 1), the last one.
last_step() { "$py" -c "
import json,sys
s=[json.loads(l).get('step',0) for l in open(sys.argv[1]) if l.strip() and 'loss' in l]
print(max(s) if s else 0)" "$1" 2>/dev/null || echo 0; }

"$bin/faceshard-synth" --output "$work/data" --identities 24 --images 8 --holdout 8 --pairs 40 --seed 5 > /dev/null \
  || fail "faceshard-synth"

case "$case_name" in
torchrun)
  id="fe$$"
  sw="${id}sw"; hosts=("${id}h0" "${id}h1" "${id}h2"); addrs=(10.79.0.1 10.79.0.2 10.79.0.3)
  alive() { ip netns pids "$1" 2>/dev/null; }
  cleanup() {
    for ns in "${hosts[@]}" "$sw"; do alive "$ns" | xargs -r kill -9 2>/dev/null; ip netns del "$ns" 2>/dev/null; done
    rm -rf "$work"
  }
  trap cleanup EXIT
  # One bridge in a namespace of its own (the switch), one veth from each host to it.
  if ! { ip netns add "$sw" && ip -n "$sw" link add br0 type bridge && ip -n "$sw" link set br0 up &&
         for k in 0 1 2; do
           ip netns add "${hosts[$k]}" && ip link add "${id}v$k" type veth peer name "${id}p$k" &&
           ip link set "${id}v$k" netns "${hosts[$k]}" && ip link set "${id}p$k" netns "$sw" &&
           ip -n "$sw" link set "${id}p$k" master br0 && ip -n "$sw" link set "${id}p$k" up &&
           ip -n "${hosts[$k]}" addr add "${addrs[$k]}/24" dev "${id}v$k" &&
           ip -n "${hosts[$k]}" link set "${id}v$k" up && ip -n "${hosts[$k]}" link set lo up || exit 1
         done; } 2> "$work/netns.err"; then
    echo "SKIP: cannot create network namespaces here: $(head -c 300 "$work/netns.err")"
    exit 77
  fi
  torchrun="$root/.venv/bin/torchrun"
  [ -x "$torchrun" ] || fail "no torchrun in .venv"
  # The global batch (24) is the same on 2 and 3 ranks; a checkpoint every 10 steps and every
  # 5 s bounds what a lost host costs. The run is long enough for host 2 to come back while
  # it is still going, also when other tests share the cores (at 240 steps a loaded machine
  # once finished the run on 2 ranks before host 2's agent had joined).
  total=400
  cat > "$work/tiny.yaml" <<YAML
base: $root/configs/base.yaml
output: $work/out
seed: 7
data: {rec: $work/data, num_classes: 24, global_batch_size: 24, num_workers: 1}
model: {backbone: mbf_small, embedding_size: 64}
loss: {margin: [1.0, 0.0, 0.4], scale: 16}
optim: {lr: 0.05, epochs: 100, warmup_epochs: 0, total_steps: $total}
train: {log_every: 1, verify_every: 0, checkpoint_every: 10, checkpoint_every_s: 5, keep_checkpoints: 3, tensorboard: false, resume: auto}
dist: {timeout_s: 5, rendezvous_timeout_s: 60}
YAML
  # agent K: torchrun on host K, its workers logging on every rank. Host 0 hosts the rendezvous store (this machine's hostname
  # resolves to 127.0.0.1, so torchrun is told which host is the endpoint and each agent its
  # own address). Dead agents are dropped after 3 missed 1-s heartbeats; once two hosts are
  # there, a round waits 10 s for a third (a host whose worker is still checkpointing on its way out must not miss the round). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the workers'
  # rank 0 hosts their store in each round (torchrun's shared store lives in the agent that
  # was rank 0 in the first round, and a later round that makes another agent rank 0 fails).
  agent() {
    local k="$1" is_host=0; [ "$k" = 0 ] && is_host=1
    ip netns exec "${hosts[$k]}" env OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 FACESHARD_LOG_ALL_RANKS=1 \
      "$torchrun" --nnodes 2:3 --nproc-per-node 1 --max-restarts 5 \
      --monitor-interval 0.5 --rdzv-backend c10d --rdzv-endpoint "${addrs[0]}:29400" --rdzv-id faceshard-elastic \
      --rdzv-conf "is_host=$is_host,last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=300" \
      --local-addr "${addrs[$k]}" --no-python "$bin/faceshard-train" --config "$work/tiny.yaml" >> "$work/agent$k.log" 2>&1 &
    eval "agent_pid$k=\$!"
  }
  # wait_for SECONDS COMMAND...: polls the condition every 0.2 s.
  wait_for() {
    local limit="$1"; shift
    local end=$(( $(date +%s) + limit ))
    while [ "$(date +%s)" -lt "$end" ]; do "$@" && return 0; sleep 0.2; done
    return 1
  }
  world_logged() { grep -h "job: rank 0/$1 " "$work"/agent*.log 2>/dev/null | wc -l; }
  starts_with_world() { [ "$(world_logged "$1")" -ge "$2" ]; }
  past_step() { [ "$(last_step "$work/out/metrics.jsonl")" -ge "$1" ]; }
  metrics_grew() { [ "$(stat -c %s "$work/out/metrics.jsonl" 2>/dev/null || echo 0)" -gt "$1" ]; }
  show() { for k in 0 1 2; do echo "--- agent $k:"; tail -40 "$work/agent$k.log"; done; }

  t_start=$(now)
  agent 0; agent 1; agent 2
  wait_for 180 starts_with_world 3 1 || { show; fail "the workers never started on 3 ranks"; }
  wait_for 240 past_step 20 || { show; fail "no step 20 on 3 ranks"; }
  # Kill host 2 (agent and worker) after a random fraction of a step.
  sleep "0.$((RANDOM % 10))"
  before=$(last_step "$work/out/metrics.jsonl")
  size=$(stat -c %s "$work/out/metrics.jsonl")
  alive "${hosts[2]}" | xargs -r kill -9
  t_kill=$(now)
  wait "$agent_pid2" 2>/dev/null
  # The survivors: their workers fail (naming the lost rank), the agents re-rendezvous on two
  # hosts and the new workers resume from the last checkpoint, resharded.
  wait_for 240 starts_with_world 2 1 || { show; fail "the run did not restart on 2 ranks"; }
  wait_for 240 metrics_grew "$size" || { show; fail "no step completed on 2 ranks"; }
  t_next=$(now)
  resumed=$(grep -h "resumed from .*step_[0-9]* at step [0-9]* (classifier resharded from 3 to 2 ranks)" "$work"/agent*.log |
            sed 's/.* at step \([0-9]*\) .*/\1/' | tail -1)
  [ -n "$resumed" ] || { show; fail "no resharded resume on 2 ranks"; }
  grep -qhE "rank 2 (died|failed: |did not join collective)" "$work/agent0.log" "$work/agent1.log" ||
    { show; fail "the survivors did not name the lost rank 2"; }
  # (An agent whose own workers failed counts a restart; one that restarts because the other
  # re-joined sees a membership change, which torchrun does not count. The first agent to act
  # does so on its failed worker: one worker of the 2-rank round says restart 1 or more. Every
  # rank logs (FACESHARD_LOG_ALL_RANKS), since that worker need not be rank 0.)
  grep -qhE "job: rank [01]/2 .* via torchrun \(restart [1-9][0-9]* of at most 5\)" "$work/agent0.log" "$work/agent1.log" ||
    { show; fail "the restarted workers did not log their restart count"; }
  # Host 2 comes back: the run continues on three ranks.
  wait_for 120 past_step $((resumed + 3)) || { show; fail "no progress on 2 ranks"; }
  two_rank_step=$(last_step "$work/out/metrics.jsonl")
  agent 2
  t_join=$(now)
  logged() { grep -qh "$1" "$work"/agent*.log; }
  wait_for 240 logged "classifier resharded from 2 to 3 ranks" || { show; fail "the run did not grow back to 3 ranks"; }
  # (The stop writes its own step's checkpoint, or takes the one still being written.)
  logged "stop requested (signal)\(: checkpointing at step\| at step [0-9]*: the checkpoint of step [0-9]*, being written\)" ||
    { show; fail "the membership change did not checkpoint the 2-rank workers"; }
  for k in 0 1 2; do
    eval "p=\$agent_pid$k"
    wait "$p"; rc=$?
    [ "$rc" -eq 0 ] || { show; fail "agent $k exited $rc"; }
  done
  t_end=$(now)
  grep -qh "done: $total steps" "$work"/agent*.log || { show; fail "the run did not finish its $total steps"; }
  final=$(printf "%s/out/checkpoints/step_%08d" "$work" "$total")
  [ -f "$final/COMMITTED" ] || { ls "$work/out/checkpoints"; fail "the final checkpoint is not committed"; }
  for r in 0 1 2; do [ -s "$final/fc_shard_$r.pt" ] || fail "the final checkpoint lacks fc_shard_$r.pt"; done
  "$bin/faceshard-verify" --model "$work/out" --bin "$work/data/synth.bin" --output "$work/verify" > "$work/verify.log" 2>&1 ||
    { cat "$work/verify.log"; fail "faceshard-verify on the export"; }
  grep -q "accuracy" "$work/verify.log" || { cat "$work/verify.log"; fail "no accuracy from faceshard-verify"; }
  "$py" - "$work/out/metrics.jsonl" "$total" <<'PY' || fail "metrics.jsonl"
import json, sys
steps = [json.loads(l)["step"] for l in open(sys.argv[1]) if l.strip() and '"loss"' in l]
# Every step 1..total was logged at least once (a resume repeats the steps after its checkpoint).
missing = sorted(set(range(1, int(sys.argv[2]) + 1)) - set(steps))
assert not missing, "steps never logged: %s" % missing
PY
  "$py" -c "
import sys
t0, tk, tn, tj, te = map(float, sys.argv[1:6])
print('host 2 killed at step %s (%.1f s into the run); next completed step %.1f s after the kill;'
      ' resumed at step %s: %d steps lost' % (sys.argv[6], tk - t0, tn - tk, sys.argv[7], int(sys.argv[6]) - int(sys.argv[7])))
print('host 2 started again at step %s; 3 ranks again, run finished %.1f s later' % (sys.argv[8], te - tj))
" "$t_start" "$t_kill" "$t_next" "$t_join" "$t_end" "$before" "$resumed" "$two_rank_step"
  grep -h "job: rank 0/" "$work"/agent*.log | sed 's/^.*job: /  /'
  grep -h "error:" "$work/agent0.log" "$work/agent1.log" | head -2
  grep -h "$(basename "$work")/data.* accuracy\|accuracy" "$work/verify.log" | head -2
  echo "PASS: torchrun --nnodes 2:3 lost a host and regained it; the run finished on 3 ranks" ;;
invariance)
  trap 'rm -rf "$work"' EXIT
  lr=0.0001
  # NCHW: with the channels-last kernels (the default layout) the sums of a step round
  # differently enough between rank counts that 2 ranks against 1 measured 1.15e-5 after 10
  # steps (3 ranks 5.9e-6) instead of 2.6e-6; the layout does not change what is computed.
  cat > "$work/inv.yaml" <<YAML
base: $root/configs/base.yaml
output: $work/out
seed: 11
data: {rec: $work/data, num_classes: 24, global_batch_size: 12, num_workers: 1}
model: {backbone: mbf_small, embedding_size: 64, sync_bn: true, channels_last: false}
loss: {margin: [1.0, 0.0, 0.4], scale: 16, sample_rate: 1.0}
optim: {lr: $lr, epochs: 100, warmup_epochs: 0, total_steps: 10}
train: {log_every: 1, verify_every: 0, checkpoint_every: 5, keep_checkpoints: 4, tensorboard: false}
dist: {timeout_s: 60}
YAML
  # run NAME NPROC [--set ...]: faceshard-train on NPROC local ranks into $work/NAME.
  run() {
    local name="$1" n="$2"; shift 2
    "$root/tools/launch.sh" --nproc "$n" --grace-s 20 -- "$bin/faceshard-train" --config "$work/inv.yaml" \
      --set output="$work/$name" "$@" > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; fail "run $name on $n ranks"; }
  }
  run w1 1; run w2 2; run w3 3
  # 3 ranks to the step-5 checkpoint, then the same run continued on 2 ranks. That checkpoint
  # is written in the background (train.checkpoint_async on): what a resume at another
  # number of ranks reads is what the background write committed.
  run w3to2 3 --set train.max_steps=5 --set train.checkpoint_async=on
  grep -q "checkpoint step 5: the training waited .* written in the background" "$work/w3to2.log" ||
    { cat "$work/w3to2.log"; fail "the step-5 checkpoint was not written in the background"; }
  run w3to2 2 --resume auto --set train.checkpoint_async=on
  grep -q "resharded from 3 to 2 ranks" "$work/w3to2.log" || { cat "$work/w3to2.log"; fail "no 3 -> 2 reshard"; }
  # bf16 centres and state (stochastic rounding keyed by class, not by rank) with streamed
  # logits: the same invariance, on 1 and 3 ranks and across a 3 -> 2 change.
  bf=(--set optim.fc_weight_dtype=bf16 --set optim.fc_state_dtype=bf16 --set loss.logits=streamed)
  run wb1 1 "${bf[@]}"; run wb3 3 "${bf[@]}"
  run wb3to2 3 "${bf[@]}" --set train.max_steps=5
  run wb3to2 2 "${bf[@]}" --resume auto
  # What is not invariant: per-rank BatchNorm statistics, and the sampled classes.
  run bn2 2 --set model.sync_bn=false; run bn3 3 --set model.sync_bn=false
  run sr2 2 --set loss.sample_rate=0.5; run sr3 3 --set loss.sample_rate=0.5
  # And a 2-rank run whose updates are 2% larger (what a wrong gradient average would do).
  run lr2 2 --set optim.lr=$(awk -v l="$lr" 'BEGIN { print l * 1.02 }')
  [ -n "${KEEP:-}" ] && { trap - EXIT; echo "work: $work"; }
  "$py" - "$work" <<'PY' || exit 1
import json, os, sys
work = sys.argv[1]
def losses(name):
    got = {}
    for line in open(os.path.join(work, name, "metrics.jsonl")):
        row = json.loads(line)
        if "loss" in row:
            got[row["step"]] = row["loss"]   # a resumed run appends its steps: the last row counts
    assert sorted(got) == list(range(1, 11)), (name, sorted(got))
    return [got[k] for k in range(1, 11)]
def worst(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
tol = 1e-5
ref = losses("w1")
print("losses on 1 rank: " + " ".join("%.6f" % x for x in ref))
bad = []
for name, what in (("w2", "2 ranks"), ("w3", "3 ranks"), ("w3to2", "3 ranks, then 2 from the step-5 checkpoint")):
    d = worst(losses(name), ref)
    print("%-45s max relative difference to 1 rank over 10 steps: %.2e" % (what, d))
    if d > tol: bad.append(what)
d = worst(losses("w3to2"), losses("w3"))
print("%-45s max relative difference to 3 ranks throughout: %.2e" % ("3 -> 2 ranks", d))
if d > tol: bad.append("3 -> 2 against 3")
bref = losses("wb1")
for name, what in (("wb3", "bf16 centres, streamed: 3 ranks"), ("wb3to2", "bf16 centres, streamed: 3 -> 2 ranks")):
    d = worst(losses(name), bref)
    print("%-45s max relative difference to 1 rank over 10 steps: %.2e" % (what, d))
    if d > tol: bad.append(what)
for a, b, what in (("bn2", "bn3", "per-rank BatchNorm (sync_bn false), 3 ranks against 2"),
                  ("sr2", "sr3", "sample rate 0.5, 3 ranks against 2"),
                  ("lr2", "w1", "updates 2% larger on 2 ranks, against 1 rank")):
    d = worst(losses(b), losses(a))
    print("%-45s max relative difference: %.2e" % (what, d))
    if d <= tol: bad.append(what + " did not differ: the comparison cannot tell")
if bad:
    print("FAIL: " + "; ".join(bad)); sys.exit(1)
PY
  echo "PASS: the losses of 10 steps agree on 1, 2 and 3 ranks and across a 3 -> 2 change to 1e-5 (fp32 centres; bf16 centres with streamed logits)" ;;
slurm_requeue)
  trap 'rm -rf "$work"' EXIT
  cat > "$work/tiny.yaml" <<YAML
base: $root/configs/base.yaml
output: $work/out
seed: 7
data: {rec: $work/data, num_classes: 24, global_batch_size: 8, num_workers: 1}
model: {backbone: mbf_small, embedding_size: 32}
loss: {margin: [1.0, 0.0, 0.4], scale: 16}
optim: {lr: 0.05, epochs: 100, warmup_epochs: 0, total_steps: 1000}
train: {log_every: 1, verify_every: 0, checkpoint_every: 0, keep_checkpoints: 2, tensorboard: false, resume: auto}
dist: {timeout_s: 10}
YAML
  port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  # srun KEY=VALUE...: two tasks of one job step, with the variables srun gives them; their
  # pids in p.
  srun() {
    local k
    p=()
    for k in 0 1; do
      env "$@" SLURM_PROCID=$k SLURM_LOCALID=$k SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=2 SLURM_NODEID=0 \
        SLURM_JOB_ID=4242 SLURM_JOB_NODELIST=localhost MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" OMP_NUM_THREADS=1 \
        "$bin/faceshard-train" --config "$work/tiny.yaml" > "$work/task$k.log" 2>&1 &
      p+=($!)
    done
  }
  srun SLURM_RESTART_COUNT=0
  for _ in $(seq 1 900); do grep -q "step 3/" "$work/task0.log" && break; sleep 0.2; done
  grep -q "step 3/" "$work/task0.log" || { cat "$work/task0.log"; fail "the job did not start"; }
  # Preemption: SLURM signals every task of the step.
  kill -TERM "${p[@]}"
  for k in 0 1; do wait "${p[$k]}"; rc=$?; [ "$rc" -eq 0 ] || { cat "$work/task$k.log"; fail "task $k exited $rc after SIGTERM"; }; done
  grep -q "via slurm" "$work/task0.log" || { cat "$work/task0.log"; fail "not seen as a SLURM job"; }
  # The stop's checkpoint: its own step's, or the one still being written when it came.
  n=$(sed -n -e 's/.*stop requested (signal): checkpointing at step \([0-9]*\) and exiting.*/\1/p' \
             -e 's/.*stop requested (signal) at step [0-9]*: the checkpoint of step \([0-9]*\), being written.*/\1/p' \
             "$work/task0.log" | head -1)
  [ -n "$n" ] || { cat "$work/task0.log"; fail "no checkpoint on SIGTERM"; }
  [ -f "$(printf "%s/out/checkpoints/step_%08d/COMMITTED" "$work" "$n")" ] || fail "the checkpoint of step $n is not committed"
  # The requeued job: the same command (train.resume: auto in the config), a shorter schedule
  # end so that it finishes.
  sed -i "s/total_steps: 1000/total_steps: $((n + 3))/" "$work/tiny.yaml"
  srun SLURM_RESTART_COUNT=1
  for k in 0 1; do wait "${p[$k]}"; rc=$?; [ "$rc" -eq 0 ] || { cat "$work/task$k.log"; fail "requeued task $k exited $rc"; }; done
  grep -q "via slurm (requeue 1)" "$work/task0.log" || { cat "$work/task0.log"; fail "the requeue count is not logged"; }
  grep -q "resumed from .*step_$(printf %08d "$n") at step $n" "$work/task0.log" || { cat "$work/task0.log"; fail "the requeued job did not resume at $n"; }
  grep -q "done: $((n + 3)) steps" "$work/task0.log" || { cat "$work/task0.log"; fail "the requeued job did not finish"; }
  [ -f "$work/out/model.pt" ] || fail "no export after the requeued job"
  # Requeued once more after it finished: nothing to do, exit 0.
  srun SLURM_RESTART_COUNT=2
  for k in 0 1; do wait "${p[$k]}"; rc=$?; [ "$rc" -eq 0 ] || { cat "$work/task$k.log"; fail "third start, task $k exited $rc"; }; done
  grep -q "the run already finished at step $((n + 3))" "$work/task0.log" || { cat "$work/task0.log"; fail "the finished run was not recognised"; }
  echo "PASS: SIGTERM checkpointed step $n and exited 0; the requeued job resumed there and finished at step $((n + 3))" ;;
*) fail "unknown case $case_name" ;;
esac
