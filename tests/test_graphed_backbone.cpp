// train.cuda_graph on the CPU: everything around the capture, with EagerReplay standing in
// for CUDA graphs (capture runs a piece once, replay runs it again on the static buffers).
// Steps through GraphedBackbone against the eager step (losses, parameters, BatchNorm's
// statistics, the classifier's centres), on one rank and on two under DataParallel, with
// gradient accumulation, loss scaling and the unfused optimiser; the warm-up leaving no trace;
// a batch of another shape; a capture that fails on one rank. The captures themselves run in
// the GPU check (test_cuda.cpp, GraphedBackboneCuda.*).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "app/config/config.h"
#include "app/train/graphed_backbone.h"
#include "app/train/step_recorder.h"
#include "app/train/train_job.h"
#include "app/train/train_step.h"
#include "app/train/training_stream.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

// `extra`: more top-level sections; `train_extra`: more keys of train ("key: value, ").
Config job_config(const std::string& dir, const std::string& extra, const std::string& train_extra = "") {
  return load_config_text("output: " + dir + "\nseed: 5\n" +
                              R"(data: {rec: synthetic, num_classes: 12, batch_size: 6, num_workers: 1}
model: {backbone: mbf_small, embedding_size: 16}
dist: {device: cpu}
train: {)" + train_extra + "verify_every: 0, tensorboard: false}\n" + extra,
                          "graphed.yaml");
}

// The first `n` batches of the job's loader (copies), to feed both steps the same data.
std::vector<Batch> first_batches(const Config& cfg, std::shared_ptr<Distributed> dist, int n) {
  TrainJob job = build_train_job(cfg, dist);
  job.loader->start_epoch(0, 0);
  std::vector<Batch> out;
  for (int k = 0; k < n; ++k) {
    Batch b = *job.loader->next();
    b.images = b.images.clone();
    b.labels = b.labels.clone();
    out.push_back(std::move(b));
  }
  return out;
}

// EagerReplay counting its replays (into a count that outlives it: a backbone that falls
// back to eager steps drops its recorder).
class CountingReplay : public EagerReplay {
 public:
  explicit CountingReplay(std::shared_ptr<int> replays) : replays_(std::move(replays)) {}
  void replay(int k) override {
    ++*replays_;
    EagerReplay::replay(k);
  }

 private:
  std::shared_ptr<int> replays_;
};

// A recorder whose capture of the backward fails (as a CUDA capture does at an operation the
// device cannot record) when `fail`.
class FailingRecorder : public CountingReplay {
 public:
  FailingRecorder(std::shared_ptr<int> replays, bool fail) : CountingReplay(std::move(replays)), fail_(fail) {}
  void capture(int k, const std::function<void()>& work) override {
    if (fail_ && k == 1) throw std::runtime_error("operation not permitted when stream is capturing\nmore detail");
    CountingReplay::capture(k, work);
  }

 private:
  bool fail_;
};

struct Outcome {
  std::vector<double> losses;
  std::vector<at::Tensor> params, buffers;
  at::Tensor centres;
  int replays = 0;
  bool captured = false;
  std::string eager_reason;
};

// `steps` optimiser steps of a fresh job on `batches`; with `recorder` (a CountingReplay
// counting into `replays`), through GraphedBackbone.
Outcome train(const Config& cfg, std::shared_ptr<Distributed> dist, const std::vector<Batch>& batches, int steps,
              std::unique_ptr<StepRecorder> recorder, std::shared_ptr<int> replays = nullptr) {
  TrainJob job = build_train_job(cfg, dist);
  job.backbone->train();
  TrainStep step(job);
  std::shared_ptr<GraphedBackbone> graphed;
  if (recorder) {
    graphed = std::make_shared<GraphedBackbone>(job.backbone, job.backbone_params, std::move(recorder),
                                                capture_agreement(*dist));
    step.set_backbone_run([graphed](const at::Tensor& images) { return graphed->forward(images); });
  }
  size_t next_batch = 0;
  BatchSource next = [&] {
    Batch b = batches.at(next_batch++);
    return b;
  };
  Outcome o;
  for (int k = 0; k < steps; ++k) {
    o.losses.push_back(step.run(next, k).loss.item<double>());
    // No parameter's gradient is the captured backward's static gradient (the next replay
    // would rewrite it).
    if (graphed && graphed->captured())
      for (size_t i = 0; i < job.backbone_params.size(); ++i)
        if (job.backbone_params[i].grad().defined() && graphed->static_gradients().at(i).defined())
          EXPECT_FALSE(job.backbone_params[i].grad().is_alias_of(graphed->static_gradients()[i]))
              << "parameter " << i << "'s .grad is the static gradient after step " << k;
  }
  for (const auto& p : job.backbone->parameters()) o.params.push_back(p.detach().clone());
  for (const auto& b : job.backbone->buffers()) o.buffers.push_back(b.detach().clone());
  o.centres = job.fc->weight().detach().clone();
  if (replays) o.replays = *replays;
  if (graphed) {
    o.captured = graphed->captured();
    o.eager_reason = graphed->eager_reason();
  }
  return o;
}

