#!/usr/bin/env bash
# faceshard-bench's step and classifier modes on a tiny job: they run the trainer's own step
# and the classifier, every phase of the step is timed, and every shard size x
# sample rate x precision asked for is reported with its bytes per class.
# usage: bench_modes.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
# Two micro-batches of 4 a step (optim.grad_accumulation): the images a window counts are
# batch x ranks x micro-batches x steps, each factor its own.
OMP_NUM_THREADS=1 "$bin/faceshard-bench" --mode step --network mbf --batch 4 --classes 200 --steps 2 --windows 2 \
  --warmup 1 --set data.num_workers=1 --set optim.grad_accumulation=2 --json "$work/step.json" > "$work/step.log" 2>&1 || { cat "$work/step.log"; fail "step mode"; }
OMP_NUM_THREADS=1 "$bin/faceshard-bench" --mode classifier --classes-per-shard 2000,4000 --sample-rate 1.0,0.5 \
  --precision fp32,bf16 --batch 16 --dim 64 --steps 1 --windows 1 --warmup 1 --json "$work/cls.json" \
  > "$work/cls.log" 2>&1 || { cat "$work/cls.log"; fail "classifier mode"; }
# A --json that cannot be written: one line naming it, a non-zero exit (the measurement is
# not lost silently).
OMP_NUM_THREADS=1 "$bin/faceshard-bench" --mode classifier --classes-per-shard 2000 --sample-rate 1.0 --precision fp32 \
  --batch 16 --dim 64 --steps 1 --windows 1 --warmup 1 --json "$work/no/such/dir/cls.json" > "$work/nojson.log" 2>&1
rc=$?
[ "$rc" -ne 0 ] || { cat "$work/nojson.log"; fail "an unwritable --json was accepted"; }
grep -q "cannot write '$work/no/such/dir/cls.json" "$work/nojson.log" || { cat "$work/nojson.log"; fail "the --json error does not name the file"; }
"$py" - "$work/step.json" "$work/cls.json" <<'PY' || exit 1
import json, sys
step = json.load(open(sys.argv[1]))
assert step["network"] == "mbf" and step["batch_per_rank"] == 4 and step["classes"] == 200, step
split = step["split_ms"]
# Every phase is timed (the data wait may be 0 with a prefetching loader); the step's time is
# their sum. (How the phases compare with the windows' wall clock is a timing, not a test.)
assert split["data"] >= 0 and all(split[k] > 0 for k in ("forward", "backward", "optimizer")), split
assert abs(step["step_ms"] - sum(split.values())) <= 1e-6 * step["step_ms"], (step["step_ms"], split)
# The headline figure: the median timed window's images over its seconds, where each window
# took batch x ranks x micro-batches x steps images (counted from the batches the steps took).
assert step["world_size"] == 1 and step["micro_batches"] == 2 and step["steps_per_window"] == 2, step
windows = step["windows"]
assert len(windows) == 2, windows
for w in windows:
    assert w["images"] == 4 * 1 * 2 * 2, (w, "images of a window: batch 4 x 1 rank x 2 micro-batches x 2 steps")
    assert w["seconds"] > 0, w
rates = sorted(w["images"] / w["seconds"] for w in windows)
assert abs(step["images_per_s"] - rates[len(rates) // 2]) <= 1e-7 * step["images_per_s"], (step["images_per_s"], rates)
assert step["sample_rate"] == 1.0 and step["channels_last"] is True, step
assert step["peak_memory_mb"] > 0, step
# The step runs on the CPU block cache, as faceshard-train does: after warm-up the timed
# steps reuse the blocks of the first one.
cache = step["cpu_cache"]
assert cache["installed"] and cache["limit_bytes"] > 0 and cache["reused"] > 0, cache
assert cache["from_system"] <= cache["reused"] // 10, cache
cls = json.load(open(sys.argv[2]))
runs = cls["runs"]
combos = {(r["classes_per_shard"], r["sample_rate"], r["precision"]) for r in runs}
assert combos == {(c, s, p) for c in (2000, 4000) for s in (1.0, 0.5) for p in ("fp32", "bf16")}, combos
assert all(r["step_ms"] > 0 and r["gemm_ms"] > 0 and r["peak_memory_mb"] > 0 for r in runs), runs
# The floor, from the formula of docs/performance.md written out here: S x d x (4 wb + 2 sb +
# 8) + N x S x 4 x 6 (buffered logits) bytes, S = classes x rate, fp32 centres and state; the
# floor the longer of the GEMMs and bytes / the bandwidth measured in the run.
for r in runs:
    S, N, d = int(r["classes_per_shard"] * r["sample_rate"]), 16, 64
    want = S * d * (4 * 4 + 2 * 4 + 8) + N * S * 4 * 6
    assert r["bytes_per_step"] == want, (r, want)
    bw = r["bandwidth_gbs"] * 1e9
    assert bw > 0, r
    floor = max(r["gemm_ms"], want / bw * 1e3)
    assert abs(r["floor_ms"] - floor) <= 1e-6 * floor, (r, floor)
    assert abs(r["step_over_floor"] - r["step_ms"] / floor) <= 1e-6 * r["step_over_floor"], r
    assert r["chunking"] == "auto", r
# Both shard sizes fit one of the CPU's chunks (8192 rows at d = 64): the same operators a step.
ops = {}
for r in runs:
    ops.setdefault((r["sample_rate"], r["precision"]), set()).add(r["ops_per_step"])
assert all(len(v) == 1 and min(v) > 0 for v in ops.values()), ops
slopes = {(b["sample_rate"], b["precision"]) for b in cls["bytes_per_class"]}
assert slopes == {(s, p) for s in (1.0, 0.5) for p in ("fp32", "bf16")}, slopes
print("step: %.1f images/s, split %s" % (step["images_per_s"], split))
print("classifier bytes per class:", [(b["sample_rate"], b["precision"], round(b["bytes_per_class"])) for b in cls["bytes_per_class"]])
PY
echo "PASS"
