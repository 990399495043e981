// The backbone's optimisation pieces against independent references: LibTorch's own
// torch::optim::SGD / AdamW and torch::nn::utils::clip_grad_norm_, plain tensor math for
// the norm and the loss scaler, and hand-computed values of the LR schedule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "app/train/backbone_optimizer.h"
#include "app/train/fault_injection.h"
#include "app/train/grad_clip.h"
#include "app/train/loss_scaler.h"
#include "app/train/lr_schedule.h"
#include "base/error.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no faceshard::Error>";
}

// --- LR schedule -----------------------------------------------------------------------

TEST(LrSchedule, WarmupThenLinearDecayByHand) {
  PolyWarmupSchedule s{0.1, 4, 12, 1.0};
  // Warm-up: 0.1 * (t + 1) / 4.
  EXPECT_DOUBLE_EQ(s.lr(0), 0.025);
  EXPECT_DOUBLE_EQ(s.lr(1), 0.05);
  EXPECT_DOUBLE_EQ(s.lr(3), 0.1);
  // Decay over T - w = 8 steps: 0.1 * (1 - (t - 4) / 8).
  EXPECT_DOUBLE_EQ(s.lr(4), 0.1);
  EXPECT_DOUBLE_EQ(s.lr(6), 0.075);
  EXPECT_DOUBLE_EQ(s.lr(8), 0.05);
  EXPECT_DOUBLE_EQ(s.lr(11), 0.0125);
  EXPECT_EQ(s.lr(12), 0.0);
  EXPECT_EQ(s.lr(1000), 0.0);
}

TEST(LrSchedule, PowerTwo) {
  PolyWarmupSchedule s{0.2, 2, 10, 2.0};
  EXPECT_DOUBLE_EQ(s.lr(0), 0.1);
  EXPECT_DOUBLE_EQ(s.lr(2), 0.2);
  EXPECT_DOUBLE_EQ(s.lr(6), 0.2 * 0.25);      // (1 - 4/8)^2
  EXPECT_DOUBLE_EQ(s.lr(9), 0.2 / 64.0);      // (1 - 7/8)^2
  EXPECT_EQ(s.lr(10), 0.0);
}

TEST(LrSchedule, NoWarmupStartsAtBase) {
  PolyWarmupSchedule s{1.0, 0, 5, 1.0};
  EXPECT_DOUBLE_EQ(s.lr(0), 1.0);
  EXPECT_DOUBLE_EQ(s.lr(1), 0.8);
  EXPECT_DOUBLE_EQ(s.lr(4), 0.2);
  EXPECT_EQ(s.lr(5), 0.0);
}

TEST(LrSchedule, WarmupRisesDecayFallsNeverAboveBase) {
  PolyWarmupSchedule s{0.1, 37, 500, 1.0};
  double prev = 0;
  for (int64_t t = 0; t < 600; ++t) {
    const double v = s.lr(t);
    EXPECT_LE(v, 0.1 + 1e-15) << "t=" << t;
    EXPECT_GE(v, 0.0) << "t=" << t;
    if (t < 37) {
      EXPECT_GT(v, prev) << "t=" << t;
    } else if (t > 37) {
      EXPECT_LE(v, prev) << "t=" << t;
    }
    if (t < 500) {
      EXPECT_GT(v, 0.0) << "t=" << t;
    } else {
      EXPECT_EQ(v, 0.0) << "t=" << t;
    }
    prev = v;
  }
}

TEST(LrSchedule, WarmupAsLongAsTheRun) {
  PolyWarmupSchedule s{0.4, 4, 4, 1.0};
  EXPECT_DOUBLE_EQ(s.lr(0), 0.1);
  EXPECT_DOUBLE_EQ(s.lr(3), 0.4);
  EXPECT_EQ(s.lr(4), 0.0);
}

TEST(LrSchedule, BadFieldsAreNamed) {
  EXPECT_NE(what_of([] { PolyWarmupSchedule{0.1, 10, 5, 1.0}.lr(0); }).find("warmup_steps"), std::string::npos);
  EXPECT_NE(what_of([] { PolyWarmupSchedule{0.1, 0, 0, 1.0}.lr(0); }).find("total_steps"), std::string::npos);
  EXPECT_NE(what_of([] { PolyWarmupSchedule{-1, 0, 5, 1.0}.lr(0); }).find("base_lr"), std::string::npos);
  EXPECT_NE(what_of([] { PolyWarmupSchedule{0.1, 0, 5, 0.0}.lr(0); }).find("power"), std::string::npos);
  EXPECT_NE(what_of([] { PolyWarmupSchedule{0.1, 0, 5, 1.0}.lr(-1); }).find("step"), std::string::npos);
}

// --- BackboneOptimizer vs torch::optim --------------------------------------------------

