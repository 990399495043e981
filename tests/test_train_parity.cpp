// Step-for-step parity with arcface_torch: faceshard's real training step (the TrainJob and
// TrainStep that faceshard-train runs; the test hands it the batches instead of the loader)
// against arcface_torch's step semantics written here in Python from plain torch ops (not
// insightface's code): the backbone in train mode with BatchNorm statistics updated as
// torch.nn.BatchNorm2d does (per rank, or over the concatenated batch for SyncBatchNorm),
// PartialFC_V2's gather and sampling, CombinedMarginLoss in either margin mode, the
// distributed softmax, the backbone gradient scaled as arcface_torch does (x W in the
// gather's backward, averaged by DDP), clipping at norm 5, and SGD with momentum and weight
// decay on backbone and classifier. After steps 1 and 3, on 1 and 2 ranks: the loss, every
// backbone parameter and buffer of every rank, and all classifier rows; and the updates
// (value - initial value) of the parameters and the classifier rows.
//
// Precision. The reference runs twice, in float64 (the step's exact value) and in float32
// (what an fp32 implementation of it, such as arcface_torch's, reaches). faceshard (fp32) is
// measured against the float64 run: values within 1e-5 and updates within 1e-4 relative,
// or, where float32 itself cannot get that close, within 4x the float32 run's distance
// (per quantity, or the median over the quantities checked together if larger), capped; the
// backbone update is also checked as a whole, the classifier rows on their own, entries whose
// exact value is zero by an absolute bound, and the number of widened tolerances is bounded.
// That floor is real and large for some entries, and it is what a comparison of two fp32
// implementations sees as "differences": (a) entries whose exact value is zero, e.g. the
// biases of BatchNorms whose output reaches the loss only through linear maps into another
// training-mode BatchNorm (which removes any per-channel constant: their gradient is exactly
// 0) and the running means of BatchNorms fed by a linear map of normalised activations
// (their batch mean is exactly 0) -- in fp32 these hold rounding noise (~1e-8) that differs
// completely between implementations; (b) MobileFaceNet's backward at these batch sizes
// cancels about 99% of the gradient arriving from the head, so any relative error there
// (fp32 rounding of the classifier's s = 64 logits, ~2e-5) reaches the lower layers about
// 150 times larger (~5e-3). The test prints both.
//
// Sampling: faceshard draws its random negatives with its own seeded generator, so the
// Python side takes the sampled classes of each rank and step from faceshard's dump (the
// only value it reads from faceshard besides the initial state and the batches).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>
#include <utility>

#include "app/config/config.h"
#include "app/io/checkpoint.h"
#include "app/train/train_job.h"
#include "app/train/train_state.h"
#include "app/train/train_step.h"
#include "models/torch_save/state_dict_io.h"
#include "tests/harness.h"
#include "tests/reference_backbones.h"

