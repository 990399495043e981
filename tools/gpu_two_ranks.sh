#!/usr/bin/env bash
# Two ranks on one device: the multi-rank CUDA evidence a one-GPU machine can give (NCCL
# refuses two ranks on one GPU; with dist.backend gloo both ranks use cuda:0 and their CUDA
# tensors go over Gloo). From a source checkout (build/bin) or an unpacked bundle:
#
#   tools/gpu_two_ranks.sh --device cuda --out DIR
#
#   train   the demo (configs/demo.yaml on faceshard-synth's data) at world 2 with
#           model.sync_bn true and class sampling (loss.sample_rate 0.05: 2 of each shard's 50
#           classes, see below), in fp32 with TF32 off, batch 16 per rank, on the device and the same on the CPU, twice: at the demo's learning rate
#           (the losses must fall on both sides: the mean of the last quarter of the steps at
#           most 0.95 x that of the first quarter, where one batch's loss scatters by about
#           2.5%) and at lr 1e-4, where the per-step losses of the device run must equal the
#           CPU run's within 1e-4 relative (see below)
#   tests   the multi-rank tests on the device (GoogleTest filter *GlooCuda*: the
#           differentiable all-gather, PartialFC, SyncBatchNorm's CUDA path, DDP and its flat
#           buckets at world 2 on cuda:0, each against its CPU reference); with --device cuda
#           a skipped, failed or missing test is a problem, with --device cpu they must skip
#
# DIR receives two_ranks.json (top-level "ok", "problems": one line each, and the figures),
# logs/ (each run's and the tests' output) and runs/<name>.metrics.jsonl. Exits 1 on any
# problem, 2 on a usage error.
#
# Options: --device cuda|cpu (cpu: both sides on the CPU, the plumbing check a machine
# without a GPU can run: 16 identities x 8 images, batch 8 per rank, 8 and 4 steps), --steps N
# (the learning runs' steps; default 30 on cuda, 8 on cpu), --compare DEVICE_METRICS REFERENCE_METRICS (only the comparison of two
# metrics.jsonl files of the tight runs, into DIR/two_ranks.json: how the check's own test
# shows that a wrong pairing fails).
#
# Why so few sampled classes: PartialFC samples a shard's rows as the batch's positives, then
# random negatives up to the budget, drawn by the device's own generator (CUDA's Philox on a
# GPU, mt19937 on the CPU), so a GPU and a CPU run would train on different negatives. With
# a budget below the positives a shard always holds (about 14 of 50 at a global batch of 32
# on 100 classes; fewer than 2 has a probability below 1e-7), the sampled rows are the
# positives, the same on both sides, and the sampled path (partial softmax, row-sparse
# update) still runs. Why 1e-4 at lr 1e-4: both sides then compute the same fp32 step (same
# data, augmentation, initialisation and rows), in other summation orders: cuDNN and cuBLAS against the CPU's kernels, and SyncBatchNorm in fp32 on the GPU
# against float64 on the CPU. docs/distributed.md measures that class of difference at 1e-5
# to 2e-5 over 10 steps (fp32 SyncBatchNorm across rank counts); a 2% larger learning rate,
# what a wrong gradient average does, moves the losses by 4.5e-4. At the demo's lr 0.1 any
# rounding difference grows by orders of magnitude within a few steps (training amplifies
# it, as between two runs whose sums are ordered differently), so that pair is compared at
# its first step only (the same forward on the same initial weights) and must learn.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
home="$(dirname "$here")"
me=gpu_two_ranks.sh
usage() { sed -n '2,/^# its first step only/p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "$me: error: $*" >&2; exit 2; }

out=""; device=cuda; steps=""; compare=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="${2:-}"; shift 2 || die "--device needs cuda or cpu" ;;
    --out) out="${2:-}"; shift 2 || die "--out needs a folder" ;;
    --steps) steps="${2:-}"; shift 2 || die "--steps needs a number" ;;
    --compare) [ $# -ge 3 ] || die "--compare needs two metrics.jsonl files"; compare=("$2" "$3"); shift 3 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[ -n "$out" ] || die "no --out folder given (see --help)"
case "$device" in cuda|cpu) ;; *) die "--device must be cuda or cpu, got '$device'" ;; esac
[ -n "$steps" ] || { [ "$device" = cuda ] && steps=30 || steps=8; }
[[ "$steps" =~ ^[0-9]+$ ]] && [ "$steps" -ge 4 ] || die "--steps must be a whole number >= 4, got '$steps'"
tight_steps=$([ "$device" = cuda ] && echo 10 || echo 4)
# --device cpu: 16 identities, 8 per shard, a budget of 1 (0.15 x 8) against about 5 positives.
if [ "$device" = cuda ]; then synth_args=(); batch=16; rate=0.05
else synth_args=(--identities 16 --images 8 --holdout 4 --pairs 20); batch=8; rate=0.15; fi

