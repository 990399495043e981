"""The GPU check's report (tools/gpu_check_report.py) on hand-made result folders: one that
holds, and one per way a check can prove nothing or find something wrong, each of which must
make the report exit 1 naming that problem. A folder is what tools/gpu_check.sh leaves in its
JSON folder: status.tsv, check.json (the sections asked and the items the check planned), the
test binary's list and its tests' GoogleTest JSON, the training runs' metrics and the resumed
run's log, the step cells' JSON, and each further section's JSON where a case asks for it.

  python3 gpu_check_report_cases.py SOURCE_DIR CASE     (CASE: one of CASES, or "all")
"""

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

# The GPU tests the hand-made binary lists: the report's committed minimum (read from the
# report under test, in main) and one more beyond it.
EXTRA_GPU_TEST = "PartialFCCuda.ATestBeyondTheMinimum"
GPU_TESTS = []
STOP, FULL, LAST = 37, 47, 62
BASE = "step_faceshard_r50_256_bf16_cl"
GRAPH = BASE + "_graph"
ARC = "step_arcface_torch_r50_256_fp16"


def demo_loss(step):
    # A falling loss with some step-to-step wiggle (as a batch's loss has).
    return 18.0 * 0.97 ** step + 0.3 * ((step * 7919) % 13) / 13.0


def step_losses(scale=1.0):
    return [round(40.0 - 0.2 * k + 0.05 * (k % 3), 6) * scale for k in range(43)]


def step_cell(graph, losses):
    return {"mode": "step", "network": "r50", "device": "cuda:0", "world_size": 1, "batch_per_rank": 256,
            "micro_batches": 1, "classes": 1000000, "precision": "bf16", "sample_rate": 0.1, "channels_last": True,
            "images_per_s": 4000.0 if not graph.get("captured") else 4300.0, "peak_memory_mb": 13000.0,
            "step_ms": 64.0, "split_ms": {"data": 1.0, "forward": 20.0, "backward": 30.0, "optimizer": 13.0},
            "cuda_graph": graph, "losses": losses}


def gtest_json(name, result="COMPLETED", failure=None):
    suite, test = name.split(".")
    t = {"name": test, "status": "RUN", "result": result, "time": "1s"}
    if failure:
        t["failures"] = [{"failure": failure, "type": ""}]
    return {"tests": 1, "testsuites": [{"name": suite, "testsuite": [t]}]}


