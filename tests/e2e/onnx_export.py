#!/usr/bin/env python3
# faceshard-export against the trainer's own numbers: random-weight backbones (weights and
# non-trivial BatchNorm statistics from the tests' Python reference, tests/reference_backbones.h)
# are exported, checked by onnx.checker (full_check), run in onnxruntime at batch 1, 4 and 16
# and compared with `faceshard-extract --no-flip --no-normalize` on the same images; fp16
# exports, insightface's model_zoo.get_model, and the command line's errors.
# usage: onnx_export.py SOURCE_DIR BIN_DIR MODE [NETWORK ...]
#   MODE: iresnet | mbf | vit | fp16 | opsets | insightface | cli | big (vit_h, r2060: by hand)
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

root, bindir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
only = sys.argv[4:]
TOL = 1e-5          # max |onnx - faceshard| / max |faceshard|, per embedding
TOL_FP16 = 1e-2     # the same for an fp16 export against faceshard's fp32 embeddings (fp16: 2^-10 = 9.8e-4)
results = []


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


try:
    import onnx
    import onnxruntime as ort
except ImportError as e:
    fail("%s: run tools/setup.sh (it installs onnx and onnxruntime into .venv)" % e)


def load_reference():
    """The tests' Python reference backbones: names, shapes and random weights."""
    text = open(os.path.join(root, "tests/reference_backbones.h")).read()
    src = re.search(r'R"PY\((.*?)\)PY"', text, re.S).group(1)
    mod = type(sys)("ref_backbones")
    exec(compile(src, "reference_backbones.h", "exec"), mod.__dict__)
    return mod


BIG = ["vit_h", "r2060"]  # by hand (mode big)


def family(names, full):
    """The reference's networks of a family (every registered one has a reference, which the
    test ModelsCatalogue requires): `full` at batches 1, 4, 16, the others at batch 1."""
    return full, [n for n in names if n not in full and n not in BIG]


def write_bmp(path, rgb):
    """24-bit BMP (bottom-up BGR rows), which faceshard's decoder reads."""
    h, w, _ = rgb.shape
    pad = b"\0" * ((4 - w * 3 % 4) % 4)
    data = b"".join(rgb[y, :, ::-1].tobytes() + pad for y in range(h - 1, -1, -1))
    header = struct.pack("<2sIHHI", b"BM", 54 + len(data), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, len(data), 2835, 2835, 0, 0)
    open(path, "wb").write(header + info + data)


