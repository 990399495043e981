#!/usr/bin/env bash
# Installs everything faceshard needs on a fresh Debian 12 machine, and nothing twice:
# Debian packages (compilers' libraries) and the pinned torch wheel (LibTorch) in .venv/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="${FACESHARD_TORCH_VERSION:-2.11.0}"

# yaml-cpp: configs; OpenCV core + imgproc: resize, affine alignment, drawing (images are
# decoded and encoded by libjpeg-turbo and libpng, so no OpenCV codec module);
# GoogleTest: tests; ccache + ninja: fast rebuilds; cmake/g++/python3-venv: the build itself;
# libgloo-dev: gloo's headers, which torch's ProcessGroupGloo.hpp includes (the wheel ships
# the implementation but not those headers); iproute2: network namespaces for the
# several-hosts tests; clang-14 + libclang-rt-14-dev: the fuzz targets (libFuzzer and the
# sanitizer runtimes come with clang's compiler-rt, not with g++); zlib1g-dev: CRC-32 of the
# entries of torch.save files; libjpeg62-turbo-dev + libpng-dev: the image decoders, called
# directly (strict and silent, unlike cv::imdecode); libgl1 + libglib2.0-0: what the
# opencv-python wheel (tests only) loads; patchelf + xz-utils: tools/bundle.sh (RUNPATH, .tar.xz).
debs=(build-essential cmake ninja-build ccache pkg-config python3 python3-venv
      libyaml-cpp-dev libopencv-core-dev libopencv-imgproc-dev
      libgtest-dev libgloo-dev iproute2 clang-14 libclang-rt-14-dev zlib1g-dev
      libjpeg62-turbo-dev libpng-dev libgl1 libglib2.0-0 patchelf xz-utils)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The torch wheel carries LibTorch (headers, CMake config, libtorch_{cpu,cuda}.so) and,
# through its nvidia-* dependencies, nccl.h. numpy is only used by tests that compare
# against Python references.
venv="$root/.venv"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$py" -m venv "$venv"
fi
have=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$TORCH_VERSION" ]; then
  echo "[setup] installing torch==$TORCH_VERSION into $venv (large download, once)"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "torch==$TORCH_VERSION" numpy
fi
"$venv/bin/python" -c 'import numpy' 2>/dev/null || "$venv/bin/pip" install -q numpy
# The ONNX export's tests (tests/e2e/onnx_export.py): onnx's checker, onnxruntime, and
# insightface's own loader (model_zoo.get_model). faceshard itself writes ONNX without them.
# opencv-python: OpenCV's own codecs, the image tests' reference (tests/cv2_reference.h).
onnx_pins=(onnx==1.23.2 onnxruntime==1.32.0 insightface==2.1 opencv-python==5.0.0.93)
"$venv/bin/python" -c 'import onnx, onnxruntime, insightface, cv2
assert (onnx.__version__, onnxruntime.__version__, insightface.__version__, cv2.__version__) == ("1.23.2", "1.32.0", "2.1", "5.0.0")' \
  2>/dev/null || { echo "[setup] installing ${onnx_pins[*]} into $venv (tests of the ONNX export and the image codecs)";
                   "$venv/bin/pip" install -q "${onnx_pins[@]}"; }
