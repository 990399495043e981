#!/usr/bin/env bash
# The GPU check: one prepared run of everything a GPU machine can tell about faceshard, from
# an unpacked bundle (tools/bundle.sh) on a machine that has PyTorch:
#
#   tar -xJf faceshard-*.tar.xz && faceshard-*/tools/gpu_check.sh RESULTS_DIR
#
#   env         nvidia-smi, driver, torch / CUDA / cuDNN / NCCL versions
#   tests       every test that needs a GPU (GoogleTest filter *Cuda*): CUDA kernels against
#               the CPU, the data loader's pinned copies, NCCL's collectives at world 1
#   train       the demo training on the GPU (NCCL, world 1): bf16 stopped at its checkpoint
#               and resumed, then fp16 with loss scaling; the export to ONNX and
#               faceshard-verify on the exported model; loss and verification accuracy
#   step        faceshard-bench --mode step for r50 (batch 256) and mbf (batch 512) at sample
#               rate 0.1 over 1M classes (bf16 and fp16, channels-last and NCHW, eager and with
#               the backbone's CUDA graphs), and beside them arcface_torch's own step on the
#               same card (tools/arcface_torch_step.py)
#   classifier  faceshard-bench --mode classifier at 1M and 10M classes: bytes per class from
#               the CUDA allocator's peak, beside faceshard-plan's figure
#   loader      the data loader on a synthetic JPEG .rec with 8 and 16 workers
#   capacity    the classifier's storage and passes (optim.fc_weight_dtype, loss.logits):
#               faceshard-bench --mode classifier with fp32/bf16 centres and buffered/streamed
#               logits (batch 128 at rates 1.0 and 0.1; batch 8192 at rate 0.2; 200k classes
#               beside the GEMMs), the r50 step with buffered and streamed logits, and the
#               largest class count faceshard-plan finds for this GPU (r50, bf16, batch 128,
#               bf16 centres and state, streamed) trained for a few steps
#
# RESULTS_DIR receives three files: results.json (every figure; "records" holds one record
# per step cell in the format of docs/benchmarks/), summary.txt (the table printed at the
# end) and logs.tar.gz (each section's log and raw JSON). Sections run one after another,
# each under its own time limit; a failing section is reported and the others still run.
#
# Options: --device cuda|cpu (cpu: the plumbing at tiny sizes, for a machine without a GPU),
# --tiny (small sizes on any device), --sections LIST (comma-separated, default all),
# --budget-s S (the step section's cells stop being started once S seconds have passed since
# the check began; default 420).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
home="$(dirname "$here")"
usage() { sed -n '2,/^# the check began/p' "$0"; }

out=""; device=cuda; tiny=0; sections="env,tests,train,step,classifier,loader,capacity"; budget=420
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
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: error: --budget-s must be a whole number of seconds" >&2; exit 2; }
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
status="$work/json/status.tsv"
: > "$status"

free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
elapsed() { echo $(( $(date +%s) - t_start )); }
# run NAME LIMIT_S CMD...: the command's output to logs/NAME.log, its status and time to status.tsv.
run() {
  local name="$1" limit="$2"; shift 2
  local t0; t0=$(date +%s.%N)
  echo "[gpu_check $(elapsed)s] $name" >&2
  MASTER_PORT=$(free_port) timeout -k 10 "$limit" "$@" > "$work/logs/$name.log" 2>&1
  local rc=$?
  local dt; dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\n' "$name" "$rc" "$dt" >> "$status"
  [ "$rc" -eq 0 ] || { echo "[gpu_check] $name failed (exit $rc): $(tail -n 3 "$work/logs/$name.log" | tr '\n' ' ')" >&2; }
  return "$rc"
}
want() { [[ ",$sections," == *",$1,"* ]]; }
# The report so far, after each section: a check cut short still leaves what it measured.
report() {
  tar -C "$work" -czf "$out/logs.tar.gz" logs json 2>/dev/null
  "$py" "$here/gpu_check_report.py" "$work/json" "$out/results.json" --device "$device" > "$out/summary.txt" 2>&1
}

# Sizes: the real check, or the plumbing at tiny sizes.
if [ "$tiny" = 1 ]; then
  train_first=3; train_set=(--set train.max_steps=6 --set train.log_every=1 --set train.verify_every=3 --set train.checkpoint_every=3)
  cells=("mbf_small 8 fp32 cl" "mbf_small 8 fp32 cl graph" "mbf_small 8 fp32 cl unfused" "mbf_small 8 fp32 cl jpeg"
         "mbf_small 8 fp32 nchw")
  step_classes=2000; jpeg_ids=20; jpeg_images=10
  declare -A at_for=([mbf_small]="mbf 8 fp32")
  step_args=(--classes "$step_classes" --sample-rate 0.1 --steps 2 --windows 2 --warmup 1)
  at_args=(--classes 2000 --sample-rate 0.1 --steps 2 --windows 2 --warmup 1)
  fc_classes="2000,20000"; fc_args=(--batch 16 --steps 1 --windows 1 --warmup 1)
  loader_args=(--workers 1,2 --batch 32 --identities 20 --images-per-identity 10 --epochs 1)
  cap_classes="2000,4000"; cap_gathered="2000,4000"; cap_gathered_batch=64; cap_200k=2000
  cap_args=(--steps 1 --windows 1 --warmup 1); cap_step=(--classes 2000 --steps 2 --windows 1 --warmup 1)
  cap_net=mbf_small; cap_batch=8
  tests_filter="*Cuda*:LossScaler.*"