# Where the binaries are: an unpacked bundle (env.sh beside tools/) or a source checkout.
if [ -f "$home/env.sh" ]; then
  # shellcheck disable=SC1091
  source "$home/env.sh" || exit 1
  bin="$home/bin"
  py="${FACESHARD_PYTHON:-python3}"
else
  bin="${FACESHARD_BUILD_DIR:-$home/build}/bin"
  py="${FACESHARD_PYTHON:-$home/.venv/bin/python}"
  [ -x "$py" ] || py=python3
fi
mkdir -p "$out/logs" "$out/runs" || exit 1
out="$(cd "$out" && pwd)"
json="$out/two_ranks.json"
rm -f "$json"

# The comparison: every figure and problem into two_ranks.json. Arguments: the device, the
# learning runs' step count (0: no learning pair, --compare), the tight runs' step count (0:
# as many as the reference logged, at least 2), the JSON's path, a file of what the shell
# found ("problem: ..." lines and key=value figures), then NAME=metrics.jsonl for
# learn_device, learn_reference, tight_device and tight_reference.
compare_py=$(cat <<'PY'
import json, math, os, sys
device, steps, tight_steps, out, facts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
runs = dict(a.split("=", 1) for a in sys.argv[6:])
problems, report = [], {"device": device, "world_size": 2, "steps": steps, "tight_steps": tight_steps,
                        "tolerance": {"tight_max_rel": 1e-4, "learn_first_step_rel": 1e-4}}
if os.path.exists(facts):
    for line in open(facts):
        line = line.rstrip("\n")
        if line.startswith("problem: "):
            problems.append(line[len("problem: "):])
        elif "=" in line:
            k, v = line.split("=", 1)
            try:
                v = json.loads(v)
            except ValueError:
                pass
            report.setdefault("facts", {})[k] = v

def losses(name, n):
    path = runs.get(name)
    if not path or not os.path.exists(path):
        problems.append(f"{name}: no metrics.jsonl ({path or 'not run'})")
        return None
    got = {}
    for line in open(path):
        if not line.strip():
            continue
        row = json.loads(line)
        if "loss" in row:
            got[int(row["step"])] = float(row["loss"])
    if n == 0:
        n = max(2, len(got))
    want = list(range(1, n + 1))
    if sorted(got) != want:
        problems.append(f"{name}: steps logged {sorted(got)[:3]}...{sorted(got)[-3:]} ({len(got)}), expected 1..{n}")
        return None
    vals = [got[k] for k in want]
    if not all(math.isfinite(v) for v in vals):
        problems.append(f"{name}: a loss is not finite: {vals}")
        return None
    report.setdefault("runs", {})[name] = {"losses": vals}
    return vals

def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)

