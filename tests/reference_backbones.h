// The Python reference backbones of the tests: iresnet, MobileFaceNet and ViT built from
// plain torch.nn.functional ops over a state_dict (names and shapes spelled out from
// insightface's module structure), independent of faceshard's model code. test_models runs
// it as a script; the training-step parity test imports it as a module.
#pragma once

namespace faceshard::testing {

inline constexpr const char* kBackboneReferencePy = R"PY(
# Reference backbones from plain torch.nn.functional ops, written for faceshard's tests.
# Every network faceshard registers has an entry here (the test ModelsCatalogue requires it).
# Modes:
#   make  <dir> <arch> <emb> : random weights (torch.save'd OrderedDict), an input batch,
#                              eval/train embeddings and the state after one train step
#                              (train mode draws its random numbers after manual_seed(77),
#                              in the order the C++ model draws them)
#   check <dir> <arch> <emb> : load faceshard's export with torch.load, check keys/shapes,
#                              recompute its embeddings, re-save the weights for C++
#   misc  <dir>              : write/check the small format cases (views, dtypes, errors)
#   catalogue <dir> <emb>    : every network's state_dict names and shapes (its spec alone,
#                              nothing computed), one "name d0,d1,..." line each, <dir>/<arch>.spec
import collections, json, sys
import torch
import torch.nn.functional as F

IRESNET = {"r18": [2, 2, 2, 2], "r34": [3, 4, 6, 3], "r50": [3, 4, 14, 3],
           "r100": [3, 13, 30, 3], "r200": [6, 26, 60, 6], "r2060": [3, 128, 896, 3]}
# IR-SE (insightface's fresnet with use_se): the iresnet block with squeeze-and-excitation
# after bn3, before the residual addition; SE = sigmoid(fc2(relu(fc1(avgpool(x))))) with 1x1
# convolutions without bias reducing by 16, named se.fc1 / se.fc2 (the IR-SE ports' SEModule).
IRSE = {"ir_se50": [3, 4, 14, 3], "ir_se100": [3, 13, 30, 3]}
SE_REDUCTION = 16
MBF = {"mbf": ((1, 4, 6, 2), 2), "mbf_small": ((1, 1, 1, 1), 1), "mbf_large": ((2, 8, 12, 4), 4)}
# dim, depth, heads, drop path of the last block, mask ratio (arcface_torch's variants; the
# ratio is what its forward applies: random_masking's default 0.1 whenever a variant masks)
VIT = {"vit_t": (256, 12, 8, 0.1, 0.1), "vit_t_dp005_mask0": (256, 12, 8, 0.05, 0.0),
       "vit_s": (512, 12, 8, 0.1, 0.1), "vit_s_dp005_mask_0": (512, 12, 8, 0.05, 0.0),
       "vit_b": (512, 24, 8, 0.1, 0.1), "vit_b_dp005_mask_005": (512, 24, 8, 0.05, 0.1),
       "vit_l_dp005_mask_005": (768, 24, 8, 0.05, 0.1), "vit_h": (1024, 48, 8, 0.1, 0.0)}
TOKENS = 144  # (112 // 9) ** 2 patches of 9x9
TRAIN_SEED = 77


class Spec:
    """Parameter/buffer names and shapes in PyTorch state_dict order."""
    def __init__(self):
        self.entries = []  # (name, shape, kind)

    def conv(self, n, cout, cin, k):
        self.entries.append((n + ".weight", (cout, cin, k, k), "conv"))

    def bn(self, n, c):
        for s, kind in (("weight", "bn_w"), ("bias", "bn_b"), ("running_mean", "rm"),
                        ("running_var", "rv")):
            self.entries.append((n + "." + s, (c,), kind))
        self.entries.append((n + ".num_batches_tracked", (), "nbt"))

    def prelu(self, n, c):
        self.entries.append((n + ".weight", (c,), "prelu"))

    def ln(self, n, c):
        self.entries.append((n + ".weight", (c,), "ln_w"))
        self.entries.append((n + ".bias", (c,), "bias"))

