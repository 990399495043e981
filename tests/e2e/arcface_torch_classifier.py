"""tools/arcface_torch_step.py --classifier-only on the CPU at small sizes: its JSON (one run
per cell of classes per shard x sample rate, in order, each with a positive step time), and
each cell's first two steps (--dump) against a plain reference computed here in float64 from
everything the ranks dumped: ArcFace-margin cross-entropy (F.cross_entropy) over normalised
embeddings and the sampled columns of the normalised weight, its gradient by autograd, and
SGD with momentum 0.9 and weight decay 5e-4 written out by hand (the second step carries the
first's momentum). The loss must match, and so must the update: as a whole, and row by row
against each row's own update (the rows without a gradient move by weight decay and momentum
alone), so that a missing backward, a skipped or wrong optimiser step, a weight decay or
momentum left out, or a loss scale left in the gradient fails.

"time_limit": a limit already past when the first cell would start: every cell is reported
as not run, with null figures, and the run still exits 0 with its JSON (as the GPU check
needs of an optional item).

  python3 arcface_torch_classifier.py SOURCE_DIR CASE    (CASE: one_rank | two_ranks_scaled | time_limit)
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fault_loops import free_port  # noqa: E402

# CASE: ranks, classes per shard, sample rates, --precision (fp16 on the CPU: GradScaler alone)
CASES = {"one_rank": (1, [300, 1000], [1.0, 0.25], "fp32"),
         "two_ranks_scaled": (2, [400], [1.0, 0.3], "fp16"),
         "time_limit": (1, [300, 1000], [1.0, 0.25], "fp32")}
BATCH = 8
LOSS_TOL, UPDATE_TOL = 1e-5, 1e-4
# Row by row against that row's own update: a row without a gradient moves by lr x 5e-4 x w
# alone, about 1e-3 of the largest update, where fp32's rounding of the weight is a few 1e-3
# of the move; a weight decay or momentum left out changes it by half or all of it.
ROW_TOL = 2e-2


def reference(ranks):
    """The steps the ranks dumped, recomputed in float64 from plain ops. Returns per step the
    loss and the whole weight after it."""
    r0 = ranks[0]
    s, m, lr, mom, wd = r0["s"], r0["m"], r0["lr"], r0["momentum"], r0["weight_decay"]
    W = torch.cat([r["weight"] for r in ranks]).double()
    buf = None
    out = []
    for i in range(len(r0["steps"])):
        steps = [r["steps"][i] for r in ranks]
        E = torch.cat([q["embeddings"] for q in steps]).double()
        Y = torch.cat([q["labels"] for q in steps]).long()
        if r0["sample_rate"] < 1:
            cols = torch.cat([q["weight_index"] + r["class_start"] for q, r in zip(steps, ranks)])
        else:
            cols = torch.arange(W.size(0))
        assert bool((cols[1:] > cols[:-1]).all()), "the sampled classes are not sorted and unique"
        target = torch.searchsorted(cols, Y)
        assert bool((cols[target.clamp(max=cols.numel() - 1)] == Y).all()), "a label's class was not sampled"
        Wr = W.clone().requires_grad_()
        cos = F.linear(F.normalize(E), F.normalize(Wr[cols])).clamp(-1, 1)
        rows = torch.arange(cos.size(0))
        with torch.no_grad():  # cos(theta + m) on the target, outside autograd as arcface_torch does
            delta = torch.zeros_like(cos)
            t = cos[rows, target]
            delta[rows, target] = torch.cos(torch.arccos(t) + m) - t
        loss = F.cross_entropy(s * (cos + delta), target)
        loss.backward()
        d_p = Wr.grad + wd * W  # torch.optim.SGD: weight decay, then momentum (dampening 0)
        buf = d_p.clone() if buf is None else mom * buf + d_p
        W = W - lr * buf
        out.append((loss.item(), W))
    return out


def check_cell(dump, n, world, cps, rate, fp16):
    ranks = [torch.load(os.path.join(dump, f"cell{n}_rank{r}.pt")) for r in range(world)]
    for r, d in enumerate(ranks):
        assert d["rank"] == r and d["world_size"] == world and d["num_local"] == cps, (r, d["num_local"])
        assert d["sample_rate"] == rate and d["fp16"] == fp16, (d["sample_rate"], d["fp16"])
        assert d["class_start"] == r * cps, d["class_start"]
    ref = reference(ranks)
    W_prev = torch.cat([r["weight"] for r in ranks]).double()
    for i, (ref_loss, ref_W) in enumerate(ref):
        losses = [r["steps"][i]["loss"] for r in ranks]
        got_W = torch.cat([r["steps"][i]["weight"] for r in ranks]).double()
        d_loss = max(abs(x - ref_loss) for x in losses) / max(abs(ref_loss), 1e-30)
        update = (ref_W - W_prev).abs().max().item()
        d_w = (got_W - ref_W).abs().max().item() / max(update, 1e-30)
        row_update = (ref_W - W_prev).abs().amax(1)
        d_rows = ((got_W - ref_W).abs().amax(1) / row_update.clamp_min(1e-30))
        worst = int(d_rows.argmax())
        print(f"  cell {n} ({cps} classes/shard x {world}, rate {rate}{', GradScaler' if fp16 else ''}) step {i + 1}: "
              f"loss {losses[0]:.6f}, reference {ref_loss:.6f} (rel. diff {d_loss:.1e}, tol {LOSS_TOL:g}); weight "
              f"update's largest difference {d_w:.1e} of the largest update {update:.3g} (tol {UPDATE_TOL:g}); "
              f"row by row {d_rows[worst]:.1e} (row {worst}, tol {ROW_TOL:g})")
        assert update > 0, "the reference's update is zero: the case tests nothing"
        assert d_loss <= LOSS_TOL, f"cell {n} step {i + 1}: loss {losses} against the reference's {ref_loss}"
        assert d_w <= UPDATE_TOL, f"cell {n} step {i + 1}: the weight update differs from SGD's by {d_w:.3g} (relative)"
        assert d_rows[worst] <= ROW_TOL, \
            f"cell {n} step {i + 1}: row {worst}'s update differs from SGD's by {d_rows[worst]:.3g} of that row's update"
        W_prev = ref_W


def main():
    source, case = sys.argv[1], sys.argv[2]
    if case not in CASES:
        print(f"unknown case {case!r} (known: {', '.join(CASES)})")
        return 2
    world, shards, rates, precision = CASES[case]
    with tempfile.TemporaryDirectory() as d:
        js, dump = os.path.join(d, "arcface_classifier.json"), os.path.join(d, "dump")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(free_port()), os.path.join(source, "tools", "arcface_torch_step.py"), "--classifier-only",
               "--device", "cpu", "--precision", precision, "--classes-per-shard", ",".join(map(str, shards)),
               "--sample-rate", ",".join(map(str, rates)), "--batch", str(BATCH), "--steps", "2", "--windows", "2",
               "--warmup", "1", "--json", js, "--dump", dump]
        if case == "time_limit":  # passed before torch is imported
            cmd += ["--time-limit-s", "0.001"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
        print(p.stdout[-3000:], p.stderr[-3000:])
        assert p.returncode == 0, f"exit {p.returncode}"
        j = json.load(open(js))
        assert j["mode"] == "classifier" and j["device"] == "cpu" and j["world_size"] == world, j
        assert j["batch_per_rank"] == BATCH and j["dim"] == 512 and j["precision"] == precision, j
        cells = [(c, r) for c in shards for r in rates]
        assert [(q["classes_per_shard"], q["sample_rate"]) for q in j["runs"]] == cells, j["runs"]
        if case == "time_limit":
            for q in j["runs"]:
                assert q["not_run"].startswith("time limit") and q["step_ms"] is None, q
                assert q["peak_memory_mb"] is None, q
            assert not os.path.exists(dump) or not os.listdir(dump), os.listdir(dump)
            print(f"PASS {case}: {len(cells)} cells reported as not run")
            return 0
        for q in j["runs"]:
            assert "not_run" not in q, q
            assert isinstance(q["step_ms"], float) and q["step_ms"] > 0, q
            assert q["step_ms"] == sorted(q["windows_ms"])[len(q["windows_ms"]) // 2] and len(q["windows_ms"]) == 2, q
            assert q["peak_memory_mb"] is None, q  # the CPU has no allocator peak to report
            assert q["num_sample_per_rank"] == int(q["sample_rate"] * q["classes_per_shard"]), q
        for n, (cps, rate) in enumerate(cells):
            check_cell(dump, n, world, cps, rate, precision == "fp16")
    print(f"PASS {case}: {len(cells)} cells, JSON and two steps each against the float64 reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
