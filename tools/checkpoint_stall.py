#!/usr/bin/env python3
"""How long checkpoints stop the training: the same short run of faceshard-train twice, with
train.checkpoint_async off (every checkpoint written while the training waits) and on
(staged in host memory, written by a background thread), one rank. From each run's
metrics.jsonl: per checkpoint the bytes, how long the training waited (checkpoint/wait_s)
and how long the write took (checkpoint/write_s); and the step times of the background run
while a write was in flight beside its other steps (the copy's and the write's cost to the
training: memory bandwidth and cores on a CPU, a side stream's copy on a GPU).

  tools/checkpoint_stall.py --bin build/bin --classes 2000000 --output /tmp/stall

prints a table and writes OUTPUT/checkpoint_stall.json (--json elsewhere). Any further
--set KEY=VALUE goes to both runs (e.g. --set dist.device=cuda --set model.backbone=r50).

usage: checkpoint_stall.py --bin DIR --output DIR [--classes N] [--backbone NAME] [--batch N]
       [--sample-rate R] [--every N] [--steps N] [--config YAML] [--json PATH] [--set K=V ...]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys


def fail(msg):
    print("checkpoint_stall.py: error: " + msg, file=sys.stderr)
    sys.exit(1)


def read_metrics(path):
    steps, ckpts = {}, {}
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                try:
                    r = json.loads(line)
                except ValueError:
                    fail("%s line %d is not JSON" % (path, n))
                if "checkpoint/wait_s" in r:
                    ckpts[int(r["step"])] = r
                elif "samples_per_sec" in r:
                    steps[int(r["step"])] = r
    except OSError as e:
        fail("cannot read %s: %s" % (path, e.strerror))
    return steps, ckpts


def run(args, mode):
    out = os.path.join(args.output, mode)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [os.path.join(args.bin, "faceshard-train"), "--config", args.config, "--set", "output=" + out,
           "--set", "data.num_classes=%d" % args.classes, "--set", "model.backbone=" + args.backbone,
           "--set", "data.batch_size=%d" % args.batch, "--set", "loss.sample_rate=%g" % args.sample_rate,
           "--set", "train.checkpoint_every=%d" % args.every, "--set", "train.max_steps=%d" % args.steps,
           "--set", "train.log_every=1", "--set", "train.verify_every=0", "--set", "train.tensorboard=false",
           "--set", "train.keep_checkpoints=1", "--set", "train.checkpoint_async=" + mode]
    for kv in args.set or []:
        cmd += ["--set", kv]
    os.makedirs(args.output, exist_ok=True)
    log = os.path.join(args.output, mode + ".log")
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        with open(log) as f:
            tail = f.read()[-1500:]
        fail("faceshard-train (checkpoint_async %s) exited %d:\n%s" % (mode, rc, tail))
    with open(log) as f:
        text = f.read()
    background = "checkpoints: written in the background" in text
    if background != (mode == "on"):
        fail("checkpoint_async %s: the trainer chose %s checkpoints (%s)" %
             (mode, "background" if background else "synchronous", log))
    steps, ckpts = read_metrics(os.path.join(out, "metrics.jsonl"))
    return steps, ckpts


def step_seconds(steps, batch):
    return {s: batch / r["samples_per_sec"] for s, r in steps.items() if r.get("samples_per_sec")}


def during_writes(step_s, ckpts):
    """The steps run while a background write was in flight: after checkpoint step c, the
    steps whose start lies within write_s of the write's start (the end of the training's
    wait at c)."""
    during = set()
    for c, r in ckpts.items():
        t, s = 0.0, c + 1
        while s in step_s and t < r["checkpoint/write_s"]:
            during.add(s)
            t += step_s[s]
            s += 1
    return during


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--config", default=None, help="the base config (default: configs/base.yaml beside the tools)")
    ap.add_argument("--classes", type=int, default=2000000)
    ap.add_argument("--backbone", default="mbf")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--sample-rate", type=float, default=0.1)
    ap.add_argument("--every", type=int, default=4, help="train.checkpoint_every")
    ap.add_argument("--steps", type=int, default=12, help="train.max_steps (the last step's checkpoint is waited for)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", action="append", help="KEY=VALUE for both runs")
    args = ap.parse_args()
    if args.config is None:
        args.config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yaml")
    if args.every < 1 or args.steps < args.every:
        fail("--every must be >= 1 and --steps >= --every")
    if not os.access(os.path.join(args.bin, "faceshard-train"), os.X_OK):
        fail("no faceshard-train in %s" % args.bin)
    runs = {mode: run(args, mode) for mode in ("off", "on")}
    (sync_steps, sync_ck), (bg_steps, bg_ck) = runs["off"], runs["on"]
    if sorted(sync_ck) != sorted(bg_ck) or not sync_ck:
        fail("the runs checkpointed at different steps: %s and %s" % (sorted(sync_ck), sorted(bg_ck)))
    rows = []
    for c in sorted(sync_ck):
        a, b = sync_ck[c], bg_ck[c]
        if not (a["checkpoint/committed"] and b["checkpoint/committed"]):
            fail("the checkpoint of step %d was not committed in both runs" % c)
        rows.append({"step": c, "bytes": a["checkpoint/bytes"], "sync_wait_s": a["checkpoint/wait_s"],
                     "async_wait_s": b["checkpoint/wait_s"], "async_stage_s": b["checkpoint/stage_s"],
                     "async_previous_wait_s": b["checkpoint/previous_wait_s"],
                     "async_write_s": b["checkpoint/write_s"],
                     "wait_ratio": a["checkpoint/wait_s"] / max(b["checkpoint/wait_s"], 1e-9)})
    bg_step_s = step_seconds(bg_steps, args.batch)
    # Checkpoint steps themselves (their time includes the training's wait) are left out.
    during = sorted(during_writes(bg_step_s, bg_ck) - set(bg_ck))
    away = sorted(set(bg_step_s) - set(during) - set(bg_ck) - {1})  # step 1 pays the warm-up
    med = lambda xs: statistics.median(xs) if xs else None
    steps = {"during_write_steps": during, "away_steps": away,
             "during_write_median_s": med([bg_step_s[s] for s in during]),
             "away_median_s": med([bg_step_s[s] for s in away])}
    steps["during_over_away"] = (steps["during_write_median_s"] / steps["away_median_s"]
                                 if steps["during_write_median_s"] and steps["away_median_s"] else None)
    result = {"classes": args.classes, "backbone": args.backbone, "batch": args.batch, "sample_rate": args.sample_rate,
              "every": args.every, "steps": args.steps, "sets": args.set or [], "checkpoints": rows,
              "background_steps": steps}
    path = args.json or os.path.join(args.output, "checkpoint_stall.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("| checkpoint | bytes | synchronous: the training waits | background: the training waits | "
          "background: the write | wait, sync / async |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| step %d | %.2f GB | %.3g s | %.3g s | %.3g s | %.1fx |" %
              (r["step"], r["bytes"] / 1e9, r["sync_wait_s"], r["async_wait_s"], r["async_write_s"], r["wait_ratio"]))
    fmt = lambda x: "-" if x is None else "%.3g" % x
    print("background run: step time while a write was in flight %s s (median of %d steps), other steps %s s "
          "(median of %d); ratio %s" % (fmt(steps["during_write_median_s"]), len(during), fmt(steps["away_median_s"]),
                                        len(away), fmt(steps["during_over_away"])))
    print("written:", path)


if __name__ == "__main__":
    main()
