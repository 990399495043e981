"""The GPU check's report: reads the raw JSON of tools/gpu_check.sh's sections and writes
results.json and the summary table (stdout).

  python3 tools/gpu_check_report.py JSON_DIR RESULTS_JSON [--device cuda|cpu]
  python3 tools/gpu_check_report.py --run-tests BINARY --list FILE --out DIR [--test-limit-s S]
  python3 tools/gpu_check_report.py --plan DOC --check GPU_CHECK_SH --benchmarks DIR
  python3 tools/gpu_check_report.py --calls DOC [--call X]

(--run-tests: gpu_check.sh's tests item, all the listed tests in one process under a limit per
test; --plan: gpu_check.sh --plan, each documented call's items and seconds against its
timeout and its lease; --calls: the calls docs/gpu.md gives, for their test.)

results.json holds "card", "date", "env", "planned" (the items the check planned before its
first, from check.json), "sections" (each item's exit status, seconds and
whether it is required; "skipped": not started, its budget spent), "tests" (the GPU tests the
binary lists and what each did), "train" (losses, verification, and the resume against the
uninterrupted run), "records" (one per step cell: who, network, batch, precision,
sample_rate, channels_last, images_per_s, peak_memory_mb, card, cuda_graph, ...: the format
of docs/benchmarks/), "graph_checks" (each graph cell's losses against its eager cell's),
"ratios" (faceshard over arcface_torch per cell), "contributions" (each variant cell against
its base cell: what the fused optimiser, the PReLU kernel, the CUDA graphs and the real input
pipeline each change), "targets" (the step's targets on a GPU, held or not: reported, not a
failed check), "classifier" (bytes per class measured and planned), "classifier_vs_arcface_torch"
(faceshard's classifier step per cell beside arcface_torch's PartialFC_V2 alone at the same
classes per shard and rate: GEMMs, bytes, floor, arcface_torch / faceshard), "capacity",
"loader", "two_ranks", "checkpoint" (with its goals, held or not) and "problems".

A check that could not fail proves nothing, so each of these is a problem (exit status 1):
the check's refusal before its first item (a required item's limit cut by the budget); an
item that failed or ran past its limit; a required item not started (the budget spent), not
in status.tsv, or without its JSON; no list of the planned items; a section asked with nothing
in status.tsv; zero GPU tests, a test the binary lists that did not run or did not pass, a
skipped test on a GPU, a test that hung or crashed, a name of MIN_GPU_TESTS the binary does
not list; a step section without a graph cell or without arcface_torch's cell; a graph cell whose graphs were not
captured on a GPU, or whose losses differ from its eager cell's; a resumed run without its
"resumed from ... at step N" line or whose losses do not continue the uninterrupted run's;
the loss not falling; faceshard-verify disagreeing with the trainer; the classifier's bytes
per class more than 10% from the plan; a capacity plan without a class count, or the largest
count not trained; on a GPU, the checkpoint goals not held (the wait at a background
checkpoint at least 20x shorter than at a synchronous one, a step during a background write
at most 10% slower); two_ranks.json not "ok".
"""

import argparse
import datetime
import glob
import json
import os
import re
import sys


def load(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def jsonl(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass
    except OSError:
        pass
    return rows


# Multiply-accumulates per 112x112 image (faceshard-flops) and dense bf16/fp16 peaks by card
# (datasheets): MFU = images/s x MACs x 2 FLOP x 3 (forward and backward) / the peak.
GMAC = {"r50": 6.309, "mbf": 0.438, "r100": 12.12}
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0)]


def mfu(network, images_per_s, card, precision):
    peak = next((p for name, p in PEAK_TFLOPS if name in card), None)
    if peak is None or network not in GMAC or precision not in ("bf16", "fp16") or not images_per_s:
        return None
    return images_per_s * GMAC[network] * 1e9 * 6 / (peak * 1e12)


# A variant cell against the base cell (same network, batch, precision and layout): what the
# change is, and whether the variant is the change on (its speed-up is variant / base) or off
# (base / variant).
VARIANTS = {"unfused": ("optim.fused=false", "the fused optimiser", False),
            "atenprelu": ("model.prelu_kernel=false", "the PReLU backward kernel", False),
            "graph": ("train.cuda_graph=true", "CUDA graphs of the backbone", True),
            "jpeg": ("JPEG .rec", "the real input pipeline (JPEG .rec through the loader)", True)}

# The step's targets on one GPU (bf16, channels-last): images/s, times arcface_torch's step,
# and the real input pipeline's largest slowdown against fixed pixels.
TARGETS = {("r50", 256): (3500.0, 2.0, 0.05), ("mbf", 512): (10000.0, 4.0, 0.10)}


def contributions_of(records, raw_variant):
    out = []
    for r in records:
        key = raw_variant.get(id(r), "")
        if r["who"] != "faceshard" or key not in VARIANTS:
            continue
        base = [x for x in records if x["who"] == "faceshard" and not raw_variant.get(id(x)) and
                all(x[k] == r[k] for k in ("network", "batch", "precision", "channels_last"))]
        if not base or not base[0]["images_per_s"] or not r["images_per_s"]:
            continue
        _, change, on = VARIANTS[key]
        b, v = base[0]["images_per_s"], r["images_per_s"]
        out.append({"network": r["network"], "batch": r["batch"], "precision": r["precision"],
                    "channels_last": r["channels_last"], "change": change, "variant": key,
                    "base_images_per_s": b, "variant_images_per_s": v, "speedup": v / b if on else b / v})
    return out


def targets_of(records, raw_variant, ratios_ref, card):
    out = []
    for (net, batch), (ips, times, slowdown) in TARGETS.items():
        cells = [r for r in records if r["who"] == "faceshard" and r["network"] == net and r["batch"] == batch and
                 r["precision"] == "bf16" and r["channels_last"] and raw_variant.get(id(r), "") in ("", "graph")]
        if not cells:
            continue
        best = max(cells, key=lambda r: r["images_per_s"])
        ref = ratios_ref(net, batch)
        t = {"network": net, "batch": batch, "card": card, "images_per_s": best["images_per_s"],
             "variant": raw_variant.get(id(best), ""), "target_images_per_s": ips,
             "times_arcface_torch": best["images_per_s"] / ref if ref else None, "target_times_arcface_torch": times}
        jpeg = [r for r in records if r["who"] == "faceshard" and r["network"] == net and r["batch"] == batch and
                r["precision"] == "bf16" and r["channels_last"] and raw_variant.get(id(r)) == "jpeg"]
        base = [r for r in cells if not raw_variant.get(id(r))]
        if jpeg and base and base[0]["images_per_s"]:
            t["input_pipeline_slowdown"] = 1 - jpeg[0]["images_per_s"] / base[0]["images_per_s"]
            t["target_input_pipeline_slowdown"] = slowdown
        t["held"] = (t["images_per_s"] >= ips and t["times_arcface_torch"] is not None and
                     t["times_arcface_torch"] >= times and t.get("input_pipeline_slowdown", 0) <= slowdown)
        out.append(t)
    return out


def number(x):
    """x where it is a number (JSON from an older or newer tool may lack a field, or hold null)."""
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def col(x, form):
    x = number(x)
    return "-" if x is None else form.format(x)


def classifier_vs_arcface_torch(fs, at):
    """faceshard-bench's classifier runs (fs: its JSON) beside arcface_torch_step.py
    --classifier-only's cells (at: its JSON), matched by classes per shard and sample rate at
    the same batch per rank: one row per faceshard run (weight dtype and logits are
    faceshard's choices; arcface_torch has one cell for them all), then arcface_torch's cells
    that no faceshard run matched. A field either side lacks is None."""
    def runs_of(j):
        runs = (j or {}).get("runs")
        return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []
    rows = []
    at_runs = runs_of(at)
    same_batch = not fs or not at or number(fs.get("batch_per_rank")) is None or \
        number(at.get("batch_per_rank")) is None or fs["batch_per_rank"] == at["batch_per_rank"]
    used = set()
    for r in runs_of(fs):
        row = {k: r.get(k) for k in ("classes_per_shard", "sample_rate", "precision", "fc_weight_dtype", "logits",
                                     "step_ms", "gemm_ms", "ops_per_step", "bytes_per_step", "bandwidth_gbs",
                                     "floor_ms", "step_over_floor")}
        match = [i for i, q in enumerate(at_runs)
                 if same_batch and q.get("classes_per_shard") == r.get("classes_per_shard")
                 and number(q.get("sample_rate")) is not None and number(r.get("sample_rate")) is not None
                 and abs(q["sample_rate"] - r["sample_rate"]) < 1e-9]
        q = at_runs[match[0]] if match else {}
        used.update(match[:1])
        row["arcface_torch_step_ms"] = number(q.get("step_ms"))
        row["arcface_torch_not_run"] = q.get("not_run")
        row["arcface_torch_precision"] = (at or {}).get("precision") if q else None
        a_ms, f_ms = row["arcface_torch_step_ms"], number(row["step_ms"])
        row["arcface_torch_over_faceshard"] = a_ms / f_ms if a_ms is not None and f_ms else None
        rows.append(row)
    for i, q in enumerate(at_runs):
        if i not in used:
            rows.append({"classes_per_shard": q.get("classes_per_shard"), "sample_rate": q.get("sample_rate"),
                         "arcface_torch_step_ms": number(q.get("step_ms")), "arcface_torch_not_run": q.get("not_run"),
                         "arcface_torch_precision": at.get("precision"), "arcface_torch_over_faceshard": None})
    return rows


