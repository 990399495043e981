// What a user reads and where a user's files land: output files named by a bare name, scheduled
// work (verification, checkpoints) kept out of the slow-link and straggler judgement, TAR@FAR
// from too few pairs, small learning rates in the log line, doubles in the printed config, the
// bad-image hint of each kind of data source, and faceshard-dist-check --trace on a run folder.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include "app/config/config.h"
#include "app/eval/verification_metrics.h"
#include "app/io/checkpoint.h"
#include "app/io/npy.h"
#include "app/train/log_sinks.h"
#include "data/dataset.h"
#include "data/insightface_rec.h"
#include "data/loader.h"
#include "data/synthetic_faces.h"
#include "partial_fc/distributed/collective_trace.h"
#include "base/error.h"
#include "partial_fc/distributed/link_watch.h"
#include "partial_fc/distributed/straggler_monitor.h"
#include "tests/harness.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// The working folder for one test, restored after it.
struct InFolder {
  explicit InFolder(const std::string& dir) : before(fs::current_path()) { fs::current_path(dir); }
  ~InFolder() { fs::current_path(before); }
  fs::path before;
};

// --- durable writes under a bare name -------------------------------------------------------

TEST(DurableWrite, BareDotAndAbsoluteNamesAreWritten) {
  EXPECT_EQ(parent_folder("emb.npy"), ".");
  EXPECT_EQ(parent_folder("./emb.npy"), ".");
  EXPECT_EQ(parent_folder("out/emb.npy"), "out");
  EXPECT_EQ(parent_folder("/data/emb.npy"), "/data");
  EXPECT_EQ(parent_folder("/emb.npy"), "/");
  TempDir d;
  InFolder here(d.path);
  // A bare name is a file of the current folder: written, its folder flushed, no error.
  write_text_durably("bare\n", "names.txt");
  write_text_durably("dot\n", "./dot.txt");
  write_text_durably("abs\n", d / "abs.txt");
  write_npy_float32(torch::arange(6, torch::kFloat).reshape({2, 3}), "emb.npy");
  EXPECT_EQ(testing::read_text(d / "names.txt"), "bare\n");
  EXPECT_EQ(testing::read_text(d / "dot.txt"), "dot\n");
  EXPECT_EQ(testing::read_text(d / "abs.txt"), "abs\n");
  const std::string npy = testing::read_text(d / "emb.npy");
  EXPECT_EQ(npy.substr(0, 6), "\x93NUMPY");
  EXPECT_GT(npy.size(), 24u + 10u);  // 6 float32 after the header
  // Nothing else is left in the folder (no temporary file).
  int files = 0;
  for (const auto& e : fs::directory_iterator(d.path)) files += e.is_regular_file();
  EXPECT_EQ(files, 4);
}

// --- scheduled work --------------------------------------------------------------------------

// Two ranks as the trainer times them: each step 0.1 s of work; every `verify_every` steps
// rank 0 verifies for 3.85 s while rank 1 waits in the verification's barrier. With
// `judge`, the steps are judged as the trainer does (judged_step of the scheduled share);
// without, raw. slow1: rank 1's work this many times slower (a real straggler).
struct TwoRanks {
  std::vector<std::unique_ptr<StragglerMonitor>> m;
  int64_t step = StragglerMonitor::kWarmupSteps;
  double clock[2] = {0, 0}, blocked[2] = {0, 0};
  std::vector<ScheduledWork> scheduled;
  explicit TwoRanks(int64_t window) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    for (int r = 0; r < 2; ++r) {
      m.push_back(std::make_unique<StragglerMonitor>(store, r, 2, std::vector<std::string>{"a", "b"}, window));
      scheduled.emplace_back([] { return 0.0; });
    }
  }
  // One step of both ranks; returns whether rank 1's step reads as a stall.
  bool run_step(bool judge, bool verify, double slow1 = 1.0, double median_step = 0.1) {
    ++step;
    bool stall1 = false;
    const double work[2] = {0.1, 0.1 * slow1};
    // The faster rank waits for the slower one in the step's collectives.
    const double wait[2] = {std::max(0.0, work[1] - work[0]), std::max(0.0, work[0] - work[1])};
    for (int r = 0; r < 2; ++r) {
      const double t0 = clock[r], b0 = blocked[r];
      clock[r] += work[r] + wait[r];
      blocked[r] += wait[r];
      if (verify) {
        // Rank 0 embeds the sets; rank 1 waits for it in the barrier: inside the brackets.
        scheduled[r].begin("verification", clock[r], blocked[r]);
        clock[r] += 3.85;
        if (r == 1) blocked[r] += 3.85;
        scheduled[r].end(clock[r], blocked[r]);
      }
      const ScheduledWork::Share share = scheduled[r].take();
      EXPECT_EQ(share.what, verify ? "verification" : "");
      const JudgedStep raw{clock[r] - t0, blocked[r] - b0};
      const JudgedStep j = judge ? judged_step(raw.step_s, raw.blocked_s, share) : raw;
      m[r]->add_step(step, j.step_s, 0.0, j.blocked_s, {0.1});
      if (r == 1) stall1 = is_stall(j.blocked_s, median_step);
    }
    return stall1;
  }
};

