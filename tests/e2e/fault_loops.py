#!/usr/bin/env python3
"""Fault loops: faceshard-train killed over and over, on CPU with a tiny job.

  kill_all   every rank is killed with SIGKILL at a random moment (or, in half the trials,
             one rank dies inside a checkpoint write and the others are killed at once),
             then the job is resumed: every resume must start from the latest committed
             checkpoint, lose at most one checkpoint interval (two when checkpoints are
             written in the background), and train on.
  kill_in_async_save
             kill_all's in-save trials with train.checkpoint_async on: the rank dies half-way
             through a checkpoint written in the background while the training goes on.
  freeze_in_agreement
             rank 1 of two freezes (SIGSTOP) inside the commit stage of the agreement of the
             run's last checkpoint, written in the background: rank 0 must end within the
             hang limit, the checkpoint stays committed, and the resume names it.
  lose_rank  one rank of three is killed (SIGKILL) or frozen (SIGSTOP) at a random moment,
             each rank and each signal in turn (rank 0 hosts the rendezvous store): every
             other rank must exit non-zero within the collective timeout (plus the failure
             diagnosis) with an error line naming the lost rank.

The network cases run a job of two hosts (network namespaces joined by a veth pair, one
rank each, root needed) with the default hang limit's scale (3 x the median step + 5 s):
  throttle   the link is limited (tbf, both ways, 16-32 Mbit/s) from a random step until the
             slow link is named, then freed: the run must name the host pair and finish.
  partition  the link goes down at a random step past the 10th (from where the hang limit
             scales with the measured step), for 0.5-2 s (the run must ride through)
             or for good (every rank must exit non-zero within the hang limit, naming the
             other host; no checkpoint may be lost or half-written, and --resume auto after
             the link is back must continue from the last committed step).
  straggler  each trial trains 10 warm-up steps and 6 windows of 3 steps with nothing wrong
             (a straggler or a slow link named there is a false flag), then slows one rank
             for up to 6 windows (a cgroup-v1 CPU quota of 20-40%, or SIGSTOP/SIGCONT
             bursts): it must be named, the other never.

The stranger case (strangers.py, two ranks on this host): each trial starts a job and one
kind of stranger (idle connections, random bytes, a 2^63 length prefix, a slow drip, a
replayed handshake) on one of its ports (the store, either rank's Gloo port): every
stranger's connection closed within 2 s, the job trains on and stops cleanly, RSS +16 MiB at most.

The storage cases (storage_faults.py, one rank):
  enospc / eio     a random kind of file (a checkpoint's, metrics.jsonl, TensorBoard's, the
                   export's), operation and call fails with ENOSPC / EIO (a quarter of the
                   trials: from that call on)
  corrupt_latest   the newest checkpoint damaged (in a fifth of the trials the one before
                   too): --resume auto walks back, or refuses in one line

usage: fault_loops.py --source DIR --bin DIR --case CASE [--trials N] [--seed S] [--keep]
       [--checkpoint-async on|off|auto]
The seed (printed first) makes the kill times and victims reproducible; the ranks are
started here, one process each with the variables tools/launch.sh would give them, so
that every rank's exit status and time are observed on their own.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

CHECKPOINT_EVERY = 2
COLLECTIVE_TIMEOUT_S = 3.0
# A failed collective waits three heartbeat intervals (1.5 s) to tell dead from slow ranks,
# and a survivor of a frozen rank 0 waits up to 5 s for the store it hosted.
DIAGNOSIS_S = 6.5
# Exiting after the diagnosis: flushing, the store's shutdown, the process's teardown. A
# loaded 2-core machine has taken up to 9.8 s for all of it, 2.7 s under the old 12.5 s
# limit; a survivor that hangs waits for minutes, so the generous slack still tells.
EXIT_SLACK_S = 10.0


def verdict(failures, seed):
    """Prints each failure and PASS, or the seed to replay them; the exit status."""
    for f in failures:
        print("FAIL: " + f)
    if failures:
        print("seed %d" % seed)
        return 1
    print("PASS")
    return 0


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Job:
    """N rank processes of faceshard-train, each logging to its own file."""

    def __init__(self, args, work, tag, nproc, extra, env_extra=None):
        self.logs = [os.path.join(work, "%s.rank%d.log" % (tag, r)) for r in range(nproc)]
        port = self.port = free_port()
        self.procs = []
        for r in range(nproc):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                       LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", NODE_RANK="0",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            env.pop("FACESHARD_FAULTS", None)
            env.update(env_extra or {})
            with open(self.logs[r], "w") as log:
                self.procs.append(subprocess.Popen(
                    [os.path.join(args.bin, "faceshard-train"), "--config", os.path.join(work, "tiny.yaml")] + extra,
                    stdout=log, stderr=subprocess.STDOUT, env=env))
        self.exit_time = [None] * nproc

    def log(self, r):
        with open(self.logs[r], errors="replace") as f:
            return f.read()

    def poll(self):
        for r, p in enumerate(self.procs):
            if self.exit_time[r] is None and p.poll() is not None:
                self.exit_time[r] = time.monotonic()

    def running(self):
        self.poll()
        return [r for r, p in enumerate(self.procs) if p.returncode is None]

    def wait_for(self, cond, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return True
            if not self.running():
                return cond()   # every rank has exited: nothing more will come
            time.sleep(0.01)
        return False

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        self.poll()


def steps_logged(text):
    return [int(s) for s in re.findall(r"step (\d+)/\d+", text)]


def resumed_step(text):
    m = re.search(r"resumed from \S*step_(\d+) at step (\d+)", text)
    return int(m.group(2)) if m else None


def committed_steps(out):
    d = os.path.join(out, "checkpoints")
    if not os.path.isdir(d):
        return []
    return sorted(int(e[5:]) for e in os.listdir(d)
                  if e.startswith("step_") and os.path.exists(os.path.join(d, e, "COMMITTED")))


def write_setup(args, work):
    subprocess.run([os.path.join(args.bin, "faceshard-synth"), "--output", os.path.join(work, "data"), "--identities",
                    "16", "--images", "8", "--holdout", "4", "--pairs", "8", "--seed", "3"],
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(work, "tiny.yaml"), "w") as f:
        f.write("""base: {root}/configs/base.yaml