namespace faceshard {
namespace {

// lr 0.001: larger rates make three fp32 steps of this tiny problem chaotic (s = 64 logits,
// batch 4: float32 and float64 runs of the same reference drift 10% apart by step 3 at 0.1).
// Weight decay 0.05 so that its share of each update is visible at the tolerances below.
constexpr int64_t kClasses = 40, kEmbedding = 32, kBatch = 4, kSteps = 3, kTotalSteps = 100;
constexpr double kLr = 0.001, kWeightDecay = 0.05;
constexpr double kValueTolerance = 1e-5, kUpdateTolerance = 1e-4, kFloorFactor = 4;
// The largest widened tolerances (see Check): what float32 itself reaches here, with margin.
constexpr double kValueCap = 1e-3, kUpdateCap = 2e-2;

struct ParityCase {
  std::string name;
  std::vector<double> margin;
  std::string mode = "exact";
  double filter = 0.0;
  double sample_rate = 1.0;
  std::string fc_update = "sampled";
  bool sync_bn = false;
  bool checkpoint = false;  // save a checkpoint after step 1 and read it back as Python would
  // Start from the network's own initialisation (BatchNorm weight 1, bias 0, statistics
  // 0 / 1) instead of randomised BatchNorm and PReLU state.
  bool fresh = false;
};

// BatchNorm affine and statistics and PReLU slopes away from their defaults (the same on
// every rank), so that the step exercises them as in a run that is under way.
void randomise_norms(Backbone& model) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
  torch::NoGradGuard ng;
  for (auto& [name, t] : model.state_dict()) {
    auto ends = [&](const char* tail) {
      const std::string s(tail);
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (ends("running_mean") || ends(".bias")) t.copy_(at::randn(t.sizes(), gen) * 0.1);
    else if (ends("running_var")) t.copy_(at::rand(t.sizes(), gen) * 0.5 + 0.75);
    else if (t.dim() == 1 && !ends("num_batches_tracked") && t.requires_grad()) t.copy_(at::rand(t.sizes(), gen) * 0.8 + 0.1);
  }
}

std::string yaml_of(const ParityCase& c, const std::string& output) {
  std::ostringstream y;
  y << "output: " << output << "\nseed: 2048\n"
    << "data:\n  rec: synthetic\n  num_classes: " << kClasses << "\n  batch_size: " << kBatch
    << "\n  num_workers: 1\n  flip: false\n"
    // NCHW, the float32 reference's layout: its distance from float64 is the rounding floor
    // of the same summation order (channels-last changes the order of BatchNorm's sums; the
    // default layout is checked against NCHW in BackboneForward.*ChannelsLast*).
    << "model:\n  backbone: mbf\n  channels_last: false\n  embedding_size: " << kEmbedding << "\n  sync_bn: " << (c.sync_bn ? "true" : "false")
    << "\nloss:\n  margin: [" << c.margin[0] << ", " << c.margin[1] << ", " << c.margin[2] << "]\n  margin_mode: " << c.mode
    << "\n  scale: 64\n  interclass_filtering_threshold: " << c.filter << "\n  sample_rate: " << c.sample_rate
    << "\noptim:\n  optimizer: sgd\n  lr: " << kLr << "\n  momentum: 0.9\n  weight_decay: " << kWeightDecay
    << "\n  total_steps: " << kTotalSteps << "\n  warmup_steps: 0\n  grad_clip: 5.0\n  fc_update: " << c.fc_update
    << "\ntrain:\n  precision: fp32\n  verify_every: 0\n  tensorboard: false\n"
    << "dist:\n  device: cpu\n";
  return y.str();
}

// The global batch of step k (the same on every rank; rank r trains on rows [rB, (r+1)B)).
std::pair<at::Tensor, at::Tensor> global_batch(int64_t k, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7000 + k);
  at::Tensor images = at::randn({world * kBatch, 3, 112, 112}, gen);
  at::Tensor labels = at::randint(0, kClasses, {world * kBatch}, gen, torch::kLong);
  return {images, labels};
}

StateDict prefixed(const StateDict& sd, const std::string& prefix) {
  StateDict out;
  for (const auto& kv : sd) out.emplace_back(prefix + kv.first, kv.second.detach().clone());
  return out;
}

// One case on this rank: initial state and batches (rank 0), then kSteps steps with the
// rank's state after steps 1 and kSteps.
void run_case(Distributed& d, const ParityCase& c, const std::string& dir) {
  const int W = d.world_size(), r = d.rank();
  const std::string cdir = dir + "/" + c.name;
  if (r == 0) std::filesystem::create_directories(cdir);
  d.barrier();
  Config cfg = load_config_text(yaml_of(c, cdir + "/out"), c.name + ".yaml");
  TrainJob job = build_train_job(cfg, std::shared_ptr<Distributed>(&d, [](Distributed*) {}));
  job.backbone->train();
  if (!c.fresh) randomise_norms(*job.backbone);

  at::Tensor fc_init = d.all_gather(job.fc->weight().detach().clone());
  if (r == 0) {
    write_state_dict(job.backbone->state_dict(), cdir + "/init_backbone.pt");
    write_state_dict({{"weight", fc_init}}, cdir + "/init_fc.pt");
    StateDict batches;
    for (int64_t k = 0; k < kSteps; ++k) {
      auto [images, labels] = global_batch(k, W);
      batches.emplace_back("images." + std::to_string(k), images);
      batches.emplace_back("labels." + std::to_string(k), labels);
    }
    write_state_dict(batches, cdir + "/batches.pt");
  }

  TrainStep step(job);
  TrainState state(job);
  StateDict samples;
  for (int64_t k = 0; k < kSteps; ++k) {
    auto [images, labels] = global_batch(k, W);
    BatchSource next = [&, images = images, labels = labels] {
      Batch b;
      b.images = images.narrow(0, r * kBatch, kBatch).contiguous();
      b.labels = labels.narrow(0, r * kBatch, kBatch).contiguous();
      return b;
    };
    StepResult res = step.run(next, k);
    if (job.fc->samples())
      samples.emplace_back("sample." + std::to_string(k), job.fc->sampled_index() + job.fc->shard().start);
    if (k == 0 || k == kSteps - 1) {
      StateDict dump = prefixed(job.backbone->state_dict(), "bb.");
      dump.emplace_back("loss", res.loss.detach().clone());
      dump.emplace_back("fc.weight", job.fc->weight().detach().clone());
      for (auto& kv : samples) dump.push_back(kv);
      write_state_dict(dump, cdir + "/rank" + std::to_string(r) + "_step" + std::to_string(k + 1) + ".pt");
    }
    if (c.checkpoint && k == 0) {
      CheckpointManager checkpoints(cdir + "/checkpoints", d, 3);
      state.progress().step = 1;
      state.save(checkpoints);
    }
  }
}

const char* kStepReferencePy = R"PY(
# arcface_torch's training step (train_v2.py: PartialFC_V2, CombinedMarginLoss, SGD) for W
# ranks simulated in one process, from plain torch ops. For every case it writes
# ref64_step<k>.pt (float64) and ref32_step<k>.pt (float32) after steps 1 and 3.
import json, math, os, sys
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_backbones as rb

torch.set_num_threads(1)
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


class StepOps(rb.Ops):
    """BatchNorm as torch.nn.BatchNorm2d/1d computes it in training, by hand: normalise with
    the biased batch variance; running_mean/var <- 0.9 * old + 0.1 * (mean, unbiased var)."""
    def bn(self, n, x, eps=1e-5):
        sd = self.sd
        dims = [0] + list(range(2, x.dim()))
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        if self.training:
            count = x.numel() // x.shape[1]
            mean = x.mean(dims)
            var = ((x - mean.view(shape)) ** 2).mean(dims)
            with torch.no_grad():
                sd[n + ".running_mean"].mul_(0.9).add_(0.1 * mean)
                sd[n + ".running_var"].mul_(0.9).add_(0.1 * var * count / (count - 1))
                sd[n + ".num_batches_tracked"].add_(1)
        else:
            mean, var = sd[n + ".running_mean"], sd[n + ".running_var"]
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + eps)
        return y * sd[n + ".weight"].view(shape) + sd[n + ".bias"].view(shape)


