#!/usr/bin/env python3
"""Storage faults: faceshard-train (one rank, CPU, a tiny job) meets a failing file system.

  matrix     the fault shim (LD_PRELOAD, tests/fault_shim/fault_shim.c) fails the N-th
             open/write/fsync/rename/close of one kind of file with ENOSPC, EDQUOT, EIO,
             EROFS or a short write, N walked over the calls a run makes (every one up to
             --ordinals per operation, evenly spread beyond): the checkpoint's files
             (fc_shard, backbone.pt, train_state.pt, the COMMITTED marker), metrics.jsonl,
             the TensorBoard events, the export (model.pt, model.json), the ONNX export
             (faceshard-export, model.onnx), the compact record index cache. Each trial
             resumes a run that has committed checkpoints at steps 2 and 4 and trains to
             step 8 (checkpoints at 6 and 8); an ONNX trial exports that run.
  full_fs    the output on a small tmpfs that fills during the fourth checkpoint: every save
             from there fails, the run stops after train.max_failed_checkpoints (3) with
             exit status 3 and one line saying the disk is full.
  corrupt_latest
             the newest committed checkpoint (step 4) is damaged at random: a byte of an
             entry's data flipped, a file cut short, emptied or deleted; in one trial of
             five the one before (step 2) too. --resume auto must say which checkpoint it
             passes over and why in one line and resume from the newest that verifies (and
             train on), or, when none verifies, exit non-zero with one line (never a crash
             or a fresh start).
  enospc / eio
             fault loops: each trial draws a file kind, an operation and a call at random
             (ENOSPC, or EIO), from a seed.

After every trial: no crash (exit 0; 3 when a checkpoint that had to be saved was not; 1
when the export failed), one warning or error line naming the file and the cause when
the fault fired, no temporary file left, every committed checkpoint verifying (zipfile's
CRC check and torch.load, independent of faceshard's reader), every checkpoint committed
before the fault that train.keep_checkpoints keeps still there byte for byte, the newest
committed one resuming ("resumed from ...step_N at step N", then steps N+1..9 logging the
losses of one uninterrupted faultless run), metrics.jsonl's every line JSON, the
TensorBoard file whole records to its end, model.pt absent or loadable.

--checkpoint-async on|off|auto sets train.checkpoint_async of every run (unset: the
default, auto, which writes checkpoints in the background where the host's memory allows).

usage: storage_faults.py --source DIR --bin DIR --case matrix|full_fs|corrupt_latest|enospc|eio
       [--ordinals K] [--trials N] [--seed S] [--keep] [--checkpoint-async on|off|auto]
"""
import argparse
import glob
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_loops  # noqa: E402  (verdict)

ERRORS = ["ENOSPC", "EDQUOT", "EIO", "EROFS", "short"]
OPS = ["open", "write", "fsync", "rename", "close"]
# What the shim matches (a part of the path) for each kind of file.
KINDS = {
    "fc_shard": "fc_shard_0.pt",
    "backbone": "backbone.pt",
    "train_state": "train_state.pt",
    "commit_marker": "COMMITTED",
    "metrics": "metrics.jsonl",
    "tensorboard": "tfevents",
    "export_model": "model.pt",
    "export_json": "model.json",
    "export_onnx": "model.onnx",
    "index_cache": ".fsidx.tmp",  # the cache file, written under a temporary name
}
CHECKPOINT_KINDS = {"fc_shard", "backbone", "train_state", "commit_marker"}
CHECKPOINT_FILES = ("backbone.pt", "train_state.pt", "fc_shard_0.pt")
KEEP = 3  # train.keep_checkpoints of the tiny config
EXPORT_KINDS = {"export_model", "export_json", "export_onnx"}


def run(cmd, env=None, timeout=300):
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    return p.returncode, p.stdout.decode(errors="replace")