def pct(x):
    return f"{100 * x:.1f}%" if x else "-"


def fmt(x, digits=4):
    return "none" if x is None else f"{x:.{digits}f}"


# The GPU tests that must exist: the check runs what the binary lists under the filter, and
# this list catches a test renamed or removed (the binary would no longer list it, and the
# check would pass without it). Add a GPU test here when it is added to tests/.
MIN_GPU_TESTS = [
    "AppOptim.CudaMatchesCpu",
    "BackboneForward.CudaReducedPrecision",
    "DataLoader.CudaCopyMatchesCpuBatches",
    "DistributedCuda.NcclCollectivesAtWorldOne",
    "DistributedCuda.RuntimeAtWorldOneWithNccl",
    "GraphedBackboneCuda.StepsMatchEagerWithoutHostSync",
    "PReLUCuda.BackwardMatchesATenAndFloat64",
    "PartialFCCuda.MatchesCpu",
    "PartialFCCuda.StreamedEqualsBuffered",
    "StochasticRoundCuda.SameBitsAsTheCpu",
    "TrainStepCuda.StepsWithoutHostSynchronisation",
    "GraphedBackboneCuda.FailedCaptureKeepsMemoryFlat",
    "AppOptim.FusedFlatCudaMatchesCpu",
    "PartialFCCuda.FirstStepsWithoutHostSynchronisation",
    "ElasticFaceDrawsCuda.SameAsTheCpuWithoutHostSync",
    "FineTune.CudaGraphsRefusedWhileFreezing",
    "RowUpdateCuda.SameAsTheCpuLoop",
    "PReLU.FailedCudaLaunchNamesTheKernel",
    "AsyncCheckpointCuda.SavesTheStateOfItsStepWhileTrainingGoesOn",
]

# A graph cell's per-step losses against its eager cell's (the same job, seed and batches):
# relative difference per step. Reduced precision with cuDNN's benchmark on may choose other
# algorithms for the graphs' shapes, and the difference grows over the cell's 40-odd steps;
# fp32 (the CPU's cells, TF32 on a GPU) agrees far more closely.
STEP_LOSS_TOL = {"fp32": 1e-3, "bf16": 0.02, "fp16": 0.02}
# The resumed run's per-step losses against the uninterrupted run's at the same steps. A GPU
# run is not bit-reproducible (atomics in the backward), so two runs part slowly; a resume
# that loses the data position, the optimiser's state or the weights moves the loss by more.
# On the CPU the two runs compute the same numbers.
RESUME_TOL = {"cuda": 0.05, "cpu": 1e-4}
RESUMED_LINE = re.compile(r"resumed from (\S+) at step (\d+)")


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def read_status(d):
    items = []
    try:
        with open(os.path.join(d, "status.tsv")) as f:
            for line in f:
                name, rc, secs, need = (line.rstrip("\n").split("\t") + ["", "", "", ""])[:4]
                if not name:
                    continue
                try:
                    seconds = float(secs or 0)
                except ValueError:
                    seconds = 0.0
                items.append({"name": name, "exit": rc, "seconds": seconds, "required": need != "optional"})
    except OSError:
        pass
    return items


def judge_items(items, problems):
    skipped = []
    for s in items:
        if s["name"] == "total":
            continue
        if s["exit"] == "skipped":
            skipped.append(s["name"])
            if s["required"]:
                problems.append(f"{s['name']}: not started, the budget was spent (a required item)")
        elif s["exit"] == "absent":
            continue
        elif s["exit"] != "0":
            why = " (killed at its time limit)" if s["exit"] in ("124", "137") else ""
            problems.append(f"{s['name']} exited {s['exit']}{why}")
    return skipped


def judge_tests(d, device, problems):
    """The GPU tests: the binary's list (gtest_expected.txt), each test's GoogleTest JSON."""
    tests = {"expected": [], "passed": 0, "failed": 0, "skipped": 0, "missing": [], "failures": [], "names": [],
             "skipped_names": []}
    try:
        with open(os.path.join(d, "gtest_expected.txt")) as f:
            tests["expected"] = [l.strip() for l in f if l.strip()]
    except OSError:
        problems.append("tests: no list of the GPU tests from the test binary (--gtest_list_tests)")
    expected = tests["expected"]
    for name in MIN_GPU_TESTS:
        if name not in expected:
            problems.append(f"tests: the test binary does not list {name} (renamed or removed? it is in "
                            f"gpu_check_report.py's MIN_GPU_TESTS)")
    results = {}
    paths = sorted(glob.glob(os.path.join(d, "gtest", "*.json"))) + [os.path.join(d, "gtest.json")]
    tests["processes"] = 0
    for path in paths:
        g = load(path)
        if not g:
            continue
        tests["processes"] += 1
        for suite in g.get("testsuites", []):
            for t in suite.get("testsuite", []):
                results[f"{suite['name']}.{t['name']}"] = t
    for name, t in sorted(results.items()):
        tests["names"].append(name)
        if t.get("failures"):
            tests["failed"] += 1
            tests["failures"].append({"test": name, "message": t["failures"][0].get("failure", "")[:2000]})
        elif t.get("result") in ("SKIPPED", "SUPPRESSED") or t.get("status") == "NOTRUN":
            tests["skipped"] += 1
            tests["skipped_names"].append(name)
        else:
            tests["passed"] += 1
    tests["missing"] = [n for n in expected if n not in results]
    for n in tests["missing"]:
        problems.append(f"tests: {n} is listed by the test binary but has no result (did not run, crashed or hung)")
    if tests["failed"]:
        problems.append(f"tests: {tests['failed']} GPU test(s) failed: {', '.join(f['test'] for f in tests['failures'])}")
    for f_ in tests["failures"]:
        # The runner's own verdicts (gpu_check_report.py --run-tests): a hang or a crash.
        if f_["message"].startswith(("hung:", "crashed:", "killed at")):
            problems.append(f"tests: {f_['test']} {f_['message'].split(';')[0]}")
    if device == "cuda" and tests["skipped"]:
        problems.append(f"tests: {tests['skipped']} GPU test(s) skipped on a GPU: {', '.join(tests['skipped_names'])}")
    if tests["passed"] == 0:
        problems.append("tests: zero tests passed")
    return tests


# Which section an item belongs to, by its name: for a folder whose check.json has no plan.
SECTION_PREFIXES = [("env", ("env", "tools_load")), ("tests", ("tests", "test_")),
                    ("train", ("train_", "export_", "verify_")), ("step", ("step_", "jpeg_data")),
                    ("classifier", ("classifier", "plan_", "arcface_classifier")), ("capacity", ("cap_",)),
                    ("loader", ("loader",)), ("tworanks", ("tworanks",)), ("checkpoint", ("checkpoint",))]


def section_of(name, planned_sections):
    if name in planned_sections:
        return planned_sections[name]
    for sec, prefixes in SECTION_PREFIXES:
        if name.startswith(prefixes):
            return sec
    return None


