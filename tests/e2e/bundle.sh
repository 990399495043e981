#!/usr/bin/env bash
# tools/bundle.sh's tarball, unpacked into an empty folder and used from there with the
# virtual environment's torch: within 40 MiB; every library a packed binary or library needs
# (DT_NEEDED, walked) is in the bundle's lib/ unless glibc, libstdc++, libgcc_s, LibTorch or
# CUDA provide it, and the loader takes it from there; RUNPATH $ORIGIN/../lib and no path of
# this machine in any file; a test case of the test binary passes from there, and the GPU
# check's plumbing (tools/gpu_check.sh --device cpu: demo training stopped and resumed,
# export, verify, step cells beside arcface_torch's, classifier, loader) holds, with what a
# GPU lease's calls a and b must show (gpu_check_expect.py).
# usage: bundle.sh SOURCE_DIR BIN_DIR
set -u
root="$1"; bin="$2"
build="$(cd "$bin/.." && pwd)"
py="$root/.venv/bin/python"; [ -x "$py" ] || py=python3
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$root/tools/bundle.sh" --build "$build" --output "$work/out" > "$work/bundle.log" 2>&1 || { cat "$work/bundle.log"; fail "bundle.sh"; }
cat "$work/bundle.log"
tarball=$(ls "$work"/out/faceshard-*-linux-*-torch*.tar.xz 2>/dev/null | head -1)
[ -n "$tarball" ] || fail "no tarball named faceshard-<describe>-linux-<arch>-torch<V>-<cuda>.tar.xz"
size=$(stat -c %s "$tarball")
echo "tarball: $(basename "$tarball"), $size bytes"
[ "$size" -le $((40 * 1024 * 1024)) ] || fail "the bundle is $size bytes, over 40 MiB"

mkdir "$work/unpacked"
tar -C "$work/unpacked" -xJf "$tarball" || fail "cannot unpack"
home=$(ls -d "$work"/unpacked/faceshard-*)
[ "$(ls "$work/unpacked" | wc -l)" = 1 ] || fail "the tarball holds more than one top folder"
for f in env.sh MANIFEST bin/faceshard-train bin/faceshard_tests bin/faceshard_tests.paths tools/gpu_check.sh \
         tools/gpu_check_report.py tools/arcface_torch_step.py tools/launch.sh configs/demo.yaml lib; do
  [ -e "$home/$f" ] || fail "the bundle has no $f"
done