class Setup:
    def __init__(self, args, work):
        self.args, self.work = args, work
        self.train = os.path.join(args.bin, "faceshard-train")
        self.export = os.path.join(args.bin, "faceshard-export")
        # The compact record index is cached here by the index_cache trials (every index,
        # however small).
        self.index_cache = os.path.join(work, "index-cache")
        self.onnx_reference = None
        self.shim = os.path.join(os.path.dirname(os.path.abspath(args.bin)), "lib", "libfaceshard_fault_shim.so")
        if not os.path.exists(self.shim):
            sys.exit("no fault shim at %s (build the faceshard_fault_shim target)" % self.shim)
        self.py = os.path.join(args.source, ".venv", "bin", "python")
        if not os.path.exists(self.py):
            self.py = sys.executable
        run([os.path.join(args.bin, "faceshard-synth"), "--output", os.path.join(work, "data"), "--identities", "16",
             "--images", "8", "--holdout", "4", "--pairs", "8", "--seed", "3"])
        self.config = os.path.join(work, "tiny.yaml")
        with open(self.config, "w") as f:
            f.write("""base: {root}/configs/base.yaml
output: {work}/out
seed: 7
data: {{rec: {work}/data, num_classes: 16, batch_size: 4, num_workers: 1}}
model: {{backbone: mbf, embedding_size: 32}}
loss: {{margin: [1.0, 0.0, 0.4], scale: 16}}
optim: {{lr: 0.05, epochs: 1000, warmup_epochs: 0}}
train: {{log_every: 1, verify_every: 0, checkpoint_every: 2, keep_checkpoints: {keep}, tensorboard: true{more}}}
dist: {{device: cpu}}
""".format(root=args.source, work=work, keep=KEEP,
           more=", checkpoint_async: " + args.checkpoint_async if args.checkpoint_async else ""))
        # The starting point of every trial: committed checkpoints at steps 2 and 4.
        self.base = os.path.join(work, "base")
        # With checkpoints in the background, step 2's write is held until step 4 has been
        # logged (the fault plan's hold_save): the checkpoint must hold step 2's state although
        # steps 3 and 4 changed all of it before it was written.
        held = args.checkpoint_async == "on"
        release = os.path.join(work, "release")
        env = {"FACESHARD_FAULTS": "hold_write@0:2", "FACESHARD_FAULTS_RELEASE": release} if held else None
        done = threading.Event()

        def release_after_step_4():
            metrics = os.path.join(self.base, "metrics.jsonl")
            while not done.wait(0.05):
                try:
                    if any(json.loads(l).get("step") == 4 and "loss" in l for l in open(metrics)):
                        break
                except (OSError, ValueError):
                    pass
            open(release, "w").close()

        watcher = threading.Thread(target=release_after_step_4)
        if held:
            watcher.start()
        code, out = self.train_run(self.base, ["--set", "train.max_steps=4"], env)
        done.set()
        if held:
            watcher.join()
            # The hold happened: the training changed the rows while step 2's write waited.
            if code == 0 and not re.search(r"step 2 \(in the background; the training copied \d+ classifier rows", out):
                sys.exit("step 2's checkpoint was not held while the training went on:\n" + out[-3000:])
        if code != 0:
            sys.exit("the base run failed:\n" + out[-3000:])
        # What every trial starts from: the steps committed before its fault, and their bytes.
        self.base_steps = committed_steps(self.base)
        if self.base_steps != [2, 4]:
            sys.exit("the base run committed steps %s, expected [2, 4]" % self.base_steps)
        self.base_digests = {step: checkpoint_digests(self.base, step) for step in self.base_steps}
        # The losses of one uninterrupted faultless run to step 9 (no resume in it): what every
        # resume from a committed checkpoint must log again for the steps after it.
        self.reference = os.path.join(work, "reference")
        code, out = self.train_run(self.reference, ["--set", "train.max_steps=9"])
        self.reference_losses = logged_losses(out)
        if code != 0 or sorted(self.reference_losses) != list(range(1, 10)):
            sys.exit("the reference run failed (steps %s logged):\n%s" % (sorted(self.reference_losses), out[-3000:]))

    def train_run(self, output, extra, env_extra=None, timeout=300):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FACESHARD_FAULT", "FACESHARD_FAULTS"):
            env.pop(k, None)
        env.update(env_extra or {})
        return run([self.train, "--config", self.config, "--set", "output=" + output] + extra, env, timeout)

    def cache_env(self, kind):
        """The index_cache trials' runs cache every record index in self.index_cache."""
        if kind != "index_cache":
            return {}
        return {"FACESHARD_INDEX_CACHE": self.index_cache, "FACESHARD_INDEX_CACHE_MIN_BYTES": "0"}

    def job(self, kind, output, env):
        """The run a trial of this kind faults: the ONNX export of a copy of the base run
        (faceshard-export), else a resume of it to step 8 (faceshard-train)."""
        if kind == "export_onnx":
            full = dict(os.environ, OMP_NUM_THREADS="1")
            full.update(env)
            return run([self.export, "--model", output, "--onnx", os.path.join(output, "model.onnx")], full)
        if kind == "index_cache":
            shutil.rmtree(self.index_cache, ignore_errors=True)  # built afresh by every trial
        return self.train_run(output, ["--resume", "--set", "train.max_steps=8"], dict(self.cache_env(kind), **env))

    def faulted(self, output, spec, kind):
        """The kind's run on a copy of the base run under the shim with FACESHARD_FAULT=spec."""
        shutil.rmtree(output, ignore_errors=True)
        shutil.copytree(self.base, output)
        log = os.path.join(self.work, "fault.log")
        if os.path.exists(log):
            os.remove(log)
        env = {"LD_PRELOAD": self.shim, "FACESHARD_FAULT": spec, "FACESHARD_FAULT_LOG": log}
        code, out = self.job(kind, output, env)
        fired = open(log).read().strip() if os.path.exists(log) else ""
        return code, out, fired

    def onnx_bytes(self):
        """model.onnx as a faultless export of the base run writes it (the reference)."""
        if self.onnx_reference is None:
            output = os.path.join(self.work, "onnx-reference")
            shutil.rmtree(output, ignore_errors=True)
            shutil.copytree(self.base, output)
            code, out = self.job("export_onnx", output, {})
            if code != 0:
                sys.exit("the reference export failed:\n" + out[-3000:])
            self.onnx_reference = open(os.path.join(output, "model.onnx"), "rb").read()
        return self.onnx_reference

    def count_calls(self, kind):
        """Calls per operation the kind's faultless run makes on paths containing its text."""
        output = os.path.join(self.work, "count")
        shutil.rmtree(output, ignore_errors=True)
        shutil.copytree(self.base, output)
        counts = os.path.join(self.work, "counts.txt")
        if os.path.exists(counts):
            os.remove(counts)
        env = {"LD_PRELOAD": self.shim, "FACESHARD_FAULT": "none:0:EIO:" + KINDS[kind], "FACESHARD_FAULT_COUNT": counts}
        code, out = self.job(kind, output, env)
        if code != 0:
            sys.exit("the counting run failed:\n" + out[-3000:])
        got = {}
        for line in open(counts):
            op, n = line.split()
            got[op] = got.get(op, 0) + int(n)
        return got

    def check_output(self, output, load=True):
        """The checks every trial's output folder must pass (torch.load of every file with
        load); a list of problems."""
        problems = []
        leftovers = [p for p in glob.glob(os.path.join(output, "**", "*.tmp.*"), recursive=True)]
        if leftovers:
            problems.append("temporary files left: %s" % [os.path.relpath(p, output) for p in leftovers])
        committed = sorted(glob.glob(os.path.join(output, "checkpoints", "step_*", "COMMITTED")))
        if not committed:
            problems.append("no committed checkpoint")
        for c in committed:
            d = os.path.dirname(c)
            for f in ("backbone.pt", "train_state.pt", "fc_shard_0.pt"):
                p = os.path.join(d, f)
                try:
                    with zipfile.ZipFile(p) as z:
                        bad = z.testzip()
                    if bad:
                        problems.append("%s: entry %s fails its CRC" % (os.path.relpath(p, output), bad))
                except Exception as e:  # a missing or torn file
                    problems.append("%s: %s" % (os.path.relpath(p, output), e))
        uncommitted = [d for d in glob.glob(os.path.join(output, "checkpoints", "step_*"))
                       if not os.path.exists(os.path.join(d, "COMMITTED"))]
        if uncommitted:
            problems.append("uncommitted step folders left: %s" % [os.path.basename(d) for d in uncommitted])
        metrics = os.path.join(output, "metrics.jsonl")
        if os.path.exists(metrics):
            for k, line in enumerate(open(metrics, "rb").read().split(b"\n")):
                if line.strip():
                    try:
                        json.loads(line)
                    except ValueError:
                        problems.append("metrics.jsonl line %d is not JSON: %r" % (k + 1, line[:80]))
        for tb in glob.glob(os.path.join(output, "tensorboard", "*tfevents*")):
            data = open(tb, "rb").read()
            pos = 0
            while pos < len(data):
                if pos + 12 > len(data):
                    problems.append("%s: a torn record header at byte %d" % (os.path.basename(tb), pos))
                    break
                (n,) = struct.unpack("<Q", data[pos:pos + 8])
                if pos + 12 + n + 4 > len(data):
                    problems.append("%s: a torn record at byte %d" % (os.path.basename(tb), pos))
                    break
                pos += 12 + n + 4
        checks = []
        for f in committed:
            d = os.path.dirname(f)
            checks += [os.path.join(d, n) for n in ("backbone.pt", "train_state.pt", "fc_shard_0.pt")]
        model = os.path.join(output, "model.pt")
        if os.path.exists(model):
            checks.append(model)
        if load and checks and not any("fails its CRC" in p or "torn" in p for p in problems):
            code, out = run([self.py, "-c", "import sys, torch\nfor f in sys.argv[1:]: torch.load(f, weights_only=True)"]
                            + checks)
            if code != 0:
                problems.append("torch.load: " + out.strip().splitlines()[-1][:200])
        return problems

    def resumes(self, output, kind=None):
        """The newest committed checkpoint loads and trains on to step 9 (an index_cache
        trial's with whatever the trial left in the cache folder): the resume names that
        checkpoint's step, and the losses of the steps after it are the faultless
        reference's (a resume that started afresh, or from an older checkpoint or state,
        logs others)."""
        newest = committed_steps(output)
        if not newest:
            return "resume: no committed checkpoint to resume from"
        n = newest[-1]
        code, out = self.train_run(output, ["--resume", "--set", "train.max_steps=9"], self.cache_env(kind))
        if code != 0:
            return "resume: exit %d: %s" % (code, (out.strip().splitlines() or [""])[-1][:200])
        if not re.search(r"resumed from \S*step_%08d at step %d\b" % (n, n), out):
            said = [l for l in out.splitlines() if "resumed from" in l or "starting fresh" in l]
            return "resume: did not name the newest committed checkpoint, step %d: %s" % (n, said[:1])
        return losses_continue(logged_losses(out), self.reference_losses, n)


