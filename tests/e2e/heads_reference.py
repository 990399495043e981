"""Every margin head of faceshard-head against its authors' definition, written here in
float64 with plain torch ops after the authors' code (AdaFace head.py, CurricularFace
head/metrics.py, MagFace models/magface.py, ElasticFace utils/losses.py, arcface_torch's
CombinedMarginLoss, SphereFace's A-Softmax): loss of every step, the gradients of the last
one with respect to the raw embeddings and raw centres, and the head's state, after 1 and 3 steps; each with the
logits buffered, streamed (loss.logits), and streamed with bf16 centres
(optim.fc_weight_dtype: the reference then takes the centres rounded to bf16).

usage: heads_reference.py BIN_DIR
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

torch.set_default_dtype(torch.float64)
BIN = sys.argv[1]


def l2n(x, axis):
    return x / torch.norm(x, 2, axis, True)


class ArcFace:  # arcface_torch CombinedMarginLoss, (1, m, 0), exact gradient
    def __init__(self, m=0.5, s=64.0):
        self.m, self.s = m, s

    def __call__(self, e, y, k):
        cos = torch.mm(l2n(e, 1), l2n(k, 0)).clamp(-1, 1)
        onehot = F.one_hot(y, cos.size(1)).bool()
        t = torch.cos(torch.acos(cos.clamp(-1 + 1e-12, 1 - 1e-12)) + self.m)
        return torch.where(onehot, t, cos) * self.s, None

    def state(self):
        return {}


class CosFace(ArcFace):
    def __init__(self, m=0.4, s=64.0):
        self.m, self.s = m, s

    def __call__(self, e, y, k):
        cos = torch.mm(l2n(e, 1), l2n(k, 0))
        return (cos - F.one_hot(y, cos.size(1)) * self.m) * self.s, None


class AdaFace:  # mk-minchul/AdaFace head.py
    def __init__(self, m=0.4, h=0.333, s=64.0, t_alpha=0.01):
        self.m, self.h, self.s, self.t_alpha, self.eps = m, h, s, t_alpha, 1e-3
        self.batch_mean = torch.ones(1) * 20
        self.batch_std = torch.ones(1) * 100

    def __call__(self, raw, label, kernel):
        norms = torch.norm(raw, 2, 1, True)
        embbedings = raw / norms
        kernel_norm = l2n(kernel, axis=0)
        cosine = torch.mm(embbedings, kernel_norm)
        cosine = cosine.clamp(-1 + self.eps, 1 - self.eps)
        safe_norms = torch.clip(norms, min=0.001, max=100).clone().detach()
        with torch.no_grad():
            mean = safe_norms.mean().detach()
            std = safe_norms.std().detach()
            self.batch_mean = mean * self.t_alpha + (1 - self.t_alpha) * self.batch_mean
            self.batch_std = std * self.t_alpha + (1 - self.t_alpha) * self.batch_std
        margin_scaler = (safe_norms - self.batch_mean) / (self.batch_std + self.eps)
        margin_scaler = margin_scaler * self.h
        margin_scaler = torch.clip(margin_scaler, -1, 1)
        m_arc = torch.zeros(label.size()[0], cosine.size()[1])
        m_arc.scatter_(1, label.reshape(-1, 1), 1.0)
        g_angular = self.m * margin_scaler * -1
        m_arc = m_arc * g_angular
        theta = cosine.acos()
        theta_m = torch.clip(theta + m_arc, min=self.eps, max=math.pi - self.eps)
        cosine = theta_m.cos()
        m_cos = torch.zeros(label.size()[0], cosine.size()[1])
        m_cos.scatter_(1, label.reshape(-1, 1), 1.0)
        g_add = self.m + (self.m * margin_scaler)
        m_cos = m_cos * g_add
        cosine = cosine - m_cos
        return cosine * self.s, None

    def state(self):
        return {"batch_mean": float(self.batch_mean), "batch_std": float(self.batch_std)}


class CurricularFace:  # HuangYG123/CurricularFace head/metrics.py
    def __init__(self, m=0.5, s=64.0):
        self.m, self.s = m, s
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.threshold = math.cos(math.pi - m)
        self.mm = math.sin(math.pi - m) * m
        self.t = torch.zeros(1)

    def __call__(self, embbedings, label, kernel):
        embbedings = l2n(embbedings, axis=1)
        kernel_norm = l2n(kernel, axis=0)
        cos_theta = torch.mm(embbedings, kernel_norm)
        cos_theta = cos_theta.clamp(-1, 1)
        target_logit = cos_theta[torch.arange(0, embbedings.size(0)), label].view(-1, 1)
        sin_theta = torch.sqrt(1.0 - torch.pow(target_logit, 2))
        cos_theta_m = target_logit * self.cos_m - sin_theta * self.sin_m
        mask = cos_theta > cos_theta_m
        final_target_logit = torch.where(target_logit > self.threshold, cos_theta_m, target_logit - self.mm)
        hard_example = cos_theta[mask]
        with torch.no_grad():
            self.t = target_logit.mean() * 0.01 + (1 - 0.01) * self.t
        cos_theta[mask] = hard_example * (self.t + hard_example)
        cos_theta.scatter_(1, label.view(-1, 1).long(), final_target_logit)
        return cos_theta * self.s, None

    def state(self):
        return {"t": float(self.t)}


class MagFace:  # IrvingMeng/MagFace models/magface.py: MagLinear + MagLoss
    def __init__(self, l_a=10, u_a=110, l_m=0.45, u_m=0.8, lambda_g=35, s=64.0, easy_margin=True):
        self.l_a, self.u_a, self.l_m, self.u_m, self.lambda_g, self.s = l_a, u_a, l_m, u_m, lambda_g, s
        self.easy_margin = easy_margin

    def _margin(self, x):
        return (self.u_m - self.l_m) / (self.u_a - self.l_a) * (x - self.l_a) + self.l_m

    def __call__(self, x, label, weight):
        x_norm = torch.norm(x, dim=1, keepdim=True).clamp(self.l_a, self.u_a)
        ada_margin = self._margin(x_norm)
        cos_m, sin_m = torch.cos(ada_margin), torch.sin(ada_margin)
        weight_norm = F.normalize(weight, dim=0)
        cos_theta = torch.mm(F.normalize(x), weight_norm)
        cos_theta = cos_theta.clamp(-1, 1)
        sin_theta = torch.sqrt(1.0 - torch.pow(cos_theta, 2))
        cos_theta_m = cos_theta * cos_m - sin_theta * sin_m
        if self.easy_margin:
            cos_theta_m = torch.where(cos_theta > 0, cos_theta_m, cos_theta)
        else:
            mm = torch.sin(math.pi - ada_margin) * ada_margin
            threshold = torch.cos(math.pi - ada_margin)
            cos_theta_m = torch.where(cos_theta > threshold, cos_theta_m, cos_theta - mm)
        one_hot = torch.zeros_like(cos_theta)
        one_hot.scatter_(1, label.view(-1, 1), 1.0)
        output = one_hot * cos_theta_m * self.s + (1.0 - one_hot) * cos_theta * self.s
        loss_g = torch.mean(1 / (self.u_a ** 2) * x_norm + 1 / (x_norm))
        return output, self.lambda_g * loss_g

    def state(self):
        return {}


class ElasticFace:  # fdbtrs/ElasticFace utils/losses.py, margins given (sigma = 0: m itself)
    def __init__(self, arc, m, s=64.0):
        self.arc, self.m, self.s = arc, m, s

    def __call__(self, embbedings, label, kernel):
        embbedings = l2n(embbedings, axis=1)
        kernel_norm = l2n(kernel, axis=0)
        cos_theta = torch.mm(embbedings, kernel_norm)
        cos_theta = cos_theta.clamp(-1, 1)
        index = torch.where(label != -1)[0]
        m_hot = torch.zeros(index.size()[0], cos_theta.size()[1])
        margin = torch.full(label[index, None].size(), self.m)
        m_hot.scatter_(1, label[index, None], margin)
        if self.arc:
            cos_theta.acos_()
            cos_theta[index] += m_hot
            cos_theta.cos_().mul_(self.s)
            return cos_theta, None
        cos_theta[index] -= m_hot
        ret = cos_theta * self.s
        return ret, None

    def state(self):
        return {}


class SphereFace:  # wy1iu/sphereface A-Softmax: Caffe's MarginInnerProduct layer, QUADRUPLE (m = 4)
    """As the authors' layer (tools/caffe-sphereface/src/caffe/layers/margin_inner_product_layer.cpp,
    Forward_cpu) computes it, with their train/code/sphereface_model.prototxt's base 1000, gamma 0.12,
    power 1, lambda_min 5, iteration 0: iter_ += 1 first, lambda = max(lambda_min, base (1 + gamma
    iter_)^-power); cos(4 theta) by its Chebyshev polynomial 8 c^4 - 8 c^2 + 1 with the layer's signs
    sign_3 = sign(c) sign(2 c^2 - 1), sign_4 = 2 sign(c) + sign_3 - 3 (psi = sign_3 cos(4 theta) + sign_4);
    every logit gets + lambda x'w and all are divided by (1 + lambda), the target's psi added before.
    On normalised features with the scale s (the layer multiplies by the feature's norm); the exact
    gradient of this forward (the layer's backward rescales it). base 0 or lambda_min 0 is
    faceshard's switch for no annealing: lambda = 0, the target psi itself."""

    def __init__(self, s=64.0, base=1000.0, gamma=0.12, power=1.0, lambda_min=5.0):
        self.s, self.base, self.gamma, self.power, self.lambda_min = s, base, gamma, power, lambda_min
        self.iter = 0.0

    def __call__(self, e, y, k):
        self.iter += 1.0
        if self.base == 0 or self.lambda_min == 0:
            lamb = 0.0
        else:
            lamb = max(self.base * (1.0 + self.gamma * self.iter) ** (-self.power), self.lambda_min)
        cos = torch.mm(l2n(e, 1), l2n(k, 0)).clamp(-1, 1)
        c = cos.detach()
        sign_0 = torch.sign(c)
        sign_3 = sign_0 * torch.sign(2 * c ** 2 - 1)
        sign_4 = 2 * sign_0 + sign_3 - 3
        psi = sign_3 * (8 * cos ** 4 - 8 * cos ** 2 + 1) + sign_4
        onehot = F.one_hot(y, cos.size(1)).double()
        top = onehot * psi + (1 - onehot) * cos  # the target replaced by psi
        top = (top + lamb * cos) / (1 + lamb)
        return top * self.s, None

    def state(self):
        return {"iteration": self.iter}


# Reference cases by head (a head may have several: its defaults, then other parameters).
# The test runs them in the catalogue's order, and fails when a head of the catalogue has
# none here (or a case names a head the catalogue lacks).
REFERENCES = [
    ("arcface", [], ArcFace),
    ("combined", [], ArcFace),  # its default loss.margin (1, 0.5, 0) is ArcFace's
    ("cosface", [], CosFace),
    ("adaface", [], AdaFace),
    ("adaface", ["loss.adaface.m=0.5", "loss.adaface.h=0.5", "loss.adaface.t_alpha=0.5"],
     lambda: AdaFace(m=0.5, h=0.5, t_alpha=0.5)),
    ("curricularface", [], CurricularFace),
    ("magface", [], MagFace),
    ("magface", ["loss.magface.easy_margin=false"], lambda: MagFace(easy_margin=False)),
    ("elasticface_arc", ["loss.elasticface_arc.sigma=0"], lambda: ElasticFace(True, 0.5)),
    ("elasticface_cos", ["loss.elasticface_cos.sigma=0", "loss.elasticface_cos.plus=true"],
     lambda: ElasticFace(False, 0.35)),
    # The published schedule (lambda 893, 806, 735 at steps 1-3); one that reaches its floor with
    # power 2 (lambda 3, then lambda_min 2 twice); lambda_min 0: no annealing (psi alone).
    ("sphereface", [], SphereFace),
    ("sphereface", ["loss.sphereface.base=12", "loss.sphereface.gamma=1", "loss.sphereface.power=2",
                    "loss.sphereface.lambda_min=2"], lambda: SphereFace(base=12, gamma=1, power=2, lambda_min=2)),
    ("sphereface", ["loss.sphereface.lambda_min=0"], lambda: SphereFace(lambda_min=0)),
]



def catalogue_heads():
    """The heads faceshard-head --list prints: one 'name: summary' line each, the parameters indented."""
    out = subprocess.run([os.path.join(BIN, "faceshard-head"), "--list"], capture_output=True, text=True, check=True)
    return [line.split(":", 1)[0] for line in out.stdout.splitlines() if line and not line[0].isspace()]


def cases_from_catalogue():
    heads = catalogue_heads()
    missing = [h for h in heads if not any(c[0] == h for c in REFERENCES)]
    unknown = sorted({c[0] for c in REFERENCES} - set(heads))
    if not heads:
        print("FAIL: faceshard-head --list printed no heads")
        sys.exit(1)
    if missing or unknown:
        print("FAIL: heads without a reference case in %s: %s; cases for heads faceshard-head --list lacks: %s"
              % (os.path.basename(__file__), ", ".join(missing) or "none", ", ".join(unknown) or "none"))
        sys.exit(1)
    return [c for h in heads for c in REFERENCES if c[0] == h]


CASES = cases_from_catalogue()


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def main():
    g = torch.Generator().manual_seed(11)
    N, D, C = 24, 32, 61
    # Norms from 2 to 140: inside and outside MagFace's [10, 110] and AdaFace's spread.
    E = torch.randn(N, D, generator=g)
    E = E / E.norm(dim=1, keepdim=True) * torch.linspace(2, 140, N)[torch.randperm(N, generator=g)].unsqueeze(1)
    # Correlated with their centres, so that targets sit at realistic angles (0.3 to 1.4 rad).
    K = torch.randn(C, D, generator=g)
    Y = torch.randint(0, C, (N,), generator=g)
    # Most rows lean towards their class, some away from it (negative target cosines: the
    # easy-margin and fallback branches).
    lean = torch.linspace(-0.7, 1.2, N)[torch.randperm(N, generator=g)].unsqueeze(1)
    E = E + lean * K[Y] / K[Y].norm(dim=1, keepdim=True) * E.norm(dim=1, keepdim=True)
    worst = {}
    failures = []
    with tempfile.TemporaryDirectory() as d:
        np.save(os.path.join(d, "E.npy"), E.numpy().astype(np.float32))
        np.save(os.path.join(d, "L.npy"), Y.numpy().astype(np.int64))
        np.save(os.path.join(d, "C.npy"), K.numpy().astype(np.float32))
        E32 = torch.from_numpy(np.load(os.path.join(d, "E.npy"))).double()
        K32 = torch.from_numpy(np.load(os.path.join(d, "C.npy"))).double()
        # Each head with the logits buffered, streamed, and streamed with bf16 centres (the
        # reference then takes the centres rounded to bf16, as faceshard stores them).
        for name, sets, make, variant, steps in [(n, st, m, v, k) for n, st, m in CASES
                                                 for v in ("buffer", "streamed", "bf16") for k in (1, 3)]:
            if True:
                out = os.path.join(d, "out")
                cmd = [os.path.join(BIN, "faceshard-head"), "--head", name, "--embeddings", os.path.join(d, "E.npy"),
                       "--labels", os.path.join(d, "L.npy"), "--centres", os.path.join(d, "C.npy"),
                       "--steps", str(steps), "--out", out]
                for s in sets:
                    cmd += ["--set", s]
                if variant != "buffer":
                    cmd += ["--set", "loss.logits=streamed"]
                if variant == "bf16":
                    cmd += ["--set", "optim.fc_weight_dtype=bf16"]
                K_ref = K32.to(torch.bfloat16).double() if variant == "bf16" else K32
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    failures.append("%s %s: exit %d: %s" % (name, sets, r.returncode, r.stderr.strip()))
                    continue
                got_losses = [float(l.split()[3]) for l in r.stdout.splitlines() if l.startswith("step ")]
                if len(got_losses) != steps:
                    failures.append("%s %s: %d loss lines for %d steps" % (name, sets, len(got_losses), steps))
                    continue
                head = make()
                for _ in range(steps):
                    e = E32.clone().requires_grad_(True)
                    k = K_ref.t().clone().requires_grad_(True)  # the authors' kernel is [D, C]
                    logits, extra = head(e, Y, k)
                    loss = F.cross_entropy(logits, Y)
                    if extra is not None:
                        loss = loss + extra
                    loss.backward()
                    want_losses = getattr(head, "_losses", []) + [loss.item()]
                    head._losses = want_losses
                ge = np.load(os.path.join(out, "grad_embeddings.npy"))
                gc = np.load(os.path.join(out, "grad_centres.npy"))
                state = json.load(open(os.path.join(out, "state.json")))["state"]
                key = "%s%s %s/%d" % (name, "".join(" " + s.split(".", 2)[2] for s in sets), variant, steps)
                assert len(head._losses) == steps, (len(head._losses), steps)
                errs = {
                    "loss": rel(got_losses, head._losses),
                    "grad_embeddings": rel(ge, e.grad.numpy()),
                    "grad_centres": rel(gc, k.grad.t().numpy()),
                }
                for sk, sv in head.state().items():
                    errs["state " + sk] = rel([state[sk]], [sv])
                worst[key] = errs
                limits = {"loss": 1e-5, "grad_embeddings": 1e-4, "grad_centres": 1e-4}
                for ek, ev in errs.items():
                    if not ev <= limits.get(ek, 1e-5):
                        failures.append("%s: %s relative difference %.3g" % (key, ek, ev))
    for key, errs in worst.items():
        print("%-48s %s" % (key, "  ".join("%s %.2e" % kv for kv in errs.items())))
    if failures:
        print("\n".join("FAIL: " + f for f in failures))
        sys.exit(1)
    print("PASS")


main()
