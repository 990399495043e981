#!/usr/bin/env bash
# The GPU check: everything a GPU machine can tell about faceshard, from an unpacked bundle
# (tools/bundle.sh) on a machine that has PyTorch, in calls that each fit one command of a
# short GPU lease (docs/gpu.md gives the exact commands):
#
#   tar -xJf faceshard-*.tar.xz && faceshard-*/tools/gpu_check.sh RESULTS_DIR --sections LIST --budget-s S
#
#   env         nvidia-smi, driver, torch / CUDA / cuDNN / NCCL versions
#   tests       every test that needs a GPU: the test binary's own list under the GoogleTest
#               filter *Cuda* (--gtest_list_tests), each test run as its own process under its
#               own time limit (a hang costs that test alone); every listed test must run and
#               pass, and a committed minimum of names (gpu_check_report.py) must be listed
#   train       the demo training on the GPU (NCCL, world 1), bf16: stopped at a checkpoint
#               in the middle of an epoch and resumed, beside the same run uninterrupted (the
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
#               (staging on a side stream) beside the write, and the step time during a write
#
# RESULTS_DIR receives results.json (every figure, and "problems"), summary.txt (the table
# printed at the end) and logs.tar.gz (each item's log and raw JSON), rewritten after each
# section, so that a call cut short keeps what it measured. Each item (a test, a training
# run, a step cell, a bench) runs under its own time limit; a failing item is reported and
# the others still run. The exit status is non-zero when anything is a problem: an item
# failed, a required item was not started, zero tests ran, a listed GPU test did not run or
# pass, a graph cell was not captured, the resume did not continue the run (the report's
# list, gpu_check_report.py).
#
# Options: --device cuda|cpu (cpu: the plumbing at tiny sizes, for a machine without a GPU),
# --tiny (small sizes on any device), --sections LIST (comma-separated; default
# env,tests,train,step,loader,tworanks: classifier, capacity and checkpoint run when named), --budget-s S
# (default 420; 0: none): no item starts once S seconds have passed since the check began,
# or, from the step section on, since the step section began; an item not started is
# reported as skipped (a problem where the item is required), and no item runs past S + 40
# seconds (its time limit is cut to what is left).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
home="$(dirname "$here")"
usage() { sed -n '2,/^# seconds (its time limit/p' "$0" | sed 's/^# \{0,1\}//'; }

out=""; device=cuda; tiny=0; sections="env,tests,train,step,loader,tworanks"; budget=420
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="${2:-}"; shift 2 ;;
    --tiny) tiny=1; shift ;;
    --sections) sections="${2:-}"; shift 2 ;;
    --budget-s) budget="${2:-}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_check.sh: error: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "gpu_check.sh: error: one results folder, got '$out' and '$1'" >&2; exit 2; }
       out="$1"; shift ;;
  esac
