#!/usr/bin/env python3
"""What a GPU check call's results.json must show for the check to have checked something:
the call's sections as docs/gpu.md gives them (a letter of its calls), each section's own
checks below, on the CPU at tiny sizes. Read by tests/e2e/gpu_check_calls.sh (each documented
call run on its own, and "budget": a call the check must refuse) and tests/e2e/bundle.sh
(calls a and b: the bundle's one check run holds their sections).

usage: gpu_check_expect.py RESULTS_JSON CALL|budget SOURCE_DIR"""
import json, os, re, sys, tarfile
r = json.load(open(sys.argv[1]))
call, root = sys.argv[2], sys.argv[3]
sys.path.insert(0, os.path.join(root, "tools"))
import gpu_check_report  # noqa: E402
names = {s["name"]: s for s in r["sections"]}


def env():
    assert names["env"]["exit"] == "0" and r["env"].get("torch"), (names.get("env"), r["env"])
    return "torch %s" % r["env"]["torch"]


def tests():
    t = r["tests"]
    # The binary's list under the tiny filter (*Cuda*:LossScaler.*), all run by one process
    # (none hung or crashed): the committed minimum among them, the LossScaler ones passed.
    missing = sorted(set(gpu_check_report.MIN_GPU_TESTS) - set(t["expected"]))
    assert not missing, "MIN_GPU_TESTS the test binary does not list: %s" % missing
    assert t["missing"] == [] and sorted(t["names"]) == sorted(t["expected"]), t
    assert names["tests"]["exit"] == "0" and t["processes"] == 1, (names["tests"], t["processes"])
    assert t["passed"] >= 1 and t["failed"] == 0 and t["passed"] + t["skipped"] == len(t["expected"]), t
    assert all("Cuda" in n for n in t["skipped_names"]), t["skipped_names"]
    return "%d GPU tests listed, %d passed, %d skipped (no GPU), in %d process" % (
        len(t["expected"]), t["passed"], t["skipped"], t["processes"])


def train():
    q = r["train"]["bf16"]["resume"]
    assert q["resumed_at"] == 3 and q["stop_step"] == 3, q
    assert q["compared_steps"] == [4, 5, 6], q
    assert q["max_relative_difference"] is not None and q["max_relative_difference"] <= q["tolerance"], q
    # The first run's steps 1-5 (two past its step-3 checkpoint, written in the background while
    # they ran), then the resumed run's 4-6.
    assert [s for s, _ in r["train"]["bf16"]["losses"]] == [1, 2, 3, 4, 5, 4, 5, 6], r["train"]["bf16"]["losses"]
    for n in ("train_bf16_part1", "train_bf16_resume", "train_bf16_full", "export_bf16", "verify_bf16"):
        assert names[n]["exit"] == "0", names[n]
    return "resumed at step %d, steps %s within %.2g" % (q["resumed_at"], q["compared_steps"],
                                                        q["max_relative_difference"])


def step():
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
    # The optional cells that ran against their base cell (an uncaptured graph cell is no
    # graph cell); at tiny sizes they all run within the documented budget.
    ran = {n for n, s in names.items() if s["exit"] == "0"}
    want = sorted(v for v in ("jpeg", "unfused") if "step_faceshard_mbf_small_8_fp32_cl_" + v in ran)
    got = sorted(q["variant"] for q in r["contributions"])
    assert got == want == ["jpeg", "unfused"], (got, want, r["contributions"])
    assert r["targets"] == [], r["targets"]
    return "%d cells; graph cell not captured (%s), losses of %d steps within %.2g of the eager cell's" % (
        len(r["records"]), g["reason"], c["steps"], c["max_relative_difference"])


def loader():
    assert len(r["loader"]["results"]) == 2, r["loader"]
    return "%d worker counts" % len(r["loader"]["results"])


def classifier():
    assert any("bytes_per_class" in c and c.get("planned_bytes_per_class") for c in r["classifier"]), r["classifier"]
    # arcface_torch's classifier alone beside every faceshard classifier cell (tiny: 2 x 2
    # cells), where the budget left it time (optional).
    fc = r["classifier_vs_arcface_torch"]
    if names.get("arcface_classifier", {}).get("exit") == "0":
        assert len(fc) == 4 and all(q["arcface_torch_step_ms"] and q["arcface_torch_over_faceshard"] for q in fc), fc
    return "bytes per class beside the plan; arcface_torch's classifier %s" % names.get("arcface_classifier", {}).get("exit")


def capacity():
    assert r["capacity"]["3GiB"]["trained"] and r["capacity"]["3GiB"]["max_classes"] > 0, r["capacity"]
    assert r["capacity"].get("cap_storage"), r["capacity"]
    return "planned %d classes, trained" % r["capacity"]["3GiB"]["max_classes"]


def tworanks():
    if os.path.exists(os.path.join(root, "tools", "gpu_two_ranks.sh")):
        assert r["two_ranks"]["ran"] and r["two_ranks"]["ok"], r["two_ranks"]
    else:
        assert r["two_ranks"] == {"ran": False, "why": "tools/gpu_two_ranks.sh is not in this build"}, r["two_ranks"]
    return "two ranks %s" % r["two_ranks"]


def checkpoint():
    # The same run synchronous and in the background: a row per checkpoint step of both, the
    # figures those runs' own log lines printed (logs.tar.gz), the ratio of the two waits.
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
    # The goals are judged (held or not) and reported; on the CPU they are no problem.
    assert [g["goal"] for g in ck["goals"]] == ["wait", "step"] and all(isinstance(g["held"], bool) for g in ck["goals"]), ck
    return "checkpoints at steps %s, waits sync/async %s; %d steps during a write, %d away; goals %s" % (
        [q["step"] for q in rows], ["%.2g/%.2g" % (q["sync_wait_s"], q["async_wait_s"]) for q in rows],
        len(b["during_write_steps"]), len(b["away_steps"]),
        ", ".join("%s %s" % (g["goal"], "held" if g["held"] else "not held") for g in ck["goals"]))


if call == "budget":
    # Refused before its first item: the checkpoint measurement's limit (240 s) past the
    # budget and its grace (100 s) is named, and nothing ran.
    want = "checkpoint_stall: a required item with a time limit of 240 s, which --budget-s 60 would cut to 100 s"
    assert any(p.startswith(want) for p in r["problems"]), r["problems"]
    assert r["sections"] == [], r["sections"]
    print("budget: refused before its first item: %s" % r["problems"])
    sys.exit(0)

[c] = [c for c in gpu_check_report.parse_calls(os.path.join(root, "docs", "gpu.md")) if c["call"] == call]
asked = c["args"][c["args"].index("--sections") + 1].split(",")
assert not r["problems"], r["problems"]
# The required items the check planned all ran and passed.
planned = [p for p in r["planned"] if p["need"] == "required"]
assert planned and all(names.get(p["name"], {}).get("exit") == "0" for p in planned), \
    [(p["name"], names.get(p["name"])) for p in planned]
assert set(asked) <= {p["section"] for p in planned}, (planned, asked)  # e2e.bundle's run holds a's and b's
for sec in asked:
    print("call %s, %s: %s" % (call, sec, globals()[sec]()))
