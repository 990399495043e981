#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/tools/build.sh"
build="${FACESHARD_BUILD_DIR:-$root/build}"
cd "$build"
ctest --output-on-failure -j "${FACESHARD_TEST_JOBS:-2}" "$@"
