// loss.init_centres: a run's classifier centres from another run's checkpoint. Each case
// writes a K = 3 checkpoint by hand (saved on 3 ranks), a faceshard-clean report naming each
// class's dominant sub-centre and, for a cleaned set, the labels.tsv that maps its classes to
// the source set's; the expected rows are picked from the saved matrix by plain loops.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "app/config/config.h"
#include "app/io/checkpoint.h"
#include "app/train/centre_init.h"
#include "app/train/train_job.h"
#include "models/torch_save/state_dict_io.h"
#include "partial_fc/classifier/class_shard.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/distributed/dist_env.h"
#include "tests/harness.h"
#include "tests/test_errors.h"

namespace faceshard {
namespace {

using testing::error_of;

constexpr int64_t kC = 23, kK = 3, kD = 8;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

struct Saved {
  std::string dir;            // the step folder
  at::Tensor weight;          // [kC * kK, kD]
  std::vector<int64_t> dominant, images;  // by class; dominant -1: not in the report
};

// A K = 3 checkpoint of step 7 and its report (class 5 has no images: no rows).
Saved save_k3(const std::string& root, uint64_t seed) {
  Saved s;
  s.dir = root + "/run/checkpoints/step_00000007";
  std::filesystem::create_directories(s.dir);
  s.weight = torch::randn({kC * kK, kD}, at::make_generator<at::CPUGeneratorImpl>(seed));
  const at::Tensor momentum = torch::ones({kC * kK, kD});
  for (const ClassShard& sh : ClassShard::all(kC, 3))
    write_state_dict({{"rows.start", torch::tensor({sh.start})},
                      {"rows.count", torch::tensor({sh.count})},
                      {"rows.subcenters", torch::tensor({kK})},
                      {"rows/weight", s.weight.narrow(0, sh.start * kK, sh.count * kK)},
                      {"rows/opt.momentum", momentum.narrow(0, sh.start * kK, sh.count * kK)}},
                     s.dir + "/fc_shard_" + std::to_string(sh.rank) + ".pt");
  testing::write_text(s.dir + "/COMMITTED", "step 7\nworld_size 3\nnum_classes 23\n");
  std::mt19937_64 rng(seed);
  std::string tsv = "# faceshard-clean dropped_subcenters.tsv: the non-dominant sub-centres\n"
                    "# run: " + s.dir + " (step 7, saved on 3 ranks)\n"
                    "# images: 230, classes: 23, sub-centres per class: 3\n"
                    "class\tsubcenter\timages\tdominant\tdominant_images\tangle_to_dominant_deg\n";
  for (int64_t c = 0; c < kC; ++c) {
    const int64_t d = c == 5 ? -1 : int64_t(rng() % kK), n = c == 5 ? 0 : 3 + int64_t(rng() % 20);
    s.dominant.push_back(d);
    s.images.push_back(n);
    if (d < 0) continue;
    for (int64_t k = 0; k < kK; ++k)
      if (k != d)
        tsv += std::to_string(c) + "\t" + std::to_string(k) + "\t1\t" + std::to_string(d) + "\t" + std::to_string(n) +
               "\t80.0\n";
  }
  std::filesystem::create_directories(root + "/report");
  testing::write_text(root + "/report/dropped_subcenters.tsv", tsv);
  return s;
}

std::string job_yaml(const std::string& dir, const std::string& rec, int64_t classes, const std::string& loss) {
  return "output: " + dir + "/out\ndata: {rec: " + rec + ", num_classes: " + std::to_string(classes) +
         ", batch_size: 4, num_workers: 1}\nmodel: {backbone: mbf, embedding_size: 8}\n"
         "train: {verify_every: 0, tensorboard: false}\ndist: {device: cpu}\nloss: {" + loss + "}\n";
}

// The whole training job on the set the K = 3 run trained on: every class keeps the saved row
// of its dominant sub-centre (sub-centre 0 for the class the report saw no image of), and the
// optimiser state starts at zero, not at the checkpoint's.
TEST(CentreInit, AK3RunsDominantSubcentresStartAK1RunOfTheSameClasses) {
  const std::string dir = testing::temp_dir("centre_init_job");
  const Saved s = save_k3(dir, 5);
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const Config cfg = load_config_text(
      job_yaml(dir, "synthetic", kC, "init_centres: " + dir + "/run, init_centres_report: " + dir + "/report"), "job.yaml");
  TrainJob job = build_train_job(cfg, dist);
  const at::Tensor w = job.fc->weight();
  ASSERT_EQ(w.size(0), kC);
  for (int64_t c = 0; c < kC; ++c) {
    const int64_t k = s.dominant[size_t(c)] < 0 ? 0 : s.dominant[size_t(c)];
    EXPECT_TRUE(torch::equal(w[c], s.weight[c * kK + k])) << "class " << c << " is not its sub-centre " << k;
  }
  int zero_state = 0;
  for (const auto& [name, t] : job.fc->state())
    if (name != "weight") zero_state += torch::equal(t, torch::zeros_like(t));
  EXPECT_GE(zero_state, 1) << "the optimiser state does not start at zero";
  // Without the report the K = 3 centres cannot become one per class; with another K they are refused.
  std::string msg = error_of([&] {
    build_train_job(load_config_text(job_yaml(dir, "synthetic", kC, "init_centres: " + dir + "/run"), "j.yaml"), dist);
  });
  EXPECT_TRUE(contains(msg, "saved with 3 sub-centres per class, this run has 1: set loss.init_centres_report")) << msg;
  msg = error_of([&] {
    build_train_job(load_config_text(job_yaml(dir, "synthetic", kC, "subcenters: 2, init_centres: " + dir + "/run"),
                                     "j.yaml"), dist);
  });
  EXPECT_TRUE(contains(msg, "this run has loss.subcenters 2")) << msg;
  // Another number of classes and no table that says which is which.
  msg = error_of([&] {
    build_train_job(load_config_text(job_yaml(dir, "synthetic", 20, "init_centres: " + dir + "/run, init_centres_report: " +
                                                                          dir + "/report"), "j.yaml"), dist);
  });
  EXPECT_TRUE(contains(msg, "the checkpoint has 23 classes, this run's data 20, and nothing says which is which")) << msg;
}

// A cleaned set: classes renumbered, some dropped, two merged. Each class takes its source
// class's dominant sub-centre; the merged class the source with more images at its dominant
// sub-centre (listed second here, so that taking the first one fails).
TEST(CentreInit, ACleanedSetsClassesTakeTheirSourcesDominantSubcentre) {
  const std::string dir = testing::temp_dir("centre_init_map");
  const Saved s = save_k3(dir, 9);
  // New class -> source classes: a permutation of some classes, with {a, b} merged where b
  // has more images at its dominant sub-centre than a.
  int64_t a = -1, b = -1;
  for (int64_t x = 0; x < kC && a < 0; ++x)
    for (int64_t y = 0; y < kC; ++y)
      if (x != 5 && y != 5 && x != y && s.images[size_t(y)] > s.images[size_t(x)]) {
        a = x;
        b = y;
        break;
      }
  ASSERT_GE(a, 0);
  std::vector<std::vector<int64_t>> sources = {{a, b}};
  for (int64_t x = kC - 1; x >= 0; x -= 2)
    if (x != a && x != b) sources.push_back({x});
  std::filesystem::create_directories(dir + "/clean");
  std::string labels = "label\tsource_classes\timages\n";
  for (size_t c = 0; c < sources.size(); ++c) {
    labels += std::to_string(c) + "\t";
    for (size_t i = 0; i < sources[c].size(); ++i) labels += (i ? "," : "") + std::to_string(sources[c][i]);
    labels += "\t10\n";
  }
  testing::write_text(dir + "/clean/train.labels.tsv", labels);
  const int64_t N = int64_t(sources.size());
  const Config cfg = load_config_text(job_yaml(dir, dir + "/clean", N,
                                               "init_centres: " + s.dir + ", init_centres_report: " + dir + "/report"),
                                      "job.yaml");
  const CentreInitPlan plan = plan_centre_init(cfg, N, 1);
  EXPECT_EQ(plan.merged, 1);
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  PartialFCOptions po;
  po.num_classes = N;
  po.embedding_size = kD;
  po.initialise_rows = false;
  PartialFC fc(*dist, po);
  init_centres(fc, plan);
  for (int64_t c = 0; c < N; ++c) {
    const int64_t src = c == 0 ? b : sources[size_t(c)][0];
    const int64_t k = s.dominant[size_t(src)] < 0 ? 0 : s.dominant[size_t(src)];
    EXPECT_TRUE(torch::equal(fc.weight()[c], s.weight[src * kK + k])) << "class " << c << " (source " << src << ")";
  }
  EXPECT_TRUE(contains(describe(plan), "1 of them merged from several")) << describe(plan);
  // A table that names a class the checkpoint does not have, or a source twice.
  testing::write_text(dir + "/clean/train.labels.tsv", "label\tsource_classes\timages\n0\t3,23\t4\n");
  std::string msg = error_of([&] { plan_centre_init(load_config_text(job_yaml(dir, dir + "/clean", 1,
      "init_centres: " + s.dir + ", init_centres_report: " + dir + "/report"), "j.yaml"), 1, 1); });
  EXPECT_TRUE(contains(msg, "train.labels.tsv:2: source class '23' of class 0 is not one of the 23")) << msg;
  testing::write_text(dir + "/clean/train.labels.tsv", "label\tsource_classes\timages\n0\t3\t4\n1\t3\t4\n");
  msg = error_of([&] { plan_centre_init(load_config_text(job_yaml(dir, dir + "/clean", 2,
      "init_centres: " + s.dir + ", init_centres_report: " + dir + "/report"), "j.yaml"), 2, 1); });
  EXPECT_TRUE(contains(msg, "train.labels.tsv:3: source class 3 is named a second time")) << msg;
}

// The same K: every row of each class, the report not asked for (and refused when given).
TEST(CentreInit, TheSameKTakesEveryRowAndAReportOfAnotherStepIsRefused) {
  const std::string dir = testing::temp_dir("centre_init_same");
  const Saved s = save_k3(dir, 13);
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  TrainJob job = build_train_job(
      load_config_text(job_yaml(dir, "synthetic", kC, "subcenters: 3, init_centres: " + dir + "/run"), "job.yaml"), dist);
  EXPECT_TRUE(torch::equal(job.fc->weight(), s.weight));
  std::string msg = error_of([&] {
    build_train_job(load_config_text(job_yaml(dir, "synthetic", kC, "subcenters: 3, init_centres: " + dir +
                                                                          "/run, init_centres_report: " + dir + "/report"),
                                     "j.yaml"), dist);
  });
  EXPECT_TRUE(contains(msg, "there is no dominant one to choose")) << msg;
  // A report made of another step, or of a checkpoint with other counts, belongs to another run.
  const std::string tsv = dir + "/report/dropped_subcenters.tsv";
  std::string text;
  {
    std::ifstream f(tsv);
    text.assign(std::istreambuf_iterator<char>(f), {});
  }
  const std::string k1 = job_yaml(dir, "synthetic", kC, "init_centres: " + dir + "/run, init_centres_report: " + dir + "/report");
  testing::write_text(tsv, std::string(text).replace(text.find("(step 7"), 7, "(step 6"));
  msg = error_of([&] { build_train_job(load_config_text(k1, "j.yaml"), dist); });
  EXPECT_TRUE(contains(msg, "dropped_subcenters.tsv: made of step 6, loss.init_centres is step 7")) << msg;
  testing::write_text(tsv, std::string(text).replace(text.find("classes: 23"), 11, "classes: 24"));
  msg = error_of([&] { build_train_job(load_config_text(k1, "j.yaml"), dist); });
  EXPECT_TRUE(contains(msg, "made of a checkpoint of 24 classes x 3 sub-centres")) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

}  // namespace
}  // namespace faceshard
