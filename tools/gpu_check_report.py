"""The GPU check's report: reads the raw JSON of tools/gpu_check.sh's sections and writes
results.json and the summary table (stdout).

  python3 tools/gpu_check_report.py JSON_DIR RESULTS_JSON [--device cuda|cpu]

results.json holds "card", "date", "env", "sections" (each command's exit status and
seconds), "tests", "train", "records" (one per step cell: who, network, batch, precision,
sample_rate, channels_last, images_per_s, peak_memory_mb, card, ...: the format of
docs/benchmarks/), "ratios" (faceshard over arcface_torch per cell), "contributions" (each
variant cell against its base cell: what the fused optimiser, the PReLU kernel, the CUDA graphs
and the real input pipeline each change), "targets" (the step's targets on a GPU, held or
not: reported, not a failed check), "classifier" (bytes per class measured and planned) and
"loader". Exit status 1 when a section failed or a check
did not hold (a test failed, the loss did not fall, a cell has no result).
"""

import argparse
import datetime
import glob
import json
import os
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


def pct(x):
    return f"{100 * x:.1f}%" if x else "-"


def fmt(x, digits=4):
    return "none" if x is None else f"{x:.{digits}f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json_dir")
    p.add_argument("results")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    d = a.json_dir
    problems = []

    sections = []
    try:
        with open(os.path.join(d, "status.tsv")) as f:
            for line in f:
                name, rc, secs = (line.rstrip("\n").split("\t") + ["", "", ""])[:3]
                sections.append({"name": name, "exit": rc, "seconds": float(secs or 0)})
    except OSError:
        pass
    for s in sections:
        if s["exit"] not in ("0", "skipped"):
            problems.append(f"{s['name']} exited {s['exit']}")

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
    tests = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "names": []}
    g = load(os.path.join(d, "gtest.json"))
    if g:
        for suite in g.get("testsuites", []):
            for t in suite.get("testsuite", []):
                name = f"{suite['name']}.{t['name']}"
                tests["names"].append(name)
                if t.get("failures"):
                    tests["failed"] += 1
                    tests["failures"].append({"test": name, "message": t["failures"][0].get("failure", "")[:2000]})
                elif t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN":
                    tests["skipped"] += 1
                else:
                    tests["passed"] += 1
        if tests["failed"]:
            problems.append(f"{tests['failed']} GPU test(s) failed")
        if a.device == "cuda" and tests["skipped"]:
            problems.append(f"{tests['skipped']} GPU test(s) skipped on a GPU")
    elif any(s["name"] == "tests" for s in sections):
        problems.append("no GoogleTest report")

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

    # step cells
    records = []
    raw_variant = {}  # id(record) -> its cell's variant word ("" for a base cell)
    for path in sorted(glob.glob(os.path.join(d, "step_*.json"))):
        r = load(path)
        if not r:
            continue
        base = os.path.basename(path)[len("step_"):-len(".json")]
        if base.startswith("arcface_torch_"):
            records.append({"who": "arcface_torch", "network": r["network"], "batch": r["batch_per_rank"],
                            "precision": r.get("precision", "fp32"), "sample_rate": r["sample_rate"],
                            "channels_last": False, "classes": r["classes"], "images_per_s": r["images_per_s"],
                            "peak_memory_mb": r.get("peak_memory_mb"), "step_ms": r.get("step_ms"),
                            "phases_ms": r.get("phases"), "card": card, "date": date})
        else:
            words = base.split("_")
            variant = words[-1] if words[-1] not in ("cl", "nchw") else ""
            layout = words[-2] if variant else words[-1]
            records.append({"who": "faceshard", "network": r["network"], "batch": r["batch_per_rank"],
                            "precision": r["precision"], "sample_rate": r.get("sample_rate"),
                            "variant": VARIANTS[variant][0] if variant in VARIANTS else variant,
                            "channels_last": layout == "cl", "classes": r["classes"],
                            "images_per_s": r["images_per_s"], "peak_memory_mb": r.get("peak_memory_mb"),
                            "step_ms": r.get("step_ms"), "phases_ms": r.get("split_ms"), "card": card, "date": date})
            raw_variant[id(records[-1])] = variant
    for r in records:
        r["mfu"] = mfu(r["network"], r["images_per_s"], card, r["precision"])
    for s in sections:
        if s["name"].startswith("step_") and s["exit"] == "0" and not os.path.exists(os.path.join(d, s["name"] + ".json")):
            problems.append(f"{s['name']}: no result")
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
                               "step_ms": run["step_ms"], "gemm_ms": run["gemm_ms"], "peak_memory_mb": run["peak_memory_mb"]})

    loader = load(os.path.join(d, "loader.json"), {})

    results = {"card": card, "date": date, "device": a.device, "env": env, "sections": sections, "tests": tests,
               "train": train, "records": records, "ratios": ratios, "contributions": contributions,
               "targets": targets, "classifier": classifier, "loader": loader,
               "problems": problems}
    tmp = a.results + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    os.replace(tmp, a.results)

    # the table
    print(f"== faceshard GPU check: {card}, {date}")
    if env:
        print(f"   torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, NCCL {env.get('nccl')}; "
              f"{env.get('nvidia_smi', '')}")
    print("-- sections (exit, seconds)")
    print("   " + ", ".join(f"{s['name']} {s['exit']} {s['seconds']:.0f}s" for s in sections))
    print(f"-- GPU tests: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped")
    for f_ in tests["failures"]:
        print(f"   FAILED {f_['test']}: {f_['message'].splitlines()[0] if f_['message'] else ''}")
    for prec, t in train.items():
        l = t["losses"]
        acc = t["verification"]
        print(f"-- train {prec}: loss {l[0][1]:.3f} (step {l[0][0]}) -> {l[-1][1]:.3f} (step {l[-1][0]}); "
              f"verification {' '.join(f'{s}:{v:.3f}' for s, v in acc)}; faceshard-verify {fmt(t['verify_tool_accuracy'])}"
              f"; onnx {t.get('onnx_bytes', 'none')} B" if l else f"-- train {prec}: no losses")
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
    for r in loader.get("results", []):
        print(f"-- loader: {r['workers']} workers: {r['images_per_s']:.0f} images/s")
    if problems:
        print("-- PROBLEMS")
        for x in problems:
            print("   " + x)
    else:
        print("-- all checks held")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
