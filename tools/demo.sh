#!/usr/bin/env bash
# The main job: installs what is missing, builds, writes the synthetic face data set
# (faceshard-synth) and trains configs/demo.yaml on 2 local CPU ranks - or on the local
# GPUs with FACESHARD_DEVICE=cuda - with verification, checkpoints and the export.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/tools/build.sh"
build="${FACESHARD_BUILD_DIR:-$root/build}"
cd "$root"
# The data set takes about a second to write: always fresh, so it matches this build.
"$build/bin/faceshard-synth" --output runs/demo-data
nproc="${FACESHARD_NPROC:-2}"
extra=()
if [ "${FACESHARD_DEVICE:-cpu}" = "cuda" ]; then
  nproc=$(nvidia-smi -L | wc -l); extra=(--set dist.device=cuda)
fi
rm -rf runs/demo
"$root/tools/launch.sh" --nproc "$nproc" -- "$build/bin/faceshard-train" --config configs/demo.yaml "${extra[@]}" "$@"
echo "demo: outputs in runs/demo (metrics.jsonl, tensorboard/, checkpoints/, model.pt, model.json)"