def normalise(rgb):
    """faceshard's input: RGB, CHW, (x / 255 - 0.5) / 0.5 in float32 (data/image_transform.cpp)."""
    table = (np.arange(256, dtype=np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
    return table[rgb].transpose(0, 3, 1, 2).copy()


def run(args, expect_rc=0, **kw):
    p = subprocess.run(args, capture_output=True, text=True, **kw)
    if expect_rc is not None and p.returncode != expect_rc:
        fail("%s: exit %d (expected %d)\n%s%s" % (" ".join(args), p.returncode, expect_rc, p.stdout, p.stderr))
    return p


class Case:
    """A random-weight model folder (model.pt, model.json, config.yaml) and its test images."""

    def __init__(self, work, ref, net, n_images, emb=512, seed=0):
        import torch
        self.net, self.emb = net, emb
        # The family (as the registry's BackboneTraits::family), from the reference's tables.
        self.iresnet = net in ref.IRESNET or net in ref.IRSE
        self.vit = net in ref.VIT
        self.se = net in ref.IRSE
        self.dir = os.path.join(work, net)
        os.makedirs(self.dir, exist_ok=True)
        g = torch.Generator().manual_seed(1000 + seed)
        sd = ref.random_weights(ref.spec_for(net, emb), g)
        if net == "r2060":
            # 1024 residual blocks of unit gain double the activations' variance 1024 times
            # (float32 overflows); small last BatchNorms keep the sum finite, as training does.
            for k in sd:
                if k.endswith("bn3.weight"):
                    sd[k] *= 0.05
        torch.save(sd, os.path.join(self.dir, "model.pt"))
        del sd
        json.dump({"backbone": net, "embedding_size": emb}, open(os.path.join(self.dir, "model.json"), "w"))
        self.config = "# the run's config (its sha1 goes into the export)\nmodel:\n  backbone: %s\n" % net
        open(os.path.join(self.dir, "config.yaml"), "w").write(self.config)
        rng = np.random.default_rng(seed)
        self.rgb = rng.integers(0, 256, size=(n_images, 112, 112, 3), dtype=np.uint8)
        names = []
        for i in range(n_images):
            names.append("img%02d.bmp" % i)
            write_bmp(os.path.join(self.dir, names[-1]), self.rgb[i])
        open(os.path.join(self.dir, "list.txt"), "w").write("\n".join(names) + "\n")

    def extract(self, batch=16, threads=1):
        """faceshard's own embeddings of the images (no flip, not normalised, fp32, CPU)."""
        out = os.path.join(self.dir, "faceshard_b%d_t%d" % (batch, threads))
        p = run([bindir + "/faceshard-extract", "--model", self.dir, "--list", os.path.join(self.dir, "list.txt"),
                 "--output", out, "--no-flip", "--no-normalize", "--device", "cpu", "--precision", "fp32",
                 "--batch", str(batch)], env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
        if "float32 rounding" in p.stderr:
            fail("%s: faceshard-extract calls well-scaled random weights ill-conditioned:\n%s" % (self.net, p.stderr))
        want = np.load(out + ".npy")
        if not np.isfinite(want).all() or not np.abs(want).max() > 0:
            fail("%s: faceshard's embeddings of the random weights are unusable: %s" % (self.net, want[:, :4]))
        return want

    def export(self, name, *flags):
        path = os.path.join(self.dir, name)
        t0 = time.time()
        p = run([bindir + "/faceshard-export", "--model", self.dir, "--onnx", path] + list(flags),
                env=dict(os.environ, OMP_NUM_THREADS="1"))
        seconds = time.time() - t0
        size = os.path.getsize(path) + (os.path.getsize(path + ".data") if os.path.exists(path + ".data") else 0)
        print("  export %s %s: %.1f s, %.1f MB  (%s)" % (self.net, " ".join(flags), seconds, size / 1e6,
                                                       (p.stdout + p.stderr).strip().splitlines()[-1] if (p.stdout + p.stderr).strip() else ""))
        return path


def session(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def rel_diff(got, want):
    """Per embedding: max |got - want| / max |want|; the worst embedding."""
    return float(np.max(np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)))


def check_graph(path, case, batch="batch", fp16=False):
    onnx.checker.check_model(path, full_check=True)
    m = onnx.load(path)
    g = m.graph
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
    if [i.name for i in g.input] != ["data"] or [o.name for o in g.output] != ["embedding"]:
        fail("%s: inputs %s, outputs %s" % (path, [i.name for i in g.input], [o.name for o in g.output]))
    if dims(g.input[0]) != [batch, 3, 112, 112] or dims(g.output[0]) != [batch, case.emb]:
        fail("%s: input %s, output %s" % (path, dims(g.input[0]), dims(g.output[0])))
    if g.input[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT or \
            g.output[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        fail("%s: input and output must be float32" % path)
    props = {p.key: p.value for p in m.metadata_props}
    want = {"network": case.net, "embedding_size": str(case.emb), "input_mean": "127.5", "input_std": "127.5",
            "precision": "fp16" if fp16 else "fp32",
            "training_config_sha1": hashlib.sha1(case.config.encode()).hexdigest()}
    for k, v in want.items():
        if props.get(k) != v:
            fail("%s: metadata %s = %r, expected %r" % (path, k, props.get(k), v))
    for k in ("input_normalization", "faceshard_version"):
        if not props.get(k):
            fail("%s: metadata %s missing" % (path, k))
    # BatchNorm folded: a node is left only where no conv or linear precedes it (iresnet's bn1).
    bns = sum(1 for n in g.node if n.op_type == "BatchNormalization")
    blocks = sum(1 for n in g.node if n.op_type == "Conv" and n.name.endswith(".conv1"))
    if bns != (blocks if case.iresnet else 0):
        fail("%s: %d BatchNormalization nodes left for %d iresnet blocks" % (path, bns, blocks))
    # IR-SE: each block's squeeze-and-excitation as GlobalAveragePool, Relu (not ReLU6's Clip), Sigmoid.
    if case.se:
        ops = [n.op_type for n in g.node]
        for op in ("GlobalAveragePool", "Relu", "Sigmoid"):
            if ops.count(op) != blocks:
                fail("%s: %d %s nodes for %d IR-SE blocks" % (path, ops.count(op), op, blocks))
        if "Clip" in ops:
            fail("%s: a Clip node in an IR-SE graph" % path)
    # insightface's ArcFaceONNX reads a graph whose first 8 node names start with Sub and Mul as
    # normalising itself (then feeds raw pixels); faceshard's graphs expect normalised input.
    firsts = [n.name for n in g.node[:8]]
    if any(n.startswith(("Sub", "_minus")) for n in firsts) and any(n.startswith(("Mul", "_mul")) for n in firsts):
        fail("%s: the first nodes %s would make insightface skip the normalisation" % (path, firsts))
    if fp16:
        types = {t.data_type for t in g.initializer if len(t.dims) >= 2}
        if types != {onnx.TensorProto.FLOAT16}:
            fail("%s: fp16 export with weight types %s" % (path, types))
    return m


def compare(case, path, want, batches, tol, label=""):
    x = normalise(case.rgb)
    sess = session(path)
    for b in batches:
        got = np.concatenate([sess.run(["embedding"], {"data": x[i:i + b]})[0] for i in range(0, len(x), b)])
        if got.shape != want.shape or got.dtype != np.float32:
            fail("%s: batch %d gives %s %s, faceshard %s" % (path, b, got.shape, got.dtype, want.shape))
        d = rel_diff(got, want)
        results.append((case.net + label, b, d))
        print("  %-22s batch %2d: max relative difference %.2e" % (case.net + label, b, d))
        if not d <= tol:
            fail("%s%s at batch %d: max relative difference %.3e > %g" % (case.net, label, b, d, tol))


def networks(default):
    return only or default


# faceshard-extract's batch size and thread count beside its batch of 16 on one thread: the
# onnxruntime graph (batch-independent) is compared with each, so an embedding that depends
# on how the images are batched or the work split between threads fails here.
EXTRACT_SETTINGS_FULL = [(1, 2), (4, 2), (7, 1), (7, 2)]
EXTRACT_SETTINGS_BATCH1 = [(1, 2), (7, 2)]


def mode_equivalence(work, ref, full, batch1):
    """full: onnxruntime at batches 1, 4, 16 on 16 images; batch1: batch 1 on 7 images (2 for the
    by-hand ones); each against faceshard-extract at batch 16 on one thread, and at the settings
    above."""
    for i, net in enumerate(networks(full + batch1)):
        big = net in batch1
        case = Case(work, ref, net, 2 if net in BIG else 7 if big else 16, seed=i)
        want = case.extract()
        path = case.export("model.onnx")
        check_graph(path, case)
        compare(case, path, want, [1] if big else [1, 4, 16], TOL)
        for b, t in EXTRACT_SETTINGS_BATCH1 if big else EXTRACT_SETTINGS_FULL:
            compare(case, path, case.extract(b, t), [1], TOL, " extract b%d t%d" % (b, t))
        shutil.rmtree(case.dir)


def mode_fp16(work, ref):
    for i, net in enumerate(networks(["r18", "mbf", "vit_t"])):
        case = Case(work, ref, net, 4, seed=i)
        want = case.extract()
        path = case.export("fp16.onnx", "--precision", "fp16")
        check_graph(path, case, fp16=True)
        compare(case, path, want, [1, 4], TOL_FP16, " fp16")
        # The same within fp32's tolerance would mean the graph did not compute in fp16.
        if min(d for n, b, d in results if n == net + " fp16") < 1e-5:
            fail("%s fp16: as close as fp32; the graph does not compute in fp16" % net)
        shutil.rmtree(case.dir)


def mode_opsets(work, ref):
    """Opsets 13 (LayerNorm as arithmetic) and 21, a fixed batch, and external data."""
    for i, net in enumerate(networks(["vit_t", "r18"])):
        case = Case(work, ref, net, 4, seed=i)
        want = case.extract()
        for opset in ("13", "21"):
            path = case.export("opset%s.onnx" % opset, "--opset", opset)
            m = check_graph(path, case)
            if [o.version for o in m.opset_import] != [int(opset)]:
                fail("%s: opset_import %s" % (path, m.opset_import))
            ln = sum(1 for n in m.graph.node if n.op_type == "LayerNormalization")
            if case.vit and (ln == 0) != (opset == "13"):
                fail("%s: %d LayerNormalization nodes at opset %s" % (path, ln, opset))
            compare(case, path, want, [1, 4], TOL, " opset " + opset)
        path = case.export("fixed.onnx", "--batch", "4", "--external-data")
        check_graph(path, case, batch=4)
        if not os.path.getsize(path + ".data") > 0.9 * os.path.getsize(os.path.join(case.dir, "model.pt")):
            fail("%s.data holds %d bytes, model.pt %d" % (path, os.path.getsize(path + ".data"),
                                                          os.path.getsize(os.path.join(case.dir, "model.pt"))))
        compare(case, path, want, [4], TOL, " batch 4 fixed, external data")
        try:
            session(path).run(["embedding"], {"data": normalise(case.rgb[:2])})
        except Exception:  # onnxruntime's InvalidArgument: the batch is fixed
            pass
        else:
            fail("%s: a batch of 2 ran in a graph fixed at 4" % path)
        shutil.rmtree(case.dir)


def mode_insightface(work, ref):
    """insightface's own loader: model_zoo.get_model routes the export to ArcFaceONNX, which must
    pick mean 127.5 / std 127.5 and give faceshard's embeddings from BGR uint8 faces."""
    import insightface
    from insightface.model_zoo.arcface_onnx import ArcFaceONNX
    for i, (net, flags) in enumerate([("r18", []), ("vit_t", ["--opset", "13"]), ("mbf", [])]):
        if only and net not in only:
            continue
        case = Case(work, ref, net, 4, seed=i)
        want = case.extract()
        path = case.export("model.onnx", *flags)
        model = insightface.model_zoo.get_model(path, providers=["CPUExecutionProvider"])
        if not isinstance(model, ArcFaceONNX):
            fail("%s: get_model gave %r, not ArcFaceONNX" % (path, model))
        if (model.input_mean, model.input_std) != (127.5, 127.5) or model.input_name != "data":
            fail("%s: ArcFaceONNX reads mean %s std %s input %s" % (path, model.input_mean, model.input_std,
                                                                    model.input_name))
        bgr = [np.ascontiguousarray(im[:, :, ::-1]) for im in case.rgb]
        got = model.get_feat(bgr)
        d = rel_diff(got, want)
        results.append((net + " insightface", len(bgr), d))
        print("  %-22s get_feat of %d faces: max relative difference %.2e" % (net + " insightface", len(bgr), d))
        if not d <= 1e-4:  # cv2's (x - 127.5) / 127.5 rounds differently from faceshard's table
            fail("%s: insightface's embeddings differ from faceshard's by %.3e" % (net, d))
        sim = model.compute_sim(got[0], want[0])
        if not sim > 0.9999:
            fail("%s: cosine similarity %f" % (net, sim))
        shutil.rmtree(case.dir)


def mode_cli(work, ref):
    """Bad input: one line on stderr, exit 2 (usage) or 1 (runtime), no file left behind."""
    case = Case(work, ref, "mbf_small", 1, emb=256)
    out = os.path.join(work, "out.onnx")
    exe = bindir + "/faceshard-export"
    cases = [
        (["--model", work + "/missing", "--onnx", out], 2, "does not exist"),
        (["--model", case.dir + "/model.pt", "--network", "r51", "--onnx", out], 2, "r51"),
        (["--model", case.dir, "--onnx", out, "--opset", "12"], 2, "opset"),
        (["--model", case.dir, "--onnx", out, "--opset", "22"], 2, "opset"),
        (["--model", case.dir, "--onnx", out, "--opset", "x"], 2, "--opset"),
        (["--model", case.dir, "--onnx", out, "--batch", "0"], 2, "--batch"),
        (["--model", case.dir, "--onnx", out, "--batch", "many"], 2, "--batch"),
        (["--model", case.dir, "--onnx", out, "--precision", "bf16"], 2, "--precision"),
        (["--model", case.dir, "--onnx", work + "/no/such/dir/out.onnx"], 2, "does not exist"),
        (["--model", case.dir, "--onnx", work], 2, "is a folder"),
        (["--model", case.dir], 2, "--onnx"),
        (["--model", case.dir, "--onnx", out, "--frobnicate"], 2, "--frobnicate"),
    ]
    for args, rc, word in cases:
        p = run([exe] + args, expect_rc=rc)
        lines = p.stderr.strip().splitlines()
        if len(lines) != 1 or word not in lines[0] or "error" not in lines[0]:
            fail("%s: expected one error line naming %r, got:\n%s" % (" ".join(args), word, p.stderr))
        print("  exit %d: %s" % (rc, lines[0]))
    # A write that fails half-way (a file size limit, EFBIG) leaves no file under the name.
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200000, 200000))
    p = run([exe, "--model", case.dir, "--onnx", out], expect_rc=1, preexec_fn=limit)
    if len(p.stderr.strip().splitlines()) != 1:
        fail("failed write: expected one error line, got:\n" + p.stderr)
    print("  exit 1: " + p.stderr.strip())
    left = [f for f in os.listdir(work) if f.startswith("out.onnx")]
    if left:
        fail("a failed export left %s" % left)
    # An existing export is replaced only by a complete one.
    run([exe, "--model", case.dir, "--onnx", out])
    before = open(out, "rb").read()
    run([exe, "--model", case.dir, "--onnx", out, "--external-data"], expect_rc=1, preexec_fn=limit)
    if open(out, "rb").read() != before or os.path.exists(out + ".data"):
        fail("a failed export changed the existing %s" % out)
    onnx.checker.check_model(out, full_check=True)
    print("  failed writes left nothing behind and kept the previous export")


def main():
    ref = load_reference()
    work = tempfile.mkdtemp(prefix="onnx_export_")
    t0 = time.time()
    try:
        if mode == "iresnet":
            # r18..r200 and the IR-SE networks (squeeze-and-excitation: GlobalAveragePool, Relu, Sigmoid).
            mode_equivalence(work, ref, *family(list(ref.IRESNET) + list(ref.IRSE), ["r18", "r50", "ir_se50"]))
        elif mode == "mbf":
            mode_equivalence(work, ref, list(ref.MBF), [])
        elif mode == "vit":
            # vit_h (756 M parameters, 3 GB of weights in each of three files) is left to `big`.
            mode_equivalence(work, ref, ["vit_t", "vit_s"], ["vit_b", "vit_l_dp005_mask_005"])
        elif mode == "big":
            print("  by hand only: vit_h and r2060 hold 3 and 4.5 GB of weights, more than CI's machine"
                  " can hold three times over")
            mode_equivalence(work, ref, [], ["vit_h", "r2060"])
        elif mode == "fp16":
            mode_fp16(work, ref)
        elif mode == "opsets":
            mode_opsets(work, ref)
        elif mode == "insightface":
            mode_insightface(work, ref)
        elif mode == "cli":
            mode_cli(work, ref)
        else:
            fail("unknown mode " + mode)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if results:
        print("worst: %s batch %d: %.2e" % max(results, key=lambda r: r[2]))
    print("PASS onnx_export %s (%.0f s)" % (mode, time.time() - t0))


main()
