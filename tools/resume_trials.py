#!/usr/bin/env python3
"""Stop-and-resume trials: the demo training stopped at a checkpoint and resumed, beside the
same run uninterrupted, repeated, so that a resume that depends on timing shows up as a rate.

Each trial, for each setting (precision x checkpoints in the background or synchronously):
  part 1     the run to step STOP (its last checkpoint), then --resume to FULL; with --past K
             the run goes K steps past its checkpoint at STOP (written in the background
             while those steps run), its later checkpoint is removed, and --resume takes STOP's
  full       the same run uninterrupted to FULL (a checkpoint at STOP written while it goes on)
and compares the per-step losses of metrics.jsonl after STOP (and the final weights) bit for
bit: on the CPU the two compute the same numbers or the resume is wrong. --load N keeps N busy
processes beside the trials (CI runs tests two at a time). Prints one line per trial and a
summary; exits 1 when any trial differs.

usage: resume_trials.py --bin build/bin --trials 30 [--precisions bf16,fp32]
                        [--checkpoints async,sync] [--load 1] [--past K] [--poison BYTE]
                        [--work DIR] [--keep]
"""
import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def burn(stop):
    x = 0
    while not stop.is_set():
        for i in range(100000):
            x = (x * 1103515245 + i) & 0xFFFFFFFF


def losses(run_dir):
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                out[r["step"]] = r["loss"]  # a resumed run's lines come last
    return out


def weights_digest(run_dir):
    ck = os.path.join(run_dir, "checkpoints")
    steps = sorted(d for d in os.listdir(ck) if os.path.exists(os.path.join(ck, d, "COMMITTED")))
    h = hashlib.sha256()
    for name in ("backbone.pt", "fc_shard_0.pt"):
        with open(os.path.join(ck, steps[-1], name), "rb") as f:
            h.update(f.read())
    return steps[-1], h.hexdigest()[:16]


def train(bindir, args, log, env=None):
    with open(log, "w") as f:
        p = subprocess.run([os.path.join(bindir, "faceshard-train")] + args, stdout=f, stderr=subprocess.STDOUT, env=env)
    if p.returncode != 0:
        sys.exit("faceshard-train failed (exit %d), see %s" % (p.returncode, log))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--checkpoints", default="async,sync")
    ap.add_argument("--stop", type=int, default=3)
    ap.add_argument("--full", type=int, default=6)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--load", type=int, default=1, help="busy processes beside the trials")
    ap.add_argument("--past", type=int, default=0, help="steps part 1 runs past its checkpoint at STOP")
    ap.add_argument("--poison", default="", help="FACESHARD_CPU_POISON for every run (a byte)")
    ap.add_argument("--work", default="")
    ap.add_argument("--keep", action="store_true", help="keep the folders of trials that differ")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="resume_trials.")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "data")
    if not os.path.exists(os.path.join(data, "train.rec")):
        subprocess.run([os.path.join(a.bin, "faceshard-synth"), "--output", data], check=True,
                       stdout=subprocess.DEVNULL)
    env = dict(os.environ)
    if a.poison:
        env["FACESHARD_CPU_POISON"] = a.poison
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=burn, args=(stop,), daemon=True) for _ in range(a.load)]
    for b in burners:
        b.start()
    failures = {}
    counts = {}
    try:
        for t in range(a.trials):
            for prec in a.precisions.split(","):
                for ck in a.checkpoints.split(","):
                    key = "%s/%s" % (prec, ck)
                    d = os.path.join(work, "t%03d_%s_%s" % (t, prec, ck))
                    shutil.rmtree(d, ignore_errors=True)
                    os.makedirs(d)
                    common = ["--config", os.path.join(ROOT, "configs", "demo.yaml"), "--set", "data.rec=" + data,
                              "--set", "dist.device=cpu", "--set", "data.batch_size=%d" % a.batch,
                              "--set", "data.num_workers=%d" % a.workers, "--set", "train.tensorboard=false",
                              "--set", "train.log_every=1", "--set", "train.verify_every=%d" % a.stop,
                              "--set", "train.precision=" + prec, "--set", "train.checkpoint_every=%d" % a.stop,
                              "--set", "train.checkpoint_async=" + ("on" if ck == "async" else "off")]
                    r, full = os.path.join(d, "resumed"), os.path.join(d, "full")
                    t0 = time.time()
                    train(a.bin, common + ["--set", "output=" + r, "--set", "train.max_steps=%d" % (a.stop + a.past)],
                          os.path.join(d, "part1.log"), env)
                    if a.past:
                        shutil.rmtree(os.path.join(r, "checkpoints", "step_%08d" % (a.stop + a.past)))
                    train(a.bin, common + ["--set", "output=" + r, "--set", "train.max_steps=%d" % a.full,
                                           "--resume"], os.path.join(d, "resume.log"), env)
                    train(a.bin, common + ["--set", "output=" + full, "--set", "train.max_steps=%d" % a.full],
                          os.path.join(d, "full.log"), env)
                    lr, lf = losses(r), losses(full)
                    steps = [s for s in range(1, a.full + 1)]
                    diff = [s for s in steps if lr.get(s) != lf.get(s)]
                    wr, wf = weights_digest(r), weights_digest(full)
                    ok = not diff and wr == wf
                    counts[key] = counts.get(key, 0) + 1
                    if not ok:
                        failures.setdefault(key, []).append(t)
                    print("trial %3d %-10s %s  %.0f s%s" % (
                        t, key, "same" if ok else "DIFFERENT", time.time() - t0,
                        "" if ok else ": steps %s differ (%s); weights %s vs %s" % (
                            diff, ", ".join("%d: %r vs %r" % (s, lr.get(s), lf.get(s)) for s in diff[:3]), wr, wf)),
                        flush=True)
                    if ok or not a.keep:
                        shutil.rmtree(d, ignore_errors=True)
    finally:
        stop.set()
        for b in burners:
            b.join(timeout=5)
    print("summary (%d busy process%s beside):" % (a.load, "" if a.load == 1 else "es"))
    for key, n in counts.items():
        f = failures.get(key, [])
        print("  %-10s %d of %d trials differ%s" % (key, len(f), n, (" (trials %s)" % f) if f else ""))
    if not a.work and not failures:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
