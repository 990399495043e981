# Sourced by the several-hosts scripts (multihost.sh, net_faults.sh): two hosts, each a
# network namespace of its own (ip netns), joined by a veth pair (10.78.0.1 and 10.78.0.2),
# a tiny data set and config in a work folder, and helpers to launch ranks on a host.
# Expects $root (source) and $bin (binaries); exits 77 (skipped) when namespaces cannot be
# created here (no privilege).
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
unset GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK
id="fs$$"                  # names are per run: ctest runs cases side by side
h0="${id}h0"; h1="${id}h1"
if0="${id}a"; if1="${id}b"  # host 0's and host 1's end of the veth pair
a0=10.78.0.1; a1=10.78.0.2
work=$(mktemp -d)
fail() { echo "FAIL: $*"; exit 1; }
alive() { ip netns pids "$1" 2>/dev/null; }
cleanup() {
  for ns in "$h0" "$h1"; do alive "$ns" | xargs -r kill -9 2>/dev/null; ip netns del "$ns" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT

if ! { ip netns add "$h0" && ip netns add "$h1" && ip link add "$if0" type veth peer name "$if1" &&
       ip link set "$if0" netns "$h0" && ip link set "$if1" netns "$h1" &&
       ip -n "$h0" addr add "$a0/24" dev "$if0" && ip -n "$h1" addr add "$a1/24" dev "$if1" &&
       ip -n "$h0" link set "$if0" up && ip -n "$h1" link set "$if1" up &&
       ip -n "$h0" link set lo up && ip -n "$h1" link set lo up; } 2> "$work/netns.err"; then
  echo "SKIP: cannot create network namespaces here: $(head -c 300 "$work/netns.err")"
  exit 77
fi
on() { local ns="$1"; shift; ip netns exec "$ns" "$@"; }
# launch NS NODE_RANK NPROC LOG PROGRAM... : tools/launch.sh on host NS, in the background.
# LOG is emptied before launch returns, so that a caller waiting for a line in a reused LOG
# never reads the previous run's lines (the background job's own redirection comes later).
launch() {
  local ns="$1" node="$2" nproc="$3" log="$4"; shift 4
  : > "$log"
  on "$ns" "$root/tools/launch.sh" --nproc "$nproc" --nnodes 2 --node-rank "$node" --master-addr "$a0" \
    --master-port 29500 --grace-s 30 -- "$@" > "$log" 2>&1 &
}
# Seconds since the epoch with a fraction, for the time limits.
now() { date +%s.%N; }
elapsed_below() { "$py" -c "import sys; sys.exit(0 if float(sys.argv[2]) - float(sys.argv[1]) < float(sys.argv[3]) else 1)" "$@"; }
# wait_for_line FILE PATTERN SECONDS: until grep finds PATTERN in FILE (fails after SECONDS).
wait_for_line() {
  local i
  for i in $(seq $(($3 * 10))); do grep -q "$2" "$1" && return 0; sleep 0.1; done
  grep -q "$2" "$1"
}

"$bin/faceshard-synth" --output "$work/data" --identities 16 --images 8 --holdout 8 --pairs 40 --seed 3 > /dev/null \
  || fail "faceshard-synth"
cat > "$work/tiny.yaml" <<YAML
base: $root/configs/base.yaml
output: $work/out
seed: 7
data: {rec: $work/data, num_classes: 16, batch_size: 8, num_workers: 1}
model: {backbone: mbf, embedding_size: 64}
loss: {margin: [1.0, 0.0, 0.4], scale: 16}
optim: {lr: 0.05, epochs: 2, warmup_epochs: 0, total_steps: 8}
train: {log_every: 1, verify_every: 0, checkpoint_every: 4, keep_checkpoints: 5, tensorboard: false}
dist: {timeout_s: 10, rendezvous_timeout_s: 20}
YAML
train_args=("$bin/faceshard-train" --config "$work/tiny.yaml")
losses() { "$py" -c "
import json,sys
for l in open(sys.argv[1]):
    o=json.loads(l)
    if 'loss' in o: print(o['step'], repr(o['loss']))" "$1"; }