done
[ -n "$out" ] || { echo "gpu_check.sh: error: no results folder given (see --help)" >&2; exit 2; }
case "$device" in cuda|cpu) ;; *) echo "gpu_check.sh: error: --device must be cuda or cpu, got '$device'" >&2; exit 2 ;; esac
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: error: --budget-s must be a whole number of seconds, got '$budget'" >&2; exit 2; }
known="env tests train step classifier capacity loader tworanks checkpoint"
[ -n "$sections" ] || { echo "gpu_check.sh: error: --sections is empty (known: ${known// /,})" >&2; exit 2; }
for s in ${sections//,/ }; do
  [[ " $known " == *" $s "* ]] || { echo "gpu_check.sh: error: --sections: unknown section '$s' (known: ${known// /,})" >&2; exit 2; }
done
[ "$device" = cpu ] && tiny=1

# Where the binaries are: an unpacked bundle (env.sh beside tools/) or a source checkout.
if [ -f "$home/env.sh" ]; then
  # shellcheck disable=SC1091
  source "$home/env.sh" || exit 1
  bin="$home/bin"
  py="${FACESHARD_PYTHON:-python3}"
else
  bin="${FACESHARD_BUILD_DIR:-$home/build}/bin"
  py="${FACESHARD_PYTHON:-$home/.venv/bin/python}"
fi
[ -x "$bin/faceshard-train" ] || { echo "gpu_check.sh: error: no faceshard-train in $bin" >&2; exit 1; }
configs="$home/configs"

mkdir -p "$out" || exit 1
out="$(cd "$out" && pwd)"
work=$(mktemp -d "${TMPDIR:-/tmp}/faceshard-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/logs" "$work/json"
t_start=$(date +%s)
budget_t0=$t_start
# The grace after the budget: an item started just before the budget ran out may run this
# much longer (a step cell takes 10-30 s on a GPU), so that the call ends by S + 40 s.
grace=40
status="$work/json/status.tsv"
: > "$status"
# What this call was asked for: the report judges each asked section by what it left.
printf '{"sections": "%s", "device": "%s", "tiny": %s, "budget_s": %s}\n' "$sections" "$device" \
  "$([ "$tiny" = 1 ] && echo true || echo false)" "$budget" > "$work/json/check.json"

free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
elapsed() { echo $(( $(date +%s) - t_start )); }
# Seconds left of the budget (a large number without one); negative once it is spent.
budget_left() {
  if [ "$budget" -eq 0 ]; then echo 1000000; else echo $(( budget - ($(date +%s) - budget_t0) )); fi
}
# item NEED NAME LIMIT_S CMD...: the command's output to logs/NAME.log; its status, seconds
# and NEED (required or optional) to status.tsv. Not started once the budget is spent: then
# "skipped" (exit status 125 to the caller).
item() {
  local need="$1" name="$2" limit="$3"; shift 3
  local left; left=$(budget_left)
  if [ "$left" -le 0 ]; then
    printf '%s\tskipped\t0\t%s\n' "$name" "$need" >> "$status"
    echo "[gpu_check $(elapsed)s] $name: not started, the budget of ${budget} s is spent ($need)" >&2
    return 125
  fi
  [ $((left + grace)) -lt "$limit" ] && limit=$((left + grace))
  local t0; t0=$(date +%s.%N)
  echo "[gpu_check $(elapsed)s] $name" >&2
  MASTER_PORT=$(free_port) timeout -k 10 "$limit" "$@" > "$work/logs/$name.log" 2>&1
  local rc=$?
  local dt; dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$need" >> "$status"
  [ "$rc" -eq 0 ] || { echo "[gpu_check] $name failed (exit $rc$([ "$rc" -ge 124 ] && [ "$rc" -le 137 ] && echo ", limit ${limit} s")): $(tail -n 3 "$work/logs/$name.log" | tr '\n' ' ')" >&2; }
  return "$rc"
}
run() { item required "$@"; }       # what the check cannot pass without
try_run() { item optional "$@"; }   # what the budget may leave out
want() { [[ ",$sections," == *",$1,"* ]]; }
# The report so far, after each section: a check cut short still leaves what it measured.
report() {
  tar -C "$work" -czf "$out/logs.tar.gz" logs json 2>/dev/null
  "$py" "$here/gpu_check_report.py" "$work/json" "$out/results.json" --device "$device" > "$out/summary.txt" 2>&1
}

# Sizes: the real check, or the plumbing at tiny sizes. A step cell is "NETWORK BATCH
# PRECISION LAYOUT [VARIANT]"; a fifth word names a variant: "graph" replays the backbone's
# CUDA graphs (train.cuda_graph=true), "unfused" is optim.fused=false (the per-parameter
# optimiser and DDP's bucket copies: the fused optimiser's contribution), "atenprelu"
# model.prelu_kernel=false (ATen's PReLU backward), "jpeg" reads a synthetic JPEG .rec
# through the loader (decoding, augmentation) instead of fixed pixels.
if [ "$tiny" = 1 ]; then
  # The demo stopped at step 3 and resumed to 6, beside the same 6 steps uninterrupted.
  train_stop=3; train_full=6; train_set=(--set train.max_steps=6 --set train.log_every=1 --set train.verify_every=3)
  cells_required=("mbf_small 8 fp32 cl" "mbf_small 8 fp32 cl graph")
  cells_optional=("mbf_small 8 fp32 cl unfused" "mbf_small 8 fp32 cl jpeg" "mbf_small 8 fp32 nchw")
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
  tests_filter="*Cuda*:LossScaler.*"; test_limit=120
  item_limit=300
else
  # Stopped at step 37 (the 7th batch of the second epoch: a resume inside an epoch) and
  # resumed to the end (62), beside the same run uninterrupted to step 47.
  train_stop=37; train_full=47; train_set=(--set train.log_every=1)
  # The base and graph cells and arcface_torch's are what the step section is for; the
  # others fill what the budget leaves, most telling first.
  cells_required=("r50 256 bf16 cl" "r50 256 bf16 cl graph" "mbf 512 bf16 cl" "mbf 512 bf16 cl graph")
  cells_optional=("r50 256 fp16 cl" "mbf 512 fp16 cl" "r50 256 bf16 cl unfused" "mbf 512 bf16 cl unfused"
                  "r50 256 bf16 cl jpeg" "mbf 512 bf16 cl jpeg" "r50 256 bf16 cl atenprelu"
                  "mbf 512 bf16 cl atenprelu" "r50 256 bf16 nchw")
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
  tests_filter="*Cuda*:-*GlooCuda*"; test_limit=120
  # A step cell takes 10-30 s on an H100/H200: two minutes means it hangs.
  item_limit=120
fi

# ---------------------------------------------------------------- env
if want env; then
  {
    if [ "$device" = cuda ]; then
      nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm --format=csv,noheader \
        > "$work/json/nvidia-smi.csv" 2>&1
      nvidia-smi > "$work/logs/nvidia-smi.txt" 2>&1
    fi
    "$py" - > "$work/json/env.json" <<'PY'
import json, os, platform, torch
d = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
     "python": platform.python_version(), "cpus": os.cpu_count(), "gpus": []}
if torch.cuda.is_available():
    d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        d["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                          "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
print(json.dumps(d))
PY
  } 2> "$work/logs/env.log"
  printf 'env\t%s\t0\trequired\n' "$?" >> "$status"
  run tools_load 60 "$bin/faceshard-config" --help
fi

# ---------------------------------------------------------------- tests
if want tests; then
  # The GPU tests this build has: the binary's own list under the filter (a DISABLED_ test
  # is not run by the filter, so it is not expected either).
  run tests_list 60 "$bin/faceshard_tests" --gtest_list_tests --gtest_filter="$tests_filter"
  awk '/^[^ ]/ { suite = ($1 ~ /\.$/) ? $1 : ""; next }
       /^  [^ ]/ && suite != "" { if (suite !~ /^DISABLED_/ && $1 !~ /^DISABLED_/) print suite $1 }' \
    "$work/logs/tests_list.log" > "$work/json/gtest_expected.txt"
  mkdir -p "$work/json/gtest"
  while read -r t; do
    safe="${t//\//_}"
    run "test_$safe" "$test_limit" "$bin/faceshard_tests" --gtest_filter="$t" \
      --gtest_output="json:$work/json/gtest/$safe.json"
  done < "$work/json/gtest_expected.txt"
  report
fi

# ---------------------------------------------------------------- train
if want train; then
  data="$work/data"
  run train_data 120 "$bin/faceshard-synth" --output "$data"
  common=(--config "$configs/demo.yaml" --set data.rec="$data" --set dist.device="$device" --set data.batch_size=64
          --set data.num_workers=4 --set train.tensorboard=false "${train_set[@]}")
  # bf16: stopped at its checkpoint and resumed, beside the same run uninterrupted (the same
  # config, its own output): the resume is judged by its log line and by its losses.
  r="$work/run_bf16"; full="$work/run_bf16_full"
  bf16=("${common[@]}" --set train.precision=bf16 --set train.checkpoint_every="$train_stop")
  run train_bf16_part1 300 "$bin/faceshard-train" "${bf16[@]}" --set output="$r" --set train.max_steps="$train_stop"
  run train_bf16_resume 300 "$bin/faceshard-train" "${bf16[@]}" --set output="$r" --resume
  run train_bf16_full 300 "$bin/faceshard-train" "${bf16[@]}" --set output="$full" --set train.max_steps="$train_full"
  cp "$r/metrics.jsonl" "$work/json/train_bf16_metrics.jsonl" 2>/dev/null
  cp "$full/metrics.jsonl" "$work/json/train_bf16_full_metrics.jsonl" 2>/dev/null
  cp "$work/logs/train_bf16_resume.log" "$work/json/train_bf16_resume.log" 2>/dev/null
  printf '{"precision": "bf16", "stop_step": %s, "full_steps": %s}\n' "$train_stop" "$train_full" > "$work/json/train_resume.json"
  run export_bf16 120 "$bin/faceshard-export" --model "$r" --onnx "$r/model.onnx"
  [ -f "$r/model.onnx" ] && stat -c '%s' "$r/model.onnx" > "$work/json/export_bf16_bytes.txt"
  run verify_bf16 120 "$bin/faceshard-verify" --model "$r" --bin "$data/synth.bin" --device "$device" \
    --json "$work/json/verify_bf16.json"
  report
  # fp16 with loss scaling (CUDA's: fp16 autocast is the GPU's), as the budget allows.
  if [ "$device" = cuda ]; then
    r="$work/run_fp16"
    try_run train_fp16 300 "$bin/faceshard-train" "${common[@]}" --set output="$r" --set train.precision=fp16 &&
      cp "$r/metrics.jsonl" "$work/json/train_fp16_metrics.jsonl" &&
      try_run export_fp16 120 "$bin/faceshard-export" --model "$r" --onnx "$r/model.onnx" &&
      stat -c '%s' "$r/model.onnx" > "$work/json/export_fp16_bytes.txt" &&
      try_run verify_fp16 120 "$bin/faceshard-verify" --model "$r" --bin "$data/synth.bin" --device "$device" \
        --json "$work/json/verify_fp16.json"
    report
  fi
fi

# ---------------------------------------------------------------- step
if want step; then
  # The step's budget counts from here: the sections before it do not eat its cells.
  budget_t0=$(date +%s)
  declare -A at_done=()
  step_cell() {
    local need="$1" net batch prec layout variant
    read -r net batch prec layout variant <<< "$2"
    local name="step_faceshard_${net}_${batch}_${prec}_${layout}${variant:+_$variant}"
    # arcface_torch's step for this cell's network first (once), then faceshard's cells beside it.
    local at="${at_for[$net]:-}"
    if [ -n "$at" ] && [ -z "${at_done[$at]:-}" ]; then
      at_done[$at]=1
      local anet abatch aprec
      read -r anet abatch aprec <<< "$at"
      item "$need" "step_arcface_torch_${anet}_${abatch}_${aprec}" "$item_limit" "$py" -m torch.distributed.run \
        --standalone --nproc_per_node 1 "$here/arcface_torch_step.py" --device "$device" --network "$anet" \
        --batch "$abatch" --precision "$aprec" "${at_args[@]}" \
        --json "$work/json/step_arcface_torch_${anet}_${abatch}_${aprec}.json"
    fi
    local cl=true; [ "$layout" = nchw ] && cl=false
    local extra=()
    case "${variant:-}" in
      unfused) extra=(--set optim.fused=false) ;;
      atenprelu) extra=(--set model.prelu_kernel=false) ;;
      graph) extra=(--set train.cuda_graph=true) ;;
      jpeg)
        if [ ! -s "$work/jpeg/train.rec" ]; then
          item "$need" jpeg_data 300 "$bin/faceshard-synth" --output "$work/jpeg" --identities "$jpeg_ids" \
            --images "$jpeg_images" --pairs 0
        fi
        extra=(--set data.rec="$work/jpeg" --set data.spare_classes=$((step_classes - jpeg_ids)) --set data.num_workers=14) ;;
    esac
    item "$need" "$name" "$item_limit" "$bin/faceshard-bench" --mode step --device "$device" \
      --network "$net" --batch "$batch" --precision "$prec" "${step_args[@]}" --set model.channels_last=$cl \
      --set data.num_workers=8 "${extra[@]}" --json "$work/json/$name.json"
    report
  }
  for c in "${cells_required[@]}"; do step_cell required "$c"; done
  for c in "${cells_optional[@]}"; do step_cell optional "$c"; done
