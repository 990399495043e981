#!/usr/bin/env bash
# Starts N local ranks of a faceshard binary with the environment torchrun would give
# them. When one rank fails, the others are stopped and the launcher exits non-zero.
#   tools/launch.sh --nproc 4 -- build/bin/faceshard-train --config configs/demo.yaml
#   several machines: add --nnodes 2 --node-rank 0|1 --master-addr HOST [--master-port P]
set -uo pipefail

usage() {
  cat <<USAGE
usage: tools/launch.sh --nproc N [--nnodes M --node-rank K --master-addr HOST] [--master-port P]
                       [--grace-s S] -- PROGRAM [ARGS...]
USAGE
}

nproc=1; nnodes=1; node_rank=0; master_addr=127.0.0.1; master_port=""; grace=10
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc|--nproc-per-node|--nproc_per_node) nproc="${2:-}"; shift 2 ;;
    --nnodes) nnodes="${2:-}"; shift 2 ;;
    --node-rank|--node_rank) node_rank="${2:-}"; shift 2 ;;
    --master-addr|--master_addr) master_addr="${2:-}"; shift 2 ;;
    --master-port|--master_port) master_port="${2:-}"; shift 2 ;;
    --grace-s) grace="${2:-}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "launch.sh: error: unknown argument '$1' (the program follows '--')" >&2; exit 2 ;;
  esac
done
for v in nproc nnodes node_rank grace; do
  if ! [[ "${!v}" =~ ^[0-9]+$ ]]; then echo "launch.sh: error: --${v//_/-} must be a non-negative integer, got '${!v}'" >&2; exit 2; fi
done
if [ "$nproc" -lt 1 ] || [ "$nnodes" -lt 1 ] || [ "$node_rank" -ge "$nnodes" ]; then
  echo "launch.sh: error: need --nproc >= 1, --nnodes >= 1 and --node-rank < --nnodes" >&2; exit 2
fi
if [ $# -eq 0 ]; then echo "launch.sh: error: no program given after '--'" >&2; usage >&2; exit 2; fi
if [ -z "$master_port" ]; then
  if [ "$nnodes" -gt 1 ]; then master_port=29500
  else master_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'); fi
fi

world=$((nproc * nnodes))
# The rendezvous store lets in the job's members only: they prove they know the job's token.
# One host: a fresh random token for this launch (a process's environment is readable by its
# user alone). Several hosts: every host must be given the same one (FACESHARD_JOB_TOKEN or
# FACESHARD_JOB_TOKEN_FILE), which the user provides.
if [ "$nnodes" -eq 1 ] && [ -z "${FACESHARD_JOB_TOKEN:-}" ] && [ -z "${FACESHARD_JOB_TOKEN_FILE:-}" ]; then
  FACESHARD_JOB_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
  export FACESHARD_JOB_TOKEN
fi
pids=()
stop_all() {
  local sig="$1"
  for p in "${pids[@]}"; do kill -"$sig" "$p" 2>/dev/null; done
}
# Ctrl-C / SIGTERM go to every rank (they checkpoint and exit); the launcher then waits.
trap 'stop_all TERM' INT TERM

for ((l = 0; l < nproc; l++)); do
  rank=$((node_rank * nproc + l))
  RANK=$rank LOCAL_RANK=$l WORLD_SIZE=$world LOCAL_WORLD_SIZE=$nproc GROUP_RANK=$node_rank \
  NODE_RANK=$node_rank MASTER_ADDR=$master_addr MASTER_PORT=$master_port \
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$@" &
  pids+=($!)
done

status=0
remaining=${#pids[@]}
while [ "$remaining" -gt 0 ]; do
  wait -n -p done_pid "${pids[@]}" 2>/dev/null
  rc=$?
  if [ -z "${done_pid:-}" ]; then
    [ "$rc" -eq 127 ] && break   # no children left
    continue                     # a trapped signal interrupted the wait: keep waiting
  fi
  remaining=$((remaining - 1))
  if [ "$rc" -ne 0 ] && [ "$status" -ne 0 ]; then
    # Every later failure too, with the signal that ended a rank (128 + N), so that a log
    # shows how each rank ended.
    for i in "${!pids[@]}"; do [ "${pids[$i]}" = "$done_pid" ] && r=$((node_rank * nproc + i)); done
    echo "launch.sh: rank ${r:-?} exited with status $rc$([ "$rc" -gt 128 ] && echo " (signal $((rc - 128)))")" >&2
  fi
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$rc
    for i in "${!pids[@]}"; do [ "${pids[$i]}" = "$done_pid" ] && failed_rank=$((node_rank * nproc + i)); done
    echo "launch.sh: rank ${failed_rank:-?} exited with status $rc$([ "$rc" -gt 128 ] && echo " (signal $((rc - 128)))");" \
         "waiting ${grace}s for the other ranks to stop" >&2
    # The others notice through their collectives and exit on their own; stop stragglers.
    # The reaper is a process group of its own (setsid), so that stopping it stops its
    # sleeps with it at any moment: nothing of the launcher outlives it.
    if [ "$remaining" -gt 0 ]; then
      setsid bash -c 'sleep "$1"; shift; kill -TERM "$@" 2>/dev/null; sleep 5; kill -KILL "$@" 2>/dev/null' \
        reaper "$grace" "${pids[@]}" &
      reaper=$!
    fi
  fi
  unset done_pid
done
if [ -n "${reaper:-}" ]; then
  # Its group once it has called setsid, else the process itself; then the group again, for
  # a sleep it may have started between the two.
  kill -- -"$reaper" 2>/dev/null || kill "$reaper" 2>/dev/null
  wait "$reaper" 2>/dev/null
  kill -- -"$reaper" 2>/dev/null
fi
exit "$status"
