#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs the demo on 3 local CPU ranks
# (or the local GPUs with FACESHARD_DEVICE=cuda).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/tools/build.sh"
build="${FACESHARD_BUILD_DIR:-$root/build}"
nproc="${FACESHARD_NPROC:-3}"
extra=()
if [ "${FACESHARD_DEVICE:-cpu}" = "cuda" ]; then
  nproc=$(nvidia-smi -L | wc -l); extra=(--cuda)
fi
exec "$root/tools/launch.sh" --nproc "$nproc" -- "$build/bin/faceshard-dist-check" --rounds 50 "${extra[@]}"
