#!/usr/bin/env bash
# The copy-on-write staging of the classifier's rows (app/train/row_staging.cpp) and its
# tests (tests/test_row_staging_copy.cpp: the training thread and the background writer at
# once, the race for one chunk made to happen) built with ThreadSanitizer and run. Only
# these two files are instrumented (LibTorch is not): the tests change the rows with plain
# loops so that the sanitizer sees both sides' accesses to them. Not part of the test suite
# (a separate build of two files, about a minute); run it after changing the staging.
# usage: tools/tsan.sh [OUT_DIR]   (default build/tsan); exit 0 when no race was reported
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/build/tsan}"
torch="$root/.venv/lib/python3.11/site-packages/torch"
[ -d "$torch/include" ] || torch="$("$root/.venv/bin/python" -c 'import torch, os; print(os.path.dirname(torch.__file__))')"
mkdir -p "$out"
g++ -std=c++17 -O1 -g -fsanitize=thread -fno-omit-frame-pointer -D_GLIBCXX_USE_CXX11_ABI=1 \
  -I"$root" -isystem "$torch/include" -isystem "$torch/include/torch/csrc/api/include" \
  "$root/app/train/row_staging.cpp" "$root/tests/test_row_staging_copy.cpp" \
  -o "$out/row_staging_tsan" \
  -L"$torch/lib" -Wl,-rpath,"$torch/lib" -ltorch_cpu -lc10 -lgtest -lgtest_main -pthread
# Report every race (halt_on_error=0) and exit non-zero when there was one.
TSAN_OPTIONS="halt_on_error=0 exitcode=66 ${TSAN_OPTIONS:-}" OMP_NUM_THREADS=1 \
  setarch "$(uname -m)" -R "$out/row_staging_tsan" --gtest_filter='RowStaging.*' 2>&1 | tee "$out/tsan.log"
rc=${PIPESTATUS[0]}
races=$(grep -c "WARNING: ThreadSanitizer" "$out/tsan.log" || true)
echo "tsan.sh: exit $rc, $races ThreadSanitizer warnings (log: $out/tsan.log)"
exit "$rc"