def committed_steps(output):
    """The steps of the committed checkpoints under output/checkpoints, ascending."""
    steps = []
    for c in glob.glob(os.path.join(output, "checkpoints", "step_*", "COMMITTED")):
        m = re.search(r"step_(\d+)$", os.path.dirname(c))
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def checkpoint_digests(output, step):
    """The SHA-256 of each file of the checkpoint at step (its marker included)."""
    import hashlib
    d = os.path.join(output, "checkpoints", "step_%08d" % step)
    got = {}
    for f in CHECKPOINT_FILES + ("COMMITTED",):
        p = os.path.join(d, f)
        got[f] = hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.exists(p) else None
    return got


def logged_losses(out):
    """{step: loss} of the log lines a run printed ("step 5/9 ... loss 12.34 ...")."""
    losses = {}
    for m in re.finditer(r"step (\d+)/\d+\b.*?\bloss ([-+0-9.eE]+|nan|inf)", out):
        losses[int(m.group(1))] = float(m.group(2))
    return losses


def losses_continue(got, reference, start):
    """Problems (None: none) of a resume from the checkpoint at `start` that logged `got`:
    exactly the steps after it, each loss the faultless reference's."""
    want = [k for k in sorted(reference) if k > start]
    if sorted(got) != want:
        return "resume from step %d logged steps %s, expected %s" % (start, sorted(got), want)
    for k in want:
        # The log line's 4 decimals: the same value prints the same; one last-digit step at most.
        if not abs(got[k] - reference[k]) <= 1.01e-4 + 1e-6 * abs(reference[k]):
            return "resume from step %d: the loss at step %d is %r, the faultless run's %r" % (start, k, got[k], reference[k])
    return None