def judge_planned(d, check, asked, items, plan_problems, problems):
    """The required items the check planned (check.json's "planned", written before its first
    item): each must be in status.tsv and, where it exited 0, have left its JSON; and every
    section asked must have left something in status.tsv. A result that lacks work it was
    asked for proves nothing about that work."""
    planned = check.get("planned")
    if plan_problems:
        return planned if isinstance(planned, list) else []
    if asked and not isinstance(planned, list):
        problems.append("check.json: no list of the items the check planned ('planned'): its required items "
                        "cannot be held to their results")
        planned = []
    planned = [p for p in planned if isinstance(p, dict) and p.get("name")]
    ran = {s["name"]: s for s in items}
    for p in planned:
        if p.get("need") != "required":
            continue
        s = ran.get(p["name"])
        if s is None:
            problems.append(f"{p['name']}: a required item of the {p.get('section') or '?'} section, planned by the "
                            f"check, is not in status.tsv (it never ran)")
        elif s["exit"] == "0" and p.get("json") and load(os.path.join(d, p["json"])) is None:
            problems.append(f"{p['name']}: no {p['json']} (the result of a required item)")
    sections = {p["name"]: p.get("section") for p in planned}
    for sec in asked:
        if not any(section_of(s["name"], sections) == sec for s in items if s["name"] != "total"):
            problems.append(f"{sec}: asked, but nothing of it in status.tsv")
    return planned


# Call d's goals for checkpoints written in the background (tools/checkpoint_stall.py): the
# training waits at least 20x less than while a synchronous checkpoint is written (median over
# the checkpoints: the first background one also allocates its pinned staging), and a step
# during a background write takes at most 10% longer than the others.
CHECKPOINT_WAIT_RATIO = 20.0
CHECKPOINT_STEP_SLOWDOWN = 1.10


def checkpoint_goals(checkpoint):
    import statistics
    ratios = [number(r.get("wait_ratio")) for r in checkpoint.get("checkpoints", []) if isinstance(r, dict)]
    ratios = [x for x in ratios if x is not None]
    wr = statistics.median(ratios) if ratios else None
    doa = number((checkpoint.get("background_steps") or {}).get("during_over_away"))
    return [{"goal": "wait", "what": "the training's wait at a synchronous checkpoint over its wait at a background one "
                                     f"(median of {len(ratios)})", "value": wr, "target": f">= {CHECKPOINT_WAIT_RATIO:g}",
             "held": wr is not None and wr >= CHECKPOINT_WAIT_RATIO},
            {"goal": "step", "what": "a step's time during a background write over the other steps' (medians)",
             "value": doa, "target": f"<= {CHECKPOINT_STEP_SLOWDOWN:.2f}",
             "held": doa is not None and doa <= CHECKPOINT_STEP_SLOWDOWN}]


def losses_of(rows):
    return [(int(r["step"]), float(r["loss"])) for r in rows if "loss" in r and "step" in r and r["loss"] is not None]


def judge_resume(d, device, problems):
    """The resumed run (its log's "resumed from ... at step N" and its losses after N) against
    the uninterrupted run's losses at the same steps."""
    plan = load(os.path.join(d, "train_resume.json"))
    if not plan:
        problems.append("train: no record of the resume to judge (train_resume.json)")
        return None
    prec, stop = plan.get("precision", "bf16"), int(plan["stop_step"])
    tol = RESUME_TOL.get(device, RESUME_TOL["cuda"])
    out = {"precision": prec, "stop_step": stop, "tolerance": tol, "resumed_at": None, "compared_steps": [],
           "max_relative_difference": None, "before_resume_max_relative_difference": None}
    try:
        with open(os.path.join(d, f"train_{prec}_resume.log"), errors="replace") as f:
            m = RESUMED_LINE.search(f.read())
    except OSError:
        m = None
    if not m:
        problems.append(f"train {prec}: the resumed run did not say 'resumed from ... at step N'")
    else:
        out["resumed_at"] = int(m.group(2))
        out["checkpoint"] = m.group(1)
        if out["resumed_at"] != stop:
            problems.append(f"train {prec}: resumed at step {out['resumed_at']}, expected the checkpoint of step {stop}")
    at = out["resumed_at"] if out["resumed_at"] is not None else stop
    run = losses_of(jsonl(os.path.join(d, f"train_{prec}_metrics.jsonl")))
    full = dict(losses_of(jsonl(os.path.join(d, f"train_{prec}_full_metrics.jsonl"))))
    before = {s: l for s, l in run if s <= at}
    after = {}
    for s, l in run:  # the resumed run's lines come after the first run's: the last line of a step
        if s > at:
            after[s] = l
    if not after:
        problems.append(f"train {prec}: the resumed run logged no loss after step {at}")
    if not full:
        problems.append(f"train {prec}: the uninterrupted run logged no loss")
    common = sorted(s for s in after if s in full)
    out["compared_steps"] = common
    if after and full and not common:
        problems.append(f"train {prec}: no step that both the resumed and the uninterrupted run logged")
    if common:
        worst = max(common, key=lambda s: rel(after[s], full[s]))
        out["max_relative_difference"] = rel(after[worst], full[worst])
        out["losses"] = [[s, after[s], full[s]] for s in common]
        if out["max_relative_difference"] > tol:
            problems.append(f"train {prec}: the resumed run's loss at step {worst} is {after[worst]:.6g}, the "
                            f"uninterrupted run's {full[worst]:.6g} ({100 * out['max_relative_difference']:.3g}% apart, "
                            f"more than {100 * tol:.3g}%): the resume does not continue the run")
    # Before the resume both runs are the same run: if they part there, the comparison after
    # it cannot tell a resume from noise.
    early = sorted(s for s in before if s in full)
    if early:
        worst = max(early, key=lambda s: rel(before[s], full[s]))
        out["before_resume_max_relative_difference"] = rel(before[worst], full[worst])
        if out["before_resume_max_relative_difference"] > tol:
            problems.append(f"train {prec}: before the resume, two runs from the same start differ at step {worst} "
                            f"({before[worst]:.6g} vs {full[worst]:.6g}): the resume's comparison cannot tell")
    return out


def judge_graph_cells(records, raw_variant, cells, device, problems):
    """A graph cell counts only where its graphs were captured (on a GPU), and its losses
    equal its eager base cell's."""
    checks = []
    for r in records:
        if r["who"] != "faceshard" or raw_variant.get(id(r)) not in ("graph", "graph-eager"):
            continue
        name = r["cell"]
        base = [x for x in records if x["who"] == "faceshard" and not raw_variant.get(id(x)) and
                all(x[k] == r[k] for k in ("network", "batch", "precision", "channels_last"))]
        check = {"cell": name, "captured": bool((r.get("cuda_graph") or {}).get("captured")), "base": None,
                 "steps": 0, "max_relative_difference": None}
        if not base:
            problems.append(f"{name}: no eager cell (the same network, batch, precision and layout) to compare "
                            f"its losses with")
            checks.append(check)
            continue
        check["base"] = base[0]["cell"]
        a, b = cells[name].get("losses"), cells[base[0]["cell"]].get("losses")
        if not a or not b:
            problems.append(f"{name}: no per-step losses in {'its JSON' if not a else base[0]['cell'] + '.json'} "
                            f"to compare")
        elif len(a) != len(b):
            problems.append(f"{name}: {len(a)} step losses against {len(b)} in {base[0]['cell']}")
        elif any(x is None for x in a + b):
            problems.append(f"{name}: a loss that is not finite (its cell or {base[0]['cell']})")
        else:
            tol = STEP_LOSS_TOL.get(r["precision"], 0.02)
            k = max(range(len(a)), key=lambda i: rel(a[i], b[i]))
            check.update(steps=len(a), max_relative_difference=rel(a[k], b[k]), tolerance=tol)
            if rel(a[k], b[k]) > tol:
                problems.append(f"{name}: its loss at step {k} is {a[k]:.6g}, the eager cell's {b[k]:.6g} "
                                f"({100 * rel(a[k], b[k]):.3g}% apart, more than {100 * tol:.3g}%)")
        checks.append(check)
    return checks


# ---------------------------------------------------------------- the GPU tests' runner
# gpu_check.sh's tests item: every listed test in one process of the test binary (a process
# per test pays LibTorch CUDA's load and cuDNN's start-up each time), with a time limit per
# test read from the console's "[ RUN      ]" lines. A test that hangs past the limit, or
# during which the process dies, gets a failed result that says so, and the tests after it
# run again in a new process; a process's GoogleTest JSON (written only at its normal end) or,
# where it did not end normally, the results its console printed, go to OUT/runN.json.
GTEST_RESULT = re.compile(r"^\[\s+(OK|FAILED|SKIPPED)\s+\] (\S+) \(\d+ ms\)")
GTEST_RUN = re.compile(r"^\[ RUN      \] (\S+)")