output: {work}/out
seed: 7
data: {{rec: {work}/data, num_classes: 16, batch_size: 4, num_workers: 1}}
model: {{backbone: mbf, embedding_size: 32}}
loss: {{margin: [1.0, 0.0, 0.4], scale: 16}}
optim: {{lr: 0.05, epochs: 1000, warmup_epochs: 0}}
train: {{log_every: 1, verify_every: 0, checkpoint_every: {k}, keep_checkpoints: 3, tensorboard: false{more}}}
dist: {{device: cpu, timeout_s: {t}}}
""".format(root=args.source, work=work, k=CHECKPOINT_EVERY, t=COLLECTIVE_TIMEOUT_S,
           more=", checkpoint_async: " + args.checkpoint_async if args.checkpoint_async else ""))


def kill_all(args, work, rng, modes=("random", "in_save")):
    out = os.path.join(work, "out")
    failures = []
    last_logged = 0
    in_save = 0
    lost_allowed, allowance_words = CHECKPOINT_EVERY, "one checkpoint interval"
    for trial in range(args.trials):
        committed = committed_steps(out)
        start_from = committed[-1] if committed else 0
        mode = rng.choice(list(modes))
        env = {}
        if mode == "in_save":
            rank = rng.randrange(2)
            save_step = start_from + CHECKPOINT_EVERY * rng.randint(1, 3)
            env["FACESHARD_FAULTS"] = "crash_in_save@%d:%d" % (rank, save_step)
        job = Job(args, work, "kill%d" % trial, 2, ["--resume"], env)
        # The resumed run must train: wait for a step past the checkpoint it started from.
        progressed = job.wait_for(lambda: any(s > start_from for s in steps_logged(job.log(0))), 90, "a step")
        if not progressed:
            job.kill_all()
            failures.append("trial %d: no step past %d within 90 s:\n%s" % (trial, start_from, job.log(0)[-2000:]))
            continue
        if mode == "random":
            time.sleep(rng.uniform(0.0, 3.0))
            what = "SIGKILL to both ranks"
        else:
            # One rank kills itself half-way through the save of save_step; the other is
            # killed the moment that is seen (it may be inside the same save).
            died = job.wait_for(lambda: job.procs[rank].poll() is not None, 90, "the crash in save")
            what = "rank %d killed inside the save of step %d, then SIGKILL to the other" % (rank, save_step)
            if not died:
                failures.append("trial %d: the crash in the save of step %d did not happen" % (trial, save_step))
            elif args.checkpoint_async == "on" and not re.search(
                    r"checkpoint step %d: the training waited \S+ s .*written in the background" % save_step, job.log(0)):
                failures.append("trial %d: the save of step %d was not written in the background" % (trial, save_step))
            else:
                in_save += 1
        job.kill_all()
        text = job.log(0)
        # With no committed checkpoint yet the run starts afresh (step 0); otherwise it
        # must resume from the latest committed one.
        resumed = resumed_step(text) if committed else (0 if "starting fresh" in text else None)
        logged = max(steps_logged(text) or [0])
        if resumed is None:
            failures.append("trial %d: the run did not resume from %d:\n%s" % (trial, start_from, text[-2000:]))
        elif resumed != start_from:
            failures.append("trial %d: resumed at step %d, the latest committed checkpoint is %d" %
                            (trial, resumed, start_from))
        elif resumed < last_logged - lost_allowed:
            failures.append("trial %d: resumed at step %d, but step %d had been logged: more than %s (%d steps) "
                            "lost" % (trial, resumed, last_logged, allowance_words, lost_allowed))
        print("trial %2d: %-7s resumed at %4s, trained to step %3d, %s; committed now %s" %
              (trial, mode, resumed if resumed is not None else "-", logged, what, committed_steps(out)[-1:]),
              flush=True)
        last_logged = max(last_logged, logged)
        # A run that writes checkpoints in the background trains on while the write of step s
        # is in flight, up to step s + interval (where the next save waits for it): killed
        # then, it resumes from s - interval, two intervals behind. Synchronous: one.
        if "checkpoints: written in the background" in text:
            lost_allowed, allowance_words = 2 * CHECKPOINT_EVERY, "two checkpoint intervals"
    # After all that, the job still finishes cleanly from where it is.
    committed = committed_steps(out)
    target = (committed[-1] if committed else 0) + 3
    job = Job(args, work, "final", 2, ["--resume", "--set", "train.max_steps=%d" % target])
    job.wait_for(lambda: not job.running(), 120, "the final run")
    job.kill_all()
    codes = [p.returncode for p in job.procs]
    resumed = resumed_step(job.log(0))
    if codes != [0, 0] or resumed is None or resumed < last_logged - lost_allowed:
        failures.append("final run: exit %s, resumed at %s (last logged %d):\n%s" %
                        (codes, resumed, last_logged, job.log(0)[-2000:]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    if not any(r.get("step") == target for r in rows):
        failures.append("final run: metrics.jsonl has no row for step %d" % target)
    print("final: resumed at %s, finished step %d with exit %s" % (resumed, target, codes))
    print("kill_all: %d trials (%d killed inside a checkpoint write), %d failures" %
          (args.trials, in_save, len(failures)))
    return failures


def lose_rank(args, work, rng):
    failures = []
    times = []
    for trial in range(args.trials):
        out = os.path.join(work, "out%d" % trial)
        job = Job(args, work, "lose%d" % trial, 3, ["--set", "output=" + out])
        if not job.wait_for(lambda: 2 in steps_logged(job.log(0)), 90, "step 2"):
            job.kill_all()
            failures.append("trial %d: no step 2 within 90 s:\n%s" % (trial, job.log(0)[-2000:]))
            continue
        time.sleep(rng.uniform(0.0, 1.0))
        # Every rank and both signals in turn; the moment is random.
        sig = [signal.SIGKILL, signal.SIGSTOP][(trial // 3) % 2]
        victim = trial % 3
        t0 = time.monotonic()
        job.procs[victim].send_signal(sig)
        survivors = [r for r in range(3) if r != victim]
        limit = COLLECTIVE_TIMEOUT_S + DIAGNOSIS_S + EXIT_SLACK_S
        job.wait_for(lambda: all(job.procs[r].poll() is not None for r in survivors), limit + 30, "the survivors")
        job.poll()
        report = []
        errors = {r: [l for l in job.log(r).splitlines() if "error:" in l] for r in survivors}
        names_victim = {r: len(e) == 1 and re.search(r"\brank %d\b" % victim, e[0]) is not None
                        for r, e in errors.items()}
        for r in survivors:
            code = job.procs[r].returncode
            took = None if job.exit_time[r] is None else job.exit_time[r] - t0
            report.append("rank %d exit %s after %s s" % (r, code, "%.1f" % took if took is not None else "-"))
            if code is None:
                failures.append("trial %d: rank %d still running %.0f s after rank %d got %s" %
                                (trial, r, limit + 30, victim, sig.name))
                continue
            times.append(took)
            if code == 0:
                failures.append("trial %d: rank %d exited 0 after rank %d got %s" % (trial, r, victim, sig.name))
            if took > limit:
                failures.append("trial %d: rank %d took %.1f s to exit (limit %.1f s)" % (trial, r, took, limit))
            if names_victim[r]:
                continue
            failures.append("trial %d: rank %d's error does not name rank %d: %s" % (trial, r, victim, errors[r]))
        job.kill_all()  # the victim (SIGKILL also ends a stopped process)
        print("trial %2d: rank %d got %-7s -> %s" % (trial, victim, sig.name, "; ".join(report)), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    print("lose_rank: %d trials, %d failures, survivors exited after %.1f-%.1f s (collective timeout %.0f s)" %
          (args.trials, len(failures), min(times or [0]), max(times or [0]), COLLECTIVE_TIMEOUT_S))
    return failures


# --- the network cases: two hosts ------------------------------------------------------

class Hosts:
    """Two network namespaces joined by a veth pair: host 0 at 10.79.0.1, host 1 at 10.79.0.2."""

    addr = ["10.79.0.1", "10.79.0.2"]

    def __init__(self):
        tag = "fl%d" % os.getpid()
        self.ns = [tag + "h0", tag + "h1"]
        self.dev = [tag + "a", tag + "b"]
        cmds = [["ip", "netns", "add", self.ns[0]], ["ip", "netns", "add", self.ns[1]],
                ["ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1]]]
        for h in range(2):
            cmds += [["ip", "link", "set", self.dev[h], "netns", self.ns[h]],
                     ["ip", "-n", self.ns[h], "addr", "add", self.addr[h] + "/24", "dev", self.dev[h]],
                     ["ip", "-n", self.ns[h], "link", "set", self.dev[h], "up"],
                     ["ip", "-n", self.ns[h], "link", "set", "lo", "up"]]
        for c in cmds:
            subprocess.run(c, check=True)

    def on(self, h, *cmd, check=True):
        return subprocess.run(["ip", "netns", "exec", self.ns[h]] + list(cmd), check=check,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode

    def link(self, up):
        self.on(1, "ip", "link", "set", self.dev[1], "up" if up else "down")

    def throttle(self, mbit):
        for h in range(2):
            if mbit:
                self.on(h, "tc", "qdisc", "add", "dev", self.dev[h], "root", "tbf", "rate", "%dmbit" % mbit,
                        "burst", "32kbit", "latency", "400ms")
            else:
                self.on(h, "tc", "qdisc", "del", "dev", self.dev[h], "root", check=False)

    def close(self):
        for ns in self.ns:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


class HostJob(Job):
    """Rank r of a two-rank job on host r."""

    def __init__(self, args, work, hosts, tag, extra):
        self.logs = [os.path.join(work, "%s.rank%d.log" % (tag, r)) for r in range(2)]
        self.procs = []
        for r in range(2):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                       GROUP_RANK=str(r), NODE_RANK=str(r), MASTER_ADDR=hosts.addr[0], MASTER_PORT="29500",
                       OMP_NUM_THREADS="1")
            env.pop("FACESHARD_FAULTS", None)
            with open(self.logs[r], "w") as log:
                self.procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", hosts.ns[r], os.path.join(args.bin, "faceshard-train"),
                     "--config", os.path.join(work, "tiny.yaml")] + extra,
                    stdout=log, stderr=subprocess.STDOUT, env=env))
        self.exit_time = [None] * 2

    def step(self):
        return max(steps_logged(self.log(0)) or [0])

    def line_time(self, pattern, timeout):
        """Waits for a line matching pattern on either rank; returns its text or None."""
        found = []

        def seen():
            for r in range(2):
                m = re.search(pattern, self.log(r))
                if m:
                    found.append(self.log(r)[m.start():].splitlines()[0])
                    return True
            return False
        self.wait_for(seen, timeout, pattern)
        return found[0] if found else None


NET_STEPS = ["--set", "dist.timeout_s=120", "--set", "dist.straggler_window=3", "--set", "train.checkpoint_every=10"]


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else float("nan")


def throttle(args, work, rng):
    failures, detect, slow = [], [], []
    hosts = Hosts()
    try:
        for trial in range(args.trials):
            out = os.path.join(work, "out%d" % trial)
            at, mbit, total = rng.randint(8, 12), rng.choice([16, 24, 32]), 32
            job = HostJob(args, work, hosts, "thr%d" % trial,
                          ["--set", "output=" + out, "--set", "optim.total_steps=%d" % total] + NET_STEPS)
            if not job.wait_for(lambda: job.step() >= at, 90, "step"):
                job.kill_all()
                failures.append("trial %d: no step %d within 90 s:\n%s" % (trial, at, job.log(0)[-1500:]))
                continue
            s0, t0 = job.step(), time.monotonic()
            hosts.throttle(mbit)
            line = job.line_time(r"slow link:.*", 120)
            took, s1 = time.monotonic() - t0, job.step()
            hosts.throttle(0)
            done = job.wait_for(lambda: not job.running(), 180, "the end")
            job.kill_all()
            codes = [p.returncode for p in job.procs]
            if not done:
                failures.append("trial %d: HANG: still running 180 s after the link was freed" % trial)
            elif codes != [0, 0] or job.step() != total:
                failures.append("trial %d: exit %s at step %d of %d" % (trial, codes, job.step(), total))
            if line is None:
                failures.append("trial %d: %d Mbit/s from step %d: the slow link was never named" % (trial, mbit, s0))
            elif "(%s) (rank 1) <-> host" % hosts.addr[1] not in line:
                failures.append("trial %d: the wrong pair: %s" % (trial, line))
            else:
                detect.append(took)
            if re.search(r"straggler: rank", job.log(0)):
                failures.append("trial %d: a straggler named for a slow link" % trial)
            rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"samples_per_sec"' in l]
            t = {r["step"]: 1.0 / r["samples_per_sec"] for r in rows if r.get("samples_per_sec")}
            ratio = median([t[k] for k in t if s0 < k <= s1]) / median([t[k] for k in t if 3 <= k <= s0])
            slow.append(ratio)
            print("trial %2d: %2d Mbit/s from step %2d: named after %5.1f s (%d steps), steps %.1fx slower; exit %s" %
                  (trial, mbit, s0, took, s1 - s0, ratio, codes), flush=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        hosts.close()
    print("throttle: %d trials, %d named (detection median %.1f s, max %.1f s), throttled steps %.1f-%.1fx slower, "
          "steps lost 0 unless listed, %d failures" % (args.trials, len(detect), median(detect), max(detect or [0]),
                                                       min(slow or [0]), max(slow or [0]), len(failures)))
    return failures


def partition(args, work, rng):
    failures, detect, lost_steps = [], [], []
    rides = stops = 0
    hosts = Hosts()
    try:
        for trial in range(args.trials):
            out = os.path.join(work, "out%d" % trial)
            at, total = rng.randint(11, 17), 24  # the hang limit scales from step 10 on
            short = rng.random() < 0.5
            down_s = rng.uniform(0.5, 2.0)
            job = HostJob(args, work, hosts, "part%d" % trial,
                          ["--set", "output=" + out, "--set", "optim.total_steps=%d" % total] + NET_STEPS)
            if not job.wait_for(lambda: job.step() >= at, 90, "step"):
                job.kill_all()
                failures.append("trial %d: no step %d within 90 s:\n%s" % (trial, at, job.log(0)[-1500:]))
                continue
            s0, t0 = job.step(), time.monotonic()
            saved = committed_steps(out)
            hosts.link(False)
            if short:
                time.sleep(down_s)
                hosts.link(True)
                done = job.wait_for(lambda: not job.running(), 180, "the end")
                job.kill_all()
                codes = [p.returncode for p in job.procs]
                stall = re.findall(r"network: step .*", job.log(0) + job.log(1))
                if not done:
                    failures.append("trial %d: HANG after a %.1f s partition" % (trial, down_s))
                elif codes != [0, 0] or job.step() != total:
                    failures.append("trial %d: a %.1f s partition: exit %s at step %d" % (trial, down_s, codes, job.step()))
                else:
                    rides += 1
                print("trial %2d: link down %.1f s after step %2d: exit %s; %s" %
                      (trial, down_s, s0, codes, stall[0][:150] if stall else "no stalled step reported"), flush=True)
                shutil.rmtree(out, ignore_errors=True)
                continue
            ended = job.wait_for(lambda: not job.running(), 90, "every rank's exit")
            took = time.monotonic() - t0
            job.kill_all()
            hosts.link(True)
            codes = [p.returncode for p in job.procs]
            errors = [[l for l in job.log(r).splitlines() if "error:" in l] for r in range(2)]
            limit = re.search(r"\+ 5 s = ([0-9.]+) s", errors[0][0]) if errors[0] else None
            if not ended:
                failures.append("trial %d: HANG: ranks running 90 s into the partition" % trial)
            elif 0 in codes:
                failures.append("trial %d: exit %s in a partition" % (trial, codes))
            if not (len(errors[0]) == 1 and "(%s))" % hosts.addr[1] in errors[0][0] and "rank 1" in errors[0][0]):
                failures.append("trial %d: host 0's error does not name host 1: %s" % (trial, errors[0]))
            if not (len(errors[1]) == 1 and "cut off from host" in errors[1][0] and hosts.addr[0] in errors[1][0]):
                failures.append("trial %d: host 1's error does not name host 0: %s" % (trial, errors[1]))
            if limit and took > float(limit.group(1)) + EXIT_SLACK_S:
                failures.append("trial %d: the ranks took %.1f s to stop (limit %s s)" % (trial, took, limit.group(1)))
            if ended:
                detect.append(took)
            now = committed_steps(out)
            if any(c not in now for c in saved):
                failures.append("trial %d: committed checkpoints lost: %s -> %s" % (trial, saved, now))
            d = os.path.join(out, "checkpoints")
            for e in (os.listdir(d) if os.path.isdir(d) else []):
                if e.startswith("step_") and int(e[5:]) not in now:
                    failures.append("trial %d: %s is there uncommitted" % (trial, e))
            last = now[-1] if now else 0
            lost_steps.append(s0 - last)
            res = HostJob(args, work, hosts, "res%d" % trial, ["--set", "output=" + out, "--resume", "auto", "--set",
                                                               "optim.total_steps=%d" % (last + 4)] + NET_STEPS)
            res.wait_for(lambda: not res.running(), 120, "the resumed run")
            res.kill_all()
            rcodes = [p.returncode for p in res.procs]
            if rcodes != [0, 0] or resumed_step(res.log(0)) != last:
                failures.append("trial %d: --resume auto: exit %s, resumed at %s, last committed %d" %
                                (trial, rcodes, resumed_step(res.log(0)), last))
            else:
                stops += 1
            print("trial %2d: link down for good after step %2d: exit %s after %4.1f s; resumed at %d (%d steps lost)" %
                  (trial, s0, codes, took, last, s0 - last), flush=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        hosts.close()
    print("partition: %d trials: %d short ones ridden through, %d long ones stopped and resumed (stop median %.1f s, "
          "max %.1f s; steps lost median %s, max %s; checkpoints lost 0 unless listed), %d failures" %
          (args.trials, rides, stops, median(detect), max(detect or [0]), median(lost_steps),
           max(lost_steps or [0]), len(failures)))
    return failures


def straggler(args, work, rng):
    failures, detect = [], []
    clean_windows = false_flags = named = 0
    hosts = Hosts()
    cg = "/sys/fs/cgroup/cpu/fl%d" % os.getpid()
    os.mkdir(cg)
    try:
        with open(cg + "/cpu.cfs_period_us", "w") as f:
            f.write("100000")
        for trial in range(args.trials):
            out = os.path.join(work, "out%d" % trial)
            victim = trial % 2
            mode = "quota" if (trial // 2) % 2 == 0 else "stop"
            clean, total = 28, 46  # 6 clean windows of 3 steps after the 10 warm-up steps, then 6 slowed
            job = HostJob(args, work, hosts, "strag%d" % trial,
                          ["--set", "output=" + out, "--set", "optim.total_steps=%d" % total] + NET_STEPS)
            if not job.wait_for(lambda: job.step() >= clean, 120, "step"):
                job.kill_all()
                failures.append("trial %d: no step %d within 120 s:\n%s" % (trial, clean, job.log(0)[-1500:]))
                continue
            s0 = job.step()
            # A straggler or a slow link named before any fault is a false flag.
            flagged_clean = re.findall(r"straggler: rank (\d)|slow link: .*?\(rank (\d)\)", job.log(0))
            flagged_clean = [a or b for a, b in flagged_clean]
            clean_windows += (s0 - 10) // 3  # windows judged before the fault (steps 1-10 are warm-up)
            false_flags += len(flagged_clean)
            t0 = time.monotonic()
            what = ""
            if mode == "quota":
                share = rng.randint(20, 40)
                with open(cg + "/cpu.cfs_quota_us", "w") as f:
                    f.write(str(share * 1000))
                with open(cg + "/cgroup.procs", "w") as f:
                    f.write(str(job.procs[victim].pid))
                # ip netns exec execs the program: the pid is faceshard-train's
                what = "CPU quota %d%%" % share
                line = job.line_time(r"straggler: rank \d.*", 120)
                with open("/sys/fs/cgroup/cpu/cgroup.procs", "w") as f:
                    if job.procs[victim].poll() is None:
                        f.write(str(job.procs[victim].pid))
            else:
                stop_ms = rng.randint(100, 250)
                what = "SIGSTOP %d ms every %d ms" % (stop_ms, 2 * stop_ms)
                found = []
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and job.procs[victim].poll() is None and not found:
                    job.procs[victim].send_signal(signal.SIGSTOP)
                    time.sleep(stop_ms / 1000)
                    job.procs[victim].send_signal(signal.SIGCONT)
                    time.sleep(stop_ms / 1000)
                    m = re.search(r"straggler: rank \d.*", job.log(0))
                    if m:
                        found.append(m.group(0))
                line = found[0] if found else None
            took = time.monotonic() - t0
            done = job.wait_for(lambda: not job.running(), 180, "the end")
            job.kill_all()
            codes = [p.returncode for p in job.procs]
            # Every straggler line of the run, not only the first after the fault: the healthy
            # rank must never be named (before the fault that is a false flag, counted above).
            healthy = sorted({int(r) for r in re.findall(r"straggler: rank (\d)", job.log(0))} - {victim})
            if healthy and not flagged_clean:
                failures.append("trial %d: rank %d slowed, but rank(s) %s named as well" % (trial, victim, healthy))
            if not done:
                failures.append("trial %d: HANG" % trial)
            elif codes != [0, 0]:
                failures.append("trial %d: exit %s" % (trial, codes))
            if flagged_clean:
                failures.append("trial %d: FALSE FLAG before any fault: rank(s) %s" % (trial, flagged_clean))
            if line is None:
                failures.append("trial %d: rank %d (%s) never named" % (trial, victim, what))
            elif not line.startswith("straggler: rank %d " % victim):
                failures.append("trial %d: rank %d slowed, named: %s" % (trial, victim, line))
            else:
                named += 1
                detect.append(took)
            print("trial %2d: rank %d, %-26s after step %2d: %s" %
                  (trial, victim, what, s0, ("named after %.1f s: %s" % (took, line[:110])) if line else "NOT NAMED"),
                  flush=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        hosts.close()
        try:
            os.rmdir(cg)
        except OSError:
            pass
    print("straggler: %d injections, %d named, %d missed (detection median %.1f s, max %.1f s); %d false flags in %d "
          "clean windows; %d failures" % (args.trials, named, args.trials - named, median(detect),
                                          max(detect or [0]), false_flags, clean_windows, len(failures)))
    return failures


# --- the storage cases: storage_faults.py's loops, with this script's seed and trials ---------

def kill_in_async_save(args, work, rng):
    """kill_all's in-save trials with checkpoints written in the background: one rank is
    killed (SIGKILL) half-way through a background write while the training goes on, then the
    other; the resume must start from the checkpoint committed before it."""
    return kill_all(args, work, rng, modes=("in_save",))


def freeze_in_agreement(args, work, rng):
    """Rank 1 freezes (SIGSTOP, the fault freeze_in_agreement) inside the commit stage of the
    agreement of the run's last checkpoint, written in the background: after finish()'s
    barrier, after rank 0 wrote COMMITTED, before rank 1 confirmed it. Rank 0 must end
    within the hang limit it prints (plus the wait's one-second slices and its exit), not
    after the agreement's ten minutes; the checkpoint stays committed (every rank's files
    were verified the stage before), none committed earlier is lost, and the resume names
    the newest committed step."""
    out = os.path.join(work, "out")
    failures = []
    ended = []
    for trial in range(args.trials):
        shutil.rmtree(out, ignore_errors=True)
        last = CHECKPOINT_EVERY * rng.randint(2, 3)
        job = Job(args, work, "freeze%d" % trial, 2, ["--set", "train.max_steps=%d" % last],
                  {"FACESHARD_FAULTS": "freeze_in_agreement@1:%d" % last, "FACESHARD_LOG_ALL_RANKS": "1"})
        froze = job.wait_for(lambda: "freezes (SIGSTOP) inside the commit stage" in job.log(1), 120, "the freeze")
        t_freeze = time.monotonic()
        if not froze:
            job.kill_all()
            failures.append("trial %d: rank 1 did not freeze in step %d's agreement:\n%s" % (trial, last, job.log(1)[-2000:]))
            continue
        job.wait_for(lambda: job.procs[0].poll() is not None, 120, "rank 0's end")
        job.poll()
        took = (job.exit_time[0] - t_freeze) if job.exit_time[0] is not None else None
        job.kill_all()
        text = job.log(0)
        m = re.search(r"past the hang limit of ([0-9.]+) s, for rank 1 \(host [^)]*\): no heartbeat", text)
        limit = float(m.group(1)) if m else None
        committed = committed_steps(out)
        problem = None
        if took is None:
            problem = "rank 0 did not end within 120 s of the freeze"
        elif limit is None:
            problem = "rank 0 did not name the frozen rank past the hang limit:\n" + text[-2000:]
        elif took > 2 * limit + 6:
            # The agreement's wait, then the run's last collective's (which names the frozen
            # rank and ends the run), each bounded by the hang limit, and a few seconds of
            # slices, export and exit.
            problem = "rank 0 ended %.1f s after the freeze, more than twice its hang limit %.1f s + 6 s" % (took, limit)
        elif last not in committed or (last - CHECKPOINT_EVERY) not in committed:
            problem = "committed checkpoints %s: expected steps %d and %d" % (committed, last - CHECKPOINT_EVERY, last)
        else:
            res = Job(args, work, "freeze%d_resume" % trial, 2, ["--resume", "--set", "train.max_steps=%d" % (last + 2)])
            res.wait_for(lambda: not res.running(), 120, "the resume")
            res.kill_all()
            codes = [p.returncode for p in res.procs]
            if codes != [0, 0] or resumed_step(res.log(0)) != max(committed):
                problem = "the resume: exit %s, resumed at %s, newest committed %d:\n%s" % (
                    codes, resumed_step(res.log(0)), max(committed), res.log(0)[-2000:])
        if problem:
            failures.append("trial %d: %s" % (trial, problem))
        else:
            ended.append(took)
        print("trial %2d: freeze in step %d's commit stage; rank 0 ended after %s s (limit %s s, exit %s); committed %s%s" %
              (trial, last, "%.1f" % took if took is not None else "-", limit, job.procs[0].returncode, committed,
               "" if not problem else "; FAILED"), flush=True)
    print("freeze_in_agreement: %d trials, rank 0 ended %.1f-%.1f s after the freeze, %d failures" %
          (args.trials, min(ended or [0]), max(ended or [0]), len(failures)))
    return failures


def storage_case(name):
    def run_case(args, work, rng):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import storage_faults
        s = storage_faults.Setup(args, work)
        if name == "corrupt_latest":
            return storage_faults.corrupt_latest(args, s, rng)
        return storage_faults.loop(args, s, rng, name.upper())
    return run_case


def stranger(args, work, rng):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import strangers
    return strangers.loop(args, work, rng)


CASES = {"kill_all": kill_all, "lose_rank": lose_rank, "throttle": throttle, "partition": partition, "straggler": straggler,
         "enospc": storage_case("enospc"), "eio": storage_case("eio"), "corrupt_latest": storage_case("corrupt_latest"),
         "stranger": stranger, "kill_in_async_save": kill_in_async_save, "freeze_in_agreement": freeze_in_agreement}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs of every rank)")
    ap.add_argument("--checkpoint-async", dest="checkpoint_async", default=None, choices=["on", "off", "auto"],
                    help="train.checkpoint_async of every run (kill_in_async_save: on)")
    args = ap.parse_args()
    if args.case in ("kill_in_async_save", "freeze_in_agreement"):
        args.checkpoint_async = "on"
    args.source, args.bin = os.path.abspath(args.source), os.path.abspath(args.bin)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print("fault loop %s: seed %d (replay with --seed %d)" % (args.case, seed, seed), flush=True)
    rng = random.Random(seed)
    work = tempfile.mkdtemp(prefix="faceshard_faults_")
    try:
        if args.case not in ("enospc", "eio", "corrupt_latest"):
            write_setup(args, work)
        failures = CASES[args.case](args, work, rng)
    finally:
        if args.keep:
            print("work folder kept: " + work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return verdict(failures, seed)


if __name__ == "__main__":
    sys.exit(main())