def embed(params, bufs, images):
    return rb.mbf_forward(StepOps(dict(params, **bufs), True), rb.MBF["mbf"][0], images)


def margin_logits(c, y, case):
    """CombinedMarginLoss on cosines c [N, S] (clamped to [-1, 1] as PartialFC_V2 does), the
    target column of row i being y[i]; returns s * logits."""
    m1, m2, m3 = case["margin"]
    onehot = F.one_hot(y, c.shape[1]).bool()
    if case["filter"] > 0:  # inter-class filtering: non-target cosines above it become 0
        with torch.no_grad():
            keep = ~((c > case["filter"]) & ~onehot)
        c = c * keep
    if case["mode"] == "arcface_torch":
        if m3 > 0:  # its CosFace branch, whatever m1 and m2 say
            out = c - m3 * onehot
        else:  # m1 == 1: arccos, + m2 on the target, cos, all under no_grad: straight-through
            with torch.no_grad():
                theta = c.acos()
                theta.scatter_(1, y[:, None], theta.gather(1, y[:, None]) + m2)
                delta = theta.cos() - c
            out = c + delta
    else:  # exact: s * (cos(m1 theta + m2) - m3), linear beyond theta_max, exact gradient
        tc = c.gather(1, y[:, None])[:, 0]
        theta = tc.clamp(-1 + 1e-7, 1 - 1e-7).acos()
        t = torch.cos(m1 * theta + m2) - m3
        tmax = (math.pi - m2) / m1
        if tmax < math.pi:
            t = torch.where(theta <= tmax, t, tc - math.cos(tmax) - 1 - m3)
        out = torch.where(onehot, t[:, None], c)
    return out * 64.0


def sgd(p, g, buf, lr, wd):
    """torch.optim.SGD(momentum=0.9, weight_decay=wd): the first step's buffer is d itself."""
    d = g + wd * p
    buf = d.clone() if buf is None else buf.mul_(0.9).add_(d)
    return p - lr * buf, buf


def load(path, dtype):
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in torch.load(path).items()}