# What the machine provides: glibc, libstdc++, libgcc_s; LibTorch and its libgomp; CUDA's
# libraries (the torch wheel's nvidia-* packages, or the driver).
provided='^(linux-vdso|ld-linux.*|libc|libm|libpthread|libdl|librt|libutil|libstdc\+\+|libgcc_s|libtorch.*|libc10.*|libgomp.*|libcuda|libcudart|libnccl|libcublas.*|libcudnn.*|libnvrtc.*|libnvToolsExt|libcupti|libcusparse.*|libcufft.*|libcurand|libcusolver.*|libnvJitLink|libcufile.*|libnvshmem.*)\.so'
checked=0
for elf in "$home"/bin/* "$home"/lib/*; do
  head -c 4 "$elf" | grep -q ELF || continue
  while read -r so; do
    [ -z "$so" ] && continue
    checked=$((checked + 1))
    if [[ "$so" =~ $provided ]]; then continue; fi
    [ -f "$home/lib/$so" ] || fail "$(basename "$elf") needs $so, which the bundle does not hold"
  done < <(readelf -d "$elf" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
done
echo "DT_NEEDED entries checked: $checked"
[ "$checked" -gt 20 ] || fail "too few DT_NEEDED entries read ($checked): is readelf working?"
for b in "$home"/bin/faceshard-*; do
  head -c 4 "$b" | grep -q ELF || continue
  rp=$(readelf -d "$b" | sed -n 's/.*R\(UN\)\?PATH.*\[\(.*\)\]/\2/p')
  [ "$rp" = '$ORIGIN/../lib' ] || fail "$(basename "$b") has RUNPATH '$rp'"
done
for p in "$root" "$build" "$root/.venv"; do
  hits=$(grep -rlF -- "$p" "$home" || true)
  [ -z "$hits" ] || fail "files name $p: $hits"
done

# From the bundle, with .venv's torch.
export FACESHARD_PYTHON="$py"
# shellcheck disable=SC1091
source "$home/env.sh" || fail "env.sh"
yaml=$(ldd "$home/bin/faceshard-train" | awk '/libyaml-cpp/ {print $3}')
[[ "$yaml" == "$home/lib/"* ]] || fail "libyaml-cpp comes from '$yaml', not the bundle"
missing=$(ldd "$home/bin/faceshard_tests" | grep "not found" || true)
[ -z "$missing" ] || fail "not found from the bundle: $missing"
FACESHARD_TEST_PYTHON="$py" "$home/bin/faceshard_tests" --gtest_filter='PartialFCInit.*:LossScaler.*' > "$work/tests.log" 2>&1 \
  || { cat "$work/tests.log"; fail "the test binary from the bundle"; }
grep -E "PASSED|tests ran" "$work/tests.log"
# The filter must have matched tests, and every one it lists must have passed (a filter that
# matches nothing passes with zero tests).
listed=$(FACESHARD_TEST_PYTHON="$py" "$home/bin/faceshard_tests" --gtest_list_tests --gtest_filter='PartialFCInit.*:LossScaler.*' |
         grep -c '^  ' || true)
[ "$listed" -gt 0 ] || fail "the bundle's test binary lists no PartialFCInit.* or LossScaler.* test"
grep -qE "^\[  PASSED  \] $listed tests?\.$" "$work/tests.log" ||
  { cat "$work/tests.log"; fail "the test binary from the bundle did not pass all $listed tests its filter lists"; }
"$home/tools/gpu_check.sh" "$work/check" --device cpu --sections env,tests,train,step,classifier,loader --budget-s 0 > "$work/check.log" 2>&1 || { cat "$work/check.log"; fail "gpu_check.sh --device cpu"; }
cat "$work/check.log" | tail -25
for f in results.json summary.txt logs.tar.gz; do [ -s "$work/check/$f" ] || fail "gpu_check wrote no $f"; done
"$py" - "$work/check/results.json" <<'PY' || exit 1
import json, sys
r = json.load(open(sys.argv[1]))
assert not r["problems"], r["problems"]
t = r["train"]["bf16"]
steps = [s for s, _ in t["losses"]]
assert steps[0] == 1 and steps[-1] == 6, f"the demo did not run steps 1-6 across its resume: {steps}"
names = [s["name"] for s in r["sections"]]
for n in ("train_bf16_part1", "train_bf16_resume", "export_bf16", "verify_bf16", "classifier", "loader"):
    assert n in names, f"no section {n}"
who = sorted({x["who"] for x in r["records"]})
assert who == ["arcface_torch", "faceshard"], who
for x in r["records"]:
    for k in ("who", "network", "batch", "precision", "sample_rate", "images_per_s", "peak_memory_mb", "card"):
        assert k in x, f"a record lacks {k}: {x}"
    assert x["images_per_s"] > 0, x
assert r["ratios"] and all(q["ratio"] > 0 for q in r["ratios"]), r["ratios"]
# Each variant cell of the tiny run against its base cell: the fused optimiser, the JPEG input
# pipeline (the graph cell ran eagerly on the CPU: no graph cell, not a contribution).
got = sorted(q["variant"] for q in r["contributions"])
assert got == ["jpeg", "unfused"], r["contributions"]
assert all(q["speedup"] > 0 and q["base_images_per_s"] > 0 for q in r["contributions"]), r["contributions"]
assert r["targets"] == [], r["targets"]  # GPU targets: not judged on the CPU
assert any("bytes_per_class" in c and c.get("planned_bytes_per_class") for c in r["classifier"]), r["classifier"]
assert len(r["loader"]["results"]) == 2, r["loader"]
assert r["tests"]["passed"] > 0 and r["tests"]["failed"] == 0, r["tests"]
print("gpu_check results.json: sections", len(names), "records", len(r["records"]), "tests", r["tests"]["passed"],
      "passed", r["tests"]["skipped"], "skipped")
PY
# The check's calls a (env, tests, train) and b (step) of a GPU lease ran above as sections
# of one run: what each call's results must show (tests/e2e/gpu_check_expect.py).
for call in a b; do
  "$py" "$root/tests/e2e/gpu_check_expect.py" "$work/check/results.json" "$call" "$root" || fail "the check's call $call"
done
echo PASS
