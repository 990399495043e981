// What train.cuda_graph came to (graph_status.h), as faceshard-bench reads it for the GPU
// check: not asked; asked on the CPU (eager, with the reason); a GraphedBackbone read live
// (before its first call, captured, a batch of another shape, a failed capture, gone). The
// GPU's real capture is GraphedBackboneCuda.* and the check's graph cells.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "app/config/config.h"
#include "app/train/graph_status.h"
#include "app/train/graphed_backbone.h"
#include "app/train/step_recorder.h"
#include "app/train/train_job.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

Config status_config(const std::string& name, bool cuda_graph) {
  return load_config_text("output: " + testing::temp_dir(name) + "/out\nseed: 5\n" +
                              R"(data: {rec: synthetic, num_classes: 12, batch_size: 6, num_workers: 1}
model: {backbone: mbf_small, embedding_size: 16}
dist: {device: cpu}
train: {verify_every: 0, tensorboard: false, cuda_graph: )" +
                              (cuda_graph ? "true" : "false") + "}\n",
                          "status.yaml");
}

// A recorder whose capture fails, as a capture that meets a host synchronisation does.
class FailingCapture : public EagerReplay {
 public:
  void capture(int, const std::function<void()>&) override { throw std::runtime_error("capture refused\nmore"); }
};

TEST(GraphStatus, NotAskedAndAskedOnTheCpu) {
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  {
    TrainJob job = build_train_job(status_config("status_off", false), dist);
    make_backbone_run(job);
    const GraphStatus s = job.graph_status();
    EXPECT_FALSE(s.asked);
    EXPECT_FALSE(s.captured);
    EXPECT_EQ(s.reason, "");
  }
  {
    TrainJob job = build_train_job(status_config("status_on", true), dist);
    EXPECT_FALSE(job.graph_status().asked) << "before make_backbone_run, nothing was asked of it";
    make_backbone_run(job);
    const GraphStatus s = job.graph_status();
    EXPECT_TRUE(s.asked);
    EXPECT_FALSE(s.captured);
    EXPECT_EQ(s.reason, "the CPU has no CUDA graphs");
  }
}

TEST(GraphStatus, ReadsTheGraphedBackboneAsItStands) {
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  TrainJob job = build_train_job(status_config("status_live", false), dist);
  job.backbone->train();
  auto graphed = std::make_shared<GraphedBackbone>(job.backbone, job.backbone_params, std::make_unique<EagerReplay>(),
                                                   std::function<bool(bool)>{}, /*warm_ups=*/1);
  const GraphStatusReader read = graphed_status(graphed);
  GraphStatus s = read();
  EXPECT_TRUE(s.asked);
  EXPECT_FALSE(s.captured) << "nothing is captured before the first call";
  EXPECT_EQ(s.reason, "");
  graphed->forward(torch::randn({6, 3, 112, 112}));
  s = read();
  EXPECT_TRUE(s.captured);
  EXPECT_EQ(s.reason, "");
  EXPECT_EQ(s.eager_calls, 0);
  graphed->forward(torch::randn({4, 3, 112, 112}));  // another shape: eager for that call
  EXPECT_EQ(read().eager_calls, 1);
  graphed.reset();
  s = read();
  EXPECT_TRUE(s.asked);
  EXPECT_FALSE(s.captured);
  EXPECT_EQ(s.reason, "the step that held the graphs is gone");
}

TEST(GraphStatus, FailedCaptureSaysWhy) {
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  TrainJob job = build_train_job(status_config("status_fail", false), dist);
  job.backbone->train();
  auto graphed = std::make_shared<GraphedBackbone>(job.backbone, job.backbone_params,
                                                   std::make_unique<FailingCapture>(), std::function<bool(bool)>{},
                                                   /*warm_ups=*/1);
  graphed->forward(torch::randn({6, 3, 112, 112}));
  const GraphStatus s = graphed_status(graphed)();
  EXPECT_TRUE(s.asked);
  EXPECT_FALSE(s.captured);
  EXPECT_EQ(s.reason, "the capture failed: capture refused");
}

}  // namespace
}  // namespace faceshard