    def linear(self, n, cout, cin, bias):
        self.entries.append((n + ".weight", (cout, cin), "linear"))
        if bias:
            self.entries.append((n + ".bias", (cout,), "bias"))


def iresnet_spec(layers, emb, se=False):
    s = Spec()
    s.conv("conv1", 64, 3, 3); s.bn("bn1", 64); s.prelu("prelu", 64)
    cin = 64
    for i, (planes, n) in enumerate(zip((64, 128, 256, 512), layers)):
        for b in range(n):
            p = "layer%d.%d" % (i + 1, b)
            s.bn(p + ".bn1", cin); s.conv(p + ".conv1", planes, cin, 3)
            s.bn(p + ".bn2", planes); s.prelu(p + ".prelu", planes)
            s.conv(p + ".conv2", planes, planes, 3); s.bn(p + ".bn3", planes)
            if se:
                s.conv(p + ".se.fc1", planes // SE_REDUCTION, planes, 1)
                s.conv(p + ".se.fc2", planes, planes // SE_REDUCTION, 1)
            if b == 0:
                s.conv(p + ".downsample.0", planes, cin, 1); s.bn(p + ".downsample.1", planes)
            cin = planes
    s.bn("bn2", 512); s.linear("fc", emb, 512 * 49, True); s.bn("features", emb)
    return s


def mbf_spec(blocks, scale, emb):
    s = Spec()
    def cb(p, cin, cout, k, groups, prelu=True):
        s.conv(p + ".layers.0", cout, cin // groups, k); s.bn(p + ".layers.1", cout)
        if prelu:
            s.prelu(p + ".layers.2", cout)
    def dw(p, cin, cout, groups):
        cb(p + ".layers.0", cin, groups, 1, 1); cb(p + ".layers.1", groups, groups, 3, groups)
        cb(p + ".layers.2", groups, cout, 1, 1, prelu=False)
    def res(p, c, n, groups):
        for j in range(n):
            dw("%s.layers.%d" % (p, j), c, c, groups)
    c64, c128 = 64 * scale, 128 * scale
    cb("layers.0", 3, c64, 3, 1)
    if blocks[0] == 1:
        cb("layers.1", c64, c64, 3, 64)
    else:
        res("layers.1", c64, blocks[0], 128)
    dw("layers.2", c64, c64, 128); res("layers.3", c64, blocks[1], 128)
    dw("layers.4", c64, c128, 256); res("layers.5", c128, blocks[2], 256)
    dw("layers.6", c128, c128, 512); res("layers.7", c128, blocks[3], 256)
    cb("conv_sep", c128, 512, 1, 1)
    cb("features.layers.0", 512, 512, 7, 512, prelu=False)
    s.linear("features.layers.2", emb, 512, False); s.bn("features.layers.3", emb)
    return s


def vit_spec(cfg, emb):
    d, depth = cfg[0], cfg[1]
    s = Spec()
    s.entries.append(("pos_embed", (1, TOKENS, d), "token"))
    s.entries.append(("mask_token", (1, 1, d), "token"))
    s.conv("patch_embed.proj", d, 3, 9)
    s.entries.append(("patch_embed.proj.bias", (d,), "bias"))
    for i in range(depth):
        p = "blocks.%d." % i
        s.ln(p + "norm1", d); s.ln(p + "norm2", d)
        s.linear(p + "attn.qkv", 3 * d, d, False); s.linear(p + "attn.proj", d, d, True)
        s.linear(p + "mlp.fc1", 4 * d, d, True); s.linear(p + "mlp.fc2", d, 4 * d, True)
    s.ln("norm", d)
    s.linear("feature.0", d, TOKENS * d, False); s.bn("feature.1", d)
    s.linear("feature.2", emb, d, False); s.bn("feature.3", emb)
    return s


def spec_for(arch, emb):
    if arch in IRESNET:
        return iresnet_spec(IRESNET[arch], emb)
    if arch in IRSE:
        return iresnet_spec(IRSE[arch], emb, se=True)
    if arch in VIT:
        return vit_spec(VIT[arch], emb)
    return mbf_spec(*MBF[arch], emb)


class Ops:
    """conv/linear/bn over a state_dict; counts MACs per image."""
    def __init__(self, sd, training):
        self.sd, self.training, self.macs = sd, training, 0

    def conv(self, n, x, stride, pad, groups=1):
        w = self.sd[n + ".weight"]
        y = F.conv2d(x, w, self.sd.get(n + ".bias"), stride, pad, 1, groups)
        self.macs += y[0].numel() * w.shape[1] * w.shape[2] * w.shape[3]
        return y

    def linear(self, n, x):
        w = self.sd[n + ".weight"]
        y = F.linear(x, w, self.sd.get(n + ".bias"))
        self.macs += y[0].numel() * w.shape[1]
        return y

    def matmul(self, a, b):
        y = a @ b
        self.macs += y[0].numel() * a.shape[-1]
        return y

    def bn(self, n, x, eps=1e-5):
        sd = self.sd
        if self.training:
            sd[n + ".num_batches_tracked"] += 1
        return F.batch_norm(x, sd[n + ".running_mean"], sd[n + ".running_var"], sd[n + ".weight"],
                            sd[n + ".bias"], self.training, 0.1, eps)

    def prelu(self, n, x):
        return F.prelu(x, self.sd[n + ".weight"])


def iresnet_forward(o, layers, x, se=False):
    x = o.prelu("prelu", o.bn("bn1", o.conv("conv1", x, 1, 1)))
    for i, n in enumerate(layers):
        for b in range(n):
            p = "layer%d.%d" % (i + 1, b)
            stride = 2 if b == 0 else 1
            y = o.conv(p + ".conv1", o.bn(p + ".bn1", x), 1, 1)
            y = o.prelu(p + ".prelu", o.bn(p + ".bn2", y))
            y = o.bn(p + ".bn3", o.conv(p + ".conv2", y, stride, 1))
            if se:
                w = o.conv(p + ".se.fc1", y.mean((2, 3), keepdim=True), 1, 0)
                y = y * torch.sigmoid(o.conv(p + ".se.fc2", F.relu(w), 1, 0))
            short = x if b else o.bn(p + ".downsample.1", o.conv(p + ".downsample.0", x, stride, 0))
            x = y + short
    x = torch.flatten(o.bn("bn2", x), 1)
    return o.bn("features", o.linear("fc", x))


def mbf_forward(o, blocks, x):
    def cb(p, x, stride, pad, groups, prelu=True):
        x = o.bn(p + ".layers.1", o.conv(p + ".layers.0", x, stride, pad, groups))
        return o.prelu(p + ".layers.2", x) if prelu else x
    def dw(p, x, stride, groups, residual):
        y = cb(p + ".layers.0", x, 1, 0, 1)
        y = cb(p + ".layers.1", y, stride, 1, groups)
        y = cb(p + ".layers.2", y, 1, 0, 1, prelu=False)
        return x + y if residual else y
    def res(p, x, n, groups):
        for j in range(n):
            x = dw("%s.layers.%d" % (p, j), x, 1, groups, True)
        return x
    x = cb("layers.0", x, 2, 1, 1)
    x = cb("layers.1", x, 1, 1, 64) if blocks[0] == 1 else res("layers.1", x, blocks[0], 128)
    x = res("layers.3", dw("layers.2", x, 2, 128, False), blocks[1], 128)
    x = res("layers.5", dw("layers.4", x, 2, 256, False), blocks[2], 256)
    x = res("layers.7", dw("layers.6", x, 2, 512, False), blocks[3], 256)
    x = cb("conv_sep", x, 1, 0, 1)
    x = cb("features.layers.0", x, 1, 0, 512, prelu=False)
    return o.bn("features.layers.3", o.linear("features.layers.2", torch.flatten(x, 1)))


def vit_forward(o, cfg, x):
    d, depth, heads, drop_path, mask_ratio = cfg
    sd, training = o.sd, o.training
    x = o.conv("patch_embed.proj", x, 9, 0)  # 112 -> 12x12 patches, the last 4 pixels unused
    b = x.shape[0]
    x = x.flatten(2).transpose(1, 2) + sd["pos_embed"]
    n_all = x.shape[1]
    restore = None
    if training and mask_ratio > 0:
        # Each sample keeps a random subset of its tokens (a random permutation's first part).
        keep = int(n_all * (1 - mask_ratio))
        order = torch.argsort(torch.rand(b, n_all), dim=1)
        restore = torch.argsort(order, dim=1)
        x = torch.gather(x, 1, order[:, :keep].unsqueeze(-1).repeat(1, 1, d))
    rates = [r.item() for r in torch.linspace(0, drop_path, depth)]

    def drop(y, rate):  # stochastic depth: whole samples, survivors scaled by 1/keep
        if not training or rate <= 0:
            return y
        m = y.new_empty((y.shape[0],) + (1,) * (y.dim() - 1)).bernoulli_(1 - rate)
        return y * m.div_(1 - rate)

    def ln(n, y):
        return F.layer_norm(y, (d,), sd[n + ".weight"], sd[n + ".bias"], 1e-5)

    for i in range(depth):
        p = "blocks.%d." % i
        y = ln(p + "norm1", x)
        n = y.shape[1]
        qkv = o.linear(p + "attn.qkv", y).reshape(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        att = (o.matmul(qkv[0], qkv[1].transpose(-2, -1)) * (d // heads) ** -0.5).softmax(-1)
        y = o.linear(p + "attn.proj", o.matmul(att, qkv[2]).transpose(1, 2).reshape(b, n, d))
        x = x + drop(y, rates[i])
        y = o.linear(p + "mlp.fc2", F.relu6(o.linear(p + "mlp.fc1", ln(p + "norm2", x))))
        x = x + drop(y, rates[i])
    x = ln("norm", x)
    if restore is not None:
        x = torch.cat([x, sd["mask_token"].repeat(b, n_all - x.shape[1], 1)], 1)
        x = torch.gather(x, 1, restore.unsqueeze(-1).repeat(1, 1, d))
    x = x.reshape(b, n_all * d)
    x = o.bn("feature.1", o.linear("feature.0", x), 2e-5)
    return o.bn("feature.3", o.linear("feature.2", x), 2e-5)


def forward(arch, sd, x, training):
    o = Ops(sd, training)
    with torch.no_grad():
        if arch in IRESNET:
            y = iresnet_forward(o, IRESNET[arch], x)
        elif arch in IRSE:
            y = iresnet_forward(o, IRSE[arch], x, se=True)
        elif arch in VIT:
            y = vit_forward(o, VIT[arch], x)
        else:
            y = mbf_forward(o, MBF[arch][0], x)
    return y, o.macs


def random_weights(spec, g):
    sd = collections.OrderedDict()
    for name, shape, kind in spec.entries:
        if kind in ("conv", "linear"):
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            t = torch.randn(shape, generator=g) * (1.0 / fan_in) ** 0.5
        elif kind in ("bn_w", "rv", "ln_w"):
            t = torch.rand(shape, generator=g) * 0.5 + 0.75
        elif kind == "token":
            t = torch.randn(shape, generator=g) * 0.5
        elif kind in ("bn_b", "rm", "bias"):
            t = torch.randn(shape, generator=g) * 0.1
        elif kind == "prelu":
            t = torch.rand(shape, generator=g) * 0.3
        else:
            t = torch.tensor(int(torch.randint(0, 1000, (1,), generator=g)))
        sd[name] = t
    return sd


def make(d, arch, emb):
    spec = spec_for(arch, emb)
    g = torch.Generator().manual_seed(1234)
    sd = random_weights(spec, g)
    sd._metadata = collections.OrderedDict([("", {"version": 1})])  # as module.state_dict()
    torch.save(sd, d + "/py_weights.pt")
    x = torch.randn(3, 3, 112, 112, generator=g)
    # The reference computes in float64 (the test runs the C++ model in float64 too): in
    # float32, train-mode BatchNorm over a batch of 3 amplifies rounding differences between
    # convolution algorithms to ~1e-4 through a deep network.
    sd64 = collections.OrderedDict((k, v.double() if v.is_floating_point() else v) for k, v in sd.items())
    y_eval, macs = forward(arch, sd64, x.double(), False)
    after = collections.OrderedDict((k, v.clone()) for k, v in sd64.items())
    torch.manual_seed(TRAIN_SEED)
    y_train, _ = forward(arch, after, x.double(), True)
    torch.save(after, d + "/py_after_train.pt")
    torch.save({"input": x, "eval": y_eval, "train": y_train}, d + "/py_io.pt")
    params = sum(torch.Size(s).numel() for n, s, k in spec.entries if k not in ("rm", "rv", "nbt"))
    json.dump({"params": params, "macs": macs, "keys": len(spec.entries)}, open(d + "/py_info.json", "w"))


def fail(msg):
    print("REFERENCE MISMATCH: " + msg)
    sys.exit(3)


def check(d, arch, emb):
    spec = spec_for(arch, emb)
    sd = torch.load(d + "/cpp_weights.pt")  # weights_only=True: the safe default loader
    if not isinstance(sd, dict):
        fail("export is a %s, not a dict" % type(sd))
    want = [n for n, _, _ in spec.entries]
    if list(sd.keys()) != want:
        extra = [k for k in sd if k not in want][:3]
        missing = [k for k in want if k not in sd][:3]
        fail("keys differ: missing %s extra %s (order equal: %s)" % (missing, extra, sorted(sd) == sorted(want)))
    for n, shape, kind in spec.entries:
        t = sd[n]
        if tuple(t.shape) != tuple(shape):
            fail("%s: shape %s, expected %s" % (n, tuple(t.shape), shape))
        if t.dtype != (torch.int64 if kind == "nbt" else torch.float32):
            fail("%s: dtype %s" % (n, t.dtype))
    io = torch.load(d + "/cpp_io.pt")
    y, _ = forward(arch, collections.OrderedDict(sd), io["input"], False)
    err = (y - io["eval"]).abs().max().item()
    scale = y.abs().max().item()
    if not err <= 1e-4 * scale + 1e-5:
        fail("embeddings differ: max abs err %g (scale %g)" % (err, scale))
    torch.save(sd, d + "/py_resaved.pt")
    print("ok max_err=%g scale=%g" % (err, scale))


def catalogue(d, emb):
    for arch in list(IRESNET) + list(IRSE) + list(MBF) + list(VIT):
        with open("%s/%s.spec" % (d, arch), "w") as f:
            for n, shape, kind in spec_for(arch, emb).entries:
                f.write("%s %s\n" % (n, ",".join(str(x) for x in shape)))
    print("ok")


def misc(d):
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    torch.save(collections.OrderedDict([
        ("a", a), ("b", a[:, 1:]), ("p", torch.nn.Parameter(torch.ones(3))),
        ("h", torch.arange(4).half()), ("bf", torch.arange(4).bfloat16()),
        ("l", torch.tensor(7)), ("e", torch.empty(0, 3))]), d + "/misc.pt")
    small = collections.OrderedDict([("w", torch.ones(2))])
    torch.save(small, d + "/legacy.pt", _use_new_zipfile_serialization=False)
    torch.save({"state_dict": small, "epoch": 3}, d + "/checkpoint.pt")
    torch.save({"a": 1}, d + "/nontensor.pt")
    torch.save([torch.ones(1)], d + "/list.pt")
    # faceshard's writer: same cases the other way round.
    m = torch.load(d + "/cpp_misc.pt")
    want = {"a": a, "b": a[:, 1:], "h": torch.arange(4).half(), "bf": torch.arange(4).bfloat16(),
            "l": torch.tensor(7), "e": torch.empty(0, 3), "big": torch.full((3,), 2.5)}
    if list(m.keys()) != list(want.keys()):
        fail("cpp_misc keys %s" % list(m.keys()))
    for k, v in want.items():
        if m[k].dtype != v.dtype or m[k].shape != v.shape or not torch.equal(m[k], v):
            fail("cpp_misc[%s] = %s, expected %s" % (k, m[k], v))
    print("ok")


if __name__ == "__main__":
    mode, d = sys.argv[1], sys.argv[2]
    if mode == "make":
        make(d, sys.argv[3], int(sys.argv[4]))
    elif mode == "check":
        check(d, sys.argv[3], int(sys.argv[4]))
    elif mode == "misc":
        misc(d)
    elif mode == "catalogue":
        catalogue(d, int(sys.argv[3]))
)PY";

}  // namespace faceshard::testing
