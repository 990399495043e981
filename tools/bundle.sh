#!/usr/bin/env bash
# Packs the built binaries into a relocatable tarball for machines that have PyTorch (the
# same torch wheel the build used) but not faceshard's other libraries: what an HPC user
# builds once and unpacks on the compute nodes.
#
#   tools/bundle.sh [--build DIR] [--output DIR] [--no-tarball]
#
# Writes OUTPUT/faceshard-<git describe>-linux-x86_64-torch<V>-cu<C>.tar.xz (OUTPUT: out/),
# one folder of that name inside:
#   bin/      the faceshard-* tools and the test binary, stripped, RUNPATH $ORIGIN/../lib
#   lib/      every library they need (DT_NEEDED, walked) beyond glibc, libstdc++, libgcc_s,
#             LibTorch and CUDA, each with RUNPATH $ORIGIN
#   env.sh    `source env.sh`: PATH and LD_LIBRARY_PATH for bin/, with LibTorch's and CUDA's
#             libraries from $FACESHARD_TORCH_LIB or from `python3 -c 'import torch'`
#   configs/, tools/ (launch.sh, gpu_check.sh + its report, arcface_torch_step.py,
#             checkpoint_stall.py),
#             tests/fuzz/regressions (the test binary's inputs)
#   MANIFEST  what was built from (commit, torch, CUDA) and each file's size
# Fails when a needed library is found nowhere, or when a packed file holds a path of this
# machine (the repository, the build folder, the virtual environment).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${FACESHARD_BUILD_DIR:-$root/build}"
output="$root/out"
tarball=1
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$(cd "${2:?--build needs a folder}" && pwd)"; shift 2 ;;
    --output) output="${2:?--output needs a folder}"; shift 2 ;;
    --no-tarball) tarball=0; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "bundle.sh: error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for t in patchelf readelf strip xz tar; do
  command -v "$t" >/dev/null || { echo "bundle.sh: error: '$t' is missing (tools/setup.sh installs it)" >&2; exit 1; }
done
[ -x "$build/bin/faceshard-train" ] || { echo "bundle.sh: error: no build in $build (run tools/build.sh first)" >&2; exit 1; }

