#!/usr/bin/env bash
# A training's numbers do not depend on what the memory it is handed held before: the demo
# network in bf16 on 2 threads with 4 loader workers and checkpoints in the background, run
# with every CPU block poisoned with 0x00 and again with 0xff (FACESHARD_CPU_POISON,
# base/cpu_block_cache.h), logs the same loss at every step bit for bit, the
# same verification accuracy and the same final weights; and the 0xff run stopped one step
# past its step-2 checkpoint (written in the background while that step ran) and resumed from
# it logs the uninterrupted run's losses. A kernel that read memory it never wrote, or a
# checkpoint copy that raced the training, would make the poisoned runs part.
# usage: poisoned_memory.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
unset GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK
export OMP_NUM_THREADS=2
work=$(mktemp -d)
[ -n "${KEEP:-}" ] && echo "work: $work" || trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$bin/faceshard-synth" --output "$work/data" --identities 40 --images 8 --holdout 10 --pairs 40 --seed 9 > /dev/null \
  || fail "faceshard-synth"
common=(--config "$root/configs/demo.yaml" --set data.rec="$work/data" --set dist.device=cpu --set data.batch_size=32
        --set data.num_workers=4 --set train.tensorboard=false --set train.log_every=1 --set train.verify_every=2
        --set train.precision=bf16 --set train.checkpoint_every=2 --set train.checkpoint_async=on)
train() {  # NAME POISON ARGS...
  local name="$1" poison="$2"; shift 2
  FACESHARD_CPU_POISON="$poison" "$bin/faceshard-train" "${common[@]}" --set output="$work/$name" "$@" \
    > "$work/$name.log" 2>&1 || { tail -5 "$work/$name.log"; fail "$name: faceshard-train failed"; }
}
train zeros 0x00 --set train.max_steps=5
train ones 0xff --set train.max_steps=5
train stopped 0xff --set train.max_steps=3
rm -rf "$work/stopped/checkpoints/step_00000003"
train stopped 0xff --set train.max_steps=5 --resume
grep -q "resumed from .*step_00000002 at step 2" "$work/stopped.log" || { cat "$work/stopped.log"; fail "the resume did not take step 2's checkpoint"; }

"$py" - "$work" <<'PY' || fail "the runs part"
import hashlib, json, os, sys
work = sys.argv[1]

def read(name):
    loss, acc = {}, {}
    for line in open(os.path.join(work, name, "metrics.jsonl")):
        r = json.loads(line)
        if "loss" in r:
            loss[r["step"]] = r["loss"]  # a resumed run's lines come last
        for k, v in r.items():
            if k.startswith("val/") or k.endswith("accuracy"):
                acc[(r.get("step"), k)] = v
    return loss, acc

def weights(name):
    h = hashlib.sha256()
    ck = os.path.join(work, name, "checkpoints", "step_00000005")
    for f in ("backbone.pt", "fc_shard_0.pt"):
        h.update(open(os.path.join(ck, f), "rb").read())
    return h.hexdigest()

z, za = read("zeros")
o, oa = read("ones")
s, _ = read("stopped")
bad = []
if sorted(z) != [1, 2, 3, 4, 5]:
    bad.append("the 0x00 run logged steps %s, expected 1-5" % sorted(z))
for step in sorted(z):
    if o.get(step) != z[step]:
        bad.append("step %d: loss %r with 0x00, %r with 0xff" % (step, z[step], o.get(step)))
    if s.get(step) != z[step]:
        bad.append("step %d: the resumed run's loss %r, the uninterrupted run's %r" % (step, s.get(step), z[step]))
if not za:
    bad.append("no verification figure in metrics.jsonl")
if za != oa:
    bad.append("verification differs: %s against %s" % (za, oa))
if weights("zeros") != weights("ones") or weights("zeros") != weights("stopped"):
    bad.append("the step-5 checkpoints' weights differ")
for b in bad:
    print(b)
print("compared steps %s and %d verification figures" % (sorted(z), len(za)))
sys.exit(1 if bad else 0)
PY
echo "PASS: poisoned memory changes nothing, the resume continues the run"
