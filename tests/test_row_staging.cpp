// Copy-on-write staging of the classifier's rows (app/train/row_staging.h): a checkpoint
// written in the background saves the rows as they were at its step, although the training
// changes them meanwhile, each row copied once by whichever side gets to it first.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <map>
#include <set>
#include <random>
#include <thread>
#include <vector>

#include "app/config/config.h"
#include "app/io/checkpoint.h"
#include "app/train/checkpoint_writer.h"
#include "app/train/row_staging.h"
#include "app/train/train_job.h"
#include "app/train/train_state.h"
#include "app/train/train_step.h"
#include "models/torch_save/state_dict_io.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

// The training's real steps (TrainStep) while the write of the checkpoint before them is
// held back: the classifier's file holds the checkpoint step's rows, for every way the
// classifier changes rows (sampled or all, streamed or buffered logits with the step in the
// backward or after it, SGD or AdamW, fp32 or bf16 centres, accumulated micro-batches).
struct RowsCase {
  std::string name, loss, optim, micro;
};

void PrintTo(const RowsCase& c, std::ostream* os) { *os << c.name; }

class AsyncCheckpointRows : public ::testing::TestWithParam<RowsCase> {};

TEST_P(AsyncCheckpointRows, TheNextStepsChangesAreNotSaved) {
  const RowsCase& c = GetParam();
  const std::string dir = testing::temp_dir("rows_cow");
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const Config cfg = load_config_text("output: " + dir + "/out\n" +
                                          "data: {rec: synthetic, num_classes: 3000, batch_size: 4, num_workers: 1}\n"
                                          "model: {backbone: mbf, embedding_size: 8}\n"
                                          "train: {verify_every: 0, tensorboard: false}\n"
                                          "dist: {device: cpu}\n"
                                          "loss: {" + c.loss + "}\n"
                                          "optim: {" + c.optim + c.micro + "}\n",
                                      "job.yaml");
  TrainJob job = build_train_job(cfg, dist);
  job.backbone->train();
  TrainState state(job);
  TrainStep step(job);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto batch = [&] {
    Batch b;
    b.images = at::randn({4, 3, 112, 112}, gen);
    b.labels = at::randint(0, 3000, {4}, gen, torch::kLong);
    return b;
  };
  step.run(batch, 0);  // the optimiser's state is not all zero at the checkpoint
  state.progress().step = 1;
  CheckpointManager checkpoints(dir + "/ck", *dist, 10);
  // Declared before the writer, which joins its thread (held here) when destroyed.
  testing::Gate gate;
  AsyncCheckpointWriter writer(checkpoints, 0, 1, nullptr, "t", std::chrono::seconds(60));
  writer.copy_rows_on_write(*job.fc);
  writer.set_before_write_hook([&](int64_t) { gate.wait(); });
  std::map<std::string, at::Tensor> at_step;
  for (const auto& [name, t] : job.fc->state()) at_step["rows/" + name] = t.clone();
  // The whole checkpoint at its step, for the backbone's and the train state's files too
  // (the backbone optimiser's momentum, the scaler and the head's state change at the next
  // steps as the rows do): a staging that handed over a live tensor would write the later value.
  const CheckpointContents live = state.contents();
  std::map<std::string, at::Tensor> backbone_at_step, train_state_at_step;
  for (const auto& [name, t] : live.backbone)
    if (t.defined()) backbone_at_step[name] = t.detach().clone();
  for (const auto& [name, t] : live.train_state)
    if (t.defined()) train_state_at_step[name] = t.detach().clone();
  EXPECT_FALSE(writer.save(state).has_value());
  for (int64_t k = 1; k < 3; ++k) step.run(batch, k);
  // The control: the steps changed the live centres.
  const bool changed = !torch::equal(job.fc->state().front().second, at_step["rows/weight"]);
  gate.open();  // before any assertion can return: the writer's thread waits on it
  ASSERT_TRUE(changed) << c.name;
  const std::optional<CheckpointOutcome> o = writer.finish();
  ASSERT_TRUE(o.has_value());
  ASSERT_TRUE(o->committed) << o->problem;
  // The writer was held back: the rows the steps changed were copied by the training.
  EXPECT_GT(o->rows_on_write, 0) << c.name;
  EXPECT_LE(o->rows_on_write, job.fc->state().front().second.size(0));
  const StateDict got = read_state_dict(dir + "/ck/step_00000001/fc_shard_0.pt");
  int compared = 0;
  for (const auto& [name, t] : got) {
    auto it = at_step.find(name);
    if (it == at_step.end()) continue;
    EXPECT_TRUE(torch::equal(t, it->second)) << c.name << ": " << name << " is not the checkpoint step's value";
    compared++;
  }
  EXPECT_EQ(compared, static_cast<int>(at_step.size())) << c.name;
  // train_state.pt and backbone.pt hold the checkpoint step's values, bit for bit, every key.
  for (const auto& [file, want] : {std::make_pair(std::string("train_state.pt"), &train_state_at_step),
                                   std::make_pair(std::string("backbone.pt"), &backbone_at_step)}) {
    const StateDict saved = read_state_dict(dir + "/ck/step_00000001/" + file);
    std::set<std::string> seen;
    for (const auto& [name, t] : saved) {
      auto it = want->find(name);
      if (it == want->end()) continue;
      seen.insert(name);
      EXPECT_TRUE(t.sizes() == it->second.sizes() && torch::equal(t, it->second.to(t.scalar_type())))
          << c.name << ": " << file << " '" << name << "' is not the checkpoint step's value";
    }
    EXPECT_EQ(seen.size(), want->size()) << c.name << ": " << file << " lacks keys of the checkpoint step";
  }
  // The backbone optimiser's state did change after the checkpoint (the control of the check above).
  bool moved = false;
  for (const auto& [name, t] : job.opt->state())
    if (auto it = train_state_at_step.find("opt/" + name); it != train_state_at_step.end())
      moved |= !torch::equal(t, it->second);
  EXPECT_TRUE(moved) << c.name << ": the two steps left the backbone optimiser's state as it was";
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AsyncCheckpointRows,
    ::testing::Values(RowsCase{"all_streamed_sgd", "sample_rate: 1.0, logits: streamed", "optimizer: sgd", ""},
                      RowsCase{"sampled_streamed_sgd_bf16", "sample_rate: 0.3, logits: streamed",
                               "optimizer: sgd, fc_weight_dtype: bf16", ""},
                      RowsCase{"sampled_buffered_sgd", "sample_rate: 0.3, logits: buffer", "optimizer: sgd", ""},
                      RowsCase{"sampled_all_rows_sgd", "sample_rate: 0.3, logits: buffer",
                               "optimizer: sgd, fc_update: all", ""},
                      RowsCase{"all_buffered_adamw", "sample_rate: 1.0, logits: buffer", "optimizer: adamw", ""},
                      RowsCase{"sampled_streamed_adamw_bf16", "sample_rate: 0.3, logits: streamed",
                               "optimizer: adamw, fc_weight_dtype: bf16", ""},
                      RowsCase{"sampled_accumulated_sgd", "sample_rate: 0.3, logits: streamed", "optimizer: sgd",
                               ", grad_accumulation: 2"}),
    [](const ::testing::TestParamInfo<RowsCase>& i) { return i.param.name; });

}  // namespace
}  // namespace faceshard