bool judged(StragglerMonitor& m, int64_t n) {
  for (int i = 0; i < 500 && m.windows_judged() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return m.windows_judged() >= n;
}

TEST(ScheduledWork, VerificationOnRankZeroIsNeitherAStallNorAStraggler) {
  // Unjudged, the other rank's wait for the verification is a 3.85 s stall, and with a
  // verification every other step rank 0 reads as a straggler: the false alarms.
  {
    TwoRanks raw(4);
    bool stalled = false;
    for (int k = 0; k < 16; ++k) stalled = raw.run_step(false, k % 2 == 1) || stalled;
    EXPECT_TRUE(stalled);
    ASSERT_TRUE(judged(*raw.m[0], 4));
    bool rank0_named = false;
    for (int i = 0; i < 100 && !rank0_named; ++i) {
      for (const auto& r : raw.m[0]->take_reports()) rank0_named = rank0_named || r.rank == 0;
      if (!rank0_named) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(rank0_named) << "the unjudged steps no longer reproduce the false straggler";
  }
  // Judged: the same run has no stall and no straggler.
  TwoRanks run(4);
  for (int k = 0; k < 16; ++k) EXPECT_FALSE(run.run_step(true, k % 2 == 1)) << "step " << run.step;
  ASSERT_TRUE(judged(*run.m[0], 4));
  EXPECT_TRUE(run.m[0]->take_reports().empty());
  for (const auto& rank : run.m[0]->last_scores())
    for (double s : rank) EXPECT_GT(s, StragglerMonitor::kThreshold);
  // A real slow peer is still named, verification or not: rank 1's work 1.6x for two windows.
  for (int k = 0; k < 8; ++k) run.run_step(true, k % 2 == 1, 1.6);
  ASSERT_TRUE(judged(*run.m[0], 6));
  std::vector<StragglerReport> got;
  for (int i = 0; i < 300 && got.empty(); ++i) {
    got = run.m[0]->take_reports();
    if (got.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].rank, 1);
  EXPECT_EQ(got[0].phase, "compute");
  // And a wait outside scheduled work (a peer that froze for 3.85 s) is still a stall.
  ScheduledWork none([] { return 0.0; });
  const JudgedStep frozen = judged_step(3.95, 3.85, none.take());
  EXPECT_TRUE(is_stall(frozen.blocked_s, 0.1));
}

// The scope reads the clock and the blocked total itself, names what ran, and keeps the
// heartbeats measured meanwhile out of the straggler windows' round trips.
TEST(ScheduledWork, ScopeMeasuresTheWorkAndHidesItsRoundTrips) {
  LinkWatch links;
  double blocked_total = 2.0;
  ScheduledWork work([&] { return blocked_total; }, &links);
  links.store_answered(1, 0.3);
  {
    const auto verifying = work.scope("verification");
    links.store_answered(2, 250.0);  // the store's host busy verifying
    blocked_total += 0.5;
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  links.store_answered(3, 0.4);
  { const auto saving = work.scope("checkpoint"); }
  { const auto again = work.scope("verification"); }
  const ScheduledWork::Share s = work.take();
  EXPECT_EQ(s.what, "verification and checkpoint");
  EXPECT_DOUBLE_EQ(s.blocked_s, 0.5);
  EXPECT_GE(s.wall_s, 0.03);
  EXPECT_LT(s.wall_s, 5.0);
  EXPECT_EQ(links.take_round_trips_ms(), (std::vector<double>{0.3, 0.4}));
  EXPECT_EQ(links.last_answer_ms(), 3);  // the store did answer: the hang detection sees it
  EXPECT_EQ(work.take().what, "");
  EXPECT_EQ(work.take().wall_s, 0.0);
}

// --- TAR@FAR ---------------------------------------------------------------------------------

TEST(VerificationMetrics, TarAtFarSaysWhenThePairsCannotMeasureIt) {
  EXPECT_EQ(negatives_needed(1e-4), 10000);
  EXPECT_EQ(negatives_needed(1e-3), 1000);
  EXPECT_EQ(negatives_needed(1e-6), 1000000);
  EXPECT_EQ(negatives_needed(0.3), 4);
  EXPECT_EQ(far_label(1e-4), "1e-4");
  EXPECT_EQ(far_label(1e-1), "1e-1");
  EXPECT_EQ(far_label(0.05), "0.05");
  // 200 negatives: the ROC's smallest FPR step is 1/200 = 5e-3; FAR 1e-4 reads FPR 0.
  EXPECT_EQ(tar_at_far_text(0.125, 1e-4, 200), "not enough pairs (200 negatives, 10000 needed)");
  EXPECT_EQ(tar_at_far_text(0.125, 1e-4, 9999), "not enough pairs (9999 negatives, 10000 needed)");
  EXPECT_EQ(tar_at_far_text(0.125, 1e-4, 10000), "0.1250");
  EXPECT_EQ(tar_at_far_text(0.98765, 1e-3, 1740, 2, true), "98.77");
  // The text follows the ROC it stands for: with 200 negatives TAR@FAR=1e-4 is the TPR at
  // FPR 0, which is what tar_at_far returns, and what a reader must not take for 1e-4.
  std::vector<double> scores;
  std::vector<int> labels;
  std::mt19937 g(3);
  std::normal_distribution<double> n(0, 1);
  for (int i = 0; i < 200; ++i) scores.push_back(n(g)), labels.push_back(0);
  for (int i = 0; i < 200; ++i) scores.push_back(n(g) + 2), labels.push_back(1);
  const RocCurve roc = roc_curve(scores, labels);
  double fpr_chosen = -1, best = 1e9;
  for (size_t k = 0; k < roc.fpr.size(); ++k)
    if (std::fabs(roc.fpr[k] - 1e-4) <= best) best = std::fabs(roc.fpr[k] - 1e-4), fpr_chosen = roc.fpr[k];
  EXPECT_EQ(fpr_chosen, 0.0);
  EXPECT_NE(tar_at_far_text(tar_at_far(roc, 1e-4), 1e-4, 200).find("not enough pairs"), std::string::npos);
  EXPECT_EQ(tar_at_far_text(tar_at_far(roc, 1e-1), 1e-1, 200).find("not enough"), std::string::npos);
}

// --- the training log line's learning rate ---------------------------------------------------

TEST(TrainLog, SmallLearningRatesKeepTheirDigits) {
  for (double lr : {0.1, 0.0593, 0.0825, 1e-3, 2.5e-6, 3.3e-9, 0.4}) {
    const std::string s = format_lr(lr);
    const double back = std::strtod(s.c_str(), nullptr);
    EXPECT_LE(std::fabs(back - lr), 5e-4 * lr) << lr << " printed as " << s;
  }
  EXPECT_EQ(format_lr(0.0), "0");
  EXPECT_EQ(format_lr(0.1), "0.1");
  // The console line carries it.
  TrainRecord r;
  r.step = 40;
  r.last_step = 90;
  r.lr = 2.5e-6;
  r.fc_lr = 2.5e-6;
  ConsoleSink sink(false);
  ::testing::internal::CaptureStdout();
  sink.train(r);
  const std::string out = ::testing::internal::GetCapturedStdout();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("  lr (\\S+)  "))) << out;
  EXPECT_NEAR(std::strtod(m[1].str().c_str(), nullptr), 2.5e-6, 1e-12) << out;
  // The classifier's own rate (optim.fc_lr) beside it when it differs, and only then.
  EXPECT_EQ(out.find("fc_lr"), std::string::npos) << out;
  r.lr = 0.1;
  r.fc_lr = 2.5e-5;
  ::testing::internal::CaptureStdout();
  sink.train(r);
  const std::string own = ::testing::internal::GetCapturedStdout();
  ASSERT_TRUE(std::regex_search(own, m, std::regex("  lr (\\S+)  fc_lr (\\S+)  "))) << own;
  EXPECT_NEAR(std::strtod(m[2].str().c_str(), nullptr), 2.5e-5, 1e-12) << own;
}

// The verification line: an untrained network's small XNorm in significant digits (never
// "0.00000"), step 0 said to be the untrained network; the fields train_e2e.sh reads by
// "XNorm: (\\S+)  threshold: (\\S+)" unchanged.
TEST(UserReports, VerificationLineNamesStepZeroAndASmallXNorm) {
  ValidationRecord v;
  v.set = "lfw";
  v.step = 0;
  v.accuracy = 0.5;
  v.xnorm = 3.25e-6;
  v.threshold = 1.5;
  ConsoleSink sink(false);
  ::testing::internal::CaptureStdout();
  sink.validation(v);
  v.step = 200;
  v.xnorm = 22.5;
  sink.validation(v);
  const std::string out = ::testing::internal::GetCapturedStdout();
  const std::string first = out.substr(0, out.find('\n')), second = out.substr(out.find('\n') + 1);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(first, m, std::regex("XNorm: (\\S+)  threshold: (\\S+)"))) << first;
  EXPECT_NEAR(std::strtod(m[1].str().c_str(), nullptr), 3.25e-6, 1e-8) << first;
  EXPECT_NE(first.find("step 0: the untrained network"), std::string::npos) << first;
  ASSERT_TRUE(std::regex_search(second, m, std::regex("XNorm: (\\S+)  threshold: (\\S+)"))) << second;
  EXPECT_EQ(m[1].str(), "22.50000");
  EXPECT_EQ(second.find("step 0"), std::string::npos) << second;
}

