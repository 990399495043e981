#!/usr/bin/env bash
# Runs one fuzz target (libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer) on one core.
# usage: tools/fuzz.sh TARGET SECONDS [--ci] [libFuzzer options...]
#   TARGET: recordio | verification_bin | state_dict_pickle | state_dict_zip | config_yaml | ijb_meta | image_header
#   A long run keeps its corpus in build/fuzz/corpus/TARGET (it grows from run to run),
#   starting from the seeds (build/fuzz/seeds/TARGET, written by the tests) and the
#   regression inputs (tests/fuzz/regressions/TARGET). --ci (what ctest runs): a fixed
#   number of inputs from a fixed random seed, from the seeds and regressions only.
# A crash, leak, timeout or out-of-memory input is saved to build/fuzz/artifacts/TARGET/;
# copy it to tests/fuzz/regressions/TARGET/ once fixed, so the ASan tests replay it.
# Each run appends "date target seconds inputs exit-status" to build/fuzz/runs.log.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${FACESHARD_BUILD_DIR:-$root/build}"
[ $# -ge 2 ] || { sed -n '2,12p' "$0"; exit 2; }
target="$1"; seconds="$2"; shift 2
ci=0
if [ "${1:-}" = "--ci" ]; then ci=1; shift; fi

bin="$build/fuzz/build/fuzz_$target"
if [ ! -x "$bin" ]; then
  [ "$ci" = 1 ] && { echo "fuzz $target: $bin is not built"; exit 1; }
  # A build folder configured without the fuzz targets gets them switched on.
  [ -f "$build/build.ninja" ] && { cmake -DFACESHARD_FUZZ=ON "$build" > /dev/null || exit 1; }
  "$root/tools/build.sh" faceshard_fuzz || exit 1
  [ -x "$bin" ] || { echo "fuzz $target: no such target ($bin)"; exit 2; }
fi
seeds="$build/fuzz/seeds/$target"
if [ ! -d "$seeds" ]; then
  [ "$ci" = 1 ] && { echo "fuzz $target: no seeds in $seeds (the test fuzz.seeds writes them)"; exit 1; }
  "$build/bin/faceshard_tests" --gtest_filter='FuzzSeeds.*' > /dev/null || exit 1
fi
dirs=("$seeds")
[ -d "$root/tests/fuzz/regressions/$target" ] && dirs+=("$root/tests/fuzz/regressions/$target")

artifacts="$build/fuzz/artifacts/$target"
mkdir -p "$artifacts"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ "$ci" = 1 ]; then
  corpus="$work/corpus"
  # About 20 s per target on one core of a CI machine; the time limit only guards a hang.
  case "$target" in
    config_yaml) runs=40000 ;;
    recordio) runs=150000 ;;
    *) runs=200000 ;;
  esac
  limits=(-runs="$runs" -seed=1 -max_total_time=240)
else
  corpus="$build/fuzz/corpus/$target"
  limits=(-max_total_time="$seconds")
fi
mkdir -p "$corpus"
dict=()
[ -f "$root/tests/fuzz/$target.dict" ] && dict=(-dict="$root/tests/fuzz/$target.dict")

export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
start=$(date +%s)
# 2 GB of memory and 10 s per input: beyond either, libFuzzer reports the input.
"$bin" "${limits[@]}" "${dict[@]}" -rss_limit_mb=2048 -malloc_limit_mb=2048 -timeout=10 -max_len=65536 \
  -print_final_stats=1 -artifact_prefix="$artifacts/" "$@" "$corpus" "${dirs[@]}" > "$work/log" 2>&1
rc=$?
secs=$(( $(date +%s) - start ))
inputs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log" | tail -1)
rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$work/log" | tail -1)
mkdir -p "$build/fuzz"
echo "$(date -u +%FT%TZ) $target $secs ${inputs:-0} $rc" >> "$build/fuzz/runs.log"
if [ "$rc" -ne 0 ]; then
  grep -E "ERROR|SUMMARY|invariant|Test unit written|leak" "$work/log" | head -20
  tail -40 "$work/log"
  echo "fuzz $target: FAILED (exit $rc) after ${inputs:-?} inputs in ${secs} s; reproducer in $artifacts/"
  exit 1
fi
echo "fuzz $target: ${inputs:-0} inputs in ${secs} s, peak RSS ${rss:-?} MB, corpus $(ls "$corpus" | wc -l) files, no crash, leak or OOM"
