// Checkpoints written in the background (app/train/checkpoint_writer.h) and the ranks'
// agreement through the store (app/io/store_agreement.h): what is saved is the state of the
// checkpoint's step, whatever the training changes meanwhile; COMMITTED appears only once
// every rank's part verified; a failure on one rank gives the save up on all.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "app/config/config.h"
#include "app/io/checkpoint.h"
#include "app/io/checkpoint_verify.h"
#include "app/io/store_agreement.h"
#include "app/plan/checkpoint_staging_plan.h"
#include "app/train/checkpoint_writer.h"
#include "app/train/train_job.h"
#include "app/train/train_state.h"
#include "models/torch_save/state_dict_io.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;

// Every entry of the file `path` equal to the reference's entry of the same name (bitwise).
void expect_file_equals(const std::string& path, const StateDict& reference, const std::string& what) {
  const StateDict got = read_state_dict(path);
  std::map<std::string, at::Tensor> by_name(got.begin(), got.end());
  for (const auto& [name, want] : reference) {
    if (!want.defined()) continue;
    auto it = by_name.find(name);
    ASSERT_NE(it, by_name.end()) << what << ": " << name << " missing";
    EXPECT_TRUE(torch::equal(it->second, want.cpu())) << what << ": " << name << " is not the checkpoint step's value";
  }
}

// A one-rank CPU job small enough to save in milliseconds, its output under `dir`.
Config tiny_job_config(const std::string& dir) {
  return load_config_text("output: " + dir + "/out\n" + R"(data: {rec: synthetic, num_classes: 10, batch_size: 4, num_workers: 1}
model: {backbone: mbf, embedding_size: 8}
train: {verify_every: 0, tensorboard: false}
dist: {device: cpu}
)", "job.yaml");
}

using testing::Gate;

StateDict cloned(const StateDict& live) {
  StateDict out;
  for (const auto& [name, t] : live) out.emplace_back(name, t.defined() ? t.detach().clone() : t);
  return out;
}

// The background write is held back (before_write hook) until the training has changed every
// saved tensor in place, as its next optimiser step does: the files must hold the step's
// values, taken before (the copies into the staging buffers), not the changed ones.
TEST(AsyncCheckpoint, SavesTheStateOfItsStepNotOfTheNextStep) {
  const std::string dir = testing::temp_dir("async_ckpt");
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const Config cfg = tiny_job_config(dir);
  TrainJob job = build_train_job(cfg, dist);
  TrainState state(job);
  state.progress().step = 2;
  CheckpointManager checkpoints(dir + "/ck", *dist, 10);
  AsyncCheckpointWriter writer(checkpoints, 0, 1, nullptr, "t", std::chrono::seconds(60));
  Gate gate;
  writer.set_before_write_hook([&](int64_t) { gate.wait(); });
  // The reference: the state at the checkpoint's step, copied by the test itself.
  const CheckpointContents at_step = state.contents();
  const StateDict backbone = cloned(at_step.backbone), shard = cloned(at_step.shard);
  EXPECT_FALSE(writer.save(state).has_value());  // nothing was in flight
  {
    // The next step: every saved tensor of the backbone and the classifier changed in place.
    at::NoGradGuard no_grad;
    for (auto& kv : job.backbone->state_dict())
      if (kv.second.is_floating_point()) kv.second.add_(1.0);
    for (auto& kv : job.fc->state()) kv.second.add_(1.0);
    state.progress().step = 3;
  }
  // The control: the live tensors did change (so the comparison below can fail).
  ASSERT_FALSE(torch::equal(job.backbone->state_dict().front().second, backbone.front().second));
  gate.open();
  const std::optional<CheckpointOutcome> o = writer.finish();
  ASSERT_TRUE(o.has_value());
  ASSERT_TRUE(o->committed) << o->problem;
  EXPECT_EQ(o->step, 2);
  EXPECT_TRUE(o->background);
  EXPECT_GT(o->bytes, 0);
  const std::string step_dir = dir + "/ck/step_00000002";
  EXPECT_EQ(read_checkpoint_info(step_dir).step, 2);
  expect_file_equals(step_dir + "/backbone.pt", backbone, "backbone.pt");
  expect_file_equals(step_dir + "/fc_shard_0.pt", shard, "fc_shard_0.pt");
  EXPECT_EQ(verify_checkpoint(step_dir, *dist), "");
  EXPECT_FALSE(writer.finish().has_value());  // one save, finished once
}

