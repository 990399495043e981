#!/usr/bin/env bash
# The GPU check: everything a GPU machine can tell about faceshard, from an unpacked bundle
# (tools/bundle.sh) on a machine that has PyTorch, in calls that each fit one command of a
# short GPU lease (docs/gpu.md gives the exact commands and which calls make which lease):
#
#   tar -xJf faceshard-*.tar.xz && faceshard-*/tools/gpu_check.sh RESULTS_DIR --sections LIST --budget-s S
#   tools/gpu_check.sh --plan [DOC]     (here, beforehand: each documented call's expected seconds)
#
#   env         nvidia-smi, driver, torch / CUDA / cuDNN / NCCL versions
#   tests       every test that needs a GPU: the test binary's own list under the GoogleTest
#               filter *Cuda* (--gtest_list_tests), run in one process (a process each would
#               pay LibTorch CUDA's load and cuDNN's start-up every time) under a time limit
#               per test: a test that hangs or crashes is reported as such and the tests after
#               it run again in a new process; every listed test must run and pass, and a
#               committed minimum of names (gpu_check_report.py) must be listed
#   train       the demo training on the GPU (NCCL, world 1), bf16: resumed from a checkpoint
#               in the middle of an epoch written in the background while two more steps ran
#               (the run's own later checkpoint removed), beside the same run uninterrupted (the
#               resumed run must say "resumed from ... at step N" and its losses continue the
#               uninterrupted run's); fp16 with loss scaling; the export to ONNX and
#               faceshard-verify on the exported model; loss and verification accuracy
#   step        faceshard-bench --mode step for r50 (batch 256) and mbf (batch 512) at sample
#               rate 0.1 over 1M classes, eager and with the backbone's CUDA graphs (a graph
#               cell counts only if its graphs were captured, and its losses must equal its
#               eager cell's), beside arcface_torch's own step on the same card
#               (tools/arcface_torch_step.py); then, as the budget allows, fp16, the unfused
#               optimiser, ATen's PReLU, a JPEG .rec through the loader, NCHW
#   classifier  faceshard-bench --mode classifier at 1M and 10M classes: bytes per class from
#               the CUDA allocator's peak, beside faceshard-plan's figure; then, as the budget
#               allows, arcface_torch's PartialFC_V2 alone at the same cells
#               (tools/arcface_torch_step.py --classifier-only)
#   capacity    the largest class count faceshard-plan finds for this GPU (r50, bf16, batch
#               128, bf16 centres and state, streamed) trained for a few steps; the
#               classifier's storage and passes (optim.fc_weight_dtype, loss.logits) with
#               fp32/bf16 centres and buffered/streamed logits; then, as the budget allows,
#               batch 8192 at rate 0.2, 200k classes beside the GEMMs, the r50 step with
#               buffered and streamed logits
#   loader      the data loader on a synthetic JPEG .rec with 8 and 16 workers
#   tworanks    tools/gpu_two_ranks.sh (two ranks: its two_ranks.json must say "ok"), when
#               the bundle has it; the report says so when it does not
#   checkpoint  tools/checkpoint_stall.py: one rank, 2M classes, r50, checkpoints written
#               synchronously and in the background: how long the training waited at each
#               (staging on a side stream) beside the write, and the step time during a write,
#               against their goals (the wait at least 20x shorter, the steps within 10%)
#
# RESULTS_DIR receives results.json (every figure, and "problems"), summary.txt (the table
# printed at the end) and logs.tar.gz (each item's log and raw JSON), rewritten after each
# section, so that a call cut short keeps what it measured. Each item (the tests, a training
# run, a step cell, a bench) runs under its own time limit; a failing item is reported and
# the others still run. The required items of every section asked run first, then the
# optional ones while the budget lasts, so that optional work never starves required work.
# Before anything runs the check writes the required items it plans into its result
# (check.json's "planned"; the report requires each, with its JSON), and it refuses to start
# (exit 1, the reason in results.json) when the budget would cut a required item's time limit
# below its own. The exit status is non-zero when anything is a problem: an item failed, a
# required item was not started or left no result, zero tests ran, a listed GPU test did not
# run or pass, a graph cell was not captured, the resume did not continue the run (the
# report's list, gpu_check_report.py).
#
# Options: --device cuda|cpu (cpu: the plumbing at tiny sizes, for a machine without a GPU),
# --tiny (small sizes on any device), --sections LIST (comma-separated; default
# env,tests,train,step,loader,tworanks: classifier, capacity and checkpoint run when named),
# --budget-s S (default 420; 0: none): no item starts once S seconds have passed since the
# check began; an item not started is reported as skipped (a problem where it is required),
# and no item runs past S + 40 seconds (its time limit is cut to what is left); --dry-run:
# print the items the other options would run (name, required or optional, time limit, the
# JSON it leaves, section), in the order they would run, and run nothing; --plan [DOC]: the
# calls of DOC (default docs/gpu.md) with each item's seconds from the newest GPU results
# under docs/benchmarks/, each call's expected and longest seconds and each lease's sum;
# exit 1 with one line when a call or a lease does not fit.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
home="$(dirname "$here")"
usage() { sed -n '2,/^# exit 1 with one line when a call or a lease/p' "$0" | sed 's/^# \{0,1\}//'; }