void expect_same(const Outcome& graphed, const Outcome& eager) {
  ASSERT_EQ(graphed.losses.size(), eager.losses.size());
  for (size_t k = 0; k < eager.losses.size(); ++k)
    EXPECT_NEAR(graphed.losses[k], eager.losses[k], 1e-6 * std::abs(eager.losses[k])) << "step " << k;
  ASSERT_EQ(graphed.params.size(), eager.params.size());
  double worst = 0;
  for (size_t i = 0; i < eager.params.size(); ++i)
    worst = std::max(worst, testing::relative_error(graphed.params[i], eager.params[i], testing::ErrorNorm::Max));
  EXPECT_LT(worst, 1e-6) << "the backbone's parameters differ";
  ASSERT_EQ(graphed.buffers.size(), eager.buffers.size());
  for (size_t i = 0; i < eager.buffers.size(); ++i)
    EXPECT_LT(testing::relative_error(graphed.buffers[i].to(at::kDouble), eager.buffers[i].to(at::kDouble),
                                      testing::ErrorNorm::Max),
              1e-6)
        << "buffer " << i << " (BatchNorm's running statistics and counts)";
  EXPECT_LT(testing::relative_error(graphed.centres, eager.centres, testing::ErrorNorm::Max), 1e-6)
      << "the classifier's centres differ";
}

struct Variant {
  const char* name;
  const char* extra;
  const char* train_extra;
  int micro;
};

const Variant kVariants[] = {
    {"fused optimiser", "", "", 1},
    {"sampling, gradient accumulation", "loss: {sample_rate: 0.5}\noptim: {grad_accumulation: 2}\n", "", 2},
    {"loss scaling", "", "loss_scaling: 'on', ", 1},
    {"unfused optimiser", "optim: {fused: false}\n", "", 1},
    {"unfused optimiser, gradient accumulation", "optim: {fused: false, grad_accumulation: 2}\n", "", 2},
};

TEST(GraphedBackbone, StepsEqualTheEagerStep) {
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const std::string dir = testing::temp_dir("graphed");
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    const Config cfg = job_config(dir + "/out", v.extra, v.train_extra);
    const int steps = 3;
    const std::vector<Batch> batches = first_batches(cfg, dist, steps * v.micro);
    const Outcome eager = train(cfg, dist, batches, steps, nullptr);
    auto replays = std::make_shared<int>(0);
    const Outcome graphed = train(cfg, dist, batches, steps, std::make_unique<CountingReplay>(replays), replays);
    ASSERT_TRUE(graphed.captured) << graphed.eager_reason;
    // Each micro-batch replays the forward and the backward once: the steps ran on the
    // replays, not on the module.
    EXPECT_EQ(graphed.replays, 2 * steps * v.micro);
    expect_same(graphed, eager);
    // The losses moved: the steps trained.
    EXPECT_NE(eager.losses.front(), eager.losses.back());
  }
}

// Two ranks under DataParallel: the all-reduces fire from the replayed node's gradients.
TEST(GraphedBackbone, TwoRanksEqualTheEagerStep) {
  const std::string dir = testing::temp_dir("graphed2");
  testing::run_ranks(2, [&](Distributed& d) {
    std::shared_ptr<Distributed> dist(&d, [](Distributed*) {});
    const Config cfg = job_config(dir + "/out" + std::to_string(d.rank()), "loss: {sample_rate: 0.5}\n");
    const std::vector<Batch> batches = first_batches(cfg, dist, 3);
    const Outcome eager = train(cfg, dist, batches, 3, nullptr);
    auto replays = std::make_shared<int>(0);
    const Outcome graphed = train(cfg, dist, batches, 3, std::make_unique<CountingReplay>(replays), replays);
    ASSERT_TRUE(graphed.captured) << graphed.eager_reason;
    EXPECT_EQ(graphed.replays, 2 * 3);
    expect_same(graphed, eager);
  });
}