fi

# ---------------------------------------------------------------- tworanks
if want tworanks; then
  if [ -f "$here/gpu_two_ranks.sh" ]; then
    run tworanks 300 bash "$here/gpu_two_ranks.sh" --device "$device" --out "$work/tworanks"
    cp "$work/tworanks/two_ranks.json" "$work/json/two_ranks.json" 2>/dev/null
  else
    # Not in this build: said in the report, not a failed check.
    printf 'tworanks\tabsent\t0\toptional\n' >> "$status"
    echo "[gpu_check $(elapsed)s] tworanks: no $here/gpu_two_ranks.sh in this build; not run" >&2
  fi
  report
fi

# ---------------------------------------------------------------- classifier
if want classifier; then
  run classifier 400 "$bin/faceshard-bench" --mode classifier --device "$device" --classes-per-shard "$fc_classes" \
    --sample-rate 1.0,0.1 "${fc_args[@]}" --json "$work/json/classifier.json"
  batch=$(printf '%s\n' "${fc_args[@]}" | awk 'p {print; exit} /^--batch$/ {p=1}')
  for rate in 1.0 0.1; do
    for cls in ${fc_classes//,/ }; do
      run "plan_${cls}_${rate}" 60 "$bin/faceshard-plan" --classes "$cls" --batch "$batch" --sample-rate "$rate" \
        --json "$work/json/plan_${cls}_${rate}.json"
    done
  done
  report
  # arcface_torch's classifier alone at the same cells (PartialFC_V2 and train_v2's SGD, fp16
  # as its configs: the loss scaled, the GEMMs fp32), as the budget allows: the item's limit is
  # cut to the budget as item() cuts it, and no cell starts that would end within 20 s of that
  # limit (guessed from the cell before), so the script ends with what it measured. A cell out
  # of memory (10M classes at rate 1.0 on an 80 GB card) is reported as not run.
  at_limit=90
  left=$(budget_left)
  [ $((left + grace)) -lt "$at_limit" ] && at_limit=$((left + grace))
  at_cells=$((at_limit - 20)); [ "$at_cells" -ge 1 ] || at_cells=1
  try_run arcface_classifier "$at_limit" "$py" -m torch.distributed.run --standalone --nproc_per_node 1 \
    "$here/arcface_torch_step.py" --classifier-only --device "$device" --classes-per-shard "$fc_classes" \
    --sample-rate 1.0,0.1 "${fc_args[@]}" --time-limit-s "$at_cells" --json "$work/json/arcface_classifier.json"
  report
fi

# ---------------------------------------------------------------- capacity
if want capacity; then
  # The largest class count for this device, planned and then trained: the memory CUDA lets
  # a process allocate (torch's total_memory, less than nvidia-smi's figure), with 3 GiB
  # kept for what the plan does not count: the CUDA context and libraries (1.48 GiB outside
  # PyTorch's allocator on an H100), cuDNN's benchmark workspaces and cuBLAS's (inside it),
  # the classifier's chunk temporaries and fragmentation. (With 2 GiB an H100 ran out of
  # memory 0.5 GiB past the plan.) First: it is what only a GPU can tell.
  mem=""
  [ "$device" = cuda ] && mem="$("$py" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory)' 2>/dev/null)B"
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
    [ -n "$largest" ] && [ "$largest" -gt 0 ] || break
    [ "$tiny" = 1 ] && largest=5000
    item "$need" "cap_largest_${reserve}GiB" 300 "$bin/faceshard-bench" --mode step --device "$device" \
      --network "$cap_net" --batch "$cap_batch" --precision bf16 --classes "$largest" --sample-rate 1.0 --steps 2 \
      --windows 1 --warmup 1 --set optim.fc_weight_dtype=bf16 --set optim.fc_state_dtype=bf16 \
      --set loss.logits=streamed --set data.num_workers=8 --json "$work/json/cap_largest_${reserve}GiB.json" && break
  done
  report
  fc_bench=("$bin/faceshard-bench" --mode classifier --device "$device" --precision bf16 --fc-state-dtype bf16)
  run cap_storage 300 "${fc_bench[@]}" --classes-per-shard "$cap_classes" --sample-rate 1.0,0.1 --batch 128 \
    --fc-weight-dtype fp32,bf16 --logits buffer,streamed "${cap_args[@]}" --json "$work/json/cap_storage.json"
  report
  try_run cap_gathered 200 "${fc_bench[@]}" --classes-per-shard "$cap_gathered" --sample-rate 0.2 \
    --batch "$cap_gathered_batch" --fc-weight-dtype bf16 --logits buffer,streamed "${cap_args[@]}" \
    --json "$work/json/cap_gathered.json"
  try_run cap_200k 200 "${fc_bench[@]}" --classes-per-shard "$cap_200k" --sample-rate 1.0 --batch 128 \
    --fc-weight-dtype fp32,bf16 --logits buffer,streamed --steps 10 --windows 3 --warmup 2 --json "$work/json/cap_200k.json"
  report
  for logits in buffer streamed; do
    try_run "cap_step_r50_${logits}" 200 "$bin/faceshard-bench" --mode step --device "$device" --network "$cap_net" \
      --batch 256 --precision bf16 --sample-rate 0.1 "${cap_step[@]}" --set loss.logits=$logits \
      --set data.num_workers=8 --json "$work/json/cap_step_${logits}.json"
  done
  report
fi

# ---------------------------------------------------------------- loader
if want loader; then
  run loader 300 "$bin/faceshard-bench" --mode data "${loader_args[@]}" --json "$work/json/loader.json"
fi

# ---------------------------------------------------------------- checkpoint
if want checkpoint; then
  run checkpoint_stall 400 "$py" "$here/checkpoint_stall.py" --bin "$bin" --config "$configs/base.yaml" \
    --output "$work/checkpoint" "${ck_args[@]}" --json "$work/json/checkpoint_stall.json"
  rm -rf "$work/checkpoint"/off "$work/checkpoint"/on  # the checkpoints themselves (GBs)
  cp "$work/checkpoint"/*.log "$work/logs/" 2>/dev/null
  report
fi

# ---------------------------------------------------------------- report
printf 'total\t0\t%s\tinfo\n' "$(elapsed)" >> "$status"
tar -C "$work" -czf "$out/logs.tar.gz" logs json
"$py" "$here/gpu_check_report.py" "$work/json" "$out/results.json" --device "$device" | tee "$out/summary.txt"
rc=${PIPESTATUS[0]}
echo "gpu_check: results in $out (results.json, summary.txt, logs.tar.gz); $(elapsed) s"
exit "$rc"