# The learning pair: the losses fall on both sides (the mean of the last quarter of the steps
# at most 0.95 x that of the first quarter), and step 1 (the same forward) agrees.
q = max(1, steps // 4)
ld, lr_ = (losses("learn_device", steps), losses("learn_reference", steps)) if steps else (None, None)
for name, vals in (("learn_device", ld), ("learn_reference", lr_)):
    if vals is None:
        continue
    first, last = sum(vals[:q]) / q, sum(vals[-q:]) / q
    report["runs"][name].update({"first_quarter_mean": first, "last_quarter_mean": last})
    if not last <= 0.95 * first:
        problems.append(f"{name}: the loss did not fall: mean of the first {q} steps {first:.5f}, of the last {q} {last:.5f}")
if ld is not None and lr_ is not None:
    d1 = rel(ld[0], lr_[0])
    report["learn_first_step_rel_diff"] = d1
    report["learn_max_rel_diff"] = max(rel(a, b) for a, b in zip(ld, lr_))
    if d1 > report["tolerance"]["learn_first_step_rel"]:
        problems.append(f"learning runs: step 1's loss {ld[0]:.7f} on {device} against {lr_[0]:.7f} on the CPU "
                        f"(relative {d1:.2e} > {report['tolerance']['learn_first_step_rel']:.0e})")

# The tight pair: every step within the tolerance.
tr = losses("tight_reference", tight_steps)
td = losses("tight_device", len(tr) if tr else tight_steps)
if td is not None and tr is not None:
    diffs = [rel(a, b) for a, b in zip(td, tr)]
    worst = max(range(len(diffs)), key=lambda k: diffs[k])
    report["tight_rel_diffs"] = diffs
    report["tight_max_rel_diff"] = diffs[worst]
    if diffs[worst] > report["tolerance"]["tight_max_rel"]:
        problems.append(f"tight runs (lr 1e-4): step {worst + 1}'s loss {td[worst]:.7f} on {device} against "
                        f"{tr[worst]:.7f} on the CPU (relative {diffs[worst]:.2e} > {report['tolerance']['tight_max_rel']:.0e})")

report["ok"] = not problems
report["problems"] = problems
with open(out, "w") as f:
    json.dump({"ok": report.pop("ok"), "problems": report.pop("problems"), **report}, f, indent=1)
for p in problems:
    print(f"problem: {p}")
print(f"two ranks on {device}: {'ok' if not problems else str(len(problems)) + ' problem(s)'} ({out})")
sys.exit(0 if not problems else 1)
PY
)

