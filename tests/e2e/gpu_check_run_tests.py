#!/usr/bin/env python3
"""The GPU check's runner of the GPU tests (tools/gpu_check_report.py --run-tests): all listed
tests in one process of the test binary, a time limit per test, a hung or crashed test reported
as such and the tests after it run again in a new process. Here against a stand-in binary that
prints GoogleTest's console lines and JSON: of 7 tests, one hangs and one kills its process;
every test must end with a result (the hang and the crash as failures that say so), in three
processes, well inside the time the hang would take; then the report on that folder names
the hang, the crash and the failure.

usage: gpu_check_run_tests.py SOURCE_DIR"""
import json
import os
import subprocess
import sys
import tempfile
import time

root = sys.argv[1]
report = os.path.join(root, "tools", "gpu_check_report.py")
TESTS = ["A.Pass1", "A.Skip1", "B.Hang", "A.Pass2", "C.Crash", "A.Fail1", "A.Pass3"]
FAKE = r'''#!%s
import json, os, signal, sys, time
TESTS = %r
flt = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--gtest_filter="))
out = next((a.split("=", 1)[1][len("json:"):] for a in sys.argv if a.startswith("--gtest_output=")), None)
names = [t for t in TESTS if t in flt.split(":")]
suites, failed = {}, False
for n in names:
    print("[ RUN      ] " + n, flush=True)
    kind = n.split(".")[1].rstrip("0123456789")
    if kind == "Hang":
        time.sleep(600)
    if kind == "Crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    t = {"name": n.split(".")[1], "status": "RUN", "result": "SKIPPED" if kind == "Skip" else "COMPLETED"}
    if kind == "Fail":
        print("test.cpp:12: Failure\nExpected equality", flush=True)
        print("[  FAILED  ] %%s (3 ms)" %% n, flush=True)
        t["failures"] = [{"failure": "test.cpp:12: Failure\nExpected equality", "type": ""}]
        failed = True
    elif kind == "Skip":
        print("[  SKIPPED ] %%s (0 ms)" %% n, flush=True)
    else:
        print("[       OK ] %%s (1 ms)" %% n, flush=True)
    suites.setdefault(n.split(".")[0], []).append(t)
if out:
    json.dump({"tests": len(names), "testsuites": [{"name": s, "testsuite": ts} for s, ts in suites.items()]},
              open(out, "w"))
sys.exit(1 if failed else 0)
''' % (sys.executable, TESTS)


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


with tempfile.TemporaryDirectory() as d:
    binary = os.path.join(d, "faceshard_tests")
    with open(binary, "w") as f:
        f.write(FAKE)
    os.chmod(binary, 0o755)
    j = os.path.join(d, "json")
    os.makedirs(j)
    with open(os.path.join(j, "gtest_expected.txt"), "w") as f:
        f.write("".join(t + "\n" for t in TESTS))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, report, "--run-tests", binary, "--list", os.path.join(j, "gtest_expected.txt"),
                        "--out", os.path.join(j, "gtest"), "--test-limit-s", "3", "--limit-s", "60"],
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    print(p.stdout)
    if p.returncode != 1:
        fail(f"--run-tests exited {p.returncode}, expected 1 (a test failed, one hung, one crashed)")
    if took > 30:
        fail(f"--run-tests took {took:.0f} s: the hung test was not stopped at its 3 s limit")
    runs = sorted(os.listdir(os.path.join(j, "gtest")))
    if runs != ["run1.json", "run2.json", "run3.json"]:
        fail(f"expected three processes' JSON (the hang and the crash each start a new process): {runs}")
    got = {}
    for r in runs:
        for s in json.load(open(os.path.join(j, "gtest", r)))["testsuites"]:
            for t in s["testsuite"]:
                msg = (t.get("failures") or [{}])[0].get("failure")
                got[f"{s['name']}.{t['name']}"] = (r, t["result"], msg)
    if sorted(got) != sorted(TESTS):
        fail(f"not one result per test: {sorted(got)}")
    want = {"A.Pass1": ("run1.json", None), "A.Skip1": ("run1.json", None), "B.Hang": ("run1.json", "hung: "),
            "A.Pass2": ("run2.json", None), "C.Crash": ("run2.json", "crashed: "), "A.Fail1": ("run3.json", "test.cpp:12"),
            "A.Pass3": ("run3.json", None)}
    for n, (run, msg) in want.items():
        if got[n][0] != run or (msg is None) != (got[n][2] is None) or (msg and not got[n][2].startswith(msg)):
            fail(f"{n}: {got[n]}, expected in {run} with a failure starting {msg!r}")
    if got["A.Skip1"][1] != "SKIPPED":
        fail(f"A.Skip1: {got['A.Skip1']}")
    # The report on the folder: each named.
    with open(os.path.join(j, "check.json"), "w") as f:
        json.dump({"sections": "tests", "planned": [{"name": "tests", "need": "required", "section": "tests"}]}, f)
    with open(os.path.join(j, "status.tsv"), "w") as f:
        f.write("tests_list\t0\t1\trequired\ntests\t1\t%.1f\trequired\n" % took)
    r = subprocess.run([sys.executable, report, j, os.path.join(d, "results.json"), "--device", "cpu"],
                       capture_output=True, text=True)
    problems = json.load(open(os.path.join(d, "results.json")))["problems"]
    print("\n".join(problems))
    for w in ("tests: B.Hang hung: no result within 3 s", "tests: C.Crash crashed: the test binary was killed by signal 11",
              "tests: 3 GPU test(s) failed: A.Fail1, B.Hang, C.Crash"):
        if not any(x.startswith(w) for x in problems):
            fail(f"the report does not say {w!r}")
    print(f"PASS ({took:.1f} s: 7 tests in 3 processes, the hang stopped at 3 s)")
