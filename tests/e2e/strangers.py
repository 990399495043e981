#!/usr/bin/env python3
"""Strangers on a training job's ports: nothing gets in, nothing is lost.

A job of two ranks on this host (faceshard-train, CPU, Gloo) trains while strangers
connect to every port it listens on: the rendezvous store (rank 0) and each rank's Gloo
listener. What they do:
  idle    hundreds of connections that send nothing, held open
  random  connections sending a few KiB of random bytes
  huge    a length prefix of 2^63 (8 bytes little-endian), then nothing
  drip    the start of a valid greeting, one byte at a time, slowly
  replay  a real member's first messages replayed from another process: for the store, the
          handshake answer a faceshard process sent (recorded by a fake store here); for
          Gloo, the 8-byte sequence numbers a rank opens its pairs with
Every stranger's connection must be refused: closed by the job within the store's handshake
deadline (the guard's own figure, read from its first refusal line) plus a slack: two of the
store's poll periods (0.25 s) and ten times a reaction measured on this machine under its
present load (how long a wrong greeting answer takes to be refused),
with nothing sent back beyond the store's greeting (a stranger let in would get the store's
proof, a replayed handshake included; Gloo's ports send nothing), and the store must count
every one of its strangers as refused (its last line). The job must train on (steps keep
coming, no error, no rank lost) and stop cleanly on SIGTERM with its checkpoint committed,
and each rank's RSS may grow by at most 16 MiB.

usage: strangers.py --source DIR --bin DIR [--attacks idle,random,...] [--idle N]
       strangers.py --source DIR --bin DIR --loop --trials N [--seed S]   (one attack per job)
"""
import argparse
import os
import re
import random
import resource
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_loops  # noqa: E402  (Job, write_setup, steps_logged, committed_steps)

RSS_LIMIT_MIB = 16.0
ATTACKS = ["idle", "random", "huge", "drip", "replay"]
GREETING = 37   # "FSGS", version, 32-byte nonce
MAGIC = b"FSGS\x01"
ANSWER = 69     # "FSGS", version, 32-byte proof, 32-byte nonce


def rss_mib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def listening_ports(pid):
    """TCP ports the process listens on (from /proc/net/tcp{,6} and its descriptors)."""
    inodes = set()
    fd_dir = "/proc/%d/fd" % pid
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/%d/net/tcp" % pid, "/proc/%d/net/tcp6" % pid):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in inodes:
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return sorted(ports)


def watch_closes(socks, opened, limit):
    """Waits until the far end closes each socket; returns the seconds each took (None: still open at `limit`)
    and the bytes each received meanwhile."""
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    took = [None] * len(socks)
    got = [b""] * len(socks)
    left = len(socks)
    deadline = time.monotonic() + limit
    while left and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.05):
            i = key.data
            try:
                data = key.fileobj.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            except BlockingIOError:
                continue
            if data:
                got[i] += data  # the greeting (or what a stranger let in would get): read on
                continue
            took[i] = time.monotonic() - opened[i]
            sel.unregister(key.fileobj)
            left -= 1
    sel.close()
    for s in socks:
        s.close()
    return took, got


def beyond_greeting(data, is_store):
    """What came back to a stranger beyond the store's greeting (Gloo's ports send nothing)."""
    if not is_store:
        return data
    head = min(len(data), len(MAGIC))
    if data[:head] != MAGIC[:head]:
        return data  # not the greeting at all
    return data[GREETING:]


def guard_limit(t, store_port):
    """The store's handshake deadline (s), from the guard's first refusal line, and the slack of
    this machine now: how long a wrong greeting answer takes to be refused (sent at once, refused
    on arrival). Returns (deadline_s, slack_s, probe_s), or None when the line never came."""
    s = connect(store_port)
    s.settimeout(10)
    t0 = time.monotonic()
    s.sendall(b"XXXX" + os.urandom(ANSWER - 4))
    try:
        while s.recv(4096):
            pass
    except OSError:
        pass
    probe_s = time.monotonic() - t0
    s.close()
    pattern = re.compile(r"does not present the job's token within (\d+) ms")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = pattern.search(t.job.log(0))
        if m:
            # The slack: two of the server's poll periods (it looks at its pending connections
            # every 0.25 s at the latest) and ten reaction times.
            return int(m.group(1)) / 1000.0, 2 * 0.25 + 10 * probe_s, probe_s
        time.sleep(0.05)
    return None