// A capture that fails on one rank: every rank runs eagerly (one line each naming why), and
// the steps are the eager ones.
TEST(GraphedBackbone, FailedCaptureOnOneRankRunsEveryRankEagerly) {
  const std::string dir = testing::temp_dir("graphed_fail");
  testing::run_ranks(2, [&](Distributed& d) {
    std::shared_ptr<Distributed> dist(&d, [](Distributed*) {});
    const Config cfg = job_config(dir + "/out" + std::to_string(d.rank()), "");
    const std::vector<Batch> batches = first_batches(cfg, dist, 2);
    const Outcome eager = train(cfg, dist, batches, 2, nullptr);
    auto replays = std::make_shared<int>(0);
    const Outcome graphed =
        train(cfg, dist, batches, 2, std::make_unique<FailingRecorder>(replays, d.rank() == 1), replays);
    EXPECT_FALSE(graphed.captured);
    EXPECT_EQ(graphed.replays, 0);
    EXPECT_EQ(graphed.eager_reason, d.rank() == 1 ? "the capture failed: operation not permitted when stream is capturing"
                                                  : "the capture failed on another rank");
    expect_same(graphed, eager);
  });
}

// The warm-up and the capture leave no trace: after the first call, BatchNorm's statistics are
// those of one forward, and no parameter has a gradient.
TEST(GraphedBackbone, CaptureLeavesNoTrace) {
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const Config cfg = job_config(testing::temp_dir("graphed_trace") + "/out", "");
  const std::vector<Batch> batches = first_batches(cfg, dist, 1);
  TrainJob a = build_train_job(cfg, dist), b = build_train_job(cfg, dist);
  a.backbone->train();
  b.backbone->train();
  const at::Tensor want = a.backbone->forward(batches[0].images);
  GraphedBackbone graphed(b.backbone, b.backbone_params, std::make_unique<EagerReplay>(), {}, /*warm_ups=*/3);
  const at::Tensor got = graphed.forward(batches[0].images);
  ASSERT_TRUE(graphed.captured());
  EXPECT_TRUE(torch::allclose(got, want, 1e-6, 1e-7));
  const auto ba = a.backbone->buffers(), bb = b.backbone->buffers();
  ASSERT_EQ(ba.size(), bb.size());
  ASSERT_FALSE(ba.empty());
  for (size_t i = 0; i < ba.size(); ++i)
    EXPECT_TRUE(torch::allclose(bb[i].to(at::kDouble), ba[i].to(at::kDouble), 1e-6, 1e-9)) << "buffer " << i;
  for (const at::Tensor& p : b.backbone_params)
    EXPECT_TRUE(!p.grad().defined() || p.grad().abs().max().item<double>() == 0) << "a parameter has a gradient";
  // And its backward reaches every parameter, as the module's own does.
  got.pow(2).sum().backward();
  want.pow(2).sum().backward();
  for (size_t i = 0; i < b.backbone_params.size(); ++i)
    EXPECT_LT(testing::relative_error(b.backbone_params[i].grad(), a.backbone_params[i].grad()), 1e-6) << "param " << i;
}

// A batch of another shape than the captured one runs eagerly for that call.
TEST(GraphedBackbone, OtherBatchShapeRunsEagerly) {
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const Config cfg = job_config(testing::temp_dir("graphed_shape") + "/out", "");
  const std::vector<Batch> batches = first_batches(cfg, dist, 2);
  TrainJob a = build_train_job(cfg, dist), b = build_train_job(cfg, dist);
  a.backbone->train();
  b.backbone->train();
  auto replays = std::make_shared<int>(0);
  GraphedBackbone graphed(b.backbone, b.backbone_params, std::make_unique<CountingReplay>(replays), {}, /*warm_ups=*/1);
  a.backbone->forward(batches[0].images);
  graphed.forward(batches[0].images);
  const at::Tensor small = batches[1].images.narrow(0, 0, 4).contiguous();
  const at::Tensor want = a.backbone->forward(small);
  const int before = *replays;
  const at::Tensor got = graphed.forward(small);
  EXPECT_EQ(graphed.eager_calls(), 1);
  EXPECT_EQ(*replays, before);
  EXPECT_TRUE(torch::allclose(got, want, 1e-6, 1e-7));
}

// On the CPU, train.cuda_graph leaves the step eager with one line saying why.
TEST(GraphedBackbone, CpuRunsEagerlyWithOneLine) {
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const Config cfg =
      job_config(testing::temp_dir("graphed_cpu") + "/out", "", "cuda_graph: true, ");
  EXPECT_TRUE(cfg.train.cuda_graph);
  TrainJob job = build_train_job(cfg, dist);
  ::testing::internal::CaptureStdout();
  const BackboneRun run = make_backbone_run(job);
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("train.cuda_graph: the CPU has no CUDA graphs; the steps run eagerly"), std::string::npos) << out;
  job.backbone->eval();
  const at::Tensor x = torch::randn({2, 3, 112, 112});
  EXPECT_TRUE(torch::equal(run(x), job.backbone->forward(x)));
}