// A small "model": a conv weight, a BN-like scale and bias, a linear weight and bias.
std::vector<at::Tensor> make_params(uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<at::Tensor> ps = {torch::randn({8, 3, 3, 3}), torch::rand({8}) + 0.5, torch::randn({8}) * 0.1,
                                torch::randn({16, 8}) * 0.3, torch::zeros({16})};
  for (auto& p : ps) p.requires_grad_(true);
  return ps;
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// The gradients of step s; param 2 gets none at step 2 (an unused param must be skipped
// and its state must not advance), and gradients vary in scale across params and steps.
std::vector<at::Tensor> grads_of_step(const std::vector<at::Tensor>& ps, int s) {
  torch::manual_seed(1000 + s);
  std::vector<at::Tensor> gs;
  for (size_t i = 0; i < ps.size(); ++i) {
    at::Tensor g = torch::randn(ps[i].sizes()) * (0.1 * (i + 1)) * (1.0 + 0.5 * s);
    gs.push_back(i == 2 && s == 2 ? at::Tensor() : g);
  }
  return gs;
}

void set_grads(std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& gs) {
  for (size_t i = 0; i < ps.size(); ++i) {
    if (gs[i].defined()) {
      ps[i].mutable_grad() = gs[i].clone();
    } else {
      ps[i].mutable_grad().reset();
    }
  }
}

double lr_of_step(int s) { return 0.05 * (s + 1) / 3.0; }  // varies per step

template <typename TorchOpt, typename SetLr>
void compare_with_torch(const BackboneOptimizerOptions& opts, TorchOpt make_ref, SetLr set_lr) {
  std::vector<at::Tensor> mine = make_params(7), ref = clone_params(mine);
  BackboneOptimizer opt(mine, opts);
  auto ref_opt = make_ref(ref);
  for (int s = 0; s < 5; ++s) {
    const auto gs = grads_of_step(mine, s);
    set_grads(mine, gs);
    set_grads(ref, gs);
    opt.step(lr_of_step(s));
    set_lr(*ref_opt, lr_of_step(s));
    ref_opt->step();
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_LT(testing::relative_error(mine[i], ref[i]), 1e-6) << "step " << s << " param " << i;
      EXPECT_TRUE(torch::allclose(mine[i], ref[i], 1e-6, 1e-7)) << "step " << s << " param " << i;
    }
    opt.zero_grad();
    for (auto& p : mine) EXPECT_FALSE(p.grad().defined());
  }
  // The parameters moved (the comparison is not between two unchanged copies).
  const auto start = make_params(7);
  for (size_t i = 0; i < mine.size(); ++i) EXPECT_GT(testing::relative_error(mine[i], start[i]), 1e-3) << "param " << i;
}

TEST(AppOptim, SgdMatchesTorchSgd) {
  BackboneOptimizerOptions o;
  o.kind = "sgd";
  o.momentum = 0.9;
  o.weight_decay = 5e-4;
  compare_with_torch(
      o,
      [](std::vector<at::Tensor>& ps) {
        return std::make_unique<torch::optim::SGD>(
            ps, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(5e-4).dampening(0).nesterov(false));
      },
      [](torch::optim::SGD& r, double lr) {
        static_cast<torch::optim::SGDOptions&>(r.param_groups()[0].options()).lr(lr);
      });
}

TEST(AppOptim, SgdWithoutMomentumOrDecayMatchesTorchSgd) {
  BackboneOptimizerOptions o;
  o.momentum = 0;
  o.weight_decay = 0;
  compare_with_torch(
      o, [](std::vector<at::Tensor>& ps) { return std::make_unique<torch::optim::SGD>(ps, torch::optim::SGDOptions(0.1)); },
      [](torch::optim::SGD& r, double lr) {
        static_cast<torch::optim::SGDOptions&>(r.param_groups()[0].options()).lr(lr);
      });
}

TEST(AppOptim, AdamWMatchesTorchAdamW) {
  BackboneOptimizerOptions o;
  o.kind = "adamw";
  o.weight_decay = 0.1;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  compare_with_torch(
      o,
      [](std::vector<at::Tensor>& ps) {
        return std::make_unique<torch::optim::AdamW>(
            ps, torch::optim::AdamWOptions(1e-3).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.1).amsgrad(false));
      },
      [](torch::optim::AdamW& r, double lr) {
        static_cast<torch::optim::AdamWOptions&>(r.param_groups()[0].options()).lr(lr);
      });
}