else
  train_first=31; train_set=()
  # A fifth word names a variant: "unfused" is the same cell with optim.fused=false (the
  # per-parameter optimiser and DDP's bucket copies), the fused optimiser's contribution.
  # "atenprelu" the same with model.prelu_kernel=false (ATen's PReLU backward); "jpeg" reads a
  # synthetic JPEG .rec through the loader (decoding, augmentation) instead of fixed pixels;
  # "graph" replays the backbone's CUDA graphs (train.cuda_graph=true).
  cells=("r50 256 bf16 cl" "r50 256 bf16 cl graph" "mbf 512 bf16 cl" "mbf 512 bf16 cl graph"
         "r50 256 bf16 cl unfused" "r50 256 bf16 cl atenprelu" "r50 256 bf16 cl jpeg"
         "r50 256 fp16 cl" "r50 256 bf16 nchw" "mbf 512 bf16 cl unfused" "mbf 512 bf16 cl atenprelu"
         "mbf 512 bf16 cl jpeg" "mbf 512 fp16 cl")
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
  tests_filter="*Cuda*"
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
  printf 'env\t%s\t0\n' "$?" >> "$status"
  run tools_load 60 "$bin/faceshard-config" --help
fi

# ---------------------------------------------------------------- tests
if want tests; then
  run tests 300 "$bin/faceshard_tests" --gtest_filter="$tests_filter" --gtest_output="json:$work/json/gtest.json"
  report
fi

# ---------------------------------------------------------------- train
if want train; then
  data="$work/data"
  run train_data 120 "$bin/faceshard-synth" --output "$data"
  common=(--config "$configs/demo.yaml" --set data.rec="$data" --set dist.device="$device" --set data.batch_size=64
          --set data.num_workers=4 --set train.tensorboard=false)
  for prec in bf16 fp16; do
    [ "$device" = cpu ] && [ "$prec" = fp16 ] && continue  # fp16 autocast is CUDA's
    r="$work/run_$prec"
    if [ "$prec" = bf16 ]; then
      # Stopped at its first checkpoint, then resumed to the end.
      run "train_${prec}_part1" 300 "$bin/faceshard-train" "${common[@]}" --set output="$r" --set train.precision="$prec" \
        "${train_set[@]}" --set train.checkpoint_every="$train_first" --set train.max_steps="$train_first"
      run "train_${prec}_resume" 300 "$bin/faceshard-train" "${common[@]}" --set output="$r" --set train.precision="$prec" \
        "${train_set[@]}" --set train.checkpoint_every="$train_first" --resume
    else
      run "train_${prec}" 300 "$bin/faceshard-train" "${common[@]}" --set output="$r" --set train.precision="$prec" "${train_set[@]}"
    fi
    cp "$r/metrics.jsonl" "$work/json/train_${prec}_metrics.jsonl" 2>/dev/null
    run "export_${prec}" 120 "$bin/faceshard-export" --model "$r" --onnx "$r/model.onnx"
    [ -f "$r/model.onnx" ] && stat -c '%s' "$r/model.onnx" > "$work/json/export_${prec}_bytes.txt"
    run "verify_${prec}" 120 "$bin/faceshard-verify" --model "$r" --bin "$data/synth.bin" --device "$device" \
      --json "$work/json/verify_${prec}.json"
    report
  done
fi

# ---------------------------------------------------------------- step
if want step; then
  declare -A at_done=()
  for c in "${cells[@]}"; do
    read -r net batch prec layout variant <<< "$c"
    name="step_faceshard_${net}_${batch}_${prec}_${layout}${variant:+_$variant}"
    if [ "$(elapsed)" -ge "$budget" ]; then
      printf '%s\tskipped\t0\n' "$name" >> "$status"
      continue
    fi
    # arcface_torch's step for this cell's network first (once), then faceshard's cells beside it.
    at="${at_for[$net]:-}"
    if [ -n "$at" ] && [ -z "${at_done[$at]:-}" ]; then
      at_done[$at]=1
      read -r anet abatch aprec <<< "$at"
      run "step_arcface_torch_${anet}_${abatch}_${aprec}" 300 "$py" -m torch.distributed.run --standalone --nproc_per_node 1 \
        "$here/arcface_torch_step.py" --device "$device" --network "$anet" --batch "$abatch" --precision "$aprec" \
        "${at_args[@]}" --json "$work/json/step_arcface_torch_${anet}_${abatch}_${aprec}.json"
    fi
    cl=true; [ "$layout" = nchw ] && cl=false
    extra=(); [ "${variant:-}" = unfused ] && extra=(--set optim.fused=false)
    [ "${variant:-}" = atenprelu ] && extra=(--set model.prelu_kernel=false)
    [ "${variant:-}" = graph ] && extra=(--set train.cuda_graph=true)
    if [ "${variant:-}" = jpeg ]; then
      if [ ! -s "$work/jpeg/train.rec" ]; then
        run jpeg_data 300 "$bin/faceshard-synth" --output "$work/jpeg" --identities "$jpeg_ids" \
          --images "$jpeg_images" --pairs 0
      fi
      extra=(--set data.rec="$work/jpeg" --set data.spare_classes=$((step_classes - jpeg_ids)) --set data.num_workers=14)
    fi
    run "$name" 300 "$bin/faceshard-bench" --mode step --device "$device" \
      --network "$net" --batch "$batch" --precision "$prec" "${step_args[@]}" --set model.channels_last=$cl \
      --set data.num_workers=8 "${extra[@]}" --json "$work/json/$name.json"
    report
  done
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
fi