// A recorder that captures on another stream than the one the job's gradient accumulators
// were made on (on a GPU: DataParallel's accumulators made while the default stream was
// current, the capture on a side stream, which breaks the captured backward). On the CPU,
// which has one stream, the other stream is a made-up one.
class OtherStreamReplay : public CountingReplay {
 public:
  using CountingReplay::CountingReplay;
  c10::Stream stream() const override { return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCPU), 7); }
};

// The capture is refused, before any warm-up, when a parameter's gradient accumulator runs on
// another stream than the capture's; the steps then run eagerly and equal the eager steps.
TEST(GraphedBackbone, AccumulatorsOnAnotherStreamAreNotCaptured) {
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const Config cfg = job_config(testing::temp_dir("graphed_streams") + "/out", "");
  const std::vector<Batch> batches = first_batches(cfg, dist, 2);
  {
    // The job made its accumulators (DataParallel keeps them) on its own training stream.
    TrainJob job = build_train_job(cfg, dist);
    ASSERT_TRUE(job.stream);
    EXPECT_EQ(job.stream->stream(), current_stream(job.device));
    int with_accumulator = 0;
    for (const at::Tensor& p : job.backbone_params)
      with_accumulator += torch::autograd::impl::try_get_grad_accumulator(p) != nullptr;
    EXPECT_EQ(with_accumulator, static_cast<int>(job.backbone_params.size()));
    EXPECT_EQ(accumulator_stream_mismatch(job.backbone_params, job.stream->stream()), "");
    const std::string other =
        accumulator_stream_mismatch(job.backbone_params, c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCPU), 7));
    EXPECT_EQ(other.rfind("parameter 0 (shape ", 0), 0u) << other;
    EXPECT_NE(other.find("its gradient accumulator runs on stream"), std::string::npos) << other;
  }
  const Outcome eager = train(cfg, dist, batches, 2, nullptr);
  auto replays = std::make_shared<int>(0);
  const Outcome graphed = train(cfg, dist, batches, 2, std::make_unique<OtherStreamReplay>(replays), replays);
  EXPECT_FALSE(graphed.captured);
  EXPECT_EQ(graphed.replays, 0);
  EXPECT_EQ(graphed.eager_reason.rfind("the capture failed: parameter 0 (shape ", 0), 0u) << graphed.eager_reason;
  expect_same(graphed, eager);
}

// Where a backbone cannot be captured on any device, the reason comes before any warm-up:
// activation checkpointing (model.checkpointing; on by default from vit_b and r2060 up),
// SyncBatchNorm, dist.find_unused_parameters; none for a plain network.
TEST(GraphedBackbone, ObstaclesAreNamedBeforeTheWarmUp) {
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const std::string dir = testing::temp_dir("graphed_obstacles");
  auto obstacle = [&](const std::string& model, const std::string& extra) {
    const Config cfg = load_config_text("output: " + dir + "/out\nseed: 5\n" +
                                            "data: {rec: synthetic, num_classes: 12, batch_size: 6, num_workers: 1}\n" +
                                            "model: {" + model + "}\ndist: {device: cpu" + extra +
                                            "}\ntrain: {verify_every: 0, tensorboard: false}\n",
                                        "obstacles.yaml");
    TrainJob job = build_train_job(cfg, dist);
    return cuda_graph_obstacle(job);
  };
  EXPECT_EQ(obstacle("backbone: mbf_small, embedding_size: 16", ""), "");
  const std::string ckpt = obstacle("backbone: r18, embedding_size: 16, checkpointing: true", "");
  EXPECT_NE(ckpt.find("activation checkpointing (model.checkpointing"), std::string::npos) << ckpt;
  EXPECT_NE(ckpt.find("CUDA generator"), std::string::npos) << ckpt;
  EXPECT_EQ(obstacle("backbone: r18, embedding_size: 16, checkpointing: false", ""), "");
  EXPECT_NE(obstacle("backbone: mbf_small, embedding_size: 16, sync_bn: true", "").find("SyncBatchNorm"),
            std::string::npos);
  EXPECT_NE(obstacle("backbone: mbf_small, embedding_size: 16", ", find_unused_parameters: true")
                .find("dist.find_unused_parameters"),
            std::string::npos);
}

TEST(GraphedBackbone, ConfigKeyIsABoolean) {
  try {
    job_config("/tmp/unused", "", "cuda_graph: sometimes, ");
    ADD_FAILURE() << "train.cuda_graph: sometimes was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("train.cuda_graph"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(job_config("/tmp/unused", "").train.cuda_graph);
}

}  // namespace
}  // namespace faceshard