// Interrupting after k steps (state() copied as a checkpoint would, loaded into a fresh
// optimiser over copies of the params) and continuing gives bit-identical params and state.
void check_resume(const BackboneOptimizerOptions& opts) {
  std::vector<at::Tensor> a = make_params(11), b = clone_params(a);
  BackboneOptimizer opt_a(a, opts), opt_b(b, opts);
  for (int s = 0; s < 3; ++s) {
    const auto gs = grads_of_step(a, s);
    set_grads(a, gs);
    set_grads(b, gs);
    opt_a.step(lr_of_step(s));
    opt_b.step(lr_of_step(s));
    opt_a.zero_grad();
    opt_b.zero_grad();
  }
  std::vector<std::pair<std::string, at::Tensor>> saved;
  for (const auto& kv : opt_b.state()) saved.emplace_back(kv.first, kv.second.detach().clone());
  std::vector<at::Tensor> c = clone_params(b);
  BackboneOptimizer opt_c(c, opts);
  opt_c.load_state(saved, "ckpt");
  for (int s = 3; s < 6; ++s) {
    const auto gs = grads_of_step(a, s);
    set_grads(a, gs);
    set_grads(c, gs);
    opt_a.step(lr_of_step(s));
    opt_c.step(lr_of_step(s));
    opt_a.zero_grad();
    opt_c.zero_grad();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], c[i])) << "param " << i;
  const auto sa = opt_a.state(), sc = opt_c.state();
  ASSERT_EQ(sa.size(), sc.size());
  for (size_t k = 0; k < sa.size(); ++k) {
    EXPECT_EQ(sa[k].first, sc[k].first);
    EXPECT_TRUE(torch::equal(sa[k].second, sc[k].second)) << sa[k].first;
  }
}

TEST(AppOptim, SgdResumeIsBitIdentical) {
  BackboneOptimizerOptions o;
  check_resume(o);
}

TEST(AppOptim, AdamWResumeIsBitIdentical) {
  BackboneOptimizerOptions o;
  o.kind = "adamw";
  o.weight_decay = 0.05;
  check_resume(o);
}

// Steps 0..n-1 of grads_of_step (param 2 has no grad at step 2), lr 1e-3.
void take_steps(BackboneOptimizer& opt, std::vector<at::Tensor>& ps, int n) {
  for (int s = 0; s < n; ++s) {
    set_grads(ps, grads_of_step(ps, s));
    opt.step(1e-3);
  }
}

// --- the fused step over flat buffers against the per-parameter one ---------------------

// Gradients of step s with every one defined (over flat buffers a param always has one: a
// missing gradient there is zeros, so the per-parameter reference gets zeros too).
std::vector<at::Tensor> dense_grads_of_step(const std::vector<at::Tensor>& ps, int s) {
  std::vector<at::Tensor> gs = grads_of_step(ps, s);
  for (size_t i = 0; i < gs.size(); ++i)
    if (!gs[i].defined()) gs[i] = torch::zeros_like(ps[i]);
  return gs;
}

// The flat side's params: the same values, the conv weight channels-last (its layout must
// survive the move into the buffer and the state must follow it).
std::vector<at::Tensor> flat_side_params(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) {
    at::Tensor c = p.dim() == 4 ? p.detach().contiguous(at::MemoryFormat::ChannelsLast).clone(at::MemoryFormat::Preserve)
                                : p.detach().clone();
    out.push_back(c.requires_grad_(true));
  }
  return out;
}

void write_grads(const std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& gs) {
  at::NoGradGuard ng;
  for (size_t i = 0; i < ps.size(); ++i) ps[i].grad().copy_(gs[i]);  // into the flat views
}