// The same on a GPU, where the staging is a copy on a side stream into pinned buffers that the
// training stream waits for (fence) before its next kernel: right after save(), the training
// changes every saved tensor in place on its stream while the write is held back; the files
// hold the step's values (backbone, classifier shard and the train state).
TEST(AsyncCheckpointCuda, SavesTheStateOfItsStepWhileTrainingGoesOn) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = testing::temp_dir("async_ckpt_cuda");
  DistEnv env;
  env.master_port = 20000 + static_cast<int>((::getpid() + 17) % 20000);
  DistOptions options;
  options.use_cuda = true;
  std::shared_ptr<Distributed> dist = Distributed::init(env, options);
  const Config cfg = load_config_text("output: " + dir + "/out\n" + R"(data: {rec: synthetic, num_classes: 10, batch_size: 4, num_workers: 1}
model: {backbone: mbf, embedding_size: 8}
train: {verify_every: 0, tensorboard: false}
dist: {device: cuda}
)", "job.yaml");
  {
    TrainJob job = build_train_job(cfg, dist);
    ASSERT_TRUE(job.device.is_cuda());
    TrainState state(job);
    state.progress().step = 2;
    CheckpointManager checkpoints(dir + "/ck", *dist, 10);
    AsyncCheckpointWriter writer(checkpoints, 0, 1, nullptr, "t", std::chrono::seconds(60));
    Gate gate;
    writer.set_before_write_hook([&](int64_t) { gate.wait(); });
    const CheckpointContents at_step = state.contents();
    const StateDict backbone = cloned(at_step.backbone), shard = cloned(at_step.shard),
                    train_state = cloned(at_step.train_state);
    EXPECT_FALSE(writer.save(state).has_value());
    {
      // Queued on the training stream (current while the job lives) right after save(): the
      // fence must order them after the side stream's copies.
      at::NoGradGuard no_grad;
      for (auto& kv : job.backbone->state_dict())
        if (kv.second.is_floating_point()) kv.second.mul_(3.0).add_(1.0);
      for (auto& kv : job.fc->state())
        if (kv.second.is_floating_point()) kv.second.mul_(3.0).add_(1.0);
      for (auto& kv : state.contents().train_state)
        if (kv.second.defined() && kv.second.is_floating_point()) kv.second.add_(1.0);
      state.progress().step = 3;
    }
    ASSERT_FALSE(torch::equal(job.backbone->state_dict().front().second.cpu(), backbone.front().second.cpu()));
    gate.open();
    const std::optional<CheckpointOutcome> o = writer.finish();
    ASSERT_TRUE(o.has_value());
    ASSERT_TRUE(o->committed) << o->problem;
    EXPECT_EQ(o->step, 2);
    const std::string step_dir = dir + "/ck/step_00000002";
    expect_file_equals(step_dir + "/backbone.pt", backbone, "backbone.pt");
    expect_file_equals(step_dir + "/fc_shard_0.pt", shard, "fc_shard_0.pt");
    expect_file_equals(step_dir + "/train_state.pt", train_state, "train_state.pt");
  }
  dist->shutdown();
}

// train.checkpoint_when_busy skip: a checkpoint due while the previous write is still held
// back is skipped (no step folder, the training not waiting); one due once it is done is
// taken; the run's last checkpoint is never skipped. The staging buffers are allocated by
// reserve() before the first checkpoint, and the first checkpoint then allocates none.
TEST(AsyncCheckpoint, SkipsACheckpointDueWhileTheLastIsBeingWritten) {
  const std::string dir = testing::temp_dir("async_ckpt_skip");
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const Config cfg = tiny_job_config(dir);
  TrainJob job = build_train_job(cfg, dist);
  TrainState state(job);
  CheckpointManager checkpoints(dir + "/ck", *dist, 10);
  AsyncCheckpointWriter writer(checkpoints, 0, 1, nullptr, "t", std::chrono::seconds(60));
  std::vector<bool> asked;
  writer.skip_when_busy([&](bool mine) {
    asked.push_back(mine);
    return mine;
  });
  Gate gate;
  writer.set_before_write_hook([&](int64_t step) {
    if (step == 2) gate.wait();
  });
  EXPECT_GT(writer.reserve(state.contents()), 0.0);
  state.progress().step = 2;
  EXPECT_FALSE(writer.save(state).has_value());
  EXPECT_TRUE(asked.empty());  // nothing was in flight: nobody asked
  state.progress().step = 4;
  EXPECT_FALSE(writer.save(state).has_value());  // step 2's write is held: step 4 skipped
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_FALSE(asked[0]);
  gate.open();
  // Step 2's write goes on; once it is over, step 6 is taken and returns step 2's outcome.
  for (int i = 0; i < 6000 && !fs::exists(dir + "/ck/step_00000002/COMMITTED"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  state.progress().step = 6;
  std::optional<CheckpointOutcome> o;
  // The write's flag is set after COMMITTED: a step may still find it busy (and skip), as
  // the training would; the test asks again until it is taken.
  for (int i = 0; i < 6000 && !o; ++i) {
    o = writer.save(state);
    if (!o) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->step, 2);
  EXPECT_TRUE(o->committed) << o->problem;
  // The run's last checkpoint (step 7) waits for step 6's write instead of being skipped.
  state.progress().step = 7;
  const size_t asked_before = asked.size();
  o = writer.save(state, /*last=*/true);
  EXPECT_EQ(asked.size(), asked_before);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->step, 6);
  o = writer.finish();
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->step, 7);
  EXPECT_TRUE(o->committed) << o->problem;
  EXPECT_FALSE(fs::exists(dir + "/ck/step_00000004"));
  EXPECT_TRUE(fs::exists(dir + "/ck/step_00000006/COMMITTED"));
  EXPECT_TRUE(fs::exists(dir + "/ck/step_00000007/COMMITTED"));
}

