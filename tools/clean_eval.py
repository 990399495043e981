#!/usr/bin/env python3
"""faceshard-clean measured against known label noise (docs/cleaning.md, "Measuring it on
synthetic noise"). Standard library only.

  clean_eval.py score --reports DIR --truth DIR [--json FILE] [--sweep]
      Precision and recall of each report of faceshard-clean's folder against the truth that
      faceshard-synth --noise-* --truth wrote. What counts as one finding:
        mislabeled            an image (index): flagged when it is a row of mislabeled.tsv,
                              true when the truth filed it under another identity's label
        duplicate_identities  a pair of classes, either order: true when one is a split of the other
        overlap               a (test identity, training class) pair: true when they are one person
                              (a row naming the right class for the wrong test identity is false)
        near_duplicates       a pair of images, either order: true when one is a copy of the other
      precision = true findings flagged / findings flagged, recall = true findings flagged /
      true findings; '-' where the denominator is 0. --sweep also prints both for stricter
      thresholds than the report was made with, from the report's own cos/angle column (the
      curve to calibrate a threshold on), and where the true and the false findings lie.

  clean_eval.py run --work DIR [options]
      The whole loop, one command: faceshard-synth with the noise -> faceshard-train with
      loss.subcenters=3 -> faceshard-clean -> score -> faceshard-pack clean --merge ->
      faceshard-train (K = 1) on the noisy set and on the cleaned one (and with --reference
      on the noise-free set) -> the final verification accuracy of each on the held-out
      pairs. Prints a table and writes DIR/result.json. See --help for the sizes.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

REPORTS = ["mislabeled", "duplicate_identities", "overlap", "near_duplicates"]


def fail(msg):
    print("clean_eval: error: " + msg, file=sys.stderr)
    sys.exit(2)


def read_tsv(path, need):
    """Rows of a TSV (lines starting with '#' skipped, the first other line the column
    names) as dicts; `need` the columns that must be there."""
    if not os.path.isfile(path):
        fail("%s: missing" % path)
    rows, cols = [], None
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            cells = line.split("\t")
            if cols is None:
                cols = cells
                missing = [c for c in need if c not in cols]
                if missing:
                    fail("%s: no column %s" % (path, ", ".join(missing)))
                continue
            if len(cells) < len(cols):
                fail("%s:%d: %d cells, expected %d" % (path, n, len(cells), len(cols)))
            rows.append(dict(zip(cols, cells)))
    if cols is None:
        fail("%s: no column line" % path)
    return rows


def as_int(path, row, col):
    try:
        return int(row[col])
    except ValueError:
        fail("%s: column %s: expected an integer, got '%s'" % (path, col, row[col]))


# Each report: the key of a finding in the report and in the truth; for --sweep, the column
# whose value orders the findings from surest (highest) to least sure, the threshold's.
def key_of(report, path, row):
    if report == "mislabeled":
        return as_int(path, row, "index")
    if report == "duplicate_identities":
        return frozenset((as_int(path, row, "class_a"), as_int(path, row, "class_b")))
    if report == "overlap":
        return (row["test_identity"], as_int(path, row, "class"))
    return frozenset((as_int(path, row, "index_a"), as_int(path, row, "index_b")))


COLUMNS = {"mislabeled": ["index"], "duplicate_identities": ["class_a", "class_b"], "overlap": ["test_identity", "class"],
           "near_duplicates": ["index_a", "index_b"]}
SWEEP = {"mislabeled": "angle_deg", "duplicate_identities": "cos", "overlap": "cos", "near_duplicates": "cos"}


def truth_keys(truth, report):
    path = os.path.join(truth, report + ".tsv")
    rows = read_tsv(path, COLUMNS[report])
    if report == "overlap":
        rows = [r for r in rows if r["class"] != "-"]
    return {key_of(report, path, r) for r in rows}


def ratio(a, b):
    return None if b == 0 else a / b


def score(reports, truth):
    out = {}
    for r in REPORTS:
        want = truth_keys(truth, r)
        path = os.path.join(reports, r + ".tsv")
        rows = read_tsv(path, COLUMNS[r])
        got = set()
        for row in rows:
            got.add(key_of(r, path, row))
        hits = len(got & want)
        out[r] = {"flagged": len(got), "true": len(want), "hits": hits, "precision": ratio(hits, len(got)),
                  "recall": ratio(hits, len(want))}
    return out


def sweep(reports, truth, report):
    """(threshold, flagged, hits, precision, recall) at each value of the report's column: what
    the report would score made with that threshold (a finding's best row counts)."""
    col = SWEEP[report]
    want = truth_keys(truth, report)
    path = os.path.join(reports, report + ".tsv")
    best = {}
    for row in read_tsv(path, COLUMNS[report] + [col]):
        k, v = key_of(report, path, row), float(row[col])
        best[k] = max(v, best.get(k, v))
    items = sorted(best.items(), key=lambda kv: -kv[1])
    curve, hits = [], 0
    for n, (k, v) in enumerate(items, 1):
        hits += k in want
        if n == len(items) or items[n][1] != v:
            curve.append((v, n, hits, hits / n, ratio(hits, len(want))))
    return col, curve


def separation(reports, truth, report):
    """The values (the report's sweep column) of its true and of its false findings."""
    col, want = SWEEP[report], truth_keys(truth, report)
    path = os.path.join(reports, report + ".tsv")
    best = {}
    for row in read_tsv(path, COLUMNS[report] + [col]):
        k = key_of(report, path, row)
        best[k] = max(float(row[col]), best.get(k, -1e9))
    return sorted(v for k, v in best.items() if k in want), sorted(v for k, v in best.items() if k not in want)


def span(v):
    if not v:
        return "none"
    return "%d from %.4f to %.4f (median %.4f)" % (len(v), v[-1], v[0], v[len(v) // 2])


def fmt(x):
    return "-" if x is None else "%.3f" % x


def print_score(s, file=sys.stdout):
    print("%-22s %8s %6s %6s %9s %7s" % ("report", "flagged", "true", "hits", "precision", "recall"), file=file)
    for r in REPORTS:
        v = s[r]
        print("%-22s %8d %6d %6d %9s %7s" % (r, v["flagged"], v["true"], v["hits"], fmt(v["precision"]),
                                             fmt(v["recall"])), file=file)


def cmd_score(a):
    s = score(a.reports, a.truth)
    print_score(s)
    if a.sweep:
        for r in REPORTS:
            col, curve = sweep(a.reports, a.truth, r)
            print("\n%s: flagged at %s >= (each line: that threshold)" % (r, col))
            print("  %-10s %8s %6s %9s %7s" % (col, "flagged", "hits", "precision", "recall"))
            t, f = separation(a.reports, a.truth, r)
            print("  true findings: %s; false findings: %s" % (span(t), span(f)))
            step = max(1, len(curve) // 40)  # about 40 lines a report, and always the last one
            for i, (v, n, h, p, rc) in enumerate(curve):
                if i % step == 0 or i == len(curve) - 1:
                    print("  %-10.4f %8d %6d %9s %7s" % (v, n, h, fmt(p), fmt(rc)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


# ---------------------------------------------------------------------------- the driver

def run(cmd, log, env=None):
    t0 = time.time()
    print("$ " + " ".join(shlex.quote(c) for c in cmd) + "   > " + log, flush=True)
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    dt = time.time() - t0
    if rc != 0:
        with open(log) as f:
            tail = f.readlines()[-15:]
        sys.stderr.write("".join(tail))
        fail("exit %d after %.0f s: %s (log: %s)" % (rc, dt, cmd[0], log))
    return dt


def final_accuracy(metrics, target):
    """The last verification accuracy of `target` in a run's metrics.jsonl, and its step."""
    key, last = "val/%s/accuracy" % target, None
    with open(metrics) as f:
        for line in f:
            r = json.loads(line)
            if key in r:
                last = (r[key], int(r["step"]))
    if last is None:
        fail("%s: no %s (the run verified nothing)" % (metrics, key))
    return last


def cmd_run(a):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bindir = os.path.abspath(a.bin or os.path.join(root, "build", "bin"))
    for b in ["faceshard-synth", "faceshard-train", "faceshard-clean", "faceshard-pack"]:
        if not os.access(os.path.join(bindir, b), os.X_OK):
            fail("--bin: %s/%s is missing" % (bindir, b))
    config = os.path.abspath(a.config or os.path.join(root, "configs", "demo.yaml"))
    if not os.path.isfile(config):
        fail("--config: '%s' does not exist" % config)
    w = os.path.abspath(a.work)
    if os.path.exists(w) and os.listdir(w):
        fail("--work: '%s' is not empty (every run starts from nothing)" % w)
    os.makedirs(w, exist_ok=True)
    data, truth, reports, cleaned = (os.path.join(w, d) for d in ["data", "truth", "reports", "cleaned"])
    sizes = ["--identities", str(a.identities), "--images", str(a.images), "--holdout", str(a.holdout),
             "--pairs", str(a.pairs), "--seed", str(a.seed)]
    times = {}
    times["synth"] = run([os.path.join(bindir, "faceshard-synth"), "--output", data] + sizes +
                         ["--noise-mislabel", str(a.noise_mislabel), "--noise-split", str(a.noise_split),
                          "--noise-duplicate", str(a.noise_duplicate), "--noise-overlap", str(a.noise_overlap),
                          "--truth", truth], os.path.join(w, "synth.log"))

    def train(name, rec, extra):
        out = os.path.join(w, name)
        cmd = [os.path.join(root, "tools", "launch.sh"), "--nproc", str(a.nproc), "--",
               os.path.join(bindir, "faceshard-train"), "--config", config, "--set", "output=" + out,
               "--set", "data.rec=" + rec, "--set", "data.val_dir=" + data, "--set", "train.verify_every=0"]
        for s in a.set + extra:
            cmd += ["--set", s]
        times[name] = run(cmd, os.path.join(w, name + ".log"))
        return out

    k3 = train("noisy_k3", data, ["loss.subcenters=3"] + a.set_k3)
    acc = {"noisy_k3": final_accuracy(os.path.join(k3, "metrics.jsonl"), a.val_target)}
    clean_cmd = [os.path.join(bindir, "faceshard-clean"), "--run", k3, "--rec", data, "--output", reports,
                 "--device", a.device] + (["--no-flip"] if not a.flip else [])
    if a.noise_overlap > 0:
        clean_cmd += ["--test-identities", os.path.join(data, "test_identities")]
    clean_cmd += shlex.split(a.clean_args)
    times["clean"] = run(clean_cmd, os.path.join(w, "clean.log"))
    s = score(reports, truth)
    with open(os.path.join(w, "score.json"), "w") as f:
        json.dump(s, f, indent=1)
    if a.score_only:
        print_score(s)
        return 0
    times["pack"] = run([os.path.join(bindir, "faceshard-pack"), "clean", os.path.join(data, "train.rec"),
                         os.path.join(cleaned, "train"), "--reports", reports, "--merge"] + shlex.split(a.pack_args),
                        os.path.join(w, "pack.log"))
    runs = [("noisy", data), ("cleaned", cleaned)]
    if a.reference:
        ref = os.path.join(w, "reference")
        times["reference_synth"] = run([os.path.join(bindir, "faceshard-synth"), "--output", ref] + sizes,
                                       os.path.join(w, "reference_synth.log"))
        runs.append(("reference", ref))
    # The same number of steps as the K = 3 run (a cleaned set is smaller: its epochs are shorter).
    same = ["optim.total_steps=%d" % acc["noisy_k3"][1]] if a.same_steps else []
    for name, rec in runs:
        out = train(name + "_k1", rec, ["loss.subcenters=1"] + same)
        acc[name] = final_accuracy(os.path.join(out, "metrics.jsonl"), a.val_target)
    with open(os.path.join(w, "pack.log")) as f:
        # Its summary line ("... images kept, ... dropped ..."), among the per-report lines and warnings.
        lines = [line.strip() for line in f if line.strip()]
        pack = next((l for l in reversed(lines) if " images kept, " in l), lines[-1] if lines else "")
    result = {"score": s, "verification": {k: {"accuracy": v[0], "step": v[1]} for k, v in acc.items()},
              "seconds": times, "clean_command": clean_cmd, "pack": pack}
    with open(os.path.join(w, "result.json"), "w") as f:
        json.dump(result, f, indent=1)

    print("\nfaceshard-clean on %d identities x %d images, seed %d (noise: mislabel %s, split %s, duplicate %s, "
          "overlap %d)" % (a.identities, a.images, a.seed, a.noise_mislabel, a.noise_split, a.noise_duplicate,
                           a.noise_overlap))
    print("clean: " + " ".join(shlex.quote(c) for c in clean_cmd[1:]))
    print_score(s)
    print("\nfaceshard-pack clean: " + pack)
    print("\n%-22s %9s %6s" % ("trained on", "accuracy", "steps"))
    print("%-22s %9.4f %6d" % ("noisy, K = 3", acc["noisy_k3"][0], acc["noisy_k3"][1]))
    for name, _ in runs:
        print("%-22s %9.4f %6d" % (name + ", K = 1", acc[name][0], acc[name][1]))
    print("\n(seconds: %s)" % ", ".join("%s %.0f" % kv for kv in times.items()))
    return 0


def main():
    p = argparse.ArgumentParser(prog="clean_eval.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("score", help="precision and recall of a report folder against the truth")
    s.add_argument("--reports", required=True, help="faceshard-clean's report folder")
    s.add_argument("--truth", required=True, help="faceshard-synth --truth's folder")
    s.add_argument("--json", help="write the figures to this file")
    s.add_argument("--sweep", action="store_true", help="precision and recall at stricter thresholds too")
    r = sub.add_parser("run", help="synth + noise -> train K=3 -> clean -> score -> pack clean -> train K=1 twice")
    r.add_argument("--work", required=True, help="an empty or new folder for everything")
    r.add_argument("--bin", help="the binaries (default: build/bin)")
    r.add_argument("--config", help="the training config (default: configs/demo.yaml)")
    r.add_argument("--nproc", type=int, default=2, help="training ranks (default 2)")
    r.add_argument("--set", action="append", default=[], help="key=value for every training (repeatable)")
    r.add_argument("--set-k3", action="append", default=[], help="key=value for the K = 3 training only")
    r.add_argument("--identities", type=int, default=500)
    r.add_argument("--images", type=int, default=20)
    r.add_argument("--holdout", type=int, default=50)
    r.add_argument("--pairs", type=int, default=400)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--noise-mislabel", type=float, default=0.10)
    r.add_argument("--noise-split", type=float, default=0.02)
    r.add_argument("--noise-duplicate", type=float, default=0.01)
    r.add_argument("--noise-overlap", type=int, default=10)
    r.add_argument("--clean-args", default="", help="faceshard-clean's thresholds, one string")
    r.add_argument("--pack-args", default="", help="more faceshard-pack clean flags, one string (--keep-...)")
    r.add_argument("--device", default="cpu", help="faceshard-clean's --device (default cpu)")
    r.add_argument("--flip", action="store_true", help="embed with the mirrored image too (default: --no-flip)")
    r.add_argument("--score-only", action="store_true",
                   help="stop after the score (to calibrate: loose thresholds, then score --sweep)")
    r.add_argument("--reference", action="store_true", help="also train K = 1 on the same set without noise")
    r.add_argument("--same-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="train every K = 1 run for as many steps as the K = 3 run took (default; --no-same-steps: "
                        "each for the config's epochs)")
    r.add_argument("--val-target", default="synth", help="the verification set the runs report (default synth)")
    a = p.parse_args()
    return cmd_score(a) if a.cmd == "score" else cmd_run(a)


if __name__ == "__main__":
    sys.exit(main())
