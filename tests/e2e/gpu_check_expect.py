#!/usr/bin/env python3
"""What a GPU check call's results.json must show for the check to have checked something
(docs/gpu.md: a = env,tests,train; b = step; c = tworanks,classifier,capacity; budget = the
step call with a 1-second budget). Read by tests/e2e/gpu_check_calls.sh (calls c and budget,
run on their own) and tests/e2e/bundle.sh (calls a and b: the bundle's check runs their
sections in one run).

usage: gpu_check_expect.py RESULTS_JSON a|b|c|budget SOURCE_DIR"""
import json, os, sys
r = json.load(open(sys.argv[1]))
call, root = sys.argv[2], sys.argv[3]
names = {s["name"]: s for s in r["sections"]}
if call == "a":
    assert not r["problems"], r["problems"]
    t = r["tests"]
    sys.path.insert(0, os.path.join(root, "tools"))
    from gpu_check_report import MIN_GPU_TESTS
    # The binary's list under the tiny filter (*Cuda*:LossScaler.*), every one run as its
    # own item: the committed minimum among them, the LossScaler ones passed.
    assert set(MIN_GPU_TESTS) <= set(t["expected"]), sorted(set(MIN_GPU_TESTS) - set(t["expected"]))
    assert t["missing"] == [] and sorted(t["names"]) == sorted(t["expected"]), t
    assert all("test_" + n.replace("/", "_") in names for n in t["expected"]), sorted(names)
    assert t["passed"] >= 1 and t["failed"] == 0 and t["passed"] + t["skipped"] == len(t["expected"]), t
    assert all("Cuda" in n for n in t["skipped_names"]), t["skipped_names"]
    q = r["train"]["bf16"]["resume"]
    assert q["resumed_at"] == 3 and q["stop_step"] == 3, q
    assert q["compared_steps"] == [4, 5, 6], q
    assert q["max_relative_difference"] is not None and q["max_relative_difference"] <= q["tolerance"], q
    assert [s for s, _ in r["train"]["bf16"]["losses"]] == [1, 2, 3, 4, 5, 6], r["train"]["bf16"]["losses"]
    for n in ("train_bf16_part1", "train_bf16_resume", "train_bf16_full", "export_bf16", "verify_bf16"):
        assert names[n]["exit"] == "0", names[n]
    print("call a: %d GPU tests listed, %d passed, %d skipped (no GPU); resumed at step %d, steps %s within %.2g"
          % (len(t["expected"]), t["passed"], t["skipped"], q["resumed_at"], q["compared_steps"],
             q["max_relative_difference"]))
elif call == "b":
    assert not r["problems"], r["problems"]
    assert not r["skipped"], r["skipped"]
    who = sorted({x["who"] for x in r["records"]})
    assert who == ["arcface_torch", "faceshard"], who
    graph = [x for x in r["records"] if x.get("cell", "").endswith("_graph")]
    assert len(graph) == 1, r["records"]
    g = graph[0]["cuda_graph"]
    assert g["asked"] is True and g["captured"] is False and g["reason"] == "the CPU has no CUDA graphs", g
    assert "not captured" in graph[0]["variant"], graph[0]
    base = [x for x in r["records"] if x.get("cell") == "step_faceshard_mbf_small_8_fp32_cl"]
    assert base and base[0]["cuda_graph"] == {"asked": False, "captured": False, "reason": "", "eager_calls": 0}, base
    # Every step's loss is in the cell's JSON (1 warm-up + 2 windows x 2 + 1 timed window x 2),
    # and the graph cell's equal its eager cell's.
    [c] = r["graph_checks"]
    assert c["base"] == "step_faceshard_mbf_small_8_fp32_cl" and c["steps"] == 7, c
    assert c["max_relative_difference"] <= c["tolerance"], c
    got = sorted(q["variant"] for q in r["contributions"])
    assert got == ["jpeg", "unfused"], r["contributions"]  # an uncaptured graph cell is no graph cell
    assert r["targets"] == [], r["targets"]
    print("call b: %d cells; graph cell not captured (%s), losses of %d steps within %.2g of the eager cell's"
          % (len(r["records"]), g["reason"], c["steps"], c["max_relative_difference"]))