void check_fused_matches_per_parameter(const BackboneOptimizerOptions& opts) {
  std::vector<at::Tensor> ref = make_params(21), mine = flat_side_params(ref);
  FlatParameters flat(mine, 0.0002);  // a few buckets
  ASSERT_GT(flat.buckets().size(), 1u);
  BackboneOptimizer fused(flat, opts), plain(ref, opts);
  const at::Tensor& buffer = flat.groups().at(0).values;
  for (size_t i = 0; i < mine.size(); ++i) {
    // The params live in the buffer, with their own layout, and their grads in the other.
    EXPECT_EQ(mine[i].storage().data_ptr().get(), buffer.storage().data_ptr().get()) << "param " << i;
    EXPECT_EQ(mine[i].grad().storage().data_ptr().get(), flat.groups()[0].grads.storage().data_ptr().get());
    EXPECT_TRUE(torch::equal(mine[i], ref[i])) << "param " << i;
  }
  EXPECT_TRUE(mine[0].is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_FALSE(mine[0].is_contiguous());
  for (int s = 0; s < 5; ++s) {
    const auto gs = dense_grads_of_step(ref, s);
    set_grads(ref, gs);
    write_grads(mine, gs);
    plain.step(lr_of_step(s));
    fused.step(lr_of_step(s));
    for (size_t i = 0; i < mine.size(); ++i)
      EXPECT_LT(testing::relative_error(mine[i], ref[i]), 1e-6) << "step " << s << " param " << i;
    fused.zero_grad();
    plain.zero_grad();
    for (auto& p : mine) EXPECT_EQ(p.grad().abs().max().item<float>(), 0.0f);
  }
  const auto sf = fused.state(), sp = plain.state();
  ASSERT_EQ(sf.size(), sp.size());
  for (size_t k = 0; k < sf.size(); ++k) {
    EXPECT_EQ(sf[k].first, sp[k].first);
    EXPECT_EQ(sf[k].second.sizes(), sp[k].second.sizes()) << sf[k].first;
    EXPECT_LT(testing::relative_error(sf[k].second.to(at::kDouble), sp[k].second.to(at::kDouble)), 1e-6) << sf[k].first;
  }
  // A checkpoint of either kind resumes in the other: three more steps stay together.
  std::vector<std::pair<std::string, at::Tensor>> from_fused, from_plain;
  for (const auto& kv : sf) from_fused.emplace_back(kv.first, kv.second.clone());
  for (const auto& kv : sp) from_plain.emplace_back(kv.first, kv.second.clone());
  // (The per-parameter side's params contiguous, as its gradients here are: its AdamW
  // kernel reads a param, its gradient and its state as laid out alike, which autograd's
  // gradients are.)
  std::vector<at::Tensor> ref2, mine2 = flat_side_params(ref);
  for (const auto& p : mine) ref2.push_back(p.detach().contiguous().clone().requires_grad_(true));
  FlatParameters flat2(mine2, 0.0002);
  BackboneOptimizer plain2(ref2, opts), fused2(flat2, opts);
  plain2.load_state(from_fused, "fused.pt");
  fused2.load_state(from_plain, "plain.pt");
  for (int s = 5; s < 8; ++s) {
    const auto gs = dense_grads_of_step(ref, s);
    set_grads(ref2, gs);
    write_grads(mine2, gs);
    plain2.step(lr_of_step(s));
    fused2.step(lr_of_step(s));
    for (size_t i = 0; i < mine.size(); ++i)
      EXPECT_LT(testing::relative_error(mine2[i], ref2[i]), 1e-6) << "resumed step " << s << " param " << i;
  }
  const auto start = make_params(21);
  for (size_t i = 0; i < mine2.size(); ++i) EXPECT_GT(testing::relative_error(mine2[i], start[i]), 1e-3) << "param " << i;
}

TEST(AppOptim, FusedFlatSgdMatchesPerParameterSgd) {
  BackboneOptimizerOptions o;
  check_fused_matches_per_parameter(o);
  o.momentum = 0;
  o.weight_decay = 0;
  check_fused_matches_per_parameter(o);
}

TEST(AppOptim, FusedFlatAdamWMatchesPerParameterAdamW) {
  BackboneOptimizerOptions o;
  o.kind = "adamw";
  o.weight_decay = 0.05;
  check_fused_matches_per_parameter(o);
}

TEST(AppOptim, FusedFlatAdamWNeedsOneStepCount) {
  // A per-parameter checkpoint whose params stepped unequally (one went unused) cannot be
  // held by one step count: one line naming the keys and the way out.
  BackboneOptimizerOptions o;
  o.kind = "adamw";
  std::vector<at::Tensor> ps = make_params(3);
  BackboneOptimizer plain(ps, o);
  take_steps(plain, ps, 3);
  std::vector<at::Tensor> mine = flat_side_params(ps);
  FlatParameters flat(mine, 25);
  BackboneOptimizer fused(flat, o);
  const std::string msg = what_of([&] { fused.load_state(plain.state(), "ck.pt"); });
  EXPECT_NE(msg.find("ck.pt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'step.2'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("optim.fused: false"), std::string::npos) << msg;
}

TEST(AppOptim, StateNamesAndUnusedParamStepCount) {
  BackboneOptimizerOptions o;
  o.kind = "adamw";
  std::vector<at::Tensor> ps = make_params(3);
  BackboneOptimizer opt(ps, o);
  take_steps(opt, ps, 4);
  std::map<std::string, at::Tensor> st;
  for (const auto& kv : opt.state()) st[kv.first] = kv.second;
  EXPECT_EQ(st.size(), 1 + 3 * ps.size());
  EXPECT_EQ(st.at("num_params").item<int64_t>(), 5);
  EXPECT_EQ(st.at("step.0").item<float>(), 4.0f);
  EXPECT_EQ(st.at("step.2").item<float>(), 3.0f);
  EXPECT_EQ(st.at("exp_avg.3").sizes(), ps[3].sizes());
}

TEST(AppOptim, LoadStateNamesTheBadKey) {
  BackboneOptimizerOptions sgd;
  std::vector<at::Tensor> ps = make_params(5);
  BackboneOptimizer opt(ps, sgd);
  set_grads(ps, grads_of_step(ps, 0));
  opt.step(0.1);
  auto good = opt.state();
  auto with = [&](const std::string& key, at::Tensor t) {
    auto s = good;
    s.emplace_back(key, t);
    return s;
  };
  auto msg = what_of([&] { opt.load_state(with("momentum.9", torch::zeros({8})), "ck.pt"); });
  EXPECT_NE(msg.find("momentum.9"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ck.pt"), std::string::npos) << msg;
  msg = what_of([&] { opt.load_state(with("exp_avg.0", torch::zeros({8, 3, 3, 3})), "ck.pt"); });
  EXPECT_NE(msg.find("exp_avg.0"), std::string::npos) << msg;
  msg = what_of([&] { opt.load_state(with("bogus", torch::zeros({1})), "ck.pt"); });
  EXPECT_NE(msg.find("bogus"), std::string::npos) << msg;
  auto wrong_shape = good;
  for (auto& kv : wrong_shape)
    if (kv.first == "momentum.3") kv.second = torch::zeros({8, 16});
  msg = what_of([&] { opt.load_state(wrong_shape, "ck.pt"); });
  EXPECT_NE(msg.find("momentum.3"), std::string::npos) << msg;
  auto wrong_count = good;
  wrong_count[0].second = torch::full({1}, 4, torch::kLong);
  msg = what_of([&] { opt.load_state(wrong_count, "ck.pt"); });
  EXPECT_NE(msg.find("num_params"), std::string::npos) << msg;
  // A failed load leaves the state as it was.
  const auto after = opt.state();
  ASSERT_EQ(after.size(), good.size());
  for (size_t k = 0; k < good.size(); ++k) EXPECT_TRUE(torch::equal(after[k].second, good[k].second));

  BackboneOptimizerOptions adamw;
  adamw.kind = "adamw";
  std::vector<at::Tensor> qs = make_params(5);
  BackboneOptimizer opt2(qs, adamw);
  set_grads(qs, grads_of_step(qs, 0));
  opt2.step(1e-3);
  auto partial = opt2.state();
  partial.erase(std::remove_if(partial.begin(), partial.end(), [](const auto& kv) { return kv.first == "step.1"; }),
                partial.end());
  msg = what_of([&] { opt2.load_state(partial, "ck.pt"); });
  EXPECT_NE(msg.find("step.1"), std::string::npos) << msg;
  EXPECT_THROW(BackboneOptimizer(make_params(1), BackboneOptimizerOptions{"lamb"}), Error);
}

// --- gradient clipping --------------------------------------------------------------------

TEST(GradClip, MatchesManualNormAndTorchClip) {
  for (double max_norm : {0.5, 5.0, 1e6}) {
    std::vector<at::Tensor> mine = make_params(21), ref = clone_params(mine);
    auto gs = grads_of_step(mine, 2);  // param 2 without a grad: ignored
    set_grads(mine, gs);
    set_grads(ref, gs);
    double sq = 0;
    for (const auto& g : gs)
      if (g.defined()) sq += g.to(torch::kDouble).pow(2).sum().item<double>();
    const double manual = std::sqrt(sq);
    at::Tensor norm = clip_grad_norm(mine, max_norm);
    EXPECT_EQ(norm.dim(), 0);
    EXPECT_EQ(norm.scalar_type(), torch::kFloat);
    EXPECT_NEAR(norm.item<double>(), manual, 1e-6 * manual);
    const double torch_norm = torch::nn::utils::clip_grad_norm_(ref, max_norm);
    EXPECT_NEAR(norm.item<double>(), torch_norm, 1e-6 * manual);
    const double coef = std::min(1.0, max_norm / (manual + 1e-6));
    EXPECT_FALSE(mine[2].grad().defined());
    double clipped_sq = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      if (!gs[i].defined()) continue;
      EXPECT_LT(testing::relative_error(mine[i].grad(), gs[i].to(torch::kDouble) * coef), 1e-6) << "max_norm " << max_norm;
      EXPECT_LT(testing::relative_error(mine[i].grad(), ref[i].grad()), 1e-6) << "max_norm " << max_norm;
      clipped_sq += mine[i].grad().to(torch::kDouble).pow(2).sum().item<double>();
    }
    EXPECT_NEAR(std::sqrt(clipped_sq), std::min(manual, max_norm), 1e-5 * manual);
    if (max_norm > manual) {
      for (size_t i = 0; i < mine.size(); ++i) {
        if (gs[i].defined()) {
          EXPECT_TRUE(torch::equal(mine[i].grad(), gs[i]));  // multiplied by exactly 1
        }
      }
    }
  }
}

TEST(GradClip, NoGradsGivesZero) {
  std::vector<at::Tensor> ps = make_params(1);
  EXPECT_EQ(clip_grad_norm(ps, 1.0).item<double>(), 0.0);
  EXPECT_THROW(clip_grad_norm(ps, 0.0), Error);
}

TEST(GradClip, HalfGradsAreNormedInFloat) {
  // Squares of 300 overflow fp16 (max 65504): the norm must still be finite and right.
  at::Tensor p = torch::zeros({4}, torch::kHalf).requires_grad_(true);
  p.mutable_grad() = torch::full({4}, 300.0, torch::kHalf);
  at::Tensor n = clip_grad_norm({p}, 1e9);
  EXPECT_NEAR(n.item<double>(), 600.0, 1e-3);
}

// --- loss scaler --------------------------------------------------------------------------

TEST(LossScaler, UnscaleMultipliesByFloatReciprocal) {
  LossScalerOptions o;
  o.init_scale = 1000.0;  // not a power of two: 1/scale rounds
  LossScaler sc(o, torch::kCPU);
  torch::manual_seed(4);
  at::Tensor a = torch::randn({5, 7}).requires_grad_(true), b = torch::randn({3}).requires_grad_(true);
  at::Tensor h = torch::randn({6}).to(torch::kHalf).requires_grad_(true), none = torch::randn({2}).requires_grad_(true);
  const at::Tensor ga = torch::randn({5, 7}) * 1000, gb = torch::randn({3}) * 1000, gh = (torch::randn({6}) * 1000).to(torch::kHalf);
  a.mutable_grad() = ga.clone();
  b.mutable_grad() = gb.clone();
  h.mutable_grad() = gh.clone();
  at::Tensor found = sc.unscale_({a, b, h, none});
  EXPECT_EQ(found.numel(), 1);
  EXPECT_EQ(found.scalar_type(), torch::kFloat);
  EXPECT_EQ(found.item<float>(), 0.0f);
  const float inv = static_cast<float>(1.0 / 1000.0);
  EXPECT_TRUE(torch::equal(a.grad(), ga * inv));
  EXPECT_TRUE(torch::equal(b.grad(), gb * inv));
  EXPECT_TRUE(torch::equal(h.grad(), (gh.to(torch::kFloat) * inv).to(torch::kHalf)));
  EXPECT_FALSE(none.grad().defined());
  EXPECT_FALSE(sc.update(found));
  EXPECT_EQ(sc.current_scale(), 1000.0);
}

TEST(LossScaler, ScaleMultipliesLossAndItsGradients) {
  LossScaler sc(LossScalerOptions{}, torch::kCPU);
  at::Tensor w = torch::randn({4}).requires_grad_(true);
  at::Tensor loss = (w * w).sum();
  at::Tensor scaled = sc.scale(loss);
  EXPECT_EQ(scaled.dim(), 0);
  EXPECT_FLOAT_EQ(scaled.item<float>(), loss.item<float>() * 65536.0f);
  scaled.backward();
  EXPECT_TRUE(torch::allclose(w.grad(), 2 * w.detach() * 65536.0f));
}

TEST(LossScaler, InfOrNanSkipsAndHalvesTheScale) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    LossScaler sc(LossScalerOptions{}, torch::kCPU);
    at::Tensor a = torch::randn({3}).requires_grad_(true), b = torch::randn({4}).requires_grad_(true);
    a.mutable_grad() = torch::ones({3});
    at::Tensor gb = torch::ones({4});
    gb[2] = bad;
    b.mutable_grad() = gb;
    at::Tensor found = sc.unscale_({a, b});
    EXPECT_EQ(found.item<float>(), 1.0f);
    EXPECT_TRUE(sc.update(found));
    EXPECT_EQ(sc.current_scale(), 32768.0);
    auto st = sc.state();
    EXPECT_EQ(st[0].first, "scale");
    EXPECT_EQ(st[0].second.item<float>(), 32768.0f);
    EXPECT_EQ(st[1].second.item<int>(), 0);
  }
}

TEST(LossScaler, GrowsAfterIntervalGoodStepsAndResetsOnOverflow) {
  LossScalerOptions o;
  o.init_scale = 8.0;
  o.growth_interval = 3;
  LossScaler sc(o, torch::kCPU);
  const at::Tensor ok = torch::zeros({1}), inf = torch::ones({1});
  EXPECT_FALSE(sc.update(ok));
  EXPECT_FALSE(sc.update(ok));
  EXPECT_EQ(sc.current_scale(), 8.0);
  EXPECT_TRUE(sc.update(inf));  // resets the count of good steps
  EXPECT_EQ(sc.current_scale(), 4.0);
  EXPECT_FALSE(sc.update(ok));
  EXPECT_FALSE(sc.update(ok));
  EXPECT_EQ(sc.current_scale(), 4.0);
  EXPECT_FALSE(sc.update(ok));  // third consecutive good step
  EXPECT_EQ(sc.current_scale(), 8.0);
  for (int i = 0; i < 3; ++i) sc.update(ok);
  EXPECT_EQ(sc.current_scale(), 16.0);

  // arcface_torch's interval: 100 good steps double the scale.
  LossScaler def(LossScalerOptions{}, torch::kCPU);
  for (int i = 0; i < 99; ++i) def.update(ok);
  EXPECT_EQ(def.current_scale(), 65536.0);
  def.update(ok);
  EXPECT_EQ(def.current_scale(), 131072.0);
}

TEST(LossScaler, StateRoundTripAndErrors) {
  LossScalerOptions o;
  o.growth_interval = 4;
  LossScaler a(o, torch::kCPU), b(o, torch::kCPU);
  a.update(torch::ones({1}));
  a.update(torch::zeros({1}));
  a.update(torch::zeros({1}));
  std::vector<std::pair<std::string, at::Tensor>> saved;
  for (const auto& kv : a.state()) saved.emplace_back(kv.first, kv.second.clone());
  b.load_state(saved, "train_state.pt");
  EXPECT_EQ(b.current_scale(), 32768.0);
  // Two more good steps reach the interval on both.
  for (int i = 0; i < 2; ++i) {
    a.update(torch::zeros({1}));
    b.update(torch::zeros({1}));
  }
  EXPECT_EQ(a.current_scale(), 65536.0);
  EXPECT_EQ(b.current_scale(), 65536.0);

  auto msg = what_of([&] { b.load_state({{"scale", torch::full({1}, -1.0)}, {"growth_tracker", torch::zeros({1}, torch::kInt)}}, "ts.pt"); });
  EXPECT_NE(msg.find("'scale'"), std::string::npos) << msg;
  msg = what_of([&] { b.load_state({{"scale", torch::full({1}, 2.0)}}, "ts.pt"); });
  EXPECT_NE(msg.find("growth_tracker"), std::string::npos) << msg;
  msg = what_of([&] { b.load_state({{"scale", torch::full({1}, 2.0)}, {"growth_tracker", torch::zeros({1}, torch::kInt)}, {"extra", torch::zeros({1})}}, "ts.pt"); });
  EXPECT_NE(msg.find("extra"), std::string::npos) << msg;
  EXPECT_THROW(LossScaler(LossScalerOptions{65536.0, 1.0}, torch::kCPU), Error);
}

TEST(LossScaler, DisabledIsIdentity) {
  LossScalerOptions o;
  o.enabled = false;
  LossScaler sc(o, torch::kCPU);
  at::Tensor loss = torch::tensor(3.5);
  EXPECT_TRUE(sc.scale(loss).is_same(loss));
  at::Tensor p = torch::zeros({2}).requires_grad_(true);
  p.mutable_grad() = torch::full({2}, std::numeric_limits<float>::infinity());
  at::Tensor found = sc.unscale_({p});
  EXPECT_EQ(found.item<float>(), 0.0f);
  EXPECT_TRUE(std::isinf(p.grad()[0].item<float>()));
  EXPECT_FALSE(sc.update(torch::ones({1})));
  EXPECT_EQ(sc.current_scale(), 1.0);
  EXPECT_TRUE(sc.state().empty());
}

// On a GPU machine: the CUDA kernels (multi-tensor fast paths, fused AdamW, AMP kernels)
// against the same references run on the CPU.
TEST(AppOptim, CudaMatchesCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (const char* kind : {"sgd", "adamw"}) {
    BackboneOptimizerOptions o;
    o.kind = kind;
    std::vector<at::Tensor> cpu = make_params(9), gpu;
    for (const auto& p : cpu) gpu.push_back(p.detach().to(torch::kCUDA).requires_grad_(true));
    BackboneOptimizer oc(cpu, o), og(gpu, o);
    for (int s = 0; s < 5; ++s) {
      const auto gs = grads_of_step(cpu, s);
      set_grads(cpu, gs);
      for (size_t i = 0; i < gpu.size(); ++i) {
        if (gs[i].defined()) {
          gpu[i].mutable_grad() = gs[i].to(torch::kCUDA);
        } else {
          gpu[i].mutable_grad().reset();
        }
      }
      at::Tensor nc = clip_grad_norm(cpu, 5.0), ng = clip_grad_norm(gpu, 5.0);
      EXPECT_NEAR(ng.item<double>(), nc.item<double>(), 1e-5 * nc.item<double>());
      oc.step(lr_of_step(s));
      og.step(lr_of_step(s));
    }
    for (size_t i = 0; i < cpu.size(); ++i) EXPECT_LT(testing::relative_error(gpu[i].cpu(), cpu[i]), 1e-5) << kind << " param " << i;
  }
  LossScaler sc(LossScalerOptions{}, torch::kCUDA);
  at::Tensor p = torch::zeros({3}, torch::kCUDA).requires_grad_(true);
  p.mutable_grad() = torch::tensor({1.0f, std::numeric_limits<float>::infinity(), 2.0f}).to(torch::kCUDA);
  at::Tensor found = sc.unscale_({p});
  EXPECT_EQ(found.device().type(), torch::kCUDA);
  EXPECT_TRUE(sc.update(found));
  EXPECT_EQ(sc.current_scale(), 32768.0);
}

// On a GPU machine: the fused step over flat buffers (one at::_fused_sgd_ / at::_fused_adamw_
// kernel per buffer, the learning rate a device tensor) with parameters, gradients and state on
// the GPU, against the same step on the CPU: SGD with momentum and weight decay, and AdamW, 5
// steps; every parameter and every state tensor within 1e-6 (relative L2), the state on the
// GPU, and the parameters moved.
TEST(AppOptim, FusedFlatCudaMatchesCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  for (const char* kind : {"sgd", "adamw"}) {
    SCOPED_TRACE(kind);
    BackboneOptimizerOptions o;
    o.kind = kind;
    o.momentum = 0.9;
    o.weight_decay = std::string(kind) == "sgd" ? 5e-4 : 0.05;
    const std::vector<at::Tensor> start = make_params(23);
    std::vector<at::Tensor> cpu = flat_side_params(start), gpu;
    // .to() keeps the conv weight channels-last on the GPU as well.
    for (const auto& p : cpu) gpu.push_back(p.detach().to(cuda).requires_grad_(true));
    ASSERT_TRUE(gpu[0].is_contiguous(at::MemoryFormat::ChannelsLast));
    FlatParameters flat_cpu(cpu, 0.0002), flat_gpu(gpu, 0.0002);
    ASSERT_EQ(flat_gpu.groups().size(), 1u);
    ASSERT_TRUE(flat_gpu.groups()[0].values.is_cuda());
    BackboneOptimizer oc(flat_cpu, o), og(flat_gpu, o);
    for (int s = 0; s < 5; ++s) {
      const std::vector<at::Tensor> gs = dense_grads_of_step(start, s);
      std::vector<at::Tensor> gs_gpu;
      for (const at::Tensor& g : gs) gs_gpu.push_back(g.to(cuda));
      write_grads(cpu, gs);
      write_grads(gpu, gs_gpu);
      oc.step(lr_of_step(s));
      og.step(lr_of_step(s));
      for (size_t i = 0; i < cpu.size(); ++i) {
        ASSERT_TRUE(gpu[i].is_cuda());
        EXPECT_LT(testing::relative_error(gpu[i].detach().cpu(), cpu[i].detach()), 1e-6) << "step " << s << " param " << i;
      }
      oc.zero_grad();
      og.zero_grad();
    }
    const auto sc = oc.state(), sg = og.state();
    ASSERT_EQ(sc.size(), sg.size());
    ASSERT_GT(sc.size(), cpu.size()) << "no optimiser state";
    for (size_t k = 0; k < sc.size(); ++k) {
      EXPECT_EQ(sg[k].first, sc[k].first);
      if (sg[k].first == "num_params") continue;
      EXPECT_TRUE(sg[k].second.is_cuda()) << sg[k].first;
      EXPECT_EQ(sg[k].second.sizes(), sc[k].second.sizes()) << sg[k].first;
      EXPECT_LT(testing::relative_error(sg[k].second.cpu().to(at::kDouble), sc[k].second.to(at::kDouble)), 1e-6)
          << sg[k].first;
    }
    for (size_t i = 0; i < cpu.size(); ++i)
      EXPECT_GT(testing::relative_error(gpu[i].detach().cpu(), start[i].detach()), 1e-3) << "param " << i << " hardly moved";
  }
}

// The e2e tests' fault plan: KIND@RANK:STEP items, anything else named as malformed.
TEST(FaultPlan, ParsesItemsAndNamesBadOnes) {
  FaultPlan p = FaultPlan::parse("inf_gradient@1:3,crash_in_save@0:8");
  ASSERT_TRUE(p.inf_gradient && p.crash_in_save);
  EXPECT_EQ(p.inf_gradient->rank, 1);
  EXPECT_EQ(p.inf_gradient->step, 3);
  EXPECT_EQ(p.crash_in_save->rank, 0);
  EXPECT_EQ(p.crash_in_save->step, 8);
  EXPECT_TRUE(FaultPlan::parse("").empty());
  // hold_save names the file that ends the hold; without it, the plan is refused.
  ::unsetenv("FACESHARD_FAULTS_RELEASE");
  EXPECT_THROW(FaultPlan::parse("hold_save@0:3"), Error);
  ::setenv("FACESHARD_FAULTS_RELEASE", "/tmp/release-me", 1);
  const FaultPlan h = FaultPlan::parse("hold_save@0:3");
  ::unsetenv("FACESHARD_FAULTS_RELEASE");
  ASSERT_TRUE(h.hold_save.has_value());
  EXPECT_EQ(h.hold_save->step, 3);
  EXPECT_EQ(h.release_file, "/tmp/release-me");
  EXPECT_FALSE(h.empty());
  for (const char* bad : {"inf_gradient@1", "inf_gradient@1:0", "inf_gradient@-1:2", "inf_gradient@1:2x", "boom@0:1"}) {
    try {
      FaultPlan::parse(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("FACESHARD_FAULTS"), std::string::npos) << e.what();
      EXPECT_EQ(e.exit_code(), 2);
    }
  }
}

}  // namespace
}  // namespace faceshard