if [ ${#compare[@]} -eq 2 ]; then
  "$py" -c "$compare_py" "$device" 0 0 "$json" /dev/null tight_device="${compare[0]}" tight_reference="${compare[1]}"
  exit $?
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/faceshard-two-ranks.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
facts="$work/facts"
: > "$facts"
problem() { echo "problem: $*" >> "$facts"; echo "$me: $*" >&2; }
fact() { echo "$1=$2" >> "$facts"; }

[ -x "$bin/faceshard-train" ] || { problem "no faceshard-train in $bin"; }
if [ "$device" = cuda ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fact gpus "${gpus:-0}"
  [ "${gpus:-0}" -ge 1 ] || problem "--device cuda but nvidia-smi lists no GPU"
fi

if [ -x "$bin/faceshard-train" ]; then
  "$bin/faceshard-synth" --output "$work/data" "${synth_args[@]}" > "$out/logs/synth.log" 2>&1 ||
    problem "faceshard-synth failed (logs/synth.log)"

  # train NAME DEVICE STEPS LR: the demo at world 2 over Gloo into runs/NAME.metrics.jsonl.
  train() {
    local name="$1" dev="$2" n="$3" lr="$4" t0 rc
    t0=$(date +%s.%N)
    # Per-step losses, no verification or TensorBoard (the comparison needs only the
    # losses); fp32 with TF32 off so that the device computes what the CPU does;
    # no warm-up, so that a few dozen steps run at the learning rate asked for; cuDNN's
    # benchmark off (it may pick another algorithm per run, which the tight pair would see).
    FACESHARD_LOG_ALL_RANKS=1 timeout 900 "$home/tools/launch.sh" --nproc 2 --grace-s 20 -- \
      "$bin/faceshard-train" --config "$home/configs/demo.yaml" \
      --set output="$work/$name" --set data.rec="$work/data" \
      --set dist.device="$dev" --set dist.backend=gloo --set dist.timeout_s=120 \
      --set model.sync_bn=true --set loss.sample_rate="$rate" --set data.batch_size="$batch" --set 'data.val_targets=[]' \
      --set train.precision=fp32 --set train.tf32=false --set train.cudnn_benchmark=false \
      --set optim.lr="$lr" --set optim.warmup_epochs=0 \
      --set train.max_steps="$n" --set train.log_every=1 --set train.verify_every=0 \
      --set train.checkpoint_every=0 --set train.tensorboard=false \
      > "$out/logs/$name.log" 2>&1
    rc=$?
    fact "${name}_seconds" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')"
    [ "$rc" = 0 ] || problem "$name: faceshard-train on 2 ranks ($dev) exited with status $rc (logs/$name.log)"
    [ -f "$work/$name/metrics.jsonl" ] && cp "$work/$name/metrics.jsonl" "$out/runs/$name.metrics.jsonl"
    # Both ranks ran on the device asked for, over Gloo.
    local want="cpu"; [ "$dev" = cuda ] && want="cuda:0"
    for r in 0 1; do
      grep -q "^\[rank $r/2\].*job: .*device $want\$" "$out/logs/$name.log" ||
        problem "$name: rank $r's log does not say 'device $want' (logs/$name.log)"
    done
    if [ "$dev" = cuda ]; then
      grep -q "dist.backend gloo: CUDA tensors go over Gloo" "$out/logs/$name.log" ||
        problem "$name: no line saying CUDA tensors go over Gloo (logs/$name.log)"
    fi
    rm -rf "${work:?}/$name"
  }
  demo_lr=$(sed -n 's/^ *lr: *\([0-9.e+-]*\).*/\1/p' "$home/configs/demo.yaml" | head -1)
  fact demo_lr "\"${demo_lr:-?}\""
  train learn_device "$device" "$steps" "${demo_lr:-0.1}"
  train learn_reference cpu "$steps" "${demo_lr:-0.1}"
  train tight_device "$device" "$tight_steps" 1e-4
  train tight_reference cpu "$tight_steps" 1e-4
fi

# The multi-rank tests on the device.
if [ -x "$bin/faceshard_tests" ]; then
  filter='*GlooCuda*'
  "$bin/faceshard_tests" --gtest_list_tests --gtest_filter="$filter" > "$out/logs/tests_list.log" 2>&1
  expected=$(awk '/^[^ ]/ { suite = $1 } /^  [^ ]/ { print suite $1 }' "$out/logs/tests_list.log" | wc -l)
  fact tests_expected "$expected"
  [ "$expected" -ge 10 ] || problem "tests: the filter $filter lists $expected test(s), expected at least 10"
  timeout 600 "$bin/faceshard_tests" --gtest_filter="$filter" --gtest_output="json:$work/gtest.json" \
    > "$out/logs/tests.log" 2>&1
  rc=$?
  if [ -f "$work/gtest.json" ]; then
    cp "$work/gtest.json" "$out/logs/gtest.json"
    read -r ran passed failed skipped < <("$py" - "$work/gtest.json" <<'PY'
import json, sys
ran = passed = failed = skipped = 0
for suite in json.load(open(sys.argv[1])).get("testsuites", []):
    for t in suite.get("testsuite", []):
        ran += 1
        if t.get("failures"):
            failed += 1
        elif t.get("result") in ("SKIPPED", "SUPPRESSED") or t.get("status") == "NOTRUN":
            skipped += 1
        else:
            passed += 1
print(ran, passed, failed, skipped)
PY
)
    fact tests "{\"ran\": ${ran:-0}, \"passed\": ${passed:-0}, \"failed\": ${failed:-0}, \"skipped\": ${skipped:-0}}"
    [ "${ran:-0}" = "$expected" ] || problem "tests: $expected listed, ${ran:-0} in the results"
    [ "${failed:-0}" = 0 ] || problem "tests: ${failed} failed (logs/tests.log)"
    if [ "$device" = cuda ]; then
      [ "${skipped:-0}" = 0 ] || problem "tests: ${skipped} skipped on a GPU machine (logs/tests.log)"
      [ "${passed:-0}" = "$expected" ] || problem "tests: ${passed:-0} of $expected passed"
    else
      [ "${skipped:-0}" = "$expected" ] || problem "tests: ${skipped:-0} of $expected skipped without a GPU (--device cpu)"
    fi
  else
    problem "tests: no results from faceshard_tests (status $rc, logs/tests.log)"
  fi
  [ "$rc" = 0 ] || grep -q "problem: tests:" "$facts" || problem "tests: faceshard_tests exited with status $rc"
else
  problem "no faceshard_tests in $bin"
fi

"$py" -c "$compare_py" "$device" "$steps" "$tight_steps" "$json" "$facts" \
  learn_device="$out/runs/learn_device.metrics.jsonl" learn_reference="$out/runs/learn_reference.metrics.jsonl" \
  tight_device="$out/runs/tight_device.metrics.jsonl" tight_reference="$out/runs/tight_reference.metrics.jsonl"