// reserve() allocates every buffer the first checkpoint stages into: staging afterwards
// allocates nothing more (the same storages), and the bytes are this rank's part.
TEST(StagingBuffers, ReservedBeforeTheFirstCheckpoint) {
  StagingBuffers buffers;
  const StateDict live = {{"a", torch::randn({64, 8})}, {"b", torch::arange(10)}, {"none", at::Tensor()}};
  buffers.reserve(live, "shard");
  EXPECT_EQ(buffers.bytes(), 64 * 8 * 4 + 10 * 8);
  const StateDict first = buffers.stage(live, "shard");
  EXPECT_EQ(buffers.bytes(), 64 * 8 * 4 + 10 * 8);
  const StateDict second = buffers.stage(live, "shard");
  ASSERT_EQ(first.size(), 3u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(first[i].second.data_ptr(), second[i].second.data_ptr()) << first[i].first;
    EXPECT_TRUE(torch::equal(first[i].second, live[i].second)) << first[i].first;
  }
  // A changed shape is staged into a new buffer of the new shape.
  const StateDict grown = {{"a", torch::randn({65, 8})}, {"b", torch::arange(10)}, {"none", at::Tensor()}};
  const StateDict third = buffers.stage(grown, "shard");
  EXPECT_TRUE(torch::equal(third[0].second, grown[0].second));
  EXPECT_EQ(buffers.bytes(), 65 * 8 * 4 + 10 * 8);
}

// Two ranks save through the store. Rank 1 holds its shard back (before its rename) until
// rank 0 has reported its own files verified; at that point COMMITTED must not exist, and
// it must once both ranks are done. A second save in which rank 1's shard cannot be written
// is given up by both ranks with the same line, and the first stays committed and verifying.
TEST(AsyncCheckpoint, CommittedOnlyAfterEveryRankVerifiedThroughTheStore) {
  testing::run_ranks(2, [&](Distributed& d) {
    if (d.rank() == 0) {
      const std::string made = testing::temp_dir("async_commit");
      d.store()->set("async_commit_dir", std::vector<uint8_t>(made.begin(), made.end()));
    }
    const std::vector<uint8_t> got = d.store()->get("async_commit_dir");
    const std::string dir(got.begin(), got.end());
    auto store = d.connect_side_store(std::chrono::seconds(30));
    CheckpointManager ck(dir + "/ck", d, 3);
    const StateDict backbone{{"w", torch::arange(6, torch::kFloat)}};
    const StateDict ts{{"step", torch::tensor({2}, torch::kLong)}};
    StateDict shard{{"rows.start", torch::tensor({d.rank() * 4}, torch::kLong)},
                    {"rows.count", torch::tensor({4}, torch::kLong)},
                    {"rows/weight", torch::full({4, 3}, 1.0f + d.rank())}};
    bool committed_early = false;
    if (d.rank() == 1)
      ck.set_mid_save_hook([&](int64_t step) {
        if (step != 2) return;
        // Rank 0 reports the verdict of its written and read-back files as stage 1 of the save.
        store->wait({"ckpt/t/2/1/0"}, std::chrono::seconds(30));
        committed_early = fs::exists(dir + "/ck/step_00000002/COMMITTED");
      });
    StoreAgreement first(store, "ckpt/t/2", d.rank(), 2, std::chrono::seconds(30));
    ASSERT_TRUE(ck.save(2, 8, backbone, ts, shard, first)) << ck.last_problem();
    EXPECT_FALSE(committed_early) << "COMMITTED was written before rank 1's part was verified";
    EXPECT_TRUE(fs::exists(dir + "/ck/step_00000002/COMMITTED"));
    EXPECT_EQ(verify_checkpoint(dir + "/ck/step_00000002", d), "");

    StateDict bad = shard;
    if (d.rank() == 1) bad.emplace_back("rows/broken", at::Tensor());  // cannot be written
    StoreAgreement second(store, "ckpt/t/4", d.rank(), 2, std::chrono::seconds(30));
    EXPECT_FALSE(ck.save(4, 8, backbone, ts, bad, second));
    EXPECT_EQ(ck.failed_in_a_row(), 1);
    EXPECT_EQ(ck.last_problem().rfind("rank 1: ", 0), 0u) << ck.last_problem();
    d.barrier();
    EXPECT_FALSE(fs::exists(dir + "/ck/step_00000004"));
    EXPECT_EQ(fs::path(ck.latest()).filename(), "step_00000002");
    EXPECT_EQ(verify_checkpoint(ck.latest(), d), "");
  });
}