def run_case(d, case, world, dtype, tag=None):
    """The case's steps; writes ref<tag>_step<k>.pt after steps 1 and the last (tag=None:
    nothing); returns the state after the last step."""
    init = load(d + "/init_backbone.pt", dtype)
    fc = load(d + "/init_fc.pt", dtype)["weight"].clone()
    batches = load(d + "/batches.pt", dtype)
    dumps = {r: torch.load("%s/rank%d_step%d.pt" % (d, r, case["steps"])) for r in range(world)}
    params = {k: v.clone() for k, v in init.items() if not k.endswith(BUFFERS)}
    bufs = [{k: v.clone() for k, v in init.items() if k.endswith(BUFFERS)} for _ in range(world)]
    mom, fc_mom = {}, None
    classes = fc.shape[0]
    for step in range(case["steps"]):
        lr = case["lr"] * (1 - step / case["total_steps"])  # polynomial decay, power 1, no warm-up
        images, labels = batches["images.%d" % step], batches["labels.%d" % step]
        b = images.shape[0] // world
        leaf = {k: v.clone().requires_grad_() for k, v in params.items()}
        if case["sync_bn"]:  # SyncBatchNorm: BatchNorm over the concatenated batch, on every rank
            emb_all = embed(leaf, bufs[0], images)
            bufs = [dict((k, v.clone()) for k, v in bufs[0].items()) for _ in range(world)]
            embs = [emb_all[r * b:(r + 1) * b] for r in range(world)]
        else:  # each rank normalises over its own images (arcface_torch: broadcast_buffers=False)
            embs = [embed(leaf, bufs[r], images[r * b:(r + 1) * b]) for r in range(world)]
        # PartialFC_V2: all-gather of embeddings and labels, each rank's (sampled) centres.
        E = torch.cat(embs).detach().requires_grad_()
        Wt = fc.clone().requires_grad_()
        if case["sample_rate"] < 1:
            cols = torch.cat([dumps[r]["sample.%d" % step] for r in range(world)])
        else:
            cols = torch.arange(classes)
        y = torch.searchsorted(cols, labels)
        cos = F.linear(F.normalize(E), F.normalize(Wt[cols])).clamp(-1, 1)
        z = margin_logits(cos, y, case)
        F.cross_entropy(z, y).backward()  # DistCrossEntropy's gradient: (softmax - onehot) / N
        with torch.no_grad():  # DistCrossEntropy's value: -mean(log(max(p_target, 1e-30)))
            if case["mode"] == "arcface_torch":
                p = (z - z.max(1, keepdim=True)[0]).exp()
                p = p / p.sum(1, keepdim=True)
                loss = -p.gather(1, y[:, None]).clamp_min(1e-30).log().mean()
            else:
                loss = F.cross_entropy(z, y)
        # Backbone gradient: each rank back-propagates W x (its rows of dL/dE) (AllGather's
        # backward) and DDP averages. SyncBN couples the ranks' graphs: its gradient is the
        # whole graph's, which that same scaling yields.
        names = list(leaf)
        if case["sync_bn"]:
            grads = torch.autograd.grad(torch.cat(embs), [leaf[n] for n in names], E.grad)
        else:
            per_rank = [torch.autograd.grad(embs[r], [leaf[n] for n in names], world * E.grad[r * b:(r + 1) * b],
                                            retain_graph=True) for r in range(world)]
            grads = [sum(g[i] for g in per_rank) / world for i in range(len(names))]
        total = torch.norm(torch.stack([g.norm() for g in grads]))
        coef = min(1.0, 5.0 / (total.item() + 1e-6))  # clip_grad_norm_(backbone.parameters(), 5)
        with torch.no_grad():
            for n, g in zip(names, grads):
                params[n], mom[n] = sgd(params[n], g * coef, mom.get(n), lr, case["wd"])
            if case["fc_update"] == "all":  # one optimiser over the whole weight: every row moves
                fc, fc_mom = sgd(fc, Wt.grad, fc_mom, lr, case["wd"])
            else:  # only the rows that took part, with their own momentum
                if fc_mom is None:
                    fc_mom = torch.zeros_like(fc)
                rows, m = sgd(fc[cols], Wt.grad[cols], fc_mom[cols], lr, case["wd"])
                fc[cols], fc_mom[cols] = rows, m
        if tag and step + 1 in (1, case["steps"]):
            out = {"loss": loss.detach(), "fc.weight": fc.clone()}
            for r in range(world):
                for k, v in params.items():
                    out["r%d.bb.%s" % (r, k)] = v.clone()
                for k, v in bufs[r].items():
                    out["r%d.bb.%s" % (r, k)] = v.clone()
            torch.save(out, "%s/ref%s_step%d.pt" % (d, tag, step + 1))
    return init, params, bufs


def analyse(d, case, world):
    """What a 2-rank comparison sees if it models the global batch as one (BatchNorm over
    the concatenated batch, as one process holding it computes): the running statistics and
    the first backbone update against the per-rank step. Saves those statistics."""
    one = dict(case, steps=1)
    init, params, bufs = run_case(d, one, world, torch.float64)
    _, g_params, g_bufs = run_case(d, dict(one, sync_bn=True), world, torch.float64)
    torch.save({"global.bb." + k: v.float() for k, v in g_bufs[0].items()}, d + "/global_stats.pt")
    num = den = 0.0
    per = []
    for k, p0 in init.items():
        if k.endswith(BUFFERS):
            continue
        u, ug = params[k] - p0, g_params[k] - p0
        num += float(((u - ug) ** 2).sum())
        den += float((u ** 2).sum())
        per.append((float((u - ug).norm() / u.norm().clamp_min(1e-300)), k))
    per.sort(reverse=True)
    print("analysis: first backbone update with per-rank BatchNorm against BatchNorm over the concatenated "
          "batch: relative difference %.3g; largest per tensor: %s" % (math.sqrt(num / den),
          ", ".join("%s %.3g" % (k, e) for e, k in per[:3])))