def gtest_doc(results):
    """GoogleTest's JSON layout for {name: (result, failure message or None)}."""
    suites = {}
    for name, (result, failure) in results.items():
        suite, test = name.split(".", 1)
        t = {"name": test, "status": "RUN", "result": result}
        if failure is not None:
            t["failures"] = [{"failure": failure, "type": ""}]
        suites.setdefault(suite, []).append(t)
    return {"tests": len(results), "testsuites": [{"name": s, "testsuite": ts} for s, ts in suites.items()]}


def run_tests(argv):
    import signal
    import subprocess
    import threading
    import time
    p = argparse.ArgumentParser(prog="gpu_check_report.py --run-tests")
    p.add_argument("binary")
    p.add_argument("--list", required=True, help="the tests to run, one full name a line")
    p.add_argument("--out", required=True, help="the folder of each process's GoogleTest JSON")
    p.add_argument("--test-limit-s", type=float, default=90.0)
    p.add_argument("--limit-s", type=float, default=None,
                   help="the whole run's limit (default: $GPU_CHECK_ITEM_LIMIT_S, the item's limit in gpu_check.sh)")
    a = p.parse_args(argv)
    try:
        with open(a.list) as f:
            remaining = [l.strip() for l in f if l.strip()]
    except OSError as e:
        print(f"--run-tests: cannot read the list of tests {a.list}: {e.strerror}")
        return 2
    limit = a.limit_s if a.limit_s is not None else float(os.environ.get("GPU_CHECK_ITEM_LIMIT_S") or 0) or None
    # Ends a little before the item's limit kills it, so that what ran is written down.
    deadline = time.monotonic() + limit - 5 if limit else None
    os.makedirs(a.out, exist_ok=True)
    state = {"child": None}

    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    all_ok, attempt = True, 0
    print(f"{len(remaining)} test(s), each under {a.test_limit_s:g} s" + (f", all within {limit:g} s" if limit else ""),
          flush=True)
    while remaining:
        attempt += 1
        json_path = os.path.join(a.out, f"run{attempt}.json")
        cmd = [a.binary, "--gtest_filter=" + ":".join(remaining), "--gtest_output=json:" + json_path]
        print(f"-- process {attempt}: {len(remaining)} test(s)", flush=True)
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                 bufsize=1, start_new_session=True)
        state["child"] = child
        seen = {}        # name -> (result, failure) from the console
        current = {"name": None, "t0": 0.0, "lines": []}
        lock = threading.Lock()

        def reader():
            for line in child.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                with lock:
                    m = GTEST_RUN.match(line)
                    if m:
                        current.update(name=m.group(1), t0=time.monotonic(), lines=[])
                        continue
                    m = GTEST_RESULT.match(line)
                    if m and m.group(2) == current["name"]:
                        kind = m.group(1)
                        seen[m.group(2)] = ("SKIPPED" if kind == "SKIPPED" else "COMPLETED",
                                            "".join(current["lines"])[-2000:] or "failed" if kind == "FAILED" else None)
                        current.update(name=None, lines=[])
                    elif current["name"] is not None and len(current["lines"]) < 200:
                        current["lines"].append(line)
        th = threading.Thread(target=reader, daemon=True)
        th.start()
        culprit, why = None, None
        try:
            while child.poll() is None:
                time.sleep(0.2)
                with lock:
                    name, t0 = current["name"], current["t0"]
                now = time.monotonic()
                if name is not None and now - t0 > a.test_limit_s:
                    culprit, why = name, f"hung: no result within {a.test_limit_s:g} s; the process was killed " \
                                         f"and the tests after it run again in a new process"
                elif deadline is not None and now > deadline:
                    culprit, why = name, "killed at the tests' time limit (the item's limit)"
                if why:
                    os.killpg(child.pid, signal.SIGKILL)
                    break
        except KeyboardInterrupt:
            culprit, why = current["name"], "killed at the tests' time limit (the item's limit)"
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        th.join(timeout=5)
        rc = child.returncode
        if why is None and rc != 0 and not os.path.exists(json_path):
            culprit = current["name"]
            how = f"was killed by signal {-rc}" if rc < 0 else f"ended with status {rc}"
            why = f"crashed: the test binary {how} during this test; the tests after it run again in a new process"
        results = {}
        if why is None and load(json_path):
            pass  # the process ended normally and wrote its own JSON
        else:
            results = dict(seen)
            if culprit:
                results[culprit] = ("COMPLETED", why)
            with open(json_path, "w") as f:
                json.dump(gtest_doc(results), f, indent=1)
        done = set()
        for suite in (load(json_path) or {}).get("testsuites", []):
            for t in suite.get("testsuite", []):
                full = f"{suite['name']}.{t['name']}"
                done.add(full)
                if t.get("failures"):
                    all_ok = False
        if rc != 0:
            all_ok = False
        left = [n for n in remaining if n not in done]
        if why and why.startswith("killed at the tests' time limit"):
            print(f"-- stopped at the time limit; {len(left)} test(s) not run", flush=True)
            return 124
        if len(left) == len(remaining):
            print(f"-- process {attempt} left no result for any test (status {rc}); {len(left)} not run", flush=True)
            return 1
        if left and why is None:
            # A normal end without every test: the binary does not have them (the report names
            # each as listed without a result).
            print(f"-- {len(left)} test(s) without a result: {', '.join(left)}", flush=True)
            return 1
        remaining = left
    return 0 if all_ok else 1


# ---------------------------------------------------------------- the calls and their plan
# docs/gpu.md gives each call of a GPU lease as the exact command a device run takes, under a
# "### Lease N" heading, with its "**x**:" letter and its timeout_s; the calls' test
# (tests/e2e/gpu_check_calls.sh) and the plan (gpu_check.sh --plan) read them from there, so
# that neither can drift from what the page tells a reader to run.
LEASE_S = 900         # device time a lease gives, its machine's start included
START_S = 240         # the machine's start, at its longest (120-240 s)
COMMAND_S = 600       # the longest one command may run
GRACE_S = 40          # gpu_check.sh's grace past its budget
UNPACK_S = 10         # per call: unpacking the bundle, the check's own plan of its items
ITEM_OVERHEAD_S = 1   # per item: a free port, the time limit's process
REPORT_S = 3          # per section and at the end: the report and the logs' tarball

# Items no GPU run has timed yet (or whose work has changed since): seconds guessed from what
# they do, or from a measured item they resemble, until a run's JSON holds them. Each: a
# pattern of the item's name, the measured item it follows (a template of the pattern's
# groups, or None), a factor and seconds added, and why.
GUESSED = [
    (r"^env$", None, 0, 5, "imports torch"),
    (r"^tests_list$", None, 0, 2, "lists the tests"),
    (r"^tests$", None, 0, 90, "6 GPU tests took 25 s in one process on an H200; 19 now, some of them r50 steps and "
                               "graph captures"),
    (r"^train_bf16_full$", "train_bf16_part1", 1.0, 8, "47 steps where the first part runs 37"),
    (r"^step_faceshard_(.+)_graph$", r"step_faceshard_\1", 1.0, 10, "its eager cell and the capture's warm-up"),
    (r"^step_faceshard_(.+)_(unfused|atenprelu)$", r"step_faceshard_\1", 1.2, 0, "its base cell, slower"),
    (r"^step_faceshard_(.+)_jpeg$", r"step_faceshard_\1", 1.0, 5, "its base cell and the JPEG loader's start"),
    (r"^step_faceshard_(.+)_bf16_cl$", None, 0, 25, "a step cell"),
    (r"^step_faceshard_(.+)_nchw$", r"step_faceshard_\1_cl", 1.5, 0, "its channels-last cell, slower"),
    (r"^step_", None, 0, 25, "a step cell"),
    (r"^jpeg_data$", None, 0, 20, "faceshard-synth writes 20,000 JPEG images"),
    (r"^arcface_classifier$", None, 0, 90, "runs cells until 20 s before its limit"),
    (r"^tworanks$", None, 0, 120, "4 demo trainings at world 2 (2 on the GPU, 2 on the CPU) and the *GlooCuda* tests"),
    (r"^cap_plan_", None, 0, 1, "faceshard-plan"),
    (r"^cap_largest_", None, 0, 60, "about 38M classes drawn and 2 steps"),
    (r"^cap_storage$", None, 0, 45, "16 classifier runs at 1M and 2M classes"),
    (r"^cap_gathered$", None, 0, 40, "4 classifier runs at batch 8192"),
    (r"^cap_200k$", None, 0, 30, "4 classifier runs at 200k classes"),
    (r"^cap_step_r50_", "step_faceshard_r50_256_bf16_cl", 1.0, 0, "the r50 step cell"),
    (r"^checkpoint_stall$", None, 0, 150, "two r50 trainings of 60 steps at 2M classes, 3 checkpoints of 4 GB each"),
    (r"^plan_", None, 0, 1, "faceshard-plan"),
]