out=""; device=cuda; tiny=0; sections="env,tests,train,step,loader,tworanks"; budget=420; dry=0; plan=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="${2:-}"; shift 2 ;;
    --tiny) tiny=1; shift ;;
    --sections) sections="${2:-}"; shift 2 ;;
    --budget-s) budget="${2:-}"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --plan) plan="$home/docs/gpu.md"; shift
            if [ $# -gt 0 ] && [[ "$1" != -* ]]; then plan="$1"; shift; fi ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_check.sh: error: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "gpu_check.sh: error: one results folder, got '$out' and '$1'" >&2; exit 2; }
       out="$1"; shift ;;
  esac
done
if [ -n "$plan" ]; then
  # The plan of the documented calls: the items each would run (this script's --dry-run),
  # their seconds from the newest GPU results, against each call's timeout and each lease.
  py="${FACESHARD_PYTHON:-$home/.venv/bin/python}"; [ -x "$py" ] || py=python3
  exec "$py" "$here/gpu_check_report.py" --plan "$plan" --check "$0" --benchmarks "$home/docs/benchmarks"
fi
[ -n "$out" ] || [ "$dry" = 1 ] || { echo "gpu_check.sh: error: no results folder given (see --help)" >&2; exit 2; }
case "$device" in cuda|cpu) ;; *) echo "gpu_check.sh: error: --device must be cuda or cpu, got '$device'" >&2; exit 2 ;; esac
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: error: --budget-s must be a whole number of seconds, got '$budget'" >&2; exit 2; }
known="env tests train step classifier capacity loader tworanks checkpoint"
[ -n "$sections" ] || { echo "gpu_check.sh: error: --sections is empty (known: ${known// /,})" >&2; exit 2; }
for s in ${sections//,/ }; do
  [[ " $known " == *" $s "* ]] || { echo "gpu_check.sh: error: --sections: unknown section '$s' (known: ${known// /,})" >&2; exit 2; }
done
[ "$device" = cpu ] && tiny=1

# Where the binaries are: an unpacked bundle (env.sh beside tools/) or a source checkout.
if [ -f "$home/env.sh" ] && [ "$dry" = 0 ]; then
  # shellcheck disable=SC1091
  source "$home/env.sh" || exit 1
  bin="$home/bin"
  py="${FACESHARD_PYTHON:-python3}"
elif [ -f "$home/env.sh" ]; then
  bin="$home/bin"; py="${FACESHARD_PYTHON:-python3}"
else
  bin="${FACESHARD_BUILD_DIR:-$home/build}/bin"
  py="${FACESHARD_PYTHON:-$home/.venv/bin/python}"
fi
[ "$dry" = 1 ] || [ -x "$bin/faceshard-train" ] || { echo "gpu_check.sh: error: no faceshard-train in $bin" >&2; exit 1; }
configs="$home/configs"

work=$(mktemp -d "${TMPDIR:-/tmp}/faceshard-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/logs" "$work/json"
if [ "$dry" = 0 ]; then
  mkdir -p "$out" || exit 1
  out="$(cd "$out" && pwd)"
fi
t_start=$(date +%s)
# The grace after the budget: an item started just before the budget ran out may run this
# much longer (a step cell takes 10-30 s on a GPU), so that the call ends by S + 40 s.
grace=40
status="$work/json/status.tsv"
: > "$status"

free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
elapsed() { echo $(( $(date +%s) - t_start )); }
# Seconds left of the budget (a large number without one); negative once it is spent.
budget_left() {
  if [ "$budget" -eq 0 ]; then echo 1000000; else echo $(( budget - ($(date +%s) - t_start) )); fi
}
# The sections run twice: the required items of every section asked first ("required"), then
# the optional ones ("optional"), so that the budget is spent on optional work only once all
# the required work has run. A section's code runs in both passes; item() runs each item in
# its own pass and, in the other, stands in for it (an optional item is left for later; a
# required one answers with the exit status it had).
phase=required
sec=""
declare -A rc_of=()
ran_since_report=0
# item NEED NAME LIMIT CMD...: the command's output to logs/NAME.log; its status, seconds
# and NEED (required or optional) to status.tsv. Not started once the budget is spent: then
# "skipped" (exit status 125 to the caller). The JSON the item leaves is the path after its
# --json, or $ITEM_JSON. With --dry-run: one line of the plan, and nothing run.
item() {
  local need="$1" name="$2" limit="$3"; shift 3
  if [ "$need" != "$phase" ]; then
    [ "$need" = optional ] && return 126
    return "${rc_of[$name]:-125}"
  fi
  if [ "$dry" = 1 ]; then
    local json="${ITEM_JSON:-}" prev=""
    for a in "$@"; do [ "$prev" = --json ] && json="$(basename "$a")"; prev="$a"; done
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$need" "$limit" "${json:--}" "$sec"
    rc_of[$name]=0
    return 0
  fi
  ran_since_report=1
  local left; left=$(budget_left)
  if [ "$left" -le 0 ]; then
    printf '%s\tskipped\t0\t%s\n' "$name" "$need" >> "$status"
    echo "[gpu_check $(elapsed)s] $name: not started, the budget of ${budget} s is spent ($need)" >&2
    rc_of[$name]=125
    return 125
  fi
  [ $((left + grace)) -lt "$limit" ] && limit=$((left + grace))
  local t0; t0=$(date +%s.%N)
  echo "[gpu_check $(elapsed)s] $name" >&2
  GPU_CHECK_ITEM_LIMIT_S="$limit" MASTER_PORT=$(free_port) timeout -k 10 "$limit" "$@" > "$work/logs/$name.log" 2>&1
  local rc=$?
  local dt; dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$need" >> "$status"
  [ "$rc" -eq 0 ] || { echo "[gpu_check] $name failed (exit $rc$([ "$rc" -ge 124 ] && [ "$rc" -le 137 ] && echo ", limit ${limit} s")): $(tail -n 3 "$work/logs/$name.log" | tr '\n' ' ')" >&2; }
  rc_of[$name]=$rc
  return "$rc"
}
run() { item required "$@"; }       # what the check cannot pass without
try_run() { item optional "$@"; }   # what the budget may leave out
want() { [[ ",$sections," == *",$1,"* ]]; }
# The report so far, after each section that ran something: a check cut short still leaves
# what it measured.
report() {
  [ "$dry" = 0 ] && [ "$ran_since_report" = 1 ] || return 0
  ran_since_report=0
  tar -C "$work" -czf "$out/logs.tar.gz" logs json 2>/dev/null
  "$py" "$here/gpu_check_report.py" "$work/json" "$out/results.json" --device "$device" > "$out/summary.txt" 2>&1
}

# Sizes: the real check, or the plumbing at tiny sizes. Each item's time limit is the same at
# both sizes: it bounds a hang on a GPU, and the plan (--plan) and the check's own refusal
# judge the documented budgets against it.
if [ "$tiny" = 1 ]; then
  # The demo run to step 5, resumed from its step-3 checkpoint to 6, beside the same 6 steps uninterrupted.
  train_stop=3; train_full=6; train_set=(--set train.max_steps=6 --set train.log_every=1 --set train.verify_every=3)
  # The step cells' two networks are both MobileFaceNet at one block per stage, batch 8.
  declare -A cell_net=([r50]="mbf_small 8" [mbf]="mbf_small 8"); cell_prec=fp32
  step_classes=2000; jpeg_ids=20; jpeg_images=10
  declare -A at_for=([mbf_small]="mbf 8 fp32")
  step_args=(--classes "$step_classes" --sample-rate 0.1 --steps 2 --windows 2 --warmup 1)
  at_args=(--classes 2000 --sample-rate 0.1 --steps 2 --windows 2 --warmup 1)
  fc_classes="2000,20000"; fc_args=(--batch 16 --steps 1 --windows 1 --warmup 1)
  loader_args=(--workers 1,2 --batch 32 --identities 20 --images-per-identity 10 --epochs 1)
  cap_classes="2000,4000"; cap_gathered="2000,4000"; cap_gathered_batch=64; cap_200k=2000
  cap_args=(--steps 1 --windows 1 --warmup 1); cap_step=(--classes 2000 --steps 2 --windows 1 --warmup 1)
  cap_net=mbf_small; cap_batch=8
  ck_args=(--classes 2000 --backbone mbf_small --batch 8 --every 3 --steps 9 --set dist.device=cpu)
  tests_filter="*Cuda*:LossScaler.*"
else
  # Resumed from step 37 (the 7th batch of the second epoch: a resume inside an epoch; the
  # first run went on to 39) to the end (62), beside the same run uninterrupted to step 47.
  train_stop=37; train_full=47; train_set=(--set train.log_every=1)
  declare -A cell_net=([r50]="r50 256" [mbf]="mbf 512"); cell_prec=bf16
  step_classes=1000000; jpeg_ids=1000; jpeg_images=20
  # arcface_torch trains in fp16 (its configs' fp16: True): its cell beside both precisions.
  declare -A at_for=([r50]="r50 256 fp16" [mbf]="mbf 512 fp16")
  step_args=(--classes "$step_classes" --sample-rate 0.1 --steps 10 --windows 3 --warmup 3)
  at_args=(--classes 1000000 --sample-rate 0.1 --steps 10 --windows 3 --warmup 3)
  fc_classes="1000000,10000000"; fc_args=(--batch 128 --steps 3 --windows 2 --warmup 1)
  loader_args=(--workers 8,16 --batch 256 --identities 1000 --images-per-identity 20 --epochs 2)
  cap_classes="1000000,2000000"; cap_gathered="500000,1000000"; cap_gathered_batch=8192; cap_200k=200000
  cap_args=(--steps 3 --windows 2 --warmup 1); cap_step=(--classes 1000000 --steps 10 --windows 2 --warmup 3)
  cap_net=r50; cap_batch=128
  # 2M classes a rank, r50 at batch 128, bf16: about 4 GB a checkpoint; 20 steps between
  # checkpoints, so that each background write has steps to overlap.
  ck_args=(--classes 2000000 --backbone r50 --batch 128 --every 20 --steps 60 --set dist.device=cuda
           --set train.precision=bf16 --set data.num_workers=4)
  # The multi-rank *GlooCuda* tests run in the tworanks section (tools/gpu_two_ranks.sh).
  tests_filter="*Cuda*:-*GlooCuda*"
fi
# The step cells, one list for both sizes: NEED NETWORK VARIANT, where NETWORK names one of
# the two networks sized above (r50 at batch 256 and mbf at 512 in bf16 on a GPU; both
# mbf_small at batch 8 in fp32 at tiny sizes: a cell that comes out the same as one before
# runs once) and VARIANT is base, graph (train.cuda_graph=true: the backbone's CUDA graphs
# replayed), fp16, unfused (optim.fused=false: the per-parameter optimiser and DDP's bucket
# copies, the fused optimiser's contribution), jpeg (a synthetic JPEG .rec through the loader,
# decoding and augmentation, instead of fixed pixels), atenprelu (model.prelu_kernel=false:
# ATen's PReLU backward) or nchw. fp16 and atenprelu run on a GPU only (fp16 autocast and the
# PReLU kernel are CUDA's). The base and graph cells and arcface_torch's are what the step
# section is for; the others fill what the budget leaves, most telling first.
step_cells=("required r50 base" "required r50 graph" "required mbf base" "required mbf graph"
            "optional r50 fp16" "optional mbf fp16" "optional r50 unfused" "optional mbf unfused"
            "optional r50 jpeg" "optional mbf jpeg" "optional r50 atenprelu" "optional mbf atenprelu"
            "optional r50 nchw")
# Time limits (seconds): each bounds a hang at about twice what the item takes on an H100 or
# H200 (docs/benchmarks/); a required item's limit must fit its call's budget + 40 s.
test_limit=90        # one GPU test (the longest, the graphed r50 steps, takes about 30 s)
tests_limit=240      # the GPU tests' process(es): a hang costs test_limit, then the rest rerun
train_limit=120      # a demo training run (37 steps: 21 s on an H200)
step_limit=120       # a step cell (10-30 s)

# ---------------------------------------------------------------- env
env_py=$(cat <<'PY'
import json, os, platform, sys, torch
d = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
     "python": platform.python_version(), "cpus": os.cpu_count(), "gpus": []}
if torch.cuda.is_available():
    d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        d["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                          "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
with open(sys.argv[1], "w") as f:
    f.write(json.dumps(d) + "\n")
PY
)
section_env() {
  if [ "$device" = cuda ] && [ "$dry" = 0 ] && [ "$phase" = required ]; then
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm --format=csv,noheader \
      > "$work/json/nvidia-smi.csv" 2>&1
    timeout 30 nvidia-smi > "$work/logs/nvidia-smi.txt" 2>&1
  fi
  ITEM_JSON=env.json run env 60 "$py" -c "$env_py" "$work/json/env.json"
  run tools_load 60 "$bin/faceshard-config" --help
}

# ---------------------------------------------------------------- tests
section_tests() {
  # The GPU tests this build has: the binary's own list under the filter (a DISABLED_ test
  # is not run by the filter, so it is not expected either).
  run tests_list 60 "$bin/faceshard_tests" --gtest_list_tests --gtest_filter="$tests_filter"
  if [ "$dry" = 0 ]; then
    awk '/^[^ ]/ { suite = ($1 ~ /\.$/) ? $1 : ""; next }
         /^  [^ ]/ && suite != "" { if (suite !~ /^DISABLED_/ && $1 !~ /^DISABLED_/) print suite $1 }' \
      "$work/logs/tests_list.log" > "$work/json/gtest_expected.txt" 2>/dev/null
    mkdir -p "$work/json/gtest"
  fi
  # All of them in one process, each under test_limit (gpu_check_report.py --run-tests: a
  # test that hangs or crashes gets a failed result naming that, and the tests after it run
  # again in a new process); each process's GoogleTest JSON in json/gtest/.
  run tests "$tests_limit" "$py" "$here/gpu_check_report.py" --run-tests "$bin/faceshard_tests" \
    --list "$work/json/gtest_expected.txt" --out "$work/json/gtest" --test-limit-s "$test_limit"
  report
}

# ---------------------------------------------------------------- train
section_train() {
  data="$work/data"
  run train_data 60 "$bin/faceshard-synth" --output "$data"
  common=(--config "$configs/demo.yaml" --set data.rec="$data" --set dist.device="$device" --set data.batch_size=64
          --set data.num_workers=4 --set train.tensorboard=false "${train_set[@]}")
  # bf16: resumed from a checkpoint written while the training went on, beside the same run
  # uninterrupted (the same config, its own output): the first run goes two steps past its
  # checkpoint at train_stop (written in the background while those steps ran, staged on a
  # side stream on a GPU), its own last checkpoint is removed, and --resume takes the one of
  # train_stop. The resume is judged by its log line and by its losses.
  local r="$work/run_bf16" full="$work/run_bf16_full"
  bf16=("${common[@]}" --set train.precision=bf16 --set train.checkpoint_every="$train_stop")
  run train_bf16_part1 "$train_limit" "$bin/faceshard-train" "${bf16[@]}" --set output="$r" \
    --set train.max_steps="$((train_stop + 2))"
  if [ "$dry" = 0 ] && [ "$phase" = required ]; then
    rm -rf "$r/checkpoints/step_$(printf '%08d' $((train_stop + 2)))"
  fi
  run train_bf16_resume "$train_limit" "$bin/faceshard-train" "${bf16[@]}" --set output="$r" --resume
  run train_bf16_full "$train_limit" "$bin/faceshard-train" "${bf16[@]}" --set output="$full" --set train.max_steps="$train_full"
  run export_bf16 60 "$bin/faceshard-export" --model "$r" --onnx "$r/model.onnx"
  run verify_bf16 60 "$bin/faceshard-verify" --model "$r" --bin "$data/synth.bin" --device "$device" \
    --json "$work/json/verify_bf16.json"
  if [ "$dry" = 0 ] && [ "$phase" = required ]; then
    cp "$r/metrics.jsonl" "$work/json/train_bf16_metrics.jsonl" 2>/dev/null
    cp "$full/metrics.jsonl" "$work/json/train_bf16_full_metrics.jsonl" 2>/dev/null
    cp "$work/logs/train_bf16_resume.log" "$work/json/train_bf16_resume.log" 2>/dev/null
    printf '{"precision": "bf16", "stop_step": %s, "full_steps": %s}\n' "$train_stop" "$train_full" > "$work/json/train_resume.json"
    [ -f "$r/model.onnx" ] && stat -c '%s' "$r/model.onnx" > "$work/json/export_bf16_bytes.txt"
  fi
  # fp16 with loss scaling (CUDA's: fp16 autocast is the GPU's), as the budget allows.
  if [ "$device" = cuda ]; then
    r="$work/run_fp16"
    try_run train_fp16 "$train_limit" "$bin/faceshard-train" "${common[@]}" --set output="$r" --set train.precision=fp16 &&
      { [ "$dry" = 1 ] || cp "$r/metrics.jsonl" "$work/json/train_fp16_metrics.jsonl"; } &&
      try_run export_fp16 60 "$bin/faceshard-export" --model "$r" --onnx "$r/model.onnx" &&
      { [ "$dry" = 1 ] || stat -c '%s' "$r/model.onnx" > "$work/json/export_fp16_bytes.txt"; } &&
      try_run verify_fp16 60 "$bin/faceshard-verify" --model "$r" --bin "$data/synth.bin" --device "$device" \
        --json "$work/json/verify_fp16.json"
  fi
  report
}

# ---------------------------------------------------------------- step
declare -A at_done=() cell_done=()
step_cell() {
  local need="$1" key="$2" variant="$3" net batch prec="$cell_prec" layout=cl
  read -r net batch <<< "${cell_net[$key]}"
  case "$variant" in
    fp16|atenprelu) [ "$device" = cuda ] || return 0 ;;
  esac
  case "$variant" in
    base) variant="" ;;
    fp16) prec=fp16; variant="" ;;
    nchw) layout=nchw; variant="" ;;
  esac
  local name="step_faceshard_${net}_${batch}_${prec}_${layout}${variant:+_$variant}"
  [ -z "${cell_done[$name]:-}" ] || return 0
  cell_done[$name]=1
  # arcface_torch's step for this cell's network first (once), then faceshard's cells beside it.
  local at="${at_for[$net]:-}"
  if [ -n "$at" ] && [ -z "${at_done[$at]:-}" ]; then
    at_done[$at]=1
    local anet abatch aprec
    read -r anet abatch aprec <<< "$at"
    item "$need" "step_arcface_torch_${anet}_${abatch}_${aprec}" "$step_limit" "$py" -m torch.distributed.run \
      --standalone --nproc_per_node 1 "$here/arcface_torch_step.py" --device "$device" --network "$anet" \
      --batch "$abatch" --precision "$aprec" "${at_args[@]}" \
      --json "$work/json/step_arcface_torch_${anet}_${abatch}_${aprec}.json"
  fi
  local cl=true; [ "$layout" = nchw ] && cl=false
  local extra=()
  case "$variant" in
    unfused) extra=(--set optim.fused=false) ;;
    atenprelu) extra=(--set model.prelu_kernel=false) ;;
    graph) extra=(--set train.cuda_graph=true) ;;
    jpeg)
      if [ -z "${cell_done[jpeg_data]:-}" ]; then
        cell_done[jpeg_data]=1
        item "$need" jpeg_data 120 "$bin/faceshard-synth" --output "$work/jpeg" --identities "$jpeg_ids" \
          --images "$jpeg_images" --pairs 0
      fi
      extra=(--set data.rec="$work/jpeg" --set data.spare_classes=$((step_classes - jpeg_ids)) --set data.num_workers=14) ;;
  esac
  item "$need" "$name" "$step_limit" "$bin/faceshard-bench" --mode step --device "$device" \
    --network "$net" --batch "$batch" --precision "$prec" "${step_args[@]}" --set model.channels_last=$cl \
    --set data.num_workers=8 "${extra[@]}" --json "$work/json/$name.json"
  report
}
section_step() {
  at_done=(); cell_done=()
  local c
  for c in "${step_cells[@]}"; do
    # shellcheck disable=SC2086
    step_cell $c
  done
}