def committed_kept(before, digests, after, keep=KEEP):
    """Problems with the checkpoints committed before a trial: every one of them that the
    run's keep_checkpoints keeps (among the newest `keep` of those and the ones the trial
    committed) must still be there, byte for byte as it was."""
    problems = []
    kept = sorted(set(before) | set(after))[-keep:]
    for step in before:
        if step not in kept:
            continue  # pruned by keep_checkpoints, as it should be
        if step not in after:
            problems.append("the checkpoint committed at step %d before the fault is gone" % step)
        elif digests[step] != digests.get(("after", step)):
            changed = [f for f in digests[step] if digests[step][f] != digests[("after", step)][f]]
            problems.append("the checkpoint committed at step %d before the fault changed: %s" % (step, changed))
    return problems


def judge(s, kind, op, err, n, code, out, fired, output, full_check):
    """Problems of one trial (empty: it passed)."""
    problems = []
    if code not in (0, 1, 3) or "terminate called" in out or "Segmentation" in out:
        problems.append("exit %d%s" % (code, " (crash)" if code < 0 or code > 128 else ""))
    lines = [l for l in out.splitlines() if "warning:" in l or "error:" in l]
    if fired and err == "short":
        pass  # a short write is not an error: the writer writes the rest
    elif fired:
        named = [l for l in lines if any(w in l for w in ("No space left", "quota", "Input/output", "Read-only",
                                                         "cannot", "not saved", "left out", "not used"))]
        if not named:
            problems.append("the fault fired (%s) but no line says so" % fired)
        if code == 1 and kind not in EXPORT_KINDS:
            problems.append("exit 1 for a fault in %s" % kind)
        if code == 3 and kind not in CHECKPOINT_KINDS:
            problems.append("exit 3 for a fault in %s" % kind)
    elif code != 0:
        problems.append("exit %d without a fault" % code)
    errors = [l for l in out.splitlines() if "error:" in l]
    if len(errors) > 1:
        problems.append("%d error lines" % len(errors))
    problems += s.check_output(output, load=full_check)
    after = committed_steps(output)
    digests = dict(s.base_digests)
    for step in after:
        digests[("after", step)] = checkpoint_digests(output, step)
    problems += committed_kept(s.base_steps, digests, after)
    if kind == "export_onnx":
        onnx = os.path.join(output, "model.onnx")
        if code != 0 and os.path.exists(onnx):
            problems.append("exit %d but model.onnx is there" % code)
        elif code == 0 and (not os.path.exists(onnx) or open(onnx, "rb").read() != s.onnx_bytes()):
            problems.append("exit 0 but model.onnx is not the faultless export's")
        if glob.glob(os.path.join(output, "*.tmp*")):
            problems.append("temporary export files left: %s" % glob.glob(os.path.join(output, "*.tmp*")))
    if kind == "index_cache":
        left = glob.glob(os.path.join(s.index_cache, "*.tmp.*"))
        if left:
            problems.append("temporary index cache files left: %s" % [os.path.basename(p) for p in left])
    if full_check and not problems:
        r = s.resumes(output, kind)
        if r:
            problems.append(r)
    return problems, (errors or [l for l in lines if "warning:" in l] or [""])[0]