if __name__ == "__main__":
    d, world = sys.argv[1], int(sys.argv[2])
    for case in json.load(open(d + "/cases.json")):
        cdir = d + "/" + case["name"]
        run_case(cdir, case, world, torch.float64, "64")
        run_case(cdir, case, world, torch.float32, "32")
        if case["analysis"]:
            analyse(cdir, case, world)
)PY";

std::string cases_json(const std::vector<ParityCase>& cases) {
  std::ostringstream j;
  j << "[";
  for (size_t i = 0; i < cases.size(); ++i) {
    const ParityCase& c = cases[i];
    j << (i ? ", " : "") << "{\"name\": \"" << c.name << "\", \"margin\": [" << c.margin[0] << ", " << c.margin[1]
      << ", " << c.margin[2] << "], \"mode\": \"" << c.mode << "\", \"filter\": " << c.filter
      << ", \"sample_rate\": " << c.sample_rate << ", \"fc_update\": \"" << c.fc_update
      << "\", \"sync_bn\": " << (c.sync_bn ? "true" : "false") << ", \"analysis\": " << (c.checkpoint ? "true" : "false")
      << ", \"steps\": " << kSteps << ", \"total_steps\": " << kTotalSteps << ", \"lr\": " << kLr
      << ", \"wd\": " << kWeightDecay << "}";
  }
  j << "]";
  return j.str();
}