# Items whose work has changed since the GPU results timed them: their guess stands instead.
CHANGED_SINCE_TIMED = {"env": "an item of its own since (it was not timed)",
                       "tests": "the H200's run timed 6 GPU tests"}


def parse_calls(doc):
    """[{lease, call, command, args, timeout_s}] from docs/gpu.md's lease headings and blocks."""
    import shlex
    calls, lease, call, block = [], None, None, None
    for line in open(doc):
        m = re.match(r"^### Lease (\d+)\b", line)
        if m:
            lease, call = int(m.group(1)), None
            continue
        if line.startswith("## "):
            lease = None
        m = re.match(r"^\*\*([a-z])\*\*:", line)
        if m:
            call = m.group(1)
        if line.startswith("```"):
            if block is None:
                block = {}
            else:
                if "command" in block and lease is not None and call is not None:
                    m = re.search(r"gpu_check\.sh \$OUT (.*?) 2>&1", block["command"])
                    if not m:
                        raise ValueError(f"call {call}: no 'gpu_check.sh $OUT ... 2>&1' in its command")
                    calls.append({"lease": lease, "call": call, "command": block["command"],
                                  "args": shlex.split(m.group(1)), "timeout_s": int(block.get("timeout_s", 0))})
                    call = None
                block = None
            continue
        if block is not None:
            m = re.match(r"^(command|carry|timeout_s):\s*(.*)$", line.rstrip("\n"))
            if m:
                block[m.group(1)] = m.group(2)
    return calls


def gpu_timings(folder):
    """Per item, its seconds on a GPU: the newest results first (by date, then name), each
    item from the newest file that timed it."""
    runs = []
    for path in glob.glob(os.path.join(folder, "*.json")):
        j = load(path)
        if isinstance(j, dict) and j.get("device") == "cuda" and isinstance(j.get("sections"), list):
            runs.append((str(j.get("date", "")), os.path.basename(path), j))
    runs.sort(reverse=True)
    seconds = {}
    for _, name, j in runs:
        for s in j["sections"]:
            if s.get("exit") not in ("skipped", "absent") and s.get("name") not in seconds and \
                    number(s.get("seconds")) is not None and s["name"] != "total":
                seconds[s["name"]] = (float(s["seconds"]), name)
    return seconds, [name for _, name, _ in runs]


def estimate(name, timed, limit):
    if name in timed and name not in CHANGED_SINCE_TIMED:
        return timed[name][0], timed[name][1]
    for pattern, follows, factor, add, why in GUESSED:
        m = re.match(pattern, name)
        if not m:
            continue
        if follows:
            base = m.expand(follows)
            if base in timed:
                return timed[base][0] * factor + add, f"guessed: {why} ({base})"
            continue
        return float(add), f"guessed: {why}" + (f" ({CHANGED_SINCE_TIMED[name]})" if name in CHANGED_SINCE_TIMED else "")
    return float(limit), "guessed: its time limit (nothing known)"


def dry_run(check, args):
    import subprocess
    p = subprocess.run(["bash", check, "--dry-run"] + args, capture_output=True, text=True)
    if p.returncode != 0:
        raise ValueError(f"gpu_check.sh --dry-run {' '.join(args)} exited {p.returncode}: {p.stderr.strip()[-300:]}")
    items = []
    for line in p.stdout.splitlines():
        name, need, limit, js, sec = line.split("\t")
        items.append({"name": name, "need": need, "limit_s": int(limit), "json": js, "section": sec})
    return items


def plan_call(c, check, timed):
    """The items of one call in the order they run, each with its estimate; the call's
    expected seconds (the budget's cuts applied) and its longest (the budget and its grace);
    and why it does not fit, if it does not."""
    args = c["args"]
    budget = int(args[args.index("--budget-s") + 1]) if "--budget-s" in args else 420
    sections = args[args.index("--sections") + 1].split(",") if "--sections" in args else []
    items = dry_run(check, args)
    why = []
    t = 0.0
    required_end = 0.0  # the required items' seconds, uncut by the budget
    for it in items:
        est, src = estimate(it["name"], timed, it["limit_s"])
        it.update(estimate_s=est, source=src)
        if it["need"] == "required" and budget and it["limit_s"] > budget + GRACE_S:
            why.append(f"{it['name']}'s limit of {it['limit_s']} s is past --budget-s {budget} + {GRACE_S} s")
        if budget and t >= budget:
            it["runs"] = False
            if it["need"] == "required":
                why.append(f"{it['name']} (required) would not start: the budget of {budget} s is spent by then")
            continue
        lim = it["limit_s"] if not budget else min(it["limit_s"], budget - t + GRACE_S)
        it["runs"] = True
        t += min(est, lim) + ITEM_OVERHEAD_S
        if it["need"] == "required":
            required_end += min(est, it["limit_s"]) + ITEM_OVERHEAD_S
    reports = REPORT_S * (len(sections) + 1)
    expected = UNPACK_S + t + reports
    if budget:
        longest = UNPACK_S + min(budget + GRACE_S + ITEM_OVERHEAD_S, sum(i["limit_s"] + ITEM_OVERHEAD_S for i in items)) \
            + reports
    else:
        longest = UNPACK_S + sum(i["limit_s"] + ITEM_OVERHEAD_S for i in items) + reports
    if budget and required_end > budget:
        why.append(f"its required items are expected to take {required_end:.0f} s, past --budget-s {budget}")
    if longest > c["timeout_s"]:
        why.append(f"it may run {longest:.0f} s (the budget, its grace and the reports), past its timeout_s "
                   f"{c['timeout_s']}")
    if c["timeout_s"] > COMMAND_S:
        why.append(f"timeout_s {c['timeout_s']} is past the {COMMAND_S} s a command may run")
    return {"items": items, "budget": budget, "expected_s": expected, "required_s": UNPACK_S + required_end,
            "longest_s": longest, "why": why}


def plan(argv):
    p = argparse.ArgumentParser(prog="gpu_check_report.py --plan")
    p.add_argument("doc")
    p.add_argument("--check", required=True, help="gpu_check.sh (its --dry-run lists a call's items)")
    p.add_argument("--benchmarks", required=True, help="the folder of the GPU results (docs/benchmarks)")
    p.add_argument("--start-s", type=int, default=START_S)
    p.add_argument("--lease-s", type=int, default=LEASE_S)
    a = p.parse_args(argv)
    try:
        calls = parse_calls(a.doc)
    except (OSError, ValueError) as e:
        print(f"gpu_check.sh --plan: refused: cannot read the calls of {a.doc}: {e}", file=sys.stderr)
        return 1
    if not calls:
        print(f"gpu_check.sh --plan: refused: {a.doc} has no call under a '### Lease N' heading", file=sys.stderr)
        return 1
    timed, sources = gpu_timings(a.benchmarks)
    print(f"== the GPU check's calls ({a.doc}); seconds from {', '.join(sources) or 'no GPU results'}, "
          f"guessed where no run has timed an item")
    refused = []
    leases = {}
    for c in calls:
        leases.setdefault(c["lease"], []).append(c)
    for lease, cs in sorted(leases.items()):
        total = sum(c["timeout_s"] for c in cs) + a.start_s
        fits = total <= a.lease_s
        print(f"-- lease {lease}: calls {', '.join(c['call'] for c in cs)}: timeouts "
              f"{' + '.join(str(c['timeout_s']) for c in cs)} s + a start of {a.start_s} s = {total} s of {a.lease_s}: "
              f"{'fits' if fits else 'does not fit'}")
        if not fits:
            refused.append(f"lease {lease}: its calls' timeouts and a start of {a.start_s} s make {total} s, "
                           f"past {a.lease_s}")
        for c in cs:
            try:
                q = plan_call(c, a.check, timed)
            except ValueError as e:
                refused.append(f"call {c['call']}: {e}")
                continue
            sec = c["args"][c["args"].index("--sections") + 1] if "--sections" in c["args"] else "(default)"
            print(f"   call {c['call']}: {sec}, --budget-s {q['budget']}, timeout_s {c['timeout_s']}: expected "
                  f"{q['expected_s']:.0f} s (required items done at {q['required_s']:.0f} s), at most "
                  f"{q['longest_s']:.0f} s: {'fits' if not q['why'] else 'does not fit'}")
            for it in q["items"]:
                print(f"      {it['name']:40} {it['need']:8} limit {it['limit_s']:>4} s  "
                      f"{'~%5.0f s' % it['estimate_s'] if it['runs'] else '  not started'}  {it['source']}")
            refused += [f"call {c['call']}: {w}" for w in q["why"]]
    if refused:
        print("gpu_check.sh --plan: refused: " + "; ".join(refused), file=sys.stderr)
        return 1
    print("-- every call and every lease fits")
    return 0