def holding_folder():
    """Everything a call of sections env,tests,train,step,tworanks leaves when all holds."""
    f = {}
    items = [("env", "0", "required"), ("tools_load", "0", "required"), ("tests_list", "0", "required"),
             ("tests", "0", "required")]
    items += [(n, "0", "required") for n in ("train_data", "train_bf16_part1", "train_bf16_resume", "train_bf16_full",
                                             "export_bf16", "verify_bf16")]
    items += [(ARC, "0", "required"), (BASE, "0", "required"), (GRAPH, "0", "required"),
              ("step_faceshard_r50_256_bf16_cl_unfused", "0", "optional"), ("tworanks", "absent", "optional")]
    f["items"] = items
    f["nvidia-smi.csv"] = "NVIDIA H200, 580.159.04, 143771 MiB, 9.0, 1980 MHz\n"
    f["check.json"] = {"sections": "env,tests,train,step,tworanks", "device": "cuda", "tiny": False, "budget_s": 170}
    # The items the check planned: by default every item of status.tsv as it ran (a case
    # adds a planned item that did not run to "planned_extra", or sets "planned" to None).
    f["planned"] = "auto"
    f["planned_extra"] = []
    f["json"] = {"env.json": {"torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91900, "gpus": []}}
    f["gtest_expected.txt"] = list(GPU_TESTS)
    f["gtest"] = {t: gtest_json(t) for t in GPU_TESTS}
    f["train_resume.json"] = {"precision": "bf16", "stop_step": STOP, "full_steps": FULL}
    f["train_bf16_resume.log"] = ("[rank 0] starting\n[rank 0] resumed from /tmp/x/run_bf16/checkpoints/step_00000037 "
                                  "at step 37; classifier rows 1 MB read in 0.01 s\n")
    f["train_bf16_metrics.jsonl"] = [{"step": s, "epoch": s // 31, "loss": demo_loss(s), "lr": 0.1} for s in range(1, LAST + 1)]
    # The uninterrupted run: the same losses, a little apart (a GPU run is not bit-reproducible).
    f["train_bf16_full_metrics.jsonl"] = [{"step": s, "epoch": s // 31, "loss": demo_loss(s) * (1 + 0.002 * (s % 2)),
                                           "lr": 0.1} for s in range(1, FULL + 1)]
    f["verify_bf16.json"] = {"sets": [{"name": "synth", "accuracy": 0.9}]}
    f["step"] = {
        BASE: step_cell({"asked": False, "captured": False, "reason": "", "eager_calls": 0}, step_losses()),
        GRAPH: step_cell({"asked": True, "captured": True, "reason": "", "eager_calls": 0}, step_losses(1.001)),
        "step_faceshard_r50_256_bf16_cl_unfused": step_cell({"asked": False, "captured": False, "reason": "",
                                                              "eager_calls": 0}, step_losses()),
        ARC: {"network": "r50", "batch_per_rank": 256, "precision": "fp16", "sample_rate": 0.1, "classes": 1000000,
              "images_per_s": 2100.0, "peak_memory_mb": 15000.0, "step_ms": 120.0},
    }
    return f


# The JSON each item leaves (gpu_check.sh's --json of the item), and its section.
def json_of(name):
    if name.startswith(("step_", "verify_", "cap_plan_", "cap_largest_")) or name in (
            "env", "classifier", "arcface_classifier", "cap_storage", "loader", "checkpoint_stall"):
        return name + ".json"
    return {"tworanks": "two_ranks.json"}.get(name)


def section_of(name):
    for sec, prefixes in (("env", ("env", "tools_load")), ("tests", ("tests",)), ("train", ("train_", "export_", "verify_")),
                          ("step", ("step_", "jpeg_data")), ("classifier", ("classifier", "plan_", "arcface_")),
                          ("capacity", ("cap_",)), ("loader", ("loader",)), ("tworanks", ("tworanks",)),
                          ("checkpoint", ("checkpoint",))):
        if name.startswith(prefixes):
            return sec
    return None


def write(folder, d):
    with open(os.path.join(d, "status.tsv"), "w") as out:
        for name, rc, need in folder["items"]:
            out.write(f"{name}\t{rc}\t{1.0 if rc not in ('skipped', 'absent') else 0}\t{need}\n")
    check = dict(folder["check.json"])
    if folder["planned"] == "auto":
        check["planned"] = [{"name": n, "need": need, "limit_s": 60, "json": json_of(n), "section": section_of(n)}
                            for n, rc, need in folder["items"] if rc != "absent"] + folder["planned_extra"]
    elif folder["planned"] is not None:
        check["planned"] = folder["planned"]
    with open(os.path.join(d, "check.json"), "w") as out:
        json.dump(check, out)
    for name in ("train_resume.json", "verify_bf16.json", "two_ranks.json"):
        if name in folder:
            with open(os.path.join(d, name), "w") as out:
                json.dump(folder[name], out)
    with open(os.path.join(d, "nvidia-smi.csv"), "w") as out:
        out.write(folder["nvidia-smi.csv"])
    with open(os.path.join(d, "gtest_expected.txt"), "w") as out:
        out.write("".join(t + "\n" for t in folder["gtest_expected.txt"]))
    # One process ran them all (gpu_check_report.py --run-tests): one GoogleTest JSON.
    os.makedirs(os.path.join(d, "gtest"))
    if folder["gtest"]:
        with open(os.path.join(d, "gtest", "run1.json"), "w") as out:
            json.dump({"tests": len(folder["gtest"]),
                       "testsuites": [s for j in folder["gtest"].values() for s in j["testsuites"]]}, out)
    for name in ("train_bf16_metrics.jsonl", "train_bf16_full_metrics.jsonl"):
        with open(os.path.join(d, name), "w") as out:
            out.write("".join(json.dumps(r) + "\n" for r in folder[name]))
    with open(os.path.join(d, "train_bf16_resume.log"), "w") as out:
        out.write(folder["train_bf16_resume.log"])
    for cell, j in folder["step"].items():
        with open(os.path.join(d, cell + ".json"), "w") as out:
            json.dump(j, out)
    for name, j in folder.get("json", {}).items():
        with open(os.path.join(d, name), "w") as out:
            json.dump(j, out)


def set_item(f, name, rc, need=None):
    f["items"] = [(n, rc if n == name else r, (need or k) if n == name else k) for n, r, k in f["items"]]


# Each case: how the holding folder is changed, and the problem the report must name (None:
# the report must hold, exit 0, no problem).
def case_holds(f):
    return None


def case_optional_cell_skipped(f):
    # A cell the budget may leave out: reported as skipped, not a problem.
    set_item(f, "step_faceshard_r50_256_bf16_cl_unfused", "skipped")
    del f["step"]["step_faceshard_r50_256_bf16_cl_unfused"]
    return None


def case_zero_tests(f):
    f["gtest"] = {}
    return r"tests: zero tests passed"


def case_known_test_missing(f):
    # The binary lists a GPU test that left no result (it crashed, hung, or was never run).
    del f["gtest"]["GraphedBackboneCuda.FailedCaptureKeepsMemoryFlat"]
    return r"GraphedBackboneCuda\.FailedCaptureKeepsMemoryFlat is listed by the test binary but has no result"


def case_min_test_not_listed(f):
    # A test of the committed minimum renamed away: the binary no longer lists it.
    f["gtest_expected.txt"].remove("PartialFCCuda.MatchesCpu")
    del f["gtest"]["PartialFCCuda.MatchesCpu"]
    return r"the test binary does not list PartialFCCuda\.MatchesCpu"


def case_test_skipped(f):
    f["gtest"]["TrainStepCuda.StepsWithoutHostSynchronisation"] = gtest_json(
        "TrainStepCuda.StepsWithoutHostSynchronisation", result="SKIPPED")
    return r"1 GPU test\(s\) skipped on a GPU: TrainStepCuda\.StepsWithoutHostSynchronisation"


def case_test_failed(f):
    f["gtest"]["PartialFCCuda.MatchesCpu"] = gtest_json("PartialFCCuda.MatchesCpu", failure="Expected equality")
    set_item(f, "tests", "1")
    return r"1 GPU test\(s\) failed: PartialFCCuda\.MatchesCpu"


def case_test_timed_out(f):
    # The tests' process(es) killed at the item's limit: what had not run has no result.
    del f["gtest"]["AppOptim.CudaMatchesCpu"]
    set_item(f, "tests", "124")
    return [r"^tests exited 124 \(killed at its time limit\)",
            r"AppOptim\.CudaMatchesCpu is listed by the test binary but has no result"]


def case_test_hung(f):
    # A test past its own limit: the runner killed the process, gave the test a failed result
    # saying so and ran the tests after it again.
    f["gtest"]["AppOptim.CudaMatchesCpu"] = gtest_json(
        "AppOptim.CudaMatchesCpu", failure="hung: no result within 90 s; the process was killed and the tests after "
                                           "it run again in a new process")
    set_item(f, "tests", "1")
    return r"tests: AppOptim\.CudaMatchesCpu hung: no result within 90 s"


def case_required_cell_skipped(f):
    set_item(f, GRAPH, "skipped")
    del f["step"][GRAPH]
    return re.escape(GRAPH) + r": not started, the budget was spent \(a required item\)"


def case_graph_not_captured(f):
    f["step"][GRAPH]["cuda_graph"] = {"asked": True, "captured": False,
                                      "reason": "the capture failed: operation not permitted when stream is capturing",
                                      "eager_calls": 0}
    return re.escape(GRAPH) + r": CUDA graphs asked but not captured: the capture failed: operation not permitted"


def case_graph_without_status(f):
    del f["step"][GRAPH]["cuda_graph"]
    return re.escape(GRAPH) + r": no CUDA graph status in its JSON"


def case_graph_eager_calls(f):
    f["step"][GRAPH]["cuda_graph"]["eager_calls"] = 3
    return re.escape(GRAPH) + r": 3 backbone call\(s\) ran eagerly beside the graphs"


def case_graph_losses_differ(f):
    losses = step_losses()
    losses[20] *= 1.10
    f["step"][GRAPH]["losses"] = losses
    return re.escape(GRAPH) + r": its loss at step 20 is [0-9.]+, the eager cell's [0-9.]+ \([0-9.]+% apart, more than 2%\)"


def case_graph_without_losses(f):
    f["step"][GRAPH]["losses"] = []
    return re.escape(GRAPH) + r": no per-step losses in its JSON"


def case_resume_without_line(f):
    f["train_bf16_resume.log"] = "[rank 0] starting fresh\n"
    return r"train bf16: the resumed run did not say 'resumed from \.\.\. at step N'"


def case_resume_at_wrong_step(f):
    f["train_bf16_resume.log"] = f["train_bf16_resume.log"].replace("step_00000037 at step 37", "step_00000031 at step 31")
    return r"train bf16: resumed at step 31, expected the checkpoint of step 37"


def case_resume_does_not_continue(f):
    # The resumed run's losses from a fresh start (the weights not restored): they jump.
    for r in f["train_bf16_metrics.jsonl"]:
        if r["step"] > STOP:
            r["loss"] = demo_loss(r["step"] - STOP)
    return r"train bf16: the resumed run's loss at step \d+ is [0-9.]+, the uninterrupted run's [0-9.]+ .*" \
           r"the resume does not continue the run"


def case_resume_logged_nothing(f):
    f["train_bf16_metrics.jsonl"] = [r for r in f["train_bf16_metrics.jsonl"] if r["step"] <= STOP]
    return r"train bf16: the resumed run logged no loss after step 37"


def case_resume_nothing_to_compare(f):
    f["train_bf16_full_metrics.jsonl"] = [r for r in f["train_bf16_full_metrics.jsonl"] if r["step"] <= STOP]
    return r"train bf16: no step that both the resumed and the uninterrupted run logged"


def case_runs_part_before_resume(f):
    for r in f["train_bf16_full_metrics.jsonl"]:
        if r["step"] == 10:
            r["loss"] *= 1.3
    return r"train bf16: before the resume, two runs from the same start differ at step 10"


def case_item_failed(f):
    set_item(f, "train_bf16_resume", "1")
    return r"train_bf16_resume exited 1"


def case_two_ranks_not_ok(f):
    set_item(f, "tworanks", "0", "required")
    f["two_ranks.json"] = {"ok": False, "problems": ["rank 1: loss differs from one rank's"]}
    return r"tworanks: not ok: rank 1: loss differs from one rank's"


def case_two_ranks_without_json(f):
    set_item(f, "tworanks", "0", "required")
    return r"tworanks: no two_ranks\.json"


# What each section asked must leave, whatever the check's plan said (a hand-made folder, or
# a check that planned wrongly): the step section's graph cell and arcface_torch's cell; a
# capacity plan that found a class count; something of each section in status.tsv.
def case_step_without_graph_cell(f):
    f["items"] = [x for x in f["items"] if x[0] != GRAPH]
    del f["step"][GRAPH]
    return r"step: no graph cell \(train\.cuda_graph=true\) among the step cells' results"


def case_step_without_arcface_cell(f):
    f["items"] = [x for x in f["items"] if x[0] != ARC]
    del f["step"][ARC]
    return r"step: no arcface_torch cell beside faceshard's"


def with_capacity(f, max_classes):
    f["check.json"]["sections"] += ",capacity"
    f["items"] += [("cap_plan_3GiB", "0", "required")]
    f["json"]["cap_plan_3GiB.json"] = {"max_classes": max_classes}
    if max_classes > 0:
        f["items"] += [("cap_largest_3GiB", "0", "required")]
        f["json"]["cap_largest_3GiB.json"] = {"images_per_s": 900.0, "peak_memory_mb": 79000.0}
    else:
        # The check stops at a plan without a class count: the largest run never starts.
        f["planned_extra"] += [{"name": "cap_largest_3GiB", "need": "required", "limit_s": 180,
                                "json": "cap_largest_3GiB.json", "section": "capacity"}]
    f["items"] += [("cap_storage", "0", "required")]
    f["json"]["cap_storage.json"] = {"bytes_per_class": [{"sample_rate": 1.0, "bytes_per_class": 2054.0}]}


def case_capacity_holds(f):
    with_capacity(f, 37965059)
    return None


def case_capacity_plan_zero(f):
    with_capacity(f, 0)
    return [r"capacity: faceshard-plan found no class count for this card \(max_classes 0 in cap_plan_3GiB\.json\)",
            r"cap_largest_3GiB: a required item of the capacity section, planned by the check, is not in status\.tsv"]


def asked_without_items(f, section):
    f["check.json"]["sections"] += "," + section
    return re.escape(section) + r": asked, but nothing of it in status\.tsv"


def case_checkpoint_nothing_in_status(f):
    return asked_without_items(f, "checkpoint")


def case_capacity_nothing_in_status(f):
    return asked_without_items(f, "capacity")


def case_loader_nothing_in_status(f):
    return asked_without_items(f, "loader")


def case_tworanks_nothing_in_status(f):
    # Not even the line saying the bundle lacks tools/gpu_two_ranks.sh.
    f["items"] = [x for x in f["items"] if x[0] != "tworanks"]
    return r"tworanks: asked, but nothing of it in status\.tsv"


# The items the check planned (check.json's "planned"): each required one must have run and
# left its JSON; a folder without the list cannot be held to it.
def case_required_item_not_run(f):
    f["items"] = [x for x in f["items"] if x[0] != "verify_bf16"]
    f["planned_extra"] += [{"name": "verify_bf16", "need": "required", "limit_s": 60, "json": "verify_bf16.json",
                            "section": "train"}]
    return r"verify_bf16: a required item of the train section, planned by the check, is not in status\.tsv"


def case_required_item_without_json(f):
    del f["verify_bf16.json"]
    return r"verify_bf16: no verify_bf16\.json \(the result of a required item\)"


def case_no_planned_list(f):
    f["planned"] = None
    return r"check\.json: no list of the items the check planned"


def case_plan_refused(f):
    # The check refused before its first item: the budget would have cut a required item.
    f["check.json"]["sections"] = "checkpoint"
    f["check.json"]["plan_problems"] = [
        "checkpoint_stall: a required item with a time limit of 240 s, which --budget-s 60 would cut to 100 s (its "
        "limit needs --budget-s 200 or more); not started"]
    f["items"] = []
    f["planned"] = [{"name": "checkpoint_stall", "need": "required", "limit_s": 240, "json": "checkpoint_stall.json",
                     "section": "checkpoint"}]
    f["check"] = "refused"
    return r"checkpoint_stall: a required item with a time limit of 240 s, which --budget-s 60 would cut to 100 s"


# Call d: checkpoints written in the background, judged against their goals on a GPU (the
# training's wait at least 20x less than a synchronous checkpoint's, the steps during a write
# within 10% of the others).
def with_checkpoint(f, sync_s, async_s, during_over_away):
    f["check.json"]["sections"] += ",checkpoint"
    f["items"] += [("checkpoint_stall", "0", "required")]
    rows = [{"step": s, "bytes": 4.1e9, "sync_wait_s": sync_s, "async_wait_s": async_s, "async_stage_s": async_s,
             "async_previous_wait_s": 0.0, "async_write_s": 2.5, "wait_ratio": sync_s / async_s} for s in (20, 40, 60)]
    f["json"]["checkpoint_stall.json"] = {
        "classes": 2000000, "backbone": "r50", "batch": 128, "every": 20, "steps": 60, "checkpoints": rows,
        "background_steps": {"during_write_steps": [21, 22, 41, 42], "away_steps": [5, 6, 30, 31, 50],
                             "during_write_median_s": 0.04 * during_over_away, "away_median_s": 0.04,
                             "during_over_away": during_over_away}}


def case_checkpoint_goals_held(f):
    with_checkpoint(f, 2.6, 0.05, 1.04)
    return None


def case_checkpoint_goals_not_held(f):
    # The background wait 4.5x the synchronous one, and steps 3.5x slower during a write.
    with_checkpoint(f, 0.4, 1.8, 3.5)
    return [r"checkpoint: the training's wait at a synchronous checkpoint over its wait at a background one "
            r"\(median of 3\): 0\.222, the goal >= 20: not held",
            r"checkpoint: a step's time during a background write over the other steps' \(medians\): 3\.5, "
            r"the goal <= 1\.10: not held"]


# The classifier section: faceshard-bench's classifier runs (classifier.json) beside
# arcface_torch's PartialFC_V2 alone (arcface_classifier.json) per cell. faceshard's runs:
# (classes per shard, rate, weight dtype, logits, step ms, and the per-run fields of the
# bandwidth floor, or None where an older faceshard-bench wrote none).
FC_RUNS = [(1000000, 1.0, "fp32", "buffer", 23.4, {"gemm_ms": 2.61, "ops_per_step": 1.61e12, "bytes_per_step": 8.4e9,
                                                   "bandwidth_gbs": 4800.0, "floor_ms": 1.75, "step_over_floor": 13.37}),
           (1000000, 1.0, "bf16", "streamed", 121.8, {"gemm_ms": 3.4, "ops_per_step": 2.15e12, "bytes_per_step": 5.1e9,
                                                       "bandwidth_gbs": 4800.0, "floor_ms": 1.06, "step_over_floor": 114.9}),
           (1000000, 0.1, "fp32", "buffer", 9.1, {"gemm_ms": 0.9, "ops_per_step": 1.6e11, "bytes_per_step": 4.4e9,
                                                  "bandwidth_gbs": 4800.0, "floor_ms": 0.92, "step_over_floor": 9.89}),
           (10000000, 1.0, "fp32", "buffer", 697.0, None),
           (10000000, 0.1, "fp32", "buffer", 74.2, {"gemm_ms": 8.2, "ops_per_step": 1.61e12, "bytes_per_step": 4.4e10,
                                                    "bandwidth_gbs": 4800.0, "floor_ms": 9.17, "step_over_floor": 8.09})]
# arcface_torch's cells: step ms, or None with the reason it did not run.
AT_RUNS = {(1000000, 1.0): 61.0, (1000000, 0.1): 20.5, (10000000, 1.0): None, (10000000, 0.1): 240.0}
AT_OOM = "out of memory: CUDA out of memory. Tried to allocate 19.07 GiB"


def with_classifier(f, arcface):
    f["check.json"]["sections"] += ",classifier"
    f["items"] += [("classifier", "0", "required")]
    f["items"] += [("arcface_classifier", "0" if arcface else "skipped", "optional")]
    runs = []
    for cps, rate, weight, logits, ms, extra in FC_RUNS:
        r = {"head": "combined", "precision": "fp32", "fc_state_dtype": "fp32", "fc_weight_dtype": weight,
             "logits": logits, "row_update": "onepass", "classes_per_shard": cps, "sample_rate": rate, "step_ms": ms,
             "gemm_ms": ms / 9, "peak_memory_mb": cps * 4608 / 2 ** 20, "peak_tensor_mb": cps * 4608 / 2 ** 20}
        r.update(extra or {})
        runs.append(r)
    f["json"]["classifier.json"] = {
        "mode": "classifier", "device": "cuda", "world_size": 1, "batch_per_rank": 128, "dim": 512, "runs": runs,
        "bytes_per_class": [{"head": "combined", "precision": "fp32", "fc_state_dtype": "fp32", "fc_weight_dtype": "fp32",
                             "logits": "buffer", "row_update": "onepass", "sample_rate": rate, "from": 1000000,
                             "to": 10000000, "bytes_per_class": 4619.0, "tensor_bytes_per_class": 4619.0}
                            for rate in (1.0, 0.1)]}
    if arcface:
        f["json"]["arcface_classifier.json"] = {
            "mode": "classifier", "who": "arcface_torch", "device": "cuda", "card": "NVIDIA H200", "world_size": 1,
            "batch_per_rank": 128, "dim": 512, "precision": "fp16", "pfc_fp16": False,
            "runs": [{"classes_per_shard": c, "sample_rate": r, "step_ms": ms, "peak_memory_mb": 3.0 * c / 1e3}
                     if ms is not None else {"classes_per_shard": c, "sample_rate": r, "step_ms": None,
                                             "peak_memory_mb": None, "not_run": AT_OOM}
                     for (c, r), ms in AT_RUNS.items()]}


def table_row(stdout, cps, rate, weight, logits):
    """The summary's row of one faceshard run, split into its columns."""
    for line in stdout.splitlines():
        w = line.split()
        if len(w) == 11 and w[:4] == [str(cps), f"{rate:g}", weight, logits]:
            return w
    return None


def check_classifier_table(r, stdout, arcface):
    rows = r["classifier_vs_arcface_torch"]
    if len(rows) != len(FC_RUNS):
        return f"{len(rows)} rows in classifier_vs_arcface_torch, expected one per faceshard run ({len(FC_RUNS)})"
    for (cps, rate, weight, logits, ms, extra), q in zip(FC_RUNS, rows):
        at = AT_RUNS[(cps, rate)] if arcface else None
        want = at / ms if at is not None else None  # arcface_torch's step over faceshard's
        got = q["arcface_torch_over_faceshard"]
        if (want is None) != (got is None) or (want is not None and abs(got - want) > 1e-12 * want):
            return f"{cps} classes/shard, rate {rate}, {weight}, {logits}: ratio {got}, expected {want}"
        if (q["classes_per_shard"], q["sample_rate"], q["fc_weight_dtype"], q["logits"], q["step_ms"]) != \
                (cps, rate, weight, logits, ms):
            return f"row {q} is not faceshard's run {cps} {rate} {weight} {logits}"
        w = table_row(stdout, cps, rate, weight, logits)
        if w is None:
            return f"no table row for {cps} classes/shard, rate {rate}, {weight}, {logits}:\n{stdout}"
        # faceshard, GEMMs, GB/step, floor, step/floor, arcface_torch, arcface/faceshard
        expect = [f"{ms:.2f}", f"{extra['gemm_ms']:.2f}" if extra else "-",
                  f"{extra['bytes_per_step'] / 1e9:.3g}" if extra else "-", f"{extra['floor_ms']:.2f}" if extra else "-",
                  f"{extra['step_over_floor']:.2f}x" if extra else "-", f"{at:.2f}" if at is not None else "-",
                  f"{want:.2f}x" if want is not None else "-"]
        if extra is None:
            expect[1] = f"{ms / 9:.2f}"  # the GEMMs are an older field: there without the floor's
        if w[4:] != expect:
            return f"table row {w}, expected the columns {expect}"
    oom = "arcface_torch at 10000000 classes/shard, rate 1.0: not run (" + AT_OOM + ")"
    if arcface and oom not in stdout:
        return f"no line saying arcface_torch's cell did not run: {oom!r}\n{stdout}"
    if not arcface and "(no arcface_classifier.json)" not in stdout:
        return f"the table does not say arcface_classifier.json is missing:\n{stdout}"
    print(f"table: {len(rows)} rows, ratios {[q['arcface_torch_over_faceshard'] for q in rows]}")
    return None


def case_classifier_beside_arcface_torch(f):
    # Both JSONs: per cell, arcface_torch's step over faceshard's as computed here; the runs
    # without the floor's fields and the cell arcface_torch could not run print "-".
    with_classifier(f, arcface=True)
    f["check"] = lambda r, out: check_classifier_table(r, out, arcface=True)
    return None


def case_classifier_without_arcface_torch(f):
    # arcface_torch's item left out by the budget: no arcface_classifier.json, the report
    # holds and its columns are empty.
    with_classifier(f, arcface=False)
    f["check"] = lambda r, out: check_classifier_table(r, out, arcface=False)
    return None


CASES = {k[len("case_"):]: v for k, v in globals().items() if k.startswith("case_")}


def run_case(source, name):
    folder = holding_folder()
    want = CASES[name](folder)
    with tempfile.TemporaryDirectory() as d:
        j = os.path.join(d, "json")
        os.makedirs(j)
        write(folder, j)
        res = os.path.join(d, "results.json")
        p = subprocess.run([sys.executable, os.path.join(source, "tools", "gpu_check_report.py"), j, res,
                            "--device", "cuda"], capture_output=True, text=True)
        try:
            problems = json.load(open(res))["problems"]
        except (OSError, ValueError):
            print(p.stdout, p.stderr)
            return f"no results.json (exit {p.returncode})"
        if want is None:
            if p.returncode != 0 or problems:
                print(p.stdout, p.stderr)
                return f"the report should hold: exit {p.returncode}, problems {problems}"
            r = json.load(open(res))
            # What the holding folder shows: every listed test passed; the resume compared
            # the steps after 37 that both runs logged; the graph cell is one.
            assert r["card"] == "NVIDIA H200", r["card"]
            assert r["tests"]["passed"] == len(GPU_TESTS), r["tests"]
            assert r["train"]["bf16"]["resume"]["compared_steps"] == list(range(STOP + 1, FULL + 1)), r["train"]
            assert [q["variant"] for q in r["contributions"]] == ["graph", "unfused"][:len(r["contributions"])], \
                r["contributions"]
            assert r["two_ranks"] == {"ran": False, "why": "tools/gpu_two_ranks.sh is not in this build"}, r["two_ranks"]
            if callable(folder.get("check")):
                return folder["check"](r, p.stdout)
            return None
        if p.returncode != 1:
            print(p.stdout, p.stderr)
            return f"the report should exit 1, exited {p.returncode}"
        wants = want if isinstance(want, list) else [want]
        for w in wants:
            if not any(re.search(w, x) for x in problems):
                print(p.stdout)
                return f"no problem matching {w!r} among {problems}"
        if folder.get("check") == "refused" and len(problems) != 1:
            return f"a refused check's report should name its reason alone: {problems}"
        if name == "graph_not_captured":
            r = json.load(open(res))
            if any(q["variant"] == "graph" for q in r["contributions"]) or \
                    any(t.get("variant") == "graph" for t in r["targets"]):
                return f"an uncaptured graph cell counted as a graph cell: {r['contributions']} {r['targets']}"
        for w in wants:
            print(f"{name}: exit 1, '{next(x for x in problems if re.search(w, x))}'")
        return None


def main():
    source, which = sys.argv[1], sys.argv[2]
    spec = importlib.util.spec_from_file_location("gpu_check_report", os.path.join(source, "tools", "gpu_check_report.py"))
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    GPU_TESTS[:] = list(report.MIN_GPU_TESTS) + [EXTRA_GPU_TEST]
    names = list(CASES) if which == "all" else [which]
    failed = 0
    for n in names:
        if n not in CASES:
            print(f"unknown case {n!r} (known: {', '.join(CASES)})")
            return 2
        err = run_case(source, n)
        if err:
            print(f"FAIL {n}: {err}")
            failed += 1
        else:
            print(f"PASS {n}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
