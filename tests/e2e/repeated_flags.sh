#!/usr/bin/env bash
# Every tool refuses a single-valued flag given twice, with one line naming the flag and both
# values and exit status 2, before doing anything (the last value used to win silently:
# `faceshard-verify --model A --model B` evaluated B alone); flags meant to repeat (--bin,
# --set) still take each value.
# usage: repeated_flags.sh BIN_DIR
set -u
bin="$1"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
n=0
refused() {  # FLAG FIRST SECOND -- TOOL ARGS...
  local flag="$1" first="$2" second="$3"; shift 4
  local out rc
  out=$(cd "$work" && "$@" 2>&1 < /dev/null); rc=$?
  [ "$rc" = 2 ] || fail "$(basename "$1") ${*:2}: exit $rc, expected 2: $out"
  [ "$(printf '%s\n' "$out" | wc -l)" = 1 ] || fail "$(basename "$1"): more than one line: $out"
  printf '%s' "$out" | grep -qF -- "$flag is given twice ('$first', then '$second')" ||
    fail "$(basename "$1"): the line does not name $flag and both values: $out"
  n=$((n + 1))
}
refused --model a b -- "$bin/faceshard-verify" --model a --bin x.bin --model b
refused --model a b -- "$bin/faceshard-ijb" --model a --model b
refused --model a b -- "$bin/faceshard-export" --model a --model b
refused --output o1 o2 -- "$bin/faceshard-extract" --output o1 --output o2
refused --run r1 r2 -- "$bin/faceshard-clean" --run r1 --run r2
refused --config a.yaml b.yaml -- "$bin/faceshard-train" --config a.yaml --config b.yaml
refused --config a.yaml b.yaml -- "$bin/faceshard-config" --config=a.yaml --config b.yaml
refused --network r50 r100 -- "$bin/faceshard-plan" --network r50 --network r100
refused --pairs 10 20 -- "$bin/faceshard-pack" pairs in out.bin --pairs 10 --pairs 20
refused --seed 1 2 -- "$bin/faceshard-synth" --seed 1 --output o --seed 2
refused --mode step data -- "$bin/faceshard-bench" --mode step --set a=1 --set b=2 --mode data
refused --head arcface cosface -- "$bin/faceshard-head" --head arcface --head cosface
refused --embedding 128 512 -- "$bin/faceshard-flops" --embedding 128 --embedding 512
refused --rounds 3 4 -- "$bin/faceshard-dist-check" --rounds 3 --rounds 4
# Repeatable flags: two --bin (verify) and two --set (train) reach the next check.
out=$("$bin/faceshard-verify" --bin a.bin --bin b.bin 2>&1); [ $? = 2 ] && [[ "$out" == *"--model is required"* ]] ||
  fail "faceshard-verify with two --bin: $out"
out=$("$bin/faceshard-train" --set optim.lr=0.1 --set optim.lr=0.2 2>&1); [ $? = 2 ] && [[ "$out" == *"--config FILE is required"* ]] ||
  fail "faceshard-train with two --set: $out"
echo "PASS: $n tools refuse a repeated single-valued flag; --bin and --set repeat"