def ordinals(count, k):
    """Every call up to k, else k calls spread evenly over 1..count (first and last included)."""
    if k <= 1:
        return [count] if count else []
    if count <= k:
        return list(range(1, count + 1))
    return sorted({1 + round(i * (count - 1) / (k - 1)) for i in range(k)})


def matrix(args, s, rng):
    failures, rows = [], []
    for kind, text in KINDS.items():
        if args.kinds and kind not in args.kinds.split(","):
            continue
        counts = s.count_calls(kind)
        for op in OPS:
            walked = ordinals(counts.get(op, 0), args.ordinals)
            for err in ERRORS:
                if err == "short" and op != "write":
                    continue
                outcomes = {}
                said = ""
                for n in walked:
                    out_dir = os.path.join(s.work, "trial")
                    code, out, fired = s.faulted(out_dir, "%s:%d:%s:%s" % (op, n, err, text), kind)
                    problems, line = judge(s, kind, op, err, n, code, out, fired, out_dir, full_check=True)
                    outcomes[code] = outcomes.get(code, 0) + 1
                    if fired and line and not said:
                        said = re.sub(r"^\[rank \d+/\d+\] ", "", line)[:160]
                    for p in problems:
                        failures.append("%s %s call %d %s: %s" % (kind, op, n, err, p))
                        print("FAIL: " + failures[-1], flush=True)
                if walked:
                    rows.append((kind, op, err, len(walked), counts.get(op, 0), outcomes, said))
                    print("%-13s %-6s %-6s calls walked %3d of %4d: exits %s | %s" %
                          (kind, op, err, len(walked), counts.get(op, 0),
                           ", ".join("%d x%d" % kv for kv in sorted(outcomes.items())), said), flush=True)
    print("matrix: %d rows, %d trials, %d failures" % (len(rows), sum(r[3] for r in rows), len(failures)))
    return failures