at::Tensor find(const StateDict& sd, const std::string& name) {
  for (const auto& kv : sd)
    if (kv.first == name) return kv.second;
  ADD_FAILURE() << "no entry '" << name << "'";
  return torch::zeros({1});
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Quantities against the float64 reference. Each is within `base` (1e-5 for values, 1e-4 for
// updates), or, where float32 itself cannot get that close, within kFloorFactor times the
// float32 floor: the float32 reference's distance from the float64 one for that quantity,
// or the median of those distances over the quantities checked together if larger (one
// float32 sample of a rounding error says little about the next one); the median applies
// only to quantities whose own floor is not zero, and no widened tolerance exceeds `cap`.
// Entries whose exact value is zero (float64's largest magnitude under kExactZero: the
// biases and running means described above) have no relative error worth the name: their
// values must stay under an absolute bound instead (kZeroAbs, float32's rounding noise there
// is about 1e-8). run() reports how many quantities it widened; the callers bound that count.
constexpr double kExactZero = 1e-12, kZeroAbs = 1e-6;
struct Check {
  Check(std::string k, double cap_) : kind(std::move(k)), cap(cap_) {}
  std::string kind;  // "value" or "update"
  double cap;
  struct Item {
    std::string what;
    double error, floor, base, got_abs, ref_abs;
    bool zero() const { return ref_abs <= kExactZero; }
  };
  std::vector<Item> items;
  double worst = 0, worst_floor = 0, worst_tol = 0;
  std::string worst_name;
  int floored = 0, zeros = 0;
  std::vector<double> tolerances;  // in force, per item (the absolute bound for exact zeros)

  void add(const std::string& what, const at::Tensor& got, const at::Tensor& ref32, const at::Tensor& ref64,
           double base) {
    items.push_back({what, testing::relative_error(got, ref64), testing::relative_error(ref32, ref64), base,
                     got.abs().max().item<double>(), ref64.abs().max().item<double>()});
  }
  void run() {
    std::vector<double> floors;
    for (const auto& it : items)
      if (!it.zero() && it.floor > 0) floors.push_back(it.floor);
    std::nth_element(floors.begin(), floors.begin() + floors.size() / 2, floors.end());
    const double median = floors.empty() ? 0.0 : floors[floors.size() / 2];
    for (const auto& it : items) {
      if (it.zero()) {
        zeros++;
        tolerances.push_back(kZeroAbs);
        EXPECT_LE(it.got_abs, kZeroAbs) << kind << " of " << it.what << ": exactly zero in float64, "
                                        << it.got_abs << " here";
        continue;
      }
      const double floor = it.floor > 0 ? std::max(it.floor, median) : 0.0;
      const double tol = std::max(it.base, std::min(cap, kFloorFactor * floor));
      tolerances.push_back(tol);
      EXPECT_LE(it.error, tol) << kind << " of " << it.what << " (float32 reference: " << it.floor << ", median "
                               << median << ", cap " << cap << ")";
      if (tol > it.base) floored++, floored_names.push_back(it.what);
      if (it.error > worst) worst = it.error, worst_name = it.what, worst_floor = floor, worst_tol = tol;
    }
  }
  std::vector<std::string> floored_names;
  int count() const { return static_cast<int>(items.size()); }
};

// The tolerances in force for one case after step 1 (the negative control below is measured
// against them).
struct InForce {
  double backbone_update = 0, classifier_update = 0;
};

// At most this fraction of the backbone's values may take a widened tolerance (measured: up
// to 17%, the fresh network on 2 ranks after step 3; see the [parity] lines). Its updates all
// do: float32 itself cannot reach 1e-4 there (MobileFaceNet's backward, above), and their
// widened tolerances are capped at kUpdateCap.
constexpr double kMaxWidenedValues = 0.25;

// The values and updates of one checkpointed step: loss, every backbone entry of every rank
// (values; updates of the parameters), the classifier rows (values and updates, a check of
// their own, so that the backbone's floors do not widen theirs).
InForce compare_case(const ParityCase& c, const std::string& dir, int world) {
  InForce in_force;
  const StateDict init = read_state_dict(dir + "/init_backbone.pt");
  const at::Tensor fc_init = find(read_state_dict(dir + "/init_fc.pt"), "weight");
  for (int64_t k : {int64_t{1}, kSteps}) {
    SCOPED_TRACE(c.name + " after step " + std::to_string(k) + " on " + std::to_string(world) + " rank(s)");
    const std::string step = "_step" + std::to_string(k) + ".pt";
    const StateDict r64 = read_state_dict(dir + "/ref64" + step), r32 = read_state_dict(dir + "/ref32" + step);
    Check values{"value", kValueCap}, updates{"update", kUpdateCap}, loss_check{"value", kValueCap};
    std::vector<at::Tensor> shards;
    double loss = 0;
    for (int r = 0; r < world; ++r) {
      const StateDict got = read_state_dict(dir + "/rank" + std::to_string(r) + step);
      shards.push_back(find(got, "fc.weight"));
      loss = find(got, "loss").item<double>();
      loss_check.add("loss", find(got, "loss"), find(r32, "loss"), find(r64, "loss"), kValueTolerance);
      int entries = 0;
      for (const auto& [name, value] : got) {
        if (name.rfind("bb.", 0) != 0) continue;
        entries++;
        const std::string key = "r" + std::to_string(r) + "." + name;
        const at::Tensor v32 = find(r32, key), v64 = find(r64, key);
        if (ends_with(name, "num_batches_tracked")) {
          EXPECT_EQ(value.item<int64_t>(), v64.item<int64_t>()) << name;
          continue;
        }
        const std::string what = "rank " + std::to_string(r) + " " + name.substr(3);
        if (ends_with(name, "running_mean") || ends_with(name, "running_var")) {
          values.add(what, value, v32, v64, kValueTolerance);
          continue;
        }
        const at::Tensor v0 = find(init, name.substr(3));
        // A parameter that starts at zero (the BatchNorm biases) is its update: a value made of
        // a few small updates has float32's relative rounding of an update, checked as one.
        if (v0.abs().max().item<double>() > 0) values.add(what, value, v32, v64, kValueTolerance);
        updates.add(what, value - v0, v32 - v0, v64 - v0, kUpdateTolerance);
      }
      EXPECT_GT(entries, 100);
    }
    // The backbone's update as a whole (rank 0; the parameters are the same on every rank).
    {
      const StateDict got = read_state_dict(dir + "/rank0" + step);
      std::vector<at::Tensor> g, a, b;
      for (const auto& [name, v0] : init) {
        if (ends_with(name, "running_mean") || ends_with(name, "running_var") || ends_with(name, "num_batches_tracked"))
          continue;
        g.push_back((find(got, "bb." + name) - v0).reshape({-1}));
        a.push_back((find(r32, "r0.bb." + name) - v0).reshape({-1}));
        b.push_back((find(r64, "r0.bb." + name) - v0).reshape({-1}));
      }
      Check whole{"update", kUpdateCap};
      whole.add("the whole backbone", torch::cat(g), torch::cat(a), torch::cat(b), kUpdateTolerance);
      whole.run();
      if (k == 1) in_force.backbone_update = whole.tolerances[0];
      std::printf("[parity] %-20s W=%d step %lld: backbone update as a whole %.1e from the float64 reference "
                  "(float32 reference %.1e, tolerance in force %.1e)\n", c.name.c_str(), world,
                  static_cast<long long>(k), whole.items[0].error, whole.items[0].floor, whole.tolerances[0]);
    }
    const at::Tensor fc = torch::cat(shards);
    Check fc_values{"value", kValueCap}, fc_updates{"update", kUpdateCap};
    fc_values.add("classifier rows", fc, find(r32, "fc.weight"), find(r64, "fc.weight"), kValueTolerance);
    fc_updates.add("classifier rows", fc - fc_init, find(r32, "fc.weight") - fc_init, find(r64, "fc.weight") - fc_init,
                   kUpdateTolerance);
    for (Check* ch : {&loss_check, &values, &updates, &fc_values, &fc_updates}) ch->run();
    if (k == 1) in_force.classifier_update = fc_updates.tolerances[0];
    EXPECT_LE(values.floored, kMaxWidenedValues * (values.count() - values.zeros))
        << values.floored << " of " << values.count() - values.zeros << " backbone values took a widened tolerance";
    std::printf("[parity] %-20s W=%d step %lld: loss %.6f (float64 reference %.6f, error %.1e); values: worst %.1e "
                "(%s, tolerance %.1e), %d of %d widened, %d exactly zero; updates: worst %.1e (%s, float32 floor %.1e, "
                "tolerance %.1e), %d of %d widened, %d exactly zero; classifier rows: value %.1e (tolerance %.1e), "
                "update %.1e (float32 %.1e, tolerance %.1e)\n",
                c.name.c_str(), world, static_cast<long long>(k), loss, find(r64, "loss").item<double>(),
                loss_check.worst, values.worst, values.worst_name.c_str(), values.worst_tol, values.floored,
                values.count(), values.zeros, updates.worst, updates.worst_name.c_str(), updates.worst_floor,
                updates.worst_tol, updates.floored, updates.count(), updates.zeros, fc_values.items[0].error,
                fc_values.tolerances[0], fc_updates.items[0].error, fc_updates.items[0].floor, fc_updates.tolerances[0]);
  }
  return in_force;
}

// The difference between the margin modes: faceshard's update in one case against the
// float64 reference of the other (same initial state and batches).
std::pair<double, double> update_difference(const std::string& got_dir, const std::string& ref_dir) {
  const StateDict init = read_state_dict(got_dir + "/init_backbone.pt");
  const StateDict got = read_state_dict(got_dir + "/rank0_step1.pt"), ref = read_state_dict(ref_dir + "/ref64_step1.pt");
  double num = 0, den = 0;
  for (const auto& [name, v0] : init) {
    if (ends_with(name, "running_mean") || ends_with(name, "running_var") || ends_with(name, "num_batches_tracked"))
      continue;
    const at::Tensor a = (find(got, "bb." + name) - v0).to(torch::kDouble), b = (find(ref, "r0.bb." + name) - v0).to(torch::kDouble);
    num += (a - b).pow(2).sum().item<double>();
    den += b.pow(2).sum().item<double>();
  }
  const at::Tensor fc0 = find(read_state_dict(got_dir + "/init_fc.pt"), "weight");
  return {std::sqrt(num / den), testing::relative_error(find(got, "fc.weight") - fc0, find(ref, "fc.weight") - fc0)};
}

// The checkpoint after step 1 of a fresh network (what faceshard-train writes: rank 0's
// backbone). Its running statistics are rank 0's (each rank normalises over its own images,
// as arcface_torch does with broadcast_buffers=False), not those of BatchNorm over the whole
// global batch. Where the exact value is zero (running means of BatchNorms fed by a linear
// map of normalised activations: their batch mean is exactly 0), the file holds rounding
// noise, of the same size as float32's, which any elementwise relative comparison with
// another implementation reports as a difference of order 1.
void compare_checkpoint(const std::string& dir) {
  const std::string step1 = dir + "/checkpoints/step_00000001/backbone.pt";
  ASSERT_TRUE(std::filesystem::exists(step1)) << step1;
  const StateDict ckpt = read_state_dict(step1), r64 = read_state_dict(dir + "/ref64_step1.pt"),
                  r32 = read_state_dict(dir + "/ref32_step1.pt"), global = read_state_dict(dir + "/global_stats.pt");
  double worst_rank0 = 0, largest_global = 0, largest_noise = 0, noise_vs_float32 = 0;
  int stats = 0, noise = 0;
  for (const auto& [name, value] : ckpt) {
    if (!ends_with(name, "running_mean") && !ends_with(name, "running_var")) continue;
    stats++;
    const at::Tensor v64 = find(r64, "r0.bb." + name);
    if (v64.abs().max().item<double>() < 1e-7) {  // exactly zero but for float64 rounding
      noise++;
      largest_noise = std::max(largest_noise, value.abs().max().item<double>());
      noise_vs_float32 = std::max(noise_vs_float32, testing::relative_error(value, find(r32, "r0.bb." + name)));
      continue;
    }
    const double e = testing::relative_error(value, v64);
    EXPECT_LE(e, kValueTolerance) << "checkpoint " << name << " is not rank 0's";
    worst_rank0 = std::max(worst_rank0, e);
    largest_global = std::max(largest_global, testing::relative_error(value, find(global, "global.bb." + name)));
  }
  EXPECT_GT(largest_global, 1e-2) << "rank 0's statistics equal the global batch's: this check cannot tell them apart";
  EXPECT_GT(noise, 0) << "the fresh network has no exactly-zero running means: the explanation above does not apply";
  EXPECT_LT(largest_noise, 1e-6) << "a running mean that is exactly zero holds more than rounding noise";
  std::printf("[parity] checkpoint after step 1: %d running statistics; %d are rank 0's to %.1e and up to %.3g away "
              "from BatchNorm over the concatenated batch; %d are exactly zero, stored as rounding noise up to %.1e "
              "(relative to the float32 reference's noise: %.2g)\n",
              stats, stats - noise, worst_rank0, largest_global, noise, largest_noise, noise_vs_float32);
}

void run_parity(int world, const std::vector<ParityCase>& cases) {
  // FS_PARITY_DIR keeps the files (initial state, dumps, references) for inspection.
  const char* keep = std::getenv("FS_PARITY_DIR");
  const std::string dir = keep && *keep ? std::string(keep) + "/W" + std::to_string(world)
                          : testing::in_rank_process() ? std::string(std::getenv("FS_PARITY_RUN_DIR"))
                                                        : testing::temp_dir("parity");
  if (!testing::in_rank_process()) std::filesystem::create_directories(dir);
  testing::RankOptions ro;
  ro.env.emplace_back("FS_PARITY_RUN_DIR", dir);
  testing::run_ranks(world, [&](Distributed& d) {
    for (const auto& c : cases) run_case(d, c, dir);
  }, ro);
  if (testing::in_rank_process() || ::testing::Test::HasFailure()) return;
  testing::write_text(dir + "/ref_backbones.py", testing::kBackboneReferencePy);
  testing::write_text(dir + "/cases.json", cases_json(cases));
  auto py = testing::run_python(dir, "step_reference.py", kStepReferencePy, {dir, std::to_string(world)});
  ASSERT_EQ(py.status, 0) << py.output;
  std::printf("%s", py.output.c_str());
  std::map<std::string, InForce> in_force;
  for (const auto& c : cases) {
    in_force[c.name] = compare_case(c, dir + "/" + c.name, world);
    if (c.checkpoint) compare_checkpoint(dir + "/" + c.name);
  }
  // The test tells the margin modes apart: arcface_torch's first update is far outside the
  // tolerances in force for the exact mode's (same initial state and batches).
  auto named = [&](const std::string& n) {
    return std::any_of(cases.begin(), cases.end(), [&](const ParityCase& c) { return c.name == n && !c.fresh; });
  };
  if (named("arcface_exact") && named("arcface_torch")) {
    auto [backbone, classifier] = update_difference(dir + "/arcface_torch", dir + "/arcface_exact");
    const InForce& tol = in_force["arcface_exact"];
    EXPECT_GT(backbone, 3 * tol.backbone_update);
    EXPECT_GT(classifier, 3 * tol.classifier_update);
    std::printf("[parity] first update, arcface_torch mode against exact: backbone %.3g (tolerance in force %.1e), "
                "classifier %.3g (%.1e) relative\n", backbone, tol.backbone_update, classifier, tol.classifier_update);
  }
}

const std::vector<double> kArcFace{1.0, 0.5, 0.0}, kCosFace{1.0, 0.0, 0.4};

// ArcFace in both modes, CosFace with inter-class filtering, combined margins (arcface_torch:
// m3 alone), and a sampled Partial FC with both classifier updates: every row, as
// PartialFC_V2's dense optimiser, and faceshard's default, only the sampled rows (the
// reference then does the same).
TEST(TrainParity, OneRankMatchesArcfaceTorchStep) {
  run_parity(1, {
                    {"arcface_exact", kArcFace, "exact"},
                    {"arcface_torch", kArcFace, "arcface_torch"},
                    {"cosface_filter", kCosFace, "arcface_torch", 0.2},
                    {"pfc_combined_all_rows", {1.0, 0.3, 0.2}, "arcface_torch", 0.0, 0.5, "all"},
                    {"pfc_sampled_rows", kCosFace, "exact", 0.0, 0.5, "sampled"},
                });
}

// Per-rank BatchNorm (and the checkpoint of a fresh network: rank 0's statistics, noise where
// they are exactly zero), SyncBatchNorm against BatchNorm over the concatenated batch, and
// sampling on two shards.
TEST(TrainParity, TwoRanksMatchArcfaceTorchStep) {
  ParityCase fresh{"arcface_torch_fresh", kArcFace, "arcface_torch"};
  fresh.checkpoint = fresh.fresh = true;
  ParityCase sync{"arcface_exact_syncbn", kArcFace, "exact"};
  sync.sync_bn = true;
  run_parity(2, {
                    fresh,
                    sync,
                    {"cosface_pfc_all_rows", kCosFace, "exact", 0.0, 0.5, "all"},
                });
}

}  // namespace
}  // namespace faceshard
