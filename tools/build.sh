#!/usr/bin/env bash
# Configures (once) and builds faceshard into build/ with Ninja; re-running rebuilds only
# what changed. Extra arguments are ninja targets.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/tools/setup.sh"
build="${FACESHARD_BUILD_DIR:-$root/build}"
if [ ! -f "$build/build.ninja" ]; then
  # The fuzz targets (clang, libFuzzer) are part of what CI builds and tests.
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFACESHARD_FUZZ=ON ${FACESHARD_CMAKE_ARGS:-} \
    > "$build.configure.log" 2>&1 \
    || { cat "$build.configure.log"; exit 1; }
fi
# Two cores and ~2.5 GB per LibTorch translation unit: two jobs fit.
ninja -C "$build" -j "${FACESHARD_JOBS:-$(nproc)}" "$@"