# ---------------------------------------------------------------- loader
if want loader; then
  run loader 300 "$bin/faceshard-bench" --mode data "${loader_args[@]}" --json "$work/json/loader.json"
fi

# ---------------------------------------------------------------- capacity
if want capacity; then
  fc_bench=("$bin/faceshard-bench" --mode classifier --device "$device" --precision bf16 --fc-state-dtype bf16)
  run cap_storage 300 "${fc_bench[@]}" --classes-per-shard "$cap_classes" --sample-rate 1.0,0.1 --batch 128 \
    --fc-weight-dtype fp32,bf16 --logits buffer,streamed "${cap_args[@]}" --json "$work/json/cap_storage.json"
  report
  run cap_gathered 200 "${fc_bench[@]}" --classes-per-shard "$cap_gathered" --sample-rate 0.2 \
    --batch "$cap_gathered_batch" --fc-weight-dtype bf16 --logits buffer,streamed "${cap_args[@]}" \
    --json "$work/json/cap_gathered.json"
  run cap_200k 200 "${fc_bench[@]}" --classes-per-shard "$cap_200k" --sample-rate 1.0 --batch 128 \
    --fc-weight-dtype fp32,bf16 --logits buffer,streamed --steps 10 --windows 3 --warmup 2 --json "$work/json/cap_200k.json"
  report
  for logits in buffer streamed; do
    run "cap_step_r50_${logits}" 200 "$bin/faceshard-bench" --mode step --device "$device" --network "$cap_net" \
      --batch 256 --precision bf16 --sample-rate 0.1 "${cap_step[@]}" --set loss.logits=$logits \
      --set data.num_workers=8 --json "$work/json/cap_step_${logits}.json"
  done
  report
  # The largest class count for this device, planned and then trained: the memory CUDA lets
  # a process allocate (torch's total_memory, less than nvidia-smi's figure), with 3 GiB
  # kept for what the plan does not count: the CUDA context and libraries (1.48 GiB outside
  # PyTorch's allocator on an H100), cuDNN's benchmark workspaces and cuBLAS's (inside it),
  # the classifier's chunk temporaries and fragmentation. (With 2 GiB an H100 ran out of
  # memory 0.5 GiB past the plan.)
  mem=""
  [ "$device" = cuda ] && mem="$("$py" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory)' 2>/dev/null)B"
  [ "$mem" != B ] && [ -n "$mem" ] || mem=4GiB
  # A plan that does not run is tried once more with 1 GiB more reserve: either way the log
  # says what the card needs beyond the plan.
  for reserve in 3 4; do
    plan=("$bin/faceshard-plan" --network "$cap_net" --precision bf16 --batch "$cap_batch" --fc-weight-dtype bf16
          --fc-state-dtype bf16 --logits streamed --device-memory "$mem" --reserve "${reserve}GiB")
    run "cap_plan_${reserve}GiB" 60 "${plan[@]}" --json "$work/json/cap_plan_${reserve}GiB.json"
    largest=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["max_classes"])' \
      "$work/json/cap_plan_${reserve}GiB.json" 2>/dev/null)
    [ -n "$largest" ] && [ "$largest" -gt 0 ] || break
    [ "$tiny" = 1 ] && largest=5000
    run "cap_largest_${reserve}GiB" 400 "$bin/faceshard-bench" --mode step --device "$device" --network "$cap_net" \
      --batch "$cap_batch" --precision bf16 --classes "$largest" --sample-rate 1.0 --steps 2 --windows 1 --warmup 1 \
      --set optim.fc_weight_dtype=bf16 --set optim.fc_state_dtype=bf16 --set loss.logits=streamed \
      --set data.num_workers=8 --json "$work/json/cap_largest_${reserve}GiB.json" && break
  done
  report
fi

# ---------------------------------------------------------------- report
printf 'total\t0\t%s\n' "$(elapsed)" >> "$status"
tar -C "$work" -czf "$out/logs.tar.gz" logs json
"$py" "$here/gpu_check_report.py" "$work/json" "$out/results.json" --device "$device" | tee "$out/summary.txt"
rc=${PIPESTATUS[0]}
echo "gpu_check: results in $out (results.json, summary.txt, logs.tar.gz); $(elapsed) s"
exit "$rc"
