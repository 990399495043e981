#!/usr/bin/env bash
# tools/gpu_two_ranks.sh --device cpu: the two-ranks check's plumbing on a machine without a
# GPU. Its JSON must say ok with every figure in place (the learning runs fall, the tight runs
# agree, the *GlooCuda* tests are listed and skip), and its comparison must fail against the
# wrong run: the tight device run against the first steps of the learning reference (same
# data, same first forward, another learning rate).
# usage: gpu_two_ranks_cpu.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export FACESHARD_BUILD_DIR="$(dirname "$bin")" FACESHARD_PYTHON="$py"

t0=$(date +%s)
"$root/tools/gpu_two_ranks.sh" --device cpu --out "$work/out" > "$work/log" 2>&1
rc=$?
cat "$work/log"
[ "$rc" = 0 ] || { tail -n 60 "$work"/out/logs/*.log; fail "gpu_two_ranks.sh --device cpu exited with status $rc"; }
echo "gpu_two_ranks.sh --device cpu took $(( $(date +%s) - t0 )) s"
"$py" - "$work/out/two_ranks.json" <<'PY' || fail "two_ranks.json"
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({k: r[k] for k in ("ok", "problems", "learn_first_step_rel_diff", "tight_max_rel_diff", "facts")}))
assert r["ok"] is True and r["problems"] == [], r["problems"]
assert r["device"] == "cpu" and r["world_size"] == 2
runs = r["runs"]
for name, n in (("learn_device", r["steps"]), ("learn_reference", r["steps"]),
                ("tight_device", r["tight_steps"]), ("tight_reference", r["tight_steps"])):
    assert len(runs[name]["losses"]) == n, (name, runs[name])
for name in ("learn_device", "learn_reference"):
    assert runs[name]["last_quarter_mean"] <= 0.95 * runs[name]["first_quarter_mean"], runs[name]
assert r["tight_max_rel_diff"] <= r["tolerance"]["tight_max_rel"] == 1e-4
assert len(r["tight_rel_diffs"]) == r["tight_steps"]
t = r["facts"]["tests"]
assert t["ran"] == r["facts"]["tests_expected"] >= 10 and t["skipped"] == t["ran"] and t["failed"] == 0, t
PY

# The wrong run: the learning reference's first steps stand in for the tight reference.
head -n "$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["tight_steps"])' "$work/out/two_ranks.json")" \
  "$work/out/runs/learn_reference.metrics.jsonl" > "$work/wrong.jsonl"
"$root/tools/gpu_two_ranks.sh" --device cpu --out "$work/wrong" \
  --compare "$work/out/runs/tight_device.metrics.jsonl" "$work/wrong.jsonl" > "$work/wrong.log" 2>&1
rc=$?
cat "$work/wrong.log"
[ "$rc" = 1 ] || fail "the comparison against the wrong run exited with status $rc, expected 1"
"$py" - "$work/wrong/two_ranks.json" <<'PY' || fail "the wrong run's two_ranks.json"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["ok"] is False, r
assert any(p.startswith("tight runs (lr 1e-4): step ") for p in r["problems"]), r["problems"]
assert r["tight_rel_diffs"][0] <= 1e-4, r["tight_rel_diffs"]   # the same first forward
print("the wrong run is caught:", r["problems"])
PY
# The same pairing the right way round passes in the comparison alone.
"$root/tools/gpu_two_ranks.sh" --device cpu --out "$work/right" --compare \
  "$work/out/runs/tight_device.metrics.jsonl" "$work/out/runs/tight_reference.metrics.jsonl" > /dev/null 2>&1 ||
  fail "--compare of the right runs failed"
echo PASS