def print_calls(argv):
    """The documented calls, for the calls' test: "LEASE CALL TIMEOUT_S" then the check's
    arguments, tab-separated, one call a line (--call X: that call's arguments, one a line)."""
    p = argparse.ArgumentParser(prog="gpu_check_report.py --calls")
    p.add_argument("doc")
    p.add_argument("--call", default=None)
    a = p.parse_args(argv)
    calls = parse_calls(a.doc)
    if a.call:
        c = [c for c in calls if c["call"] == a.call]
        if not c:
            print(f"no call {a.call!r} in {a.doc} (calls: {', '.join(c['call'] for c in calls)})", file=sys.stderr)
            return 1
        print("\n".join(c[0]["args"]))
        return 0
    for c in calls:
        print("\t".join([str(c["lease"]), c["call"], str(c["timeout_s"])] + c["args"]))
    return 0

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json_dir")
    p.add_argument("results")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    d = a.json_dir
    problems = []

    check = load(os.path.join(d, "check.json"), {})
    items = read_status(d)
    asked = [s for s in str(check.get("sections", "")).split(",") if s]
    if not asked:  # an older check's folder: the sections its items show
        prefixes = {"env": "env", "tests": "test", "train": "train", "step": "step_", "classifier": "classifier",
                    "capacity": "cap_", "loader": "loader", "tworanks": "tworanks", "checkpoint": "checkpoint_"}
        asked = [k for k, v in prefixes.items() if any(s["name"].startswith(v) for s in items)]
    # A call the check refused before its first item (a required item's limit cut by the
    # budget): its reasons are the problems.
    plan_problems = [str(x) for x in check.get("plan_problems") or []]
    problems.extend(plan_problems)
    if not items and not plan_problems:
        problems.append("no item ran (status.tsv is empty or missing)")
    skipped = judge_items(items, problems)
    planned_items = judge_planned(d, check, asked, items, plan_problems, problems)

    env = load(os.path.join(d, "env.json"), {})
    card = "cpu"
    smi = os.path.join(d, "nvidia-smi.csv")
    if os.path.exists(smi):
        with open(smi) as f:
            first = f.readline().strip()
        if first:
            env["nvidia_smi"] = first
            card = first.split(",")[0].strip()
    elif env.get("gpus"):
        card = env["gpus"][0]["name"]
    if a.device == "cpu":
        card = "cpu"
    date = datetime.date.today().isoformat()

    # tests
    tests = judge_tests(d, a.device, problems) if "tests" in asked else {}

    # train
    train = {}
    for prec in ("bf16", "fp16"):
        m = jsonl(os.path.join(d, f"train_{prec}_metrics.jsonl"))
        if not m:
            continue
        losses = [(r["step"], r["loss"]) for r in m if "loss" in r]
        acc = [(r["step"], r["val/synth/accuracy"]) for r in m if "val/synth/accuracy" in r]
        v = load(os.path.join(d, f"verify_{prec}.json"), {})
        verify_acc = v.get("sets", [{}])[0].get("accuracy") if v.get("sets") else None
        entry = {"losses": losses, "verification": acc, "verify_tool_accuracy": verify_acc}
        b = os.path.join(d, f"export_{prec}_bytes.txt")
        if os.path.exists(b):
            entry["onnx_bytes"] = int(open(b).read().strip() or 0)
        if len(losses) >= 2:
            entry["loss_falls"] = losses[-1][1] < losses[0][1]
            if not entry["loss_falls"]:
                problems.append(f"train {prec}: loss did not fall ({losses[0][1]:.3f} -> {losses[-1][1]:.3f})")
        if acc and verify_acc is not None and abs(acc[-1][1] - verify_acc) > 1e-9:
            problems.append(f"train {prec}: faceshard-verify {verify_acc} != trainer {acc[-1][1]}")
        train[prec] = entry
    if "train" in asked:
        resume = judge_resume(d, a.device, problems)
        if resume:
            train.setdefault(resume["precision"], {})["resume"] = resume
        if "bf16" not in train or not train["bf16"].get("losses"):
            problems.append("train bf16: no losses (metrics.jsonl)")

    # step cells
    records = []
    cells = {}        # cell name -> its raw JSON
    raw_variant = {}  # id(record) -> its cell's variant word ("" for a base cell, "graph-eager": asked, not captured)
    for path in sorted(glob.glob(os.path.join(d, "step_*.json"))):
        r = load(path)
        if not r:
            continue
        cell = os.path.basename(path)[:-len(".json")]
        cells[cell] = r
        base = cell[len("step_"):]
        if base.startswith("arcface_torch_"):
            records.append({"who": "arcface_torch", "cell": cell, "network": r["network"], "batch": r["batch_per_rank"],
                            "precision": r.get("precision", "fp32"), "sample_rate": r["sample_rate"],
                            "channels_last": False, "classes": r["classes"], "images_per_s": r["images_per_s"],
                            "peak_memory_mb": r.get("peak_memory_mb"), "step_ms": r.get("step_ms"),
                            "phases_ms": r.get("phases"), "card": card, "date": date})
            continue
        words = base.split("_")
        variant = words[-1] if words[-1] not in ("cl", "nchw") else ""
        layout = words[-2] if variant else words[-1]
        graph = r.get("cuda_graph")
        label = VARIANTS[variant][0] if variant in VARIANTS else variant
        if variant == "graph":
            if not isinstance(graph, dict):
                problems.append(f"{cell}: no CUDA graph status in its JSON (faceshard-bench too old?)")
                variant = "graph-eager"
            elif not graph.get("asked"):
                problems.append(f"{cell}: train.cuda_graph was not asked in the step it measured")
                variant = "graph-eager"
            elif not graph.get("captured"):
                # Not a graph cell: the steps ran eagerly. On a GPU that is a failed check.
                variant = "graph-eager"
                if a.device == "cuda":
                    problems.append(f"{cell}: CUDA graphs asked but not captured: {graph.get('reason') or 'no reason given'}")
            elif graph.get("eager_calls"):
                variant = "graph-eager"
                if a.device == "cuda":
                    problems.append(f"{cell}: {graph['eager_calls']} backbone call(s) ran eagerly beside the graphs")
            if variant == "graph-eager":
                label = "train.cuda_graph=true, not captured" + (f" ({graph.get('reason')})"
                                                                 if isinstance(graph, dict) and graph.get("reason") else "")
        records.append({"who": "faceshard", "cell": cell, "network": r["network"], "batch": r["batch_per_rank"],
                        "precision": r["precision"], "sample_rate": r.get("sample_rate"), "variant": label,
                        "channels_last": layout == "cl", "classes": r["classes"],
                        "images_per_s": r["images_per_s"], "peak_memory_mb": r.get("peak_memory_mb"),
                        "step_ms": r.get("step_ms"), "phases_ms": r.get("split_ms"), "cuda_graph": graph,
                        "card": card, "date": date})
        raw_variant[id(records[-1])] = variant
    for r in records:
        r["mfu"] = mfu(r["network"], r["images_per_s"], card, r["precision"])
    for s in items:
        if s["name"].startswith("step_") and s["exit"] == "0" and not os.path.exists(os.path.join(d, s["name"] + ".json")):
            problems.append(f"{s['name']}: no result")
    if "step" in asked and not plan_problems:
        if not any(s["name"].startswith("step_faceshard_") and s["exit"] not in ("skipped",) for s in items):
            problems.append("step: no cell ran")
        # What the step section is for, whatever the plan said: a graph cell and arcface_torch's.
        if not any(raw_variant.get(id(r)) in ("graph", "graph-eager") for r in records if r["who"] == "faceshard"):
            problems.append("step: no graph cell (train.cuda_graph=true) among the step cells' results")
        if not any(r["who"] == "arcface_torch" for r in records):
            problems.append("step: no arcface_torch cell beside faceshard's")
    graph_checks = judge_graph_cells(records, raw_variant, cells, a.device, problems)
    ratios = []
    for r in records:
        if r["who"] != "faceshard":
            continue
        ref = [x for x in records if x["who"] == "arcface_torch" and x["batch"] == r["batch"] and
               (x["network"] == r["network"] or a.device == "cpu")]
        if ref:
            ratios.append({"network": r["network"], "batch": r["batch"], "precision": r["precision"],
                           "variant": r.get("variant", ""),
                           "channels_last": r["channels_last"], "faceshard": r["images_per_s"],
                           "arcface_torch": ref[0]["images_per_s"], "arcface_torch_precision": ref[0]["precision"],
                           "ratio": r["images_per_s"] / ref[0]["images_per_s"] if ref[0]["images_per_s"] else None})

    contributions = contributions_of(records, raw_variant)

    def arcface_torch_images_per_s(net, batch):
        ref = [x for x in records if x["who"] == "arcface_torch" and x["network"] == net and x["batch"] == batch]
        return ref[0]["images_per_s"] if ref else None
    targets = targets_of(records, raw_variant, arcface_torch_images_per_s, card) if a.device == "cuda" else []

    # classifier: bytes per class measured (the allocator's peak slope) and planned
    classifier = []
    for path in sorted(glob.glob(os.path.join(d, "classifier*.json"))):
        c = load(path)
        if not c:
            continue
        for b in c.get("bytes_per_class", []):
            rate = b["sample_rate"]
            plans = {}
            for cls in (b["from"], b["to"]):
                pj = load(os.path.join(d, f"plan_{cls}_{rate}.json"))
                if pj is None:
                    pj = load(os.path.join(d, f"plan_{cls}_{rate:.1f}.json"))
                if pj:
                    plans[cls] = sum(x["bytes"] for x in pj.get("parts", []) if x.get("group") == "classifier")
            planned = None
            if len(plans) == 2:
                planned = (plans[b["to"]] - plans[b["from"]]) / (b["to"] - b["from"])
            entry = {"sample_rate": rate, "precision": b.get("precision"), "from": b["from"], "to": b["to"],
                     "bytes_per_class": b["bytes_per_class"], "planned_bytes_per_class": planned}
            if planned:
                entry["measured_over_planned"] = b["bytes_per_class"] / planned
                if a.device == "cuda" and abs(entry["measured_over_planned"] - 1) > 0.10:
                    problems.append(f"classifier rate {rate}: {b['bytes_per_class']:.0f} B/class measured vs "
                                    f"{planned:.0f} planned (more than 10% apart)")
            classifier.append(entry)
        for run in c.get("runs", []):
            classifier.append({"sample_rate": run["sample_rate"], "classes_per_shard": run["classes_per_shard"],
                               "step_ms": run["step_ms"], "gemm_ms": run["gemm_ms"], "peak_memory_mb": run["peak_memory_mb"],
                               **{k: run.get(k) for k in ("fc_weight_dtype", "logits", "ops_per_step", "bytes_per_step",
                                                          "bandwidth_gbs", "floor_ms", "step_over_floor")}})
    if "classifier" in asked and not any("bytes_per_class" in c for c in classifier):
        problems.append("classifier: no bytes per class measured")
    # The classifier step beside arcface_torch's PartialFC_V2 alone (an optional item: absent
    # or partial, its columns are empty).
    fc_json, at_json = load(os.path.join(d, "classifier.json")), load(os.path.join(d, "arcface_classifier.json"))
    fc_vs_at = classifier_vs_arcface_torch(fc_json if isinstance(fc_json, dict) else None,
                                           at_json if isinstance(at_json, dict) else None)

    # capacity: the largest class count planned and whether it trained
    capacity = {}
    for reserve in (3, 4):
        plan = load(os.path.join(d, f"cap_plan_{reserve}GiB.json"))
        if plan:
            ran = load(os.path.join(d, f"cap_largest_{reserve}GiB.json"))
            capacity[f"{reserve}GiB"] = {"max_classes": plan.get("max_classes"),
                                         "trained": bool(ran), "images_per_s": (ran or {}).get("images_per_s"),
                                         "peak_memory_mb": (ran or {}).get("peak_memory_mb")}
    for name in ("cap_storage", "cap_gathered", "cap_200k"):
        c = load(os.path.join(d, f"{name}.json"))
        if c:
            capacity[name] = c.get("bytes_per_class", [])
    if "capacity" in asked and not plan_problems:
        ran = {s["name"]: s for s in items}
        plan3 = load(os.path.join(d, "cap_plan_3GiB.json"))
        if ran.get("cap_plan_3GiB", {}).get("exit") == "0":
            most = plan3.get("max_classes") if isinstance(plan3, dict) else None
            if not isinstance(most, int) or isinstance(most, bool) or most <= 0:
                problems.append(f"capacity: faceshard-plan found no class count for this card (max_classes {most!r} "
                                f"in cap_plan_3GiB.json): nothing to train")
        if not any(v.get("trained") for k, v in capacity.items() if k.endswith("GiB")):
            problems.append("capacity: the largest class count was not trained (no cap_largest_*GiB.json)")

    loader = load(os.path.join(d, "loader.json"), {})

    # checkpoints written in the background (tools/checkpoint_stall.py): the training's wait
    # synchronous against background, and the steps run during a background write
    checkpoint = {}
    if "checkpoint" in asked:
        st = [s for s in items if s["name"] == "checkpoint_stall"]
        if st and st[0]["exit"] not in ("skipped",):
            j = load(os.path.join(d, "checkpoint_stall.json"))
            if not isinstance(j, dict) or not j.get("checkpoints"):
                problems.append("checkpoint: no checkpoint_stall.json")
            else:
                checkpoint = j
                # Judged on a GPU, where the background write is meant to pay; a CPU's tiny
                # run only shows the plumbing, and its figures are reported.
                checkpoint["goals"] = checkpoint_goals(j)
                for g in checkpoint["goals"] if a.device == "cuda" else []:
                    if g["held"]:
                        continue
                    if g["value"] is None:
                        problems.append(f"checkpoint: {g['what']}: not measured (goal {g['target']}): not held")
                    else:
                        problems.append(f"checkpoint: {g['what']}: {g['value']:.3g}, the goal {g['target']}: not held")

    # two ranks (tools/gpu_two_ranks.sh)
    two_ranks = {}
    if "tworanks" in asked:
        st = [s for s in items if s["name"] == "tworanks"]
        if st and st[0]["exit"] == "absent":
            two_ranks = {"ran": False, "why": "tools/gpu_two_ranks.sh is not in this build"}
        elif st and st[0]["exit"] != "skipped":
            j = load(os.path.join(d, "two_ranks.json"))
            if not isinstance(j, dict):
                problems.append("tworanks: no two_ranks.json")
                two_ranks = {"ran": True}
            else:
                two_ranks = {"ran": True, "ok": j.get("ok") is True, "problems": j.get("problems", [])}
                if j.get("ok") is not True:
                    problems.append("tworanks: not ok" + (": " + "; ".join(map(str, j.get("problems") or [])) if
                                                          j.get("problems") else ""))
                elif j.get("problems"):
                    problems.append("tworanks: ok, yet problems listed: " + "; ".join(map(str, j["problems"])))

    results = {"card": card, "date": date, "device": a.device, "asked": asked, "planned": planned_items, "env": env,
               "sections": items,
               "skipped": skipped, "tests": tests, "train": train, "records": records, "graph_checks": graph_checks,
               "ratios": ratios, "contributions": contributions, "targets": targets, "classifier": classifier,
               "classifier_vs_arcface_torch": fc_vs_at, "capacity": capacity, "loader": loader, "two_ranks": two_ranks,
               "checkpoint": checkpoint, "problems": problems}
    tmp = a.results + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    os.replace(tmp, a.results)

    # the table
    print(f"== faceshard GPU check: {card}, {date}; sections {','.join(asked)}")
    if env:
        print(f"   torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, NCCL {env.get('nccl')}; "
              f"{env.get('nvidia_smi', '')}")
    print("-- items (exit, seconds)")
    print("   " + ", ".join(f"{s['name']} {s['exit']} {s['seconds']:.0f}s" for s in items))
    if skipped:
        print("-- not started (budget spent): " + ", ".join(
            n + ("" if next(s for s in items if s["name"] == n)["required"] else " (optional)") for n in skipped))
    if tests:
        print(f"-- GPU tests: {len(tests['expected'])} listed, {tests['passed']} passed, {tests['failed']} failed, "
              f"{tests['skipped']} skipped, {len(tests['missing'])} without a result "
              f"({tests.get('processes', 0)} process(es))")
        for f_ in tests["failures"]:
            print(f"   FAILED {f_['test']}: {f_['message'].splitlines()[0] if f_['message'] else ''}")
    for prec, t in train.items():
        l = t.get("losses")
        acc = t.get("verification", [])
        if l:
            print(f"-- train {prec}: loss {l[0][1]:.3f} (step {l[0][0]}) -> {l[-1][1]:.3f} (step {l[-1][0]}); "
                  f"verification {' '.join(f'{s}:{v:.3f}' for s, v in acc)}; "
                  f"faceshard-verify {fmt(t.get('verify_tool_accuracy'))}; onnx {t.get('onnx_bytes', 'none')} B")
        else:
            print(f"-- train {prec}: no losses")
        q = t.get("resume")
        if q:
            steps = q["compared_steps"]
            span = f"steps {steps[0]}-{steps[-1]}" if steps else "no step"
            diff = q["max_relative_difference"]
            print(f"   resumed at step {q['resumed_at']} (checkpoint of step {q['stop_step']}); against the "
                  f"uninterrupted run at {span}: largest difference "
                  f"{'none' if diff is None else f'{100 * diff:.3g}%'} (limit {100 * q['tolerance']:.3g}%)")
    if records:
        print("-- step (images/s, peak MB)")
        print(f"   {'who':14} {'network':9} {'batch':>5} {'prec':5} {'layout':6} {'images/s':>10} {'peak MB':>9} {'step ms':>8} {'MFU':>6}")
        for r in records:
            print(f"   {r['who']:14} {r['network']:9} {r['batch']:>5} {r['precision']:5} "
                  f"{'NHWC' if r['channels_last'] else 'NCHW':6} {r['images_per_s']:>10.1f} "
                  f"{(r['peak_memory_mb'] or 0):>9.0f} {(r['step_ms'] or 0):>8.1f} "
                  f"{pct(r.get('mfu')):>6} {r.get('variant', '')}")
        for q in ratios:
            print(f"   faceshard/arcface_torch {q['network']} {q['batch']} {q['precision']} "
                  f"{'NHWC' if q['channels_last'] else 'NCHW'}{' ' + q['variant'] if q.get('variant') else ''}: {q['ratio']:.2f}x "
                  f"(arcface_torch {q['arcface_torch_precision']})")
    for q in graph_checks:
        if q.get("max_relative_difference") is not None:
            print(f"   {q['cell']} ({'captured' if q['captured'] else 'not captured'}): losses of {q['steps']} steps "
                  f"against {q['base']}: largest difference {100 * q['max_relative_difference']:.3g}% "
                  f"(limit {100 * q['tolerance']:.3g}%)")
    for q in contributions:
        print(f"   {q['change']}: {q['speedup']:.2f}x ({q['network']} {q['batch']} {q['precision']} "
              f"{'NHWC' if q['channels_last'] else 'NCHW'}: {q['base_images_per_s']:.1f} images/s, with "
              f"{VARIANTS[q['variant']][0]} {q['variant_images_per_s']:.1f})")
    for t in targets:
        slow = t.get("input_pipeline_slowdown")
        print(f"-- target {t['network']} {t['batch']} bf16 on {t['card']}: {t['images_per_s']:.0f} images/s "
              f"({t['variant'] or 'eager'}; target {t['target_images_per_s']:.0f}), "
              f"{fmt(t['times_arcface_torch'], 2)}x arcface_torch (target {t['target_times_arcface_torch']:.0f}x)"
              + (f", JPEG .rec {100 * slow:.1f}% slower (target {100 * t['target_input_pipeline_slowdown']:.0f}%)"
                 if slow is not None else "") + (": held" if t["held"] else ": not held"))
    for c in classifier:
        if "bytes_per_class" in c:
            planned = c.get("planned_bytes_per_class")
            print(f"-- classifier rate {c['sample_rate']}: {c['bytes_per_class']:.0f} B/class measured "
                  f"({c['from']} -> {c['to']} classes), plan {planned:.0f}" if planned else
                  f"-- classifier rate {c['sample_rate']}: {c['bytes_per_class']:.0f} B/class measured, no plan")
    if fc_vs_at:
        print("-- classifier step (ms) beside arcface_torch's PartialFC_V2 alone"
              + (f" ({at_json.get('precision')}, batch {at_json.get('batch_per_rank')})" if isinstance(at_json, dict) else
                 " (no arcface_classifier.json)"))
        print(f"   {'classes/shard':>13} {'rate':>5} {'weight':6} {'logits':8} {'faceshard':>9} {'GEMMs':>8} "
              f"{'GB/step':>8} {'floor':>8} {'step/floor':>10} {'arcface_torch':>13} {'arcface/faceshard':>17}")
        for q in fc_vs_at:
            print(f"   {col(q.get('classes_per_shard'), '{:.0f}'):>13} {col(q.get('sample_rate'), '{:g}'):>5} "
                  f"{str(q.get('fc_weight_dtype') or '-'):6} {str(q.get('logits') or '-'):8} "
                  f"{col(q.get('step_ms'), '{:.2f}'):>9} "
                  f"{col(q.get('gemm_ms'), '{:.2f}'):>8} "
                  f"{col(None if number(q.get('bytes_per_step')) is None else q['bytes_per_step'] / 1e9, '{:.3g}'):>8} "
                  f"{col(q.get('floor_ms'), '{:.2f}'):>8} {col(q.get('step_over_floor'), '{:.2f}x'):>10} "
                  f"{col(q.get('arcface_torch_step_ms'), '{:.2f}'):>13} "
                  f"{col(q.get('arcface_torch_over_faceshard'), '{:.2f}x'):>17}")
        seen = set()
        for q in fc_vs_at:
            key = (q.get("classes_per_shard"), q.get("sample_rate"))
            if q.get("arcface_torch_not_run") and key not in seen:
                seen.add(key)
                print(f"   arcface_torch at {key[0]} classes/shard, rate {key[1]}: not run ({q['arcface_torch_not_run']})")
    for k, v in capacity.items():
        if k.endswith("GiB"):
            print(f"-- capacity, {k} reserve: {v['max_classes']} classes planned, "
                  + (f"trained ({v['peak_memory_mb']:.0f} MB peak)" if v["trained"] else "not trained"))
    for r in loader.get("results", []):
        print(f"-- loader: {r['workers']} workers: {r['images_per_s']:.0f} images/s")
    for r in checkpoint.get("checkpoints", []):
        print(f"-- checkpoint step {r['step']} ({r['bytes'] / 1e9:.2f} GB): the training waited {r['sync_wait_s']:.3g} s "
              f"synchronous, {r['async_wait_s']:.3g} s in the background ({r['wait_ratio']:.1f}x less; the write "
              f"{r['async_write_s']:.3g} s)")
    if checkpoint.get("background_steps", {}).get("during_over_away"):
        b = checkpoint["background_steps"]
        print(f"-- steps during a background write: {b['during_over_away']:.2f}x the others' time "
              f"({len(b['during_write_steps'])} steps beside {len(b['away_steps'])})")
    for g in checkpoint.get("goals", []):
        print(f"-- checkpoint goal: {g['what']}: {fmt(g['value'], 3)} (goal {g['target']}): "
              f"{'held' if g['held'] else 'not held'}{'' if a.device == 'cuda' else ' (judged on a GPU only)'}")
    if two_ranks:
        print("-- two ranks: " + ("not run: " + two_ranks["why"] if not two_ranks["ran"] else
                                  "ok" if two_ranks.get("ok") else "NOT ok"))
    if problems:
        print("-- PROBLEMS")
        for x in problems:
            print("   " + x)
    else:
        print("-- all checks held")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--run-tests":
        sys.exit(run_tests(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--plan":
        sys.exit(plan(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--calls":
        sys.exit(print_calls(sys.argv[2:]))
    sys.exit(main())