elif call == "c":
    assert not r["problems"], r["problems"]
    assert any("bytes_per_class" in c and c.get("planned_bytes_per_class") for c in r["classifier"]), r["classifier"]
    assert r["capacity"]["3GiB"]["trained"], r["capacity"]
    assert r["capacity"].get("cap_storage"), r["capacity"]
    # arcface_torch's classifier alone beside every faceshard classifier cell (tiny: 2 x 2 cells).
    fc = r["classifier_vs_arcface_torch"]
    assert len(fc) == 4 and all(q["arcface_torch_step_ms"] and q["arcface_torch_over_faceshard"] for q in fc), fc
    two = os.path.exists(os.path.join(root, "tools", "gpu_two_ranks.sh"))
    if two:
        assert r["two_ranks"]["ran"] and r["two_ranks"]["ok"], r["two_ranks"]
    else:
        assert r["two_ranks"] == {"ran": False, "why": "tools/gpu_two_ranks.sh is not in this build"}, r["two_ranks"]
    print("call c: classifier and capacity measured; two ranks:", r["two_ranks"])
elif call == "d":
    # The same run synchronous and in the background: a row per checkpoint step of both, the
    # figures those runs' own log lines printed (logs.tar.gz), the ratio of the two waits.
    assert not r["problems"], r["problems"]
    import re, tarfile
    ck = r["checkpoint"]
    rows = ck["checkpoints"]
    assert [q["step"] for q in rows] == [3, 6, 9], rows
    logs = tarfile.open(os.path.join(os.path.dirname(sys.argv[1]), "logs.tar.gz"))
    text = {m: logs.extractfile("logs/%s.log" % m).read().decode() for m in ("off", "on")}
    for q in rows:
        assert q["bytes"] > 0 and q["async_write_s"] > 0 and q["sync_wait_s"] > 0, q
        assert abs(q["wait_ratio"] - q["sync_wait_s"] / q["async_wait_s"]) <= 1e-6 * q["wait_ratio"], q
        # The synchronous wait is the whole save: the write it logged and the ranks' agreement.
        m = re.search(r"checkpoint step %d: this rank wrote \S+ \S+ in (\S+) s" % q["step"], text["off"])
        assert m and float(m.group(1)) <= 1.005 * q["sync_wait_s"] + 1e-3, (m and m.group(0), q)
        m = re.search(r"checkpoint step %d: the training waited (\S+) s .*written in the background" % q["step"],
                      text["on"])
        assert m and abs(float(m.group(1)) - q["async_wait_s"]) <= 0.01 * q["async_wait_s"] + 1e-3, (m and m.group(0), q)
    b = ck["background_steps"]
    assert set(b["during_write_steps"]).isdisjoint(b["away_steps"]), b
    assert not {3, 6, 9} & set(b["during_write_steps"] + b["away_steps"]), b  # checkpoint steps are neither
    assert b["away_steps"], b
    print("call d: checkpoints at steps %s, waits sync/async %s; %d steps during a write, %d away"
          % ([q["step"] for q in rows], ["%.2g/%.2g" % (q["sync_wait_s"], q["async_wait_s"]) for q in rows],
             len(b["during_write_steps"]), len(b["away_steps"])))
else:
    # The budget spent after the first item: the rest reported as skipped, the required
    # cells as problems, the optional ones not.
    req = [n for n, s in names.items() if s["exit"] == "skipped" and s["required"]]
    opt = [n for n, s in names.items() if s["exit"] == "skipped" and not s["required"]]
    assert "step_faceshard_mbf_small_8_fp32_cl_graph" in req and "step_faceshard_mbf_small_8_fp32_nchw" in opt, names
    for n in req:
        assert f"{n}: not started, the budget was spent (a required item)" in r["problems"], (n, r["problems"])
    assert not any(n in p for n in opt for p in r["problems"]), r["problems"]
    print("budget: skipped (required) %s; skipped (optional) %s" % (req, opt))