def refused_in_all(text):
    """The store's count of refused connections from its last line (None: no such line)."""
    m = re.findall(r"the rendezvous store has refused (\d+) connections? in all", text)
    return int(m[-1]) if m else None


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def record_member_answer(args, work, token):
    """A fake store greets a faceshard process that holds the job's token and records its answer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), FACESHARD_JOB_TOKEN=token, OMP_NUM_THREADS="1")
    member = subprocess.Popen([os.path.join(args.bin, "faceshard-dist-check"), "--rendezvous-timeout-s", "5"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    srv.settimeout(20)
    try:
        conn, _ = srv.accept()
        conn.settimeout(10)
        conn.sendall(b"FSGS\x01" + os.urandom(32))
        answer = b""
        while len(answer) < ANSWER:
            chunk = conn.recv(ANSWER - len(answer))
            if not chunk:
                break
            answer += chunk
        conn.close()
    finally:
        srv.close()
        member.kill()
        member.wait()
    if len(answer) != ANSWER or not answer.startswith(b"FSGS\x01"):
        raise RuntimeError("could not record a member's handshake (got %d bytes)" % len(answer))
    return answer


def attack(kind, port, is_store, rng, replay_answer, idle_count, limit):
    """Runs one attack on one port; returns (connections, seconds to close each, bytes each received)."""
    socks, opened = [], []

    def open_one():
        s = connect(port)
        socks.append(s)
        opened.append(time.monotonic())
        return s

    if kind == "idle":
        for _ in range(idle_count):
            open_one()
    elif kind == "random":
        for _ in range(rng.randint(20, 60)):
            s = open_one()
            try:
                s.sendall(os.urandom(rng.randint(1, 8192)))
            except OSError:
                pass
    elif kind == "huge":
        for _ in range(5):
            s = open_one()
            try:
                s.sendall(struct.pack("<Q", 1 << 63))
            except OSError:
                pass
    elif kind == "drip":
        # The start of a valid greeting answer (store) or of a sequence number (Gloo), one
        # byte every 150 ms: a connection that takes its time is closed all the same.
        payload = (b"FSGS\x01" + os.urandom(64)) if is_store else os.urandom(8)
        drips = []
        for _ in range(3):
            drips.append(open_one())

        def drip(s):
            for b in payload:
                try:
                    s.send(bytes([b]))
                except OSError:
                    return
                time.sleep(0.15)
        threads = [threading.Thread(target=drip, args=(s,), daemon=True) for s in drips]
        for t in threads:
            t.start()
    elif kind == "replay":
        if is_store:
            for _ in range(5):
                s = open_one()
                try:
                    s.sendall(replay_answer)
                except OSError:
                    pass
        else:
            for seq in range(4):
                s = open_one()
                try:
                    s.sendall(struct.pack("<Q", seq))
                except OSError:
                    pass
    took, got = watch_closes(socks, opened, limit + 3.0)
    return len(socks), took, got


class Trainer:
    def __init__(self, args, work, tag, token):
        self.job = fault_loops.Job(args, work, tag, 2, ["--set", "optim.epochs=100000"], {"FACESHARD_JOB_TOKEN": token})

    def step(self):
        return max(fault_loops.steps_logged(self.job.log(0)) or [0])

    def wait_step(self, n, timeout):
        return self.job.wait_for(lambda: self.step() >= n, timeout, "step %d" % n)

    def stop(self, timeout=60):
        for p in self.job.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.job.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        hung = self.job.running()
        if hung:
            self.job.kill_all()
        return hung


def run_job(args, work, tag, plan, rng, token, replay_answer):
    """One job, the planned attacks (kind, target) one after another; returns (failures, report lines)."""
    failures, report = [], []
    out = os.path.join(work, "out")
    shutil.rmtree(out, ignore_errors=True)
    t = Trainer(args, work, tag, token)
    try:
        if not t.wait_step(5, 120):
            return ["%s: the job never reached step 5:\n%s" % (tag, t.job.log(0)[-2000:])], report
        pids = [p.pid for p in t.job.procs]
        store_port = t.job.port
        targets = {"store": (store_port, True, 0)}
        for r, pid in enumerate(pids):
            gloo = [p for p in listening_ports(pid) if p != store_port]
            if len(gloo) != 1:
                failures.append("%s: rank %d listens on %s besides the store: expected Gloo's one port" % (tag, r, gloo))
            for p in gloo:
                targets["gloo%d" % r] = (p, False, r)
        # Steady state first: the allocator's first steps are no stranger's doing.
        t.wait_step(20, 60)
        rss0 = [rss_mib(p) for p in pids]
        step0 = t.step()
        limits = guard_limit(t, store_port)
        if limits is None:
            failures.append("%s: the store refused a wrong greeting answer without its refusal line:\n%s" %
                            (tag, t.job.log(0)[-1500:]))
            return failures, report
        deadline_s, slack_s, probe_s = limits
        close_limit = deadline_s + slack_s
        report.append("close limit %.2f s: the store's handshake deadline %.2f s + slack %.2f s (a wrong answer "
                      "refused in %.3f s)" % (close_limit, deadline_s, slack_s, probe_s))
        store_strangers = 1  # the probe
        for kind, target in plan:
            if target not in targets:
                continue
            port, is_store, owner = targets[target]
            n, took, got = attack(kind, port, is_store, rng, replay_answer, args.idle, close_limit)
            store_strangers += n if is_store else 0
            closed = [x for x in took if x is not None]
            slow = [x for x in closed if x > close_limit]
            answered = [beyond_greeting(g, is_store) for g in got]
            answered = [a for a in answered if a]
            still = len(took) - len(closed)
            line = "%-6s on %-5s (port %5d): %3d connections, closed after median %.2f s, max %.2f s%s" % (
                kind, target, port, n, sorted(closed)[len(closed) // 2] if closed else 0, max(closed or [0]),
                ", %d STILL OPEN" % still if still else "")
            report.append(line)
            print("  " + line, flush=True)
            if still:
                failures.append("%s: %s on %s: %d of %d connections still open after %.1f s" %
                                (tag, kind, target, still, n, close_limit + 3))
            if slow:
                failures.append("%s: %s on %s: %d connections closed only after %.2f s (limit %.2f s)" %
                                (tag, kind, target, len(slow), max(slow), close_limit))
            if answered:
                failures.append("%s: %s on %s: %d connections got more than the greeting back (%d bytes, first %r): "
                                "let in" % (tag, kind, target, len(answered), len(answered[0]), answered[0][:16]))
            if t.job.running() != [0, 1]:
                failures.append("%s: a rank exited during %s on %s" % (tag, kind, target))
                break
        # Every stranger on the store was refused, by the store's own count (its line once a
        # burst of refusals has been quiet for a second).
        quiet = time.monotonic() + 10
        while refused_in_all(t.job.log(0)) != store_strangers and time.monotonic() < quiet:
            time.sleep(0.1)
        refused = refused_in_all(t.job.log(0))
        if refused != store_strangers:
            failures.append("%s: the store counts %s refused connections; %d strangers came to it" %
                            (tag, refused, store_strangers))
        else:
            report.append("the store refused %d connections in all: its %d strangers" % (refused, store_strangers))
        rss1 = [rss_mib(p) if t.job.procs[r].poll() is None else 0 for r, p in enumerate(pids)]
        # Training went on: more steps after the attacks, within the usual pace.
        step1 = t.step()
        if not t.wait_step(step1 + 3, 60):
            failures.append("%s: no step after the attacks (stuck at %d)" % (tag, step1))
        for r in range(2):
            grew = rss1[r] - rss0[r]
            report.append("rank %d RSS %.1f -> %.1f MiB (%+.1f)" % (r, rss0[r], rss1[r], grew))
            if grew > RSS_LIMIT_MIB:
                failures.append("%s: rank %d RSS grew by %.1f MiB during the attacks (limit %.0f)" %
                                (tag, r, grew, RSS_LIMIT_MIB))
        report.append("steps %d -> %d during the attacks" % (step0, step1))
    finally:
        hung = t.stop()
    if hung:
        failures.append("%s: rank(s) %s did not stop within 60 s of SIGTERM" % (tag, hung))
    for r, p in enumerate(t.job.procs):
        text = t.job.log(r)
        if p.returncode != 0:
            failures.append("%s: rank %d exited %s:\n%s" % (tag, r, p.returncode, text[-1500:]))
        bad = [l for l in text.splitlines() if "error:" in l or "terminate called" in l or "Aborted" in l]
        if bad:
            failures.append("%s: rank %d logged: %s" % (tag, r, bad[:3]))
    # The stop's checkpoint: its own step's ("checkpointing at step N"), or the one still being
    # written when it came ("... at step M: the checkpoint of step N, being written ...").
    stops = [re.search(r"checkpointing at step (\d+)|: the checkpoint of step (\d+), being written", l)
             for l in t.job.log(0).splitlines() if "stop requested" in l]
    stop_line = [m for m in stops if m]
    committed = fault_loops.committed_steps(out)
    if not stop_line or not committed:
        failures.append("%s: no checkpoint committed at the stop (committed: %s)" % (tag, committed))
    else:
        n = int(stop_line[-1].group(1) or stop_line[-1].group(2))
        if committed[-1] != n:
            failures.append("%s: stopped at step %d but the last committed checkpoint is %d" % (tag, n, committed[-1]))
    guard_lines = [l for r in range(2) for l in t.job.log(r).splitlines() if "network:" in l and "clos" in l]
    report.extend(guard_lines[:6])
    return failures, report


def setup(args):
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    work = tempfile.mkdtemp(prefix="faceshard_strangers_")
    # fault_loops' settings this script has no flag for: their defaults.
    for name in ("checkpoint_async",):
        if not hasattr(args, name):
            setattr(args, name, None)
    fault_loops.write_setup(args, work)
    token = os.urandom(16).hex()
    replay = record_member_answer(args, work, token)
    return work, token, replay


def loop(args, work, rng, token=None, replay=None):
    """fault_loops' `stranger` case: one job per trial, one random attack on one random port."""
    if token is None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
        token = os.urandom(16).hex()
        replay = record_member_answer(args, work, token)
    failures, tally = [], {}
    for trial in range(args.trials):
        kind = rng.choice(ATTACKS)
        target = rng.choice(["store", "gloo0", "gloo1"])
        args.idle = rng.randint(100, 400)
        print("trial %2d: %s on %s%s" % (trial, kind, target, " (%d connections)" % args.idle if kind == "idle" else ""),
              flush=True)
        f, _ = run_job(args, work, "t%d" % trial, [(kind, target)], rng, token, replay)
        failures.extend(f)
        key = (kind, target)
        tally.setdefault(key, [0, 0])
        tally[key][0] += 1
        tally[key][1] += 0 if f else 1
        for x in f:
            print("  FAIL " + x.splitlines()[0], flush=True)
    print("stranger: %d trials, %d failures" % (args.trials, len(failures)))
    for (kind, target), (n, ok) in sorted(tally.items()):
        print("  %-6s on %-5s: %d/%d clean" % (kind, target, ok, n))
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--idle", type=int, default=300)
    ap.add_argument("--loop", action="store_true")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    args.source, args.bin = os.path.abspath(args.source), os.path.abspath(args.bin)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print("strangers: seed %d" % seed, flush=True)
    rng = random.Random(seed)
    work, token, replay = setup(args)
    try:
        if args.loop:
            failures = loop(args, work, rng, token, replay)
        else:
            plan = [(k, target) for k in args.attacks.split(",") for target in ("store", "gloo0", "gloo1")]
            failures, report = run_job(args, work, "all", plan, rng, token, replay)
            print("\n".join(report))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return fault_loops.verdict(failures, seed)


if __name__ == "__main__":
    sys.exit(main())