// A stage that a rank never reports to ends after the timeout with a line naming it, on the
// ranks that did report (a rank killed in the middle of a background write).
TEST(StoreAgreement, ARankThatNeverReportsFailsTheStage) {
  testing::run_ranks(2, [&](Distributed& d) {
    auto store = d.connect_side_store(std::chrono::seconds(30));
    if (d.rank() == 0) {
      StoreAgreement a(store, "silent", 0, 2, std::chrono::milliseconds(1500));
      const std::string verdict = a.agree("");
      EXPECT_NE(verdict.find("did not all report within"), std::string::npos) << verdict;
    }
    d.barrier();
    // Both report: the first non-empty problem, rank 0's first, on both.
    StoreAgreement b(store, "both", d.rank(), 2, std::chrono::seconds(30));
    EXPECT_EQ(b.agree(d.rank() == 1 ? "rank 1: disk full" : ""), "rank 1: disk full");
    EXPECT_EQ(b.agree(""), "");
  });
}

// The staging plan by hand: 10 classes over 3 ranks puts ceil(10/3) = 4 rows on rank 0, so
// its shard stages 4/10 of the shards' 1000 B; rank 0 adds the backbone (100 B) and the train
// state (50 B); a host of 2 ranks holds rank 0's 550 B and another rank's 400 B.
// A GPU tensor's staging buffer is pinned memory, handed out in powers of two by LibTorch's
// caching host allocator: the fit check counts the block, not the tensor's bytes.
TEST(CheckpointStagingPlan, PinnedBuffersCountTheirBlocks) {
  EXPECT_EQ(pinned_block_bytes(0), 0);
  EXPECT_EQ(pinned_block_bytes(1), 1);
  EXPECT_EQ(pinned_block_bytes(3), 4);
  EXPECT_EQ(pinned_block_bytes(4096), 4096);
  EXPECT_EQ(pinned_block_bytes(4097), 8192);
  // 2M classes x 512 fp32 centres: 4.0 GiB exactly; plus one byte, twice that.
  EXPECT_EQ(pinned_block_bytes(2097152.0 * 2048), 4294967296.0);
  EXPECT_EQ(pinned_block_bytes(2097152.0 * 2048 + 1), 8589934592.0);
  // CPU tensors (the CPU's buffers are not pinned) count their own bytes.
  CheckpointContents c;
  c.shard = {{"rows/weight", torch::zeros({3, 5})}};
  EXPECT_EQ(staging_bytes(c, 1), 60);
}

TEST(CheckpointStagingPlan, RankAndHostBytesByHand) {
  CheckpointPlan ck;
  ck.files = {{"backbone.pt", 100, ""}, {"train_state.pt", 50, ""}, {"fc_shard_0.pt .. fc_shard_2.pt", 1000, ""}};
  JobSettings job;
  job.num_classes = 10;
  job.world_size = 3;
  const CheckpointStagingPlan s = plan_checkpoint_staging(ck, job, 2);
  EXPECT_DOUBLE_EQ(s.rank0_bytes, 550);
  EXPECT_DOUBLE_EQ(s.other_bytes, 400);
  EXPECT_EQ(s.ranks_per_host, 2);
  EXPECT_DOUBLE_EQ(s.host_bytes, 950);
  // More ranks per host than the job has: the job's.
  EXPECT_EQ(plan_checkpoint_staging(ck, job, 8).ranks_per_host, 3);
}

}  // namespace
}  // namespace faceshard