# ---------------------------------------------------------------- tworanks
section_tworanks() {
  if [ -f "$here/gpu_two_ranks.sh" ]; then
    ITEM_JSON=two_ranks.json run tworanks 240 bash "$here/gpu_two_ranks.sh" --device "$device" --out "$work/tworanks"
    [ "$dry" = 1 ] || cp "$work/tworanks/two_ranks.json" "$work/json/two_ranks.json" 2>/dev/null
  elif [ "$dry" = 0 ] && [ "$phase" = required ]; then
    # Not in this build: said in the report, not a failed check.
    printf 'tworanks\tabsent\t0\toptional\n' >> "$status"
    ran_since_report=1
    echo "[gpu_check $(elapsed)s] tworanks: no $here/gpu_two_ranks.sh in this build; not run" >&2
  fi
  report
}

# ---------------------------------------------------------------- classifier
section_classifier() {
  run classifier 240 "$bin/faceshard-bench" --mode classifier --device "$device" --classes-per-shard "$fc_classes" \
    --sample-rate 1.0,0.1 "${fc_args[@]}" --json "$work/json/classifier.json"
  local batch rate cls
  batch=$(printf '%s\n' "${fc_args[@]}" | awk 'p {print; exit} /^--batch$/ {p=1}')
  for rate in 1.0 0.1; do
    for cls in ${fc_classes//,/ }; do
      run "plan_${cls}_${rate}" 60 "$bin/faceshard-plan" --classes "$cls" --batch "$batch" --sample-rate "$rate" \
        --json "$work/json/plan_${cls}_${rate}.json"
    done
  done
  # arcface_torch's classifier alone at the same cells (PartialFC_V2 and train_v2's SGD, fp16
  # as its configs: the loss scaled, the GEMMs fp32), as the budget allows: the item's limit is
  # cut to the budget as item() cuts it, and no cell starts that would end within 20 s of that
  # limit (guessed from the cell before), so the script ends with what it measured. A cell out
  # of memory (10M classes at rate 1.0 on an 80 GB card) is reported as not run.
  local at_limit=90 left at_cells
  left=$(budget_left)
  [ $((left + grace)) -lt "$at_limit" ] && at_limit=$((left + grace))
  [ "$at_limit" -ge 1 ] || at_limit=1
  at_cells=$((at_limit - 20)); [ "$at_cells" -ge 1 ] || at_cells=1
  try_run arcface_classifier "$at_limit" "$py" -m torch.distributed.run --standalone --nproc_per_node 1 \
    "$here/arcface_torch_step.py" --classifier-only --device "$device" --classes-per-shard "$fc_classes" \
    --sample-rate 1.0,0.1 "${fc_args[@]}" --time-limit-s "$at_cells" --json "$work/json/arcface_classifier.json"
  report
}

# ---------------------------------------------------------------- capacity
section_capacity() {
  # The largest class count for this device, planned and then trained: the memory CUDA lets
  # a process allocate (torch's total_memory, less than nvidia-smi's figure), with 3 GiB
  # kept for what the plan does not count: the CUDA context and libraries (1.48 GiB outside
  # PyTorch's allocator on an H100), cuDNN's benchmark workspaces and cuBLAS's (inside it),
  # the classifier's chunk temporaries and fragmentation. (With 2 GiB an H100 ran out of
  # memory 0.5 GiB past the plan.) First: it is what only a GPU can tell.
  local mem="" reserve need largest
  if [ "$device" = cuda ] && [ "$dry" = 0 ]; then
    mem="$("$py" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory)' 2>/dev/null)B"
  fi
  [ "$mem" != B ] && [ -n "$mem" ] || mem=4GiB
  # A plan that does not run is tried once more with 1 GiB more reserve: either way the log
  # says what the card needs beyond the plan (the first try's failure stays a problem).
  for reserve in 3 4; do
    need=required; [ "$reserve" = 4 ] && need=optional
    plan=("$bin/faceshard-plan" --network "$cap_net" --precision bf16 --batch "$cap_batch" --fc-weight-dtype bf16
          --fc-state-dtype bf16 --logits streamed --device-memory "$mem" --reserve "${reserve}GiB")
    item "$need" "cap_plan_${reserve}GiB" 60 "${plan[@]}" --json "$work/json/cap_plan_${reserve}GiB.json"
    largest=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["max_classes"])' \
      "$work/json/cap_plan_${reserve}GiB.json" 2>/dev/null)
    [ "$dry" = 1 ] && largest=1
    [ -n "$largest" ] && [ "$largest" -gt 0 ] || break
    [ "$tiny" = 1 ] && largest=5000
    item "$need" "cap_largest_${reserve}GiB" 180 "$bin/faceshard-bench" --mode step --device "$device" \
      --network "$cap_net" --batch "$cap_batch" --precision bf16 --classes "$largest" --sample-rate 1.0 --steps 2 \
      --windows 1 --warmup 1 --set optim.fc_weight_dtype=bf16 --set optim.fc_state_dtype=bf16 \
      --set loss.logits=streamed --set data.num_workers=8 --json "$work/json/cap_largest_${reserve}GiB.json" && break
  done
  report
  fc_bench=("$bin/faceshard-bench" --mode classifier --device "$device" --precision bf16 --fc-state-dtype bf16)
  run cap_storage 180 "${fc_bench[@]}" --classes-per-shard "$cap_classes" --sample-rate 1.0,0.1 --batch 128 \
    --fc-weight-dtype fp32,bf16 --logits buffer,streamed "${cap_args[@]}" --json "$work/json/cap_storage.json"
  report
  try_run cap_gathered 120 "${fc_bench[@]}" --classes-per-shard "$cap_gathered" --sample-rate 0.2 \
    --batch "$cap_gathered_batch" --fc-weight-dtype bf16 --logits buffer,streamed "${cap_args[@]}" \
    --json "$work/json/cap_gathered.json"
  try_run cap_200k 120 "${fc_bench[@]}" --classes-per-shard "$cap_200k" --sample-rate 1.0 --batch 128 \
    --fc-weight-dtype fp32,bf16 --logits buffer,streamed --steps 10 --windows 3 --warmup 2 --json "$work/json/cap_200k.json"
  report
  local logits
  for logits in buffer streamed; do
    try_run "cap_step_r50_${logits}" 120 "$bin/faceshard-bench" --mode step --device "$device" --network "$cap_net" \
      --batch 256 --precision bf16 --sample-rate 0.1 "${cap_step[@]}" --set loss.logits=$logits \
      --set data.num_workers=8 --json "$work/json/cap_step_${logits}.json"
  done
  report
}

