#!/usr/bin/env bash
# The project's CUDA kernel libraries carry the GPU code the build promises: SASS (an ELF
# image) for each compute capability in SM_LIST and PTX for each in PTX_LIST, in every
# library given. A GPU with neither fails the kernel's launch ("no kernel image").
# Usage: check_cuda_archs.sh CUOBJDUMP "SM_LIST" "PTX_LIST" LIBRARY...   (lists: "80 86 ...")
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 CUOBJDUMP \"SM_LIST\" \"PTX_LIST\" LIBRARY..." >&2
  exit 2
fi
cuobjdump="$1" sm_list="$2" ptx_list="$3"
shift 3
if [ ! -x "$cuobjdump" ]; then
  echo "SKIP: no cuobjdump (the CUDA toolkit's cuda-cuobjdump, or triton's in the torch wheel)"
  exit 77
fi
missing=0
for lib in "$@"; do
  if [ ! -f "$lib" ]; then
    echo "FAIL: $lib: no such library (build it first)"
    missing=1
    continue
  fi
  # The ELF and PTX members are named <source>.sm_<NN>.cubin / .ptx.
  elf="$("$cuobjdump" --list-elf "$lib" 2>&1)" || { echo "FAIL: $cuobjdump --list-elf $lib: $elf"; missing=1; continue; }
  ptx="$("$cuobjdump" --list-ptx "$lib" 2>&1)" || ptx=""
  have_sm="$(grep -o 'sm_[0-9]*[a-z]*\.cubin' <<<"$elf" | sed 's/\.cubin$//' | sort -u | tr '\n' ' ')"
  have_ptx="$(grep -o 'sm_[0-9]*[a-z]*\.ptx' <<<"$ptx" | sed 's/\.ptx$//' | sort -u | tr '\n' ' ')"
  if [ -z "$have_sm" ]; then
    echo "FAIL: $(basename "$lib"): no ELF image at all"
    missing=1
  fi
  for sm in $sm_list; do
    if ! grep -qw "sm_$sm" <<<"$have_sm"; then
      echo "FAIL: $(basename "$lib"): no SASS for sm_$sm (has: ${have_sm:-none}); those GPUs get no kernel"
      missing=1
    fi
  done
  for sm in $ptx_list; do
    if ! grep -qw "sm_$sm" <<<"$have_ptx"; then
      echo "FAIL: $(basename "$lib"): no PTX for compute_$sm (has: ${have_ptx:-none}); later GPUs cannot compile the kernels at load time"
      missing=1
    fi
  done
  echo "$(basename "$lib"): SASS ${have_sm:-none}| PTX ${have_ptx:-none}"
done
if [ "$missing" -ne 0 ]; then
  exit 1
fi
echo "every library has SASS for: ${sm_list:-(any)}; PTX for: ${ptx_list:-(none required)}"