py="$root/.venv/bin/python"
[ -x "$py" ] || py=python3
read -r torch_version cuda_version torch_lib < <("$py" -c '
import os, torch
print(torch.__version__.split("+")[0], (torch.version.cuda or "cpu").replace(".", ""), os.path.join(os.path.dirname(torch.__file__), "lib"))')
describe=$(git -C "$root" describe --tags --always --dirty 2>/dev/null || echo unknown)
name="faceshard-${describe}-linux-$(uname -m)-torch${torch_version}-cu${cuda_version}"
[ "$cuda_version" = cpu ] && name="faceshard-${describe}-linux-$(uname -m)-torch${torch_version}-cpu"

mkdir -p "$output"
output="$(cd "$output" && pwd)"
stage=$(mktemp -d "${TMPDIR:-/tmp}/faceshard-bundle.XXXXXX")
trap 'rm -rf "$stage"' EXIT
dest="$stage/$name"
mkdir -p "$dest/bin" "$dest/lib" "$dest/tools" "$dest/tests/fuzz"

# --- binaries
bins=()
for f in "$build"/bin/faceshard-* "$build/bin/faceshard_tests"; do
  [ -f "$f" ] && [ -x "$f" ] || continue
  cp "$f" "$dest/bin/"
  bins+=("$dest/bin/$(basename "$f")")
done

# --- libraries: a needed soname is provided by the machine (glibc, libstdc++, libgcc_s),
# by the torch wheel (LibTorch, its libgomp, CUDA's runtime libraries, NCCL, cuDNN), or
# packed here.
provided() {
  case "$1" in
    linux-vdso.so.*|ld-linux*.so.*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libutil.so.*) return 0 ;;
    libstdc++.so.*|libgcc_s.so.*) return 0 ;;
    libtorch*.so*|libc10*.so*|libgomp*.so*|libshm.so*) return 0 ;;
    libcuda.so.*|libcudart.so.*|libnccl.so.*|libcublas*.so.*|libcudnn*.so.*|libnvrtc*.so.*|libnvToolsExt*.so.*) return 0 ;;
    libcupti.so.*|libcusparse*.so.*|libcufft*.so.*|libcurand.so.*|libcusolver*.so.*|libnvJitLink.so.*) return 0 ;;
    libcufile*.so.*|libnvshmem*.so.*|libnvperf*.so.*) return 0 ;;
  esac
  return 1
}
needed() { readelf -d "$1" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
# Where this machine's loader finds a soname (as the build's binaries load it).
declare -A where=()
while read -r so _ path _; do
  [ -n "${path:-}" ] && [ "${path:0:1}" = / ] && where[$so]="$path"
done < <(for b in "${bins[@]}"; do LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$b"; done | awk '/=>/ {print $1, $2, $3, $4}')
queue=("${bins[@]}")
declare -A packed=()
while [ ${#queue[@]} -gt 0 ]; do
  elf="${queue[0]}"; queue=("${queue[@]:1}")
  for so in $(needed "$elf"); do
    provided "$so" && continue
    [ -n "${packed[$so]:-}" ] && continue
    src="${where[$so]:-}"
    if [ -z "$src" ]; then
      src=$(ldconfig -p | awk -v s="$so" '$1 == s && /x86-64/ {print $NF; exit}')
    fi
    [ -n "$src" ] && [ -f "$src" ] || { echo "bundle.sh: error: $(basename "$elf") needs $so, which is not found on this machine" >&2; exit 1; }
    cp -L "$src" "$dest/lib/$so"
    chmod u+w "$dest/lib/$so"
    packed[$so]=1
    queue+=("$dest/lib/$so")
  done
done

# --- strip, RUNPATH, and no path of this machine
for b in "${bins[@]}"; do
  strip --strip-all "$b"
  patchelf --set-rpath '$ORIGIN/../lib' "$b"
done
for l in "$dest"/lib/*; do
  [ -f "$l" ] || continue
  strip --strip-unneeded "$l" 2>/dev/null || true
  patchelf --set-rpath '$ORIGIN' "$l"
done

# --- scripts, configs, test inputs
cp -r "$root/configs" "$dest/configs"
cp "$root/tools/launch.sh" "$root/tools/gpu_check.sh" "$root/tools/gpu_check_report.py" "$root/tools/arcface_torch_step.py" "$root/tools/checkpoint_stall.py" \
   "$dest/tools/"
cp "$root/tools/gpu_two_ranks.sh" "$dest/tools/"
cp -r "$root/tests/fuzz/regressions" "$dest/tests/fuzz/regressions"
# The test binary's paths (tests/test_paths.h), relative to bin/.
printf 'source=..\nbin=.\npython=python3\nfuzz_seeds=../tests/fuzz/seeds\n' > "$dest/bin/faceshard_tests.paths"
cat > "$dest/env.sh" <<'ENV'
# source this file: PATH and LD_LIBRARY_PATH for this faceshard bundle.
# LibTorch's libraries come from $FACESHARD_TORCH_LIB, or from the torch that `python3`
# (or $FACESHARD_PYTHON) imports: it must be the version named in this folder's name.
FACESHARD_HOME="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)"
export FACESHARD_HOME
if [ -z "${FACESHARD_TORCH_LIB:-}" ]; then
  FACESHARD_TORCH_LIB=$("${FACESHARD_PYTHON:-python3}" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null) || FACESHARD_TORCH_LIB=""
fi
if [ -z "$FACESHARD_TORCH_LIB" ] || [ ! -e "$FACESHARD_TORCH_LIB/libtorch_cpu.so" ]; then
  echo "faceshard env.sh: no LibTorch found: set FACESHARD_TORCH_LIB to the torch wheel's lib folder, or FACESHARD_PYTHON to a Python that imports torch" >&2
  return 1 2>/dev/null || exit 1
fi
export FACESHARD_TORCH_LIB
_fs_libs="$FACESHARD_HOME/lib:$FACESHARD_TORCH_LIB"
# The wheel's CUDA runtime libraries (nvidia/cu13/lib, nvidia/nccl/lib, ...) beside torch/.
for _fs_d in "$FACESHARD_TORCH_LIB"/../../nvidia/*/lib; do
  [ -d "$_fs_d" ] && _fs_libs="$_fs_libs:$(cd "$_fs_d" && pwd)"
done
export LD_LIBRARY_PATH="$_fs_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$FACESHARD_HOME/bin:$PATH"
unset _fs_libs _fs_d
ENV

# No file may name this machine's folders.
for p in "$root" "$build" "$(dirname "$torch_lib")"; do
  if hits=$(grep -rlF -- "$p" "$dest" 2>/dev/null) && [ -n "$hits" ]; then
    echo "bundle.sh: error: these files name $p: $(echo $hits | sed "s|$dest/||g")" >&2
    exit 1
  fi
done

{
  echo "name: $name"
  echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "torch: $torch_version, cuda: $cuda_version"
  echo "libraries packed: ${!packed[*]}"
  (cd "$dest" && find . -type f -printf '%s %p\n' | sort -k2)
} > "$dest/MANIFEST"

if [ "$tarball" = 1 ]; then
  out="$output/$name.tar.xz"
  tar -C "$stage" -cf - "$name" | xz -T0 -6 > "$out.tmp"
  mv "$out.tmp" "$out"
  echo "bundle: $out ($(du -h "$out" | cut -f1); ${#bins[@]} binaries, ${#packed[@]} libraries packed: ${!packed[*]})"
else
  rm -rf "${output:?}/$name"
  mv "$dest" "$output/$name"
  echo "bundle: $output/$name (${#bins[@]} binaries, ${#packed[@]} libraries packed)"
fi