# ---------------------------------------------------------------- loader
section_loader() {
  run loader 120 "$bin/faceshard-bench" --mode data "${loader_args[@]}" --json "$work/json/loader.json"
  report
}

# ---------------------------------------------------------------- checkpoint
section_checkpoint() {
  run checkpoint_stall 240 "$py" "$here/checkpoint_stall.py" --bin "$bin" --config "$configs/base.yaml" \
    --output "$work/checkpoint" "${ck_args[@]}" --json "$work/json/checkpoint_stall.json"
  if [ "$dry" = 0 ]; then
    rm -rf "$work/checkpoint"/off "$work/checkpoint"/on  # the checkpoints themselves (GBs)
    cp "$work/checkpoint"/*.log "$work/logs/" 2>/dev/null
  fi
  report
}

# ---------------------------------------------------------------- the two passes
# The order of the sections in each pass: what only a GPU can tell and what the most depends
# on first (the capacity run before the classifier's and the two ranks').
order="env tests train step loader capacity checkpoint classifier tworanks"
run_sections() {
  for phase in required optional; do
    for sec in $order; do
      want "$sec" && "section_$sec"
    done
  done
  sec=""
}

if [ "$dry" = 1 ]; then
  run_sections
  exit 0
fi

# Before anything runs: the items this call plans (the same script, --dry-run), written into
# its own result, and a required item whose time limit the budget would cut below its own is
# a problem now rather than a kill later. Then the check refuses to start: the call's
# seconds are better spent on a corrected command.
dry_args=(--dry-run --device "$device" --sections "$sections" --budget-s "$budget")
[ "$tiny" = 1 ] && dry_args+=(--tiny)
bash "$0" "${dry_args[@]}" > "$work/json/planned.tsv" 2> "$work/logs/planned.log" ||
  { echo "gpu_check.sh: error: the plan of this call failed: $(tail -n 3 "$work/logs/planned.log")" >&2; exit 1; }
"$py" - "$work/json/planned.tsv" "$work/json/check.json" "$sections" "$device" "$tiny" "$budget" "$grace" <<'PY'
import json, sys
planned_tsv, check, sections, device, tiny, budget, grace = sys.argv[1:8]
budget, grace = int(budget), int(grace)
planned, problems = [], []
for line in open(planned_tsv):
    name, need, limit, js, sec = line.rstrip("\n").split("\t")
    planned.append({"name": name, "need": need, "limit_s": int(limit), "json": None if js == "-" else js, "section": sec})
    if need == "required" and budget and int(limit) > budget + grace:
        problems.append(f"{name}: a required item with a time limit of {limit} s, which --budget-s {budget} would cut "
                        f"to {budget + grace} s (its limit needs --budget-s {int(limit) - grace} or more); not started")
with open(check, "w") as f:
    json.dump({"sections": sections, "device": device, "tiny": tiny == "1", "budget_s": budget, "grace_s": grace,
               "planned": planned, "plan_problems": problems}, f, indent=1)
for p in problems:
    print("gpu_check.sh: " + p, file=sys.stderr)
sys.exit(1 if problems else 0)
PY
if [ $? -ne 0 ]; then
  # Refused before the first item: results.json names each cut item (the report reads
  # check.json's plan_problems).
  tar -C "$work" -czf "$out/logs.tar.gz" logs json
  "$py" "$here/gpu_check_report.py" "$work/json" "$out/results.json" --device "$device" | tee "$out/summary.txt"
  echo "gpu_check: refused to start: the budget would cut a required item (results in $out)"
  exit 1
fi

run_sections

# ---------------------------------------------------------------- report
printf 'total\t0\t%s\tinfo\n' "$(elapsed)" >> "$status"
tar -C "$work" -czf "$out/logs.tar.gz" logs json
"$py" "$here/gpu_check_report.py" "$work/json" "$out/results.json" --device "$device" | tee "$out/summary.txt"
rc=${PIPESTATUS[0]}
echo "gpu_check: results in $out (results.json, summary.txt, logs.tar.gz); $(elapsed) s"
exit "$rc"
