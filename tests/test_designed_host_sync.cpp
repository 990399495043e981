// The host synchronisations a training step makes on purpose (designed_host_sync.h), on the
// CPU, where the step passes the same points as on a GPU: with loss scaling, sampling and two
// accumulated micro-batches, exactly the three named ones, once a step each; without them,
// none. GraphedBackboneCuda.StepsMatchEagerWithoutHostSync holds the same list on a GPU,
// where every other synchronisation is an error.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "app/config/config.h"
#include "app/train/train_job.h"
#include "app/train/train_step.h"
#include "base/designed_host_sync.h"
#include "partial_fc/distributed/distributed.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

std::map<std::string, int64_t> syncs_of_steps(const std::string& extra_train, const std::string& extra_optim,
                                              double sample_rate, int steps) {
  const std::string dir = testing::temp_dir("designed_syncs");
  const Config cfg = load_config_text(
      "output: " + dir + "/out\nseed: 3\ndata: {rec: synthetic, num_classes: 40, batch_size: 8, num_workers: 1}\n" +
          "model: {backbone: mbf_small, embedding_size: 16}\nloss: {sample_rate: " + std::to_string(sample_rate) +
          "}\noptim:\n  total_steps: 10\n" + extra_optim + "train:\n  verify_every: 0\n  tensorboard: false\n" +
          extra_train + "dist: {device: cpu}\n",
      "syncs.yaml");
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  TrainJob job = build_train_job(cfg, dist);
  job.backbone->train();
  job.loader->start_epoch(0, 0);
  TrainStep step(job);
  BatchSource next = [&] { return *job.loader->next(); };
  reset_designed_host_syncs();
  for (int k = 0; k < steps; ++k) step.run(next, k);
  return designed_host_syncs();
}

TEST(DesignedHostSync, TheStepsListIsTheDesignsList) {
  const auto all = syncs_of_steps("  loss_scaling: 'on'\n", "  grad_accumulation: 2\n", 0.5, 3);
  std::set<std::string> names;
  for (const auto& [what, count] : all) {
    names.insert(what);
    EXPECT_EQ(count, 3) << what << ": once a step";
  }
  const std::set<std::string> want = {"classifier: the distinct rows of the accumulated micro-batches",
                                      "loss scaler: found_inf to the host, for the ranks' one skip decision",
                                      "loss scaler: the skip decision and the new scale"};
  EXPECT_EQ(names, want);
  // The plain step (no scaling, no accumulation, every class) waits for nothing on purpose.
  EXPECT_TRUE(syncs_of_steps("", "", 1.0, 2).empty());
}

TEST(DesignedHostSync, CountsEachScopeAndResets) {
  reset_designed_host_syncs();
  { DesignedHostSync a("a"); }
  { DesignedHostSync a("a"); DesignedHostSync b("b"); }
  const auto c = designed_host_syncs();
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c.at("a"), 2);
  EXPECT_EQ(c.at("b"), 1);
  reset_designed_host_syncs();
  EXPECT_TRUE(designed_host_syncs().empty());
}

}  // namespace
}  // namespace faceshard
