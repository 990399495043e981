#!/usr/bin/env python3
"""The GPU check's committed minimum of GPU tests (MIN_GPU_TESTS in tools/gpu_check_report.py)
against the tests in tests/*.cpp: the check runs what the test binary lists under its filter
(tools/gpu_check.sh's tests_filter on a GPU) and the minimum catches a test renamed or removed,
so the minimum must name every such test the sources define. Fails, naming each, when

  - a test the filter selects (its full name matches, TEST_P instances included) is not in
    MIN_GPU_TESTS;
  - a test takes a CUDA-only path (CUDA's availability, a CUDA device or stream, a CUDA
    kernel's header) but its name does not match the filter: the GPU check would never run it
    (the two-rank *GlooCuda* tests are tools/gpu_two_ranks.sh's, not the minimum's);
  - a name in MIN_GPU_TESTS is no test of tests/*.cpp (the GPU run would fail on it).

usage: gpu_check_min_tests.py SOURCE_DIR"""
import fnmatch
import glob
import os
import re
import sys

root = sys.argv[1]
sys.path.insert(0, os.path.join(root, "tools"))
from gpu_check_report import MIN_GPU_TESTS  # noqa: E402

# The filter of the GPU-sized check (the one that excludes the two-rank tests).
script = open(os.path.join(root, "tools", "gpu_check.sh")).read()
filters = re.findall(r'^\s*tests_filter="([^"]+)"', script, re.M)
gpu_filter = [f for f in filters if "-" in f]
assert len(gpu_filter) == 1, f"no single GPU tests_filter with exclusions in tools/gpu_check.sh: {filters}"
gpu_filter = gpu_filter[0]
positive, _, negative = gpu_filter.partition("-")
positive = [p for p in positive.split(":") if p] or ["*"]
negative = [p for p in negative.split(":") if p]


def selected(full):
    return any(fnmatch.fnmatchcase(full, p) for p in positive) and \
        not any(fnmatch.fnmatchcase(full, p) for p in negative)


# What only a CUDA build on a GPU runs: a test body with one of these takes a CUDA-only path
# (a test that skips where CUDA is available, "if (torch::cuda::is_available()) GTEST_SKIP()",
# is a CPU test).
CUDA_PATH = re.compile(r"!\s*torch::cuda::is_available|\bkCUDA\b|FACESHARD_WITH_CUDA|c10::cuda::|at::cuda::|"
                       r"\.cuda\(\)|cuda_kernel|CUDAStream|CUDAGuard")


def body_at(text, start):
    """The test's body: from the first brace after start to its match, strings and comments
    skipped."""
    i = text.find("{", start)
    if i < 0:
        return ""
    depth, j, n = 0, i, len(text)
    while j < n:
        c = text[j]
        if text.startswith("//", j):
            j = text.find("\n", j)
            j = n if j < 0 else j
            continue
        if text.startswith("/*", j):
            j = text.find("*/", j)
            j = n if j < 0 else j + 2
            continue
        if c in "\"'":
            k = j + 1
            while k < n and text[k] != c:
                k += 2 if text[k] == "\\" else 1
            j = k + 1
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i:j + 1]
        j += 1
    return text[i:]
MACRO = re.compile(r"^(TEST|TEST_F|TEST_P)\(\s*(\w+)\s*,\s*(\w+)\s*\)", re.M)
INSTANCE = re.compile(r"^INSTANTIATE_TEST_SUITE_P\(\s*(\w+)\s*,\s*(\w+)\s*,", re.M)

tests = {}      # full name (a TEST_P as PREFIX/SUITE.NAME/*) -> (file, takes a CUDA-only path)
for path in sorted(glob.glob(os.path.join(root, "tests", "*.cpp"))):
    text = open(path, errors="replace").read()
    rel = os.path.relpath(path, root)
    marks = list(MACRO.finditer(text))
    instances = {}
    for m in INSTANCE.finditer(text):
        instances.setdefault(m.group(2), []).append(m.group(1))
    for i, m in enumerate(marks):
        kind, suite, name = m.groups()
        if suite.startswith("DISABLED_") or name.startswith("DISABLED_"):
            continue
        cuda = bool(CUDA_PATH.search(body_at(text, m.end())))
        if kind == "TEST_P":
            # Each instantiation; the body's CUDA path is taken by the ones whose prefix names
            # CUDA (GlooCuda/...), and the CPU ones run it on the CPU.
            prefixes = instances.get(suite, [])
            on_cuda = any(fnmatch.fnmatchcase(p, "*Cuda*") for p in prefixes)
            for prefix in prefixes:
                tests[f"{prefix}/{suite}.{name}/*"] = (rel, cuda and not on_cuda)
        else:
            tests[f"{suite}.{name}"] = (rel, cuda)

problems = []
minimum = set(MIN_GPU_TESTS)
for full, (rel, cuda) in sorted(tests.items()):
    sel = selected(full.replace("/*", "/0"))
    if sel:
        if "*" in full:
            if not any(fnmatch.fnmatchcase(n, full) for n in minimum):
                problems.append(f"{full} ({rel}): a GPU test the check runs ({gpu_filter}), not in MIN_GPU_TESTS")
        elif full not in minimum:
            problems.append(f"{full} ({rel}): a GPU test the check runs ({gpu_filter}), not in MIN_GPU_TESTS")
    elif cuda and not fnmatch.fnmatchcase(full, "*Cuda*"):
        problems.append(f"{full} ({rel}): takes a CUDA-only path, but its name does not match the GPU check's "
                        f"filter {gpu_filter}: no GPU run would run it")
for n in sorted(minimum):
    if n not in tests and not any("*" in t and fnmatch.fnmatchcase(n, t) for t in tests):
        problems.append(f"{n}: in MIN_GPU_TESTS, but no test of tests/*.cpp (renamed or removed?)")
gpu = sorted(t for t in tests if selected(t.replace("/*", "/0")))
for p in problems:
    print("FAIL: " + p)
print(f"{len(tests)} tests in tests/*.cpp, {sum(c for _, c in tests.values())} of them with a CUDA-only path; "
      f"{len(gpu)} selected by {gpu_filter}; MIN_GPU_TESTS {len(minimum)} names")
if problems:
    sys.exit(1)
print("PASS")