// --- doubles in the printed config -----------------------------------------------------------

TEST(ConfigYaml, DoublesArePrintedShortestAndReadBackExactly) {
  const Config c = load_config_text(
      "data:\n  num_classes: 10\noptim:\n  lr: 1.0e-7\n  momentum: 0.9\n  weight_decay: 5.0e-4\n"
      "loss:\n  margin: [1.0, 0.5, 0.0]\n  sample_rate: 0.3\n",
      "m.yaml");
  const std::string yaml = config_to_yaml(c);
  // No double printed with 17 digits ("0.90000000000000002", "0.29999999999999999").
  EXPECT_FALSE(std::regex_search(yaml, std::regex("[0-9]\\.[0-9]{12,}"))) << yaml;
  EXPECT_NE(yaml.find("momentum: 0.9\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("lr: 1e-07\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("margin: [1, 0.5, 0]"), std::string::npos) << yaml;
  const Config back = load_config_text(yaml, "printed.yaml");
  EXPECT_EQ(back.optim.momentum, c.optim.momentum);
  EXPECT_EQ(back.optim.lr, c.optim.lr);
  EXPECT_EQ(back.optim.weight_decay, c.optim.weight_decay);
  EXPECT_EQ(back.loss.margin, c.loss.margin);
  EXPECT_EQ(config_to_yaml(back), yaml);
}

// --- the hint for bad images -----------------------------------------------------------------

std::string loader_error(const std::shared_ptr<Dataset>& ds) {
  LoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 1;
  o.max_bad_fraction = 0.0;
  DataLoader loader(ds, DistributedSampler(ds->size(), 1, 0, 0), o);
  return error_of([&] {
    loader.start_epoch(0);
    while (loader.next()) {
    }
  });
}

TEST(DataLoader, BadImageHintFitsTheSourceKind) {
  TempDir d;
  const SyntheticFaces faces(4);
  std::vector<uint8_t> cut = faces.view_jpeg(1, 3);
  cut.resize(cut.size() / 3);
  // A folder source: the hint is pack's check of that folder, never a .rec command.
  for (int id = 0; id < 2; ++id) {
    fs::create_directories(d / ("faces/id" + std::to_string(id)));
    for (int i = 0; i < 4; ++i)
      testing::spit(d / ("faces/id" + std::to_string(id) + "/" + std::to_string(i) + ".jpg"),
                    id == 1 && i == 2 ? cut : faces.view_jpeg(uint64_t(id), uint64_t(i)));
  }
  const std::string folder = loader_error(open_dataset(d / "faces"));
  EXPECT_NE(folder.find("id1/2.jpg"), std::string::npos) << folder;
  EXPECT_NE(folder.find("faceshard-pack pack " + (d / "faces") + " OUT --decode"), std::string::npos) << folder;
  EXPECT_EQ(folder.find("verify"), std::string::npos) << folder;
  EXPECT_EQ(folder.find(".rec"), std::string::npos) << folder;
  // A .rec source: the hint is pack's verify of that file.
  fs::create_directories(d / "rec");
  {
    InsightFaceRecWriter w(d / "rec/train.rec", d / "rec/train.idx");
    for (int i = 0; i < 8; ++i) w.add(i / 4, i == 5 ? cut : faces.view_jpeg(uint64_t(i / 4), uint64_t(i)));
    w.commit();
  }
  const std::string rec = loader_error(open_dataset(d / "rec"));
  EXPECT_NE(rec.find("faceshard-pack verify " + (d / "rec/train.rec") + " --decode"), std::string::npos) << rec;
  EXPECT_EQ(rec.find("faceshard-pack pack "), std::string::npos) << rec;
}

// --- faceshard-dist-check --trace RUN --------------------------------------------------------

TEST(DistCheckTool, TraceTakesTheRunFolderOrItsTraceFolder) {
  const std::string run = testing::temp_dir("trace_run");
  fs::create_directories(run + "/trace");
  for (int r = 0; r < 2; ++r) {
    CollectiveTrace t;
    t.set_context(7, "forward");
    for (int64_t seq = 1; seq <= (r == 1 ? 2 : 3); ++seq) {
      t.begin(seq, "all_reduce", "gloo", "float32", 4);
      if (seq < 3) t.end(seq);  // rank 0 waits in #3, which rank 1 never entered
    }
    ASSERT_TRUE(t.write(run + "/trace/rank" + std::to_string(r) + ".jsonl", r, 2, "h" + std::to_string(r), "test"));
  }
  const auto inner = testing::run_tool("faceshard-dist-check", "--trace " + run + "/trace");
  ASSERT_EQ(inner.status, 0) << inner.output;
  EXPECT_NE(inner.output.find("never entered by rank 1"), std::string::npos) << inner.output;
  const auto outer = testing::run_tool("faceshard-dist-check", "--trace " + run);
  EXPECT_EQ(outer.status, 0) << outer.output;
  EXPECT_EQ(outer.output, inner.output);
  // A folder with neither: one line naming it, usage exit status.
  const std::string empty = testing::temp_dir("trace_empty");
  const auto none = testing::run_tool("faceshard-dist-check", "--trace " + empty);
  EXPECT_EQ(none.status, 2) << none.output;
  EXPECT_NE(none.output.find("no trace files (rank<r>.jsonl) in it or in its trace/ folder"), std::string::npos)
      << none.output;
}

}  // namespace
}  // namespace faceshard