def loop(args, s, rng, err):
    failures = []
    counts = {kind: s.count_calls(kind) for kind in KINDS}
    for trial in range(args.trials):
        kind = rng.choice(sorted(KINDS))
        ops = [op for op in OPS if counts[kind].get(op, 0) > 0]
        op = rng.choice(ops)
        n = rng.randint(1, counts[kind][op])
        sticky = rng.random() < 0.25  # a disk that stays full
        spec = "%s:%d:%s%s:%s" % (op, n, err, "+" if sticky else "", KINDS[kind])
        out_dir = os.path.join(s.work, "trial")
        code, out, fired = s.faulted(out_dir, spec, kind)
        problems, line = judge(s, kind, op, err, n, code, out, fired, out_dir, full_check=True)
        for p in problems:
            failures.append("trial %d (%s): %s" % (trial, spec, p))
        print("trial %2d: %-40s exit %d, %s" % (trial, spec, code, re.sub(r"^\[rank \d+/\d+\] ", "", line)[:120]
                                                  or "nothing logged"), flush=True)
    print("%s: %d trials, %d failures" % (err.lower(), args.trials, len(failures)))
    return failures


def damage(path, rng):
    """Damages one checkpoint file at random; says how."""
    how = rng.choice(["flip", "flip", "cut", "empty", "delete"])
    name = os.path.basename(path)
    if how == "delete":
        os.remove(path)
        return "%s deleted" % name
    size = os.path.getsize(path)
    if how == "empty":
        open(path, "w").close()
        return "%s emptied" % name
    if how == "cut":
        n = rng.randint(0, size - 1)
        with open(path, "r+b") as f:
            f.truncate(n)
        return "%s cut to %d of %d bytes" % (name, n, size)
    with zipfile.ZipFile(path) as z:
        entries = [i for i in z.infolist() if i.file_size > 0]
        e = rng.choice(entries)
    with open(path, "r+b") as f:
        f.seek(e.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = e.header_offset + 30 + name_len + extra_len + rng.randrange(e.file_size)
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
    return "%s: a bit of entry %s flipped at byte %d" % (name, e.filename, at)


def corrupt_latest(args, s, rng):
    failures = []
    walked = refused = 0
    for trial in range(args.trials):
        out_dir = os.path.join(s.work, "trial")
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.copytree(s.base, out_dir)
        ck = os.path.join(out_dir, "checkpoints")
        both = rng.random() < 0.2
        what = []
        for step in ([4, 2] if both else [4]):
            d = os.path.join(ck, "step_%08d" % step)
            what.append("step %d: %s" % (step, damage(os.path.join(d, rng.choice(
                ["backbone.pt", "train_state.pt", "fc_shard_0.pt"])), rng)))
        code, out = s.train_run(out_dir, ["--resume", "auto", "--set", "train.max_steps=6"])
        errors = [l for l in out.splitlines() if "error:" in l]
        said = [l for l in out.splitlines() if "does not verify" in l]
        problem = None
        if code < 0 or code > 2 or "terminate called" in out:
            problem = "exit %d (crash?)" % code
        elif both:
            if code == 0 or len(errors) != 1 or "no checkpoint under" not in errors[0]:
                problem = "both damaged: exit %d, errors %s" % (code, errors)
            elif "starting fresh" in out or re.search(r"step 1/", out):
                problem = "started afresh"
            else:
                refused += 1
        else:
            if code != 0:
                problem = "exit %d: %s" % (code, errors)
            elif len(said) != 1 or "step_00000004 does not verify" not in said[0] or "resuming from step_00000002" not in said[0]:
                problem = "the walk-back was not said in one line: %s" % said
            elif not re.search(r"resumed from \S*step_00000002 at step 2", out):
                problem = "did not resume at step 2"
            else:
                # Step 2's checkpoint was written in the background while steps 3 and 4 ran
                # (train.checkpoint_async auto): the resumed steps are the faultless run's, so
                # nothing of steps 3-4 (the backbone optimiser's state, the scaler, the head's
                # state, the classifier's rows) reached it.
                problem = losses_continue(logged_losses(out),
                                          {k: v for k, v in s.reference_losses.items() if k <= 6}, 2)
                walked += problem is None
        if problem:
            failures.append("trial %d (%s): %s" % (trial, "; ".join(what), problem))
        line = re.sub(r"^\[rank \d+/\d+\] ", "", (said or errors or [""])[0])
        print("trial %2d: %-60s exit %d | %s" % (trial, "; ".join(what)[:60], code, line[:170]), flush=True)
    print("corrupt_latest: %d trials: %d walked back to step 2, %d refused (both damaged), %d failures" %
          (args.trials, walked, refused, len(failures)))
    return failures


def full_fs(args, s, rng):
    mnt = os.path.join(s.work, "small")
    os.makedirs(mnt)
    code, out = run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", mnt])
    if code != 0:
        print("SKIP: cannot mount a tmpfs here: " + out.strip()[:200])
        return None
    try:
        out_dir = os.path.join(mnt, "out")
        # A checkpoint is about 15 MB: fill the file system so that the fourth one does not fit.
        code, out = s.train_run(out_dir, ["--set", "train.max_steps=6", "--set", "train.keep_checkpoints=10"])
        used = sum(os.path.getsize(p) for p in glob.glob(os.path.join(out_dir, "**"), recursive=True) if os.path.isfile(p))
        st = os.statvfs(mnt)
        free = st.f_bavail * st.f_frsize
        before = committed_steps(out_dir)
        before_digests = {step: checkpoint_digests(out_dir, step) for step in before}
        with open(os.path.join(mnt, "filler"), "wb") as f:
            f.write(b"\0" * max(0, free - used // 3 // 2))
        code, out = s.train_run(out_dir, ["--resume", "--set", "train.max_steps=20", "--set", "train.keep_checkpoints=10"])
        failures = []
        errors = [l for l in out.splitlines() if "error:" in l]
        warns = [l for l in out.splitlines() if "not saved" in l]
        if code != 3:
            failures.append("exit %d, expected 3:\n%s" % (code, out[-2000:]))
        if len(errors) != 1 or "No space left" not in errors[0] or "full?" not in errors[0]:
            failures.append("the error line does not say the disk is full: %s" % errors)
        if len(warns) != 1:
            failures.append("%d 'not saved' warnings, expected one" % len(warns))
        os.remove(os.path.join(mnt, "filler"))
        failures += s.check_output(out_dir)
        after = committed_steps(out_dir)
        digests = dict(before_digests)
        for step in after:
            digests[("after", step)] = checkpoint_digests(out_dir, step)
        failures += committed_kept(before, digests, after, keep=10)
        if after and before and after[-1] < before[-1]:
            failures.append("the newest committed checkpoint went back from step %d to %d" % (before[-1], after[-1]))
        r = s.resumes(out_dir)
        if r:
            failures.append(r)
        print("full file system: exit %d" % code)
        for l in warns + errors:
            print("  " + re.sub(r"^\[rank \d+/\d+\] ", "", l)[:300])
        return failures
    finally:
        run(["umount", mnt])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--case", required=True, choices=["matrix", "full_fs", "corrupt_latest", "enospc", "eio"])
    ap.add_argument("--ordinals", type=int, default=6, help="calls walked per operation (evenly spread beyond)")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--kinds", default="", help="matrix: only these kinds of file (comma-separated)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--checkpoint-async", dest="checkpoint_async", default=None, choices=["on", "off", "auto"],
                    help="train.checkpoint_async of every run (written in the background with on)")
    args = ap.parse_args()
    args.source, args.bin = os.path.abspath(args.source), os.path.abspath(args.bin)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print("storage faults %s: seed %d" % (args.case, seed), flush=True)
    rng = random.Random(seed)
    work = tempfile.mkdtemp(prefix="faceshard_storage_")
    try:
        s = Setup(args, work)
        if args.case == "matrix":
            failures = matrix(args, s, rng)
        elif args.case == "corrupt_latest":
            failures = corrupt_latest(args, s, rng)
        elif args.case == "full_fs":
            failures = full_fs(args, s, rng)
            if failures is None:
                return 77
        else:
            failures = loop(args, s, rng, args.case.upper())
    finally:
        if args.keep:
            print("work folder kept: " + work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return fault_loops.verdict(failures, seed)


if __name__ == "__main__":
    sys.exit(main())
