// Your own data, first time right: the run folder's rules (a fresh run is refused where a
// run is, --overwrite moves it whole, --resume DIR), what faceshard-pack packs (folders and
// .lst lists, every problem in one pass, the header check), the verification pairs, the
// training.log file, the tools' progress lines and the rounded numbers of log lines.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "app/train/run_folder.h"
#include "data/pack_source.h"
#include "data/synthetic_faces.h"
#include "data/verification_pairs.h"
#include "base/error.h"
#include "base/log.h"
#include "base/progress.h"
#include "tests/test_errors.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

void write(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << text;
}

using testing::error_of;

TEST(RunFolder, FreshRunIntoARunIsRefusedAndOverwriteMovesItWhole) {
  TempDir d;
  const std::string out = d / "run";
  EXPECT_TRUE(run_files_in(out).empty());  // missing: no run
  EXPECT_NO_THROW(check_output_free_for_fresh_run(out, false));
  fs::create_directories(out + "/checkpoints");
  fs::create_directories(out + "/notes");
  write(out + "/notes/mine.txt", "kept");
  EXPECT_TRUE(run_files_in(out).empty());  // an empty checkpoints/ and other files are no run
  write(out + "/metrics.jsonl", "{}\n");
  write(out + "/checkpoints/step_00000003/COMMITTED", "x");
  EXPECT_EQ(run_files_in(out), (std::vector<std::string>{"metrics.jsonl", "checkpoints"}));
  const std::string e = error_of([&] { check_output_free_for_fresh_run(out, false); });
  EXPECT_NE(e.find("output '" + fs::absolute(out).lexically_normal().string() +
                   "' already holds a run (metrics.jsonl, checkpoints): continue it with --resume"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("--overwrite"), std::string::npos) << e;
  EXPECT_NO_THROW(check_output_free_for_fresh_run(out, true));
  const std::string aside = move_previous_run_aside(out);
  ASSERT_FALSE(aside.empty());
  EXPECT_EQ(fs::path(aside).parent_path(), fs::path(out));
  EXPECT_EQ(fs::path(aside).filename().string().rfind("replaced-", 0), 0u);
  EXPECT_TRUE(fs::exists(aside + "/metrics.jsonl"));
  EXPECT_TRUE(fs::exists(aside + "/checkpoints/step_00000003/COMMITTED"));
  EXPECT_TRUE(run_files_in(out).empty());
  EXPECT_TRUE(fs::exists(out + "/notes/mine.txt"));  // not the run's: stays
  // A second move in the same second gets its own folder.
  write(out + "/config.yaml", "a: 1\n");
  const std::string aside2 = move_previous_run_aside(out);
  EXPECT_NE(aside2, aside);
  EXPECT_TRUE(fs::exists(aside2 + "/config.yaml"));
  EXPECT_EQ(move_previous_run_aside(out), "");  // nothing left to move
  write(d / "file", "x");
  EXPECT_NE(error_of([&] { check_output_free_for_fresh_run(d / "file", true); }).find("is a file, not a folder"),
            std::string::npos);
}

TEST(RunFolder, ResumeTakesARunFolderACheckpointsFolderOrACheckpoint) {
  TempDir d;
  const std::string run = d / "run";
  for (const char* step : {"step_00000004", "step_00000012"}) {
    const std::string dir = run + "/checkpoints/" + step;
    const std::string n = std::to_string(std::stoi(std::string(step).substr(5)));
    write(dir + "/COMMITTED", "step " + n + "\nworld_size 1\nnum_classes 10\n");
  }
  fs::create_directories(run + "/checkpoints/step_00000016");  // uncommitted: never taken
  const std::string abs = fs::absolute(d / "nowhere").lexically_normal().string();
  EXPECT_EQ(error_of([&] { resolve_resume_source(d / "nowhere"); }), "--resume '" + abs + "': does not exist");
  write(d / "a_file", "x");
  EXPECT_NE(error_of([&] { resolve_resume_source(d / "a_file"); }).find("is a file"), std::string::npos);
  fs::create_directories(d / "empty");
  EXPECT_NE(error_of([&] { resolve_resume_source(d / "empty"); }).find("is neither a run folder"), std::string::npos);
  fs::create_directories(d / "fresh/checkpoints");
  EXPECT_NE(error_of([&] { resolve_resume_source(d / "fresh"); }).find("holds no committed checkpoint"),
            std::string::npos);
  // Whichever it is given, the checkpoint is the newest committed one (or the one named).
  const std::string latest = run + "/checkpoints/step_00000012";
  EXPECT_EQ(resolve_resume_source(run), latest);
  EXPECT_EQ(resolve_resume_source(run + "/checkpoints"), latest);
  EXPECT_EQ(resolve_resume_source(run + "/checkpoints/step_00000004"), run + "/checkpoints/step_00000004");
}

TEST(PackSource, FoldersListEveryProblemAndDropItemsRenumbers) {
  TempDir d;
  const SyntheticFaces faces(8);
  auto put = [&](const std::string& rel, const std::vector<uint8_t>& b) {
    fs::create_directories(fs::path(d / rel).parent_path());
    testing::spit(d / rel, b);
  };
  put("in/b_id/1.jpg", faces.view_jpeg(0, 0));
  put("in/b_id/2.jpg", faces.view_jpeg(0, 1));
  put("in/a_id/1.jpg", faces.view_jpeg(1, 0));
  put("in/c_id/1.png", std::vector<uint8_t>{1, 2, 3});
  put("in/b_id/notes.txt", std::vector<uint8_t>{'x'});
  fs::create_directories(d / "in/empty_id");
  PackSource s = list_pack_source(d / "in");
  EXPECT_EQ(s.identities, (std::vector<std::string>{"a_id", "b_id", "c_id"}));
  ASSERT_EQ(s.items.size(), 4u);
  EXPECT_EQ(s.items[0].label, 0);
  EXPECT_EQ(s.items[3].label, 2);
  EXPECT_EQ(s.ignored_files, 1u);
  ASSERT_EQ(s.problems.size(), 1u);
  EXPECT_NE(s.problems[0].what.find("empty identity folder"), std::string::npos);
  // c_id's only image is bad: dropping it removes the class and renumbers nothing before it.
  const std::vector<std::string> emptied = drop_items(s, {3});
  EXPECT_EQ(emptied, (std::vector<std::string>{"c_id"}));
  EXPECT_EQ(s.identities, (std::vector<std::string>{"a_id", "b_id"}));
  // The header check: fine, another size, cut short, not an image.
  const std::vector<uint8_t> jpeg = faces.view_jpeg(0, 0);
  EXPECT_EQ(check_image_bytes(jpeg, 112), "");
  EXPECT_NE(check_image_bytes(jpeg, 128).find("image is 112x112, expected 128x128"), std::string::npos);
  EXPECT_EQ(check_image_bytes(std::vector<uint8_t>(jpeg.begin(), jpeg.begin() + jpeg.size() / 2), 112),
            "cut short (no JPEG end marker)");
  EXPECT_NE(check_image_bytes({'h', 'e', 'l', 'l', 'o'}, 112).find("not a JPEG, PNG or BMP"), std::string::npos);
  EXPECT_NE(error_of([&] { list_pack_source(d / "nope"); }).find("does not exist"), std::string::npos);
  EXPECT_NE(error_of([&] { list_pack_source(d / "in/a_id/1.jpg"); }).find("is a file"), std::string::npos);
}

TEST(PackSource, ImageListsInBothFormsAndTheirBadLines) {
  TempDir d;
  write(d / "list.lst",
        "0\t5\tx/a.jpg\n"          // MXNet: index, label, path
        "1\t5.000000\tx/b.jpg\n"   // a float label
        "1\ty/c.jpg\t2\n"          // insightface: aligned, path, label
        "\n"
        "one field\n"
        "2\t-1\tz.jpg\n");         // a negative label is no label
  const PackSource s = list_pack_source(d / "list.lst");
  ASSERT_EQ(s.items.size(), 3u);
  EXPECT_EQ(s.identities, (std::vector<std::string>{"y", "x"}));  // labels 2, 5 -> 0, 1
  EXPECT_EQ(s.items[0].path, (fs::path(d.path) / "y/c.jpg").string());
  EXPECT_EQ(s.items[0].label, 0);
  EXPECT_EQ(s.items[1].label, 1);
  EXPECT_EQ(s.items[2].path, (fs::path(d.path) / "x/b.jpg").string());
  ASSERT_EQ(s.problems.size(), 2u);
  EXPECT_EQ(s.problems[0].path, d / "list.lst" + ":5");
  EXPECT_EQ(s.problems[1].path, d / "list.lst" + ":6");
}

TEST(VerificationPairs, HalfOfEachKindAlternatingDistinctAndSeeded) {
  std::vector<int64_t> labels;
  for (int64_t id = 0; id < 6; ++id)
    for (int i = 0; i < 3; ++i) labels.push_back(id);
  const auto a = make_verification_pairs(labels, 30, 7), b = make_verification_pairs(labels, 30, 7),
             c = make_verification_pairs(labels, 30, 8);
  ASSERT_EQ(a.size(), 30u);
  std::set<std::pair<uint64_t, uint64_t>> seen;
  bool same_as_c = true;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].same, i % 2 == 0);
    EXPECT_EQ(labels[a[i].a] == labels[a[i].b], a[i].same);
    EXPECT_NE(a[i].a, a[i].b);
    EXPECT_TRUE(seen.insert({std::min(a[i].a, a[i].b), std::max(a[i].a, a[i].b)}).second) << "pair " << i;
    EXPECT_EQ(a[i].a, b[i].a);
    EXPECT_EQ(a[i].b, b[i].b);
    same_as_c = same_as_c && a[i].a == c[i].a && a[i].b == c[i].b;
  }
  EXPECT_FALSE(same_as_c);
  // Every same-identity pair there is (6 x 3 = 18), asked for exactly: all listed once.
  EXPECT_EQ(make_verification_pairs(labels, 36, 1).size(), 36u);
  EXPECT_NE(error_of([&] { make_verification_pairs(labels, 38, 1); }).find("give only 18"), std::string::npos);
  EXPECT_NE(error_of([&] { make_verification_pairs({0, 1, 2}, 2, 1); }).find("no identity has two images"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make_verification_pairs({0, 0, 0}, 2, 1); }).find("one identity"), std::string::npos);
  EXPECT_NE(error_of([&] { make_verification_pairs(labels, 3, 1); }).find("an even number"), std::string::npos);
}

TEST(RunLog, LogFileProgressAndRoundedNumbers) {
  EXPECT_EQ(format_sig(0.0170583), "0.0171");
  EXPECT_EQ(format_sig(241.713), "242");
  EXPECT_EQ(format_bytes(4123220), "4.12 MB");
  EXPECT_EQ(format_bytes(9.01e9), "9.01 GB");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(Progress::format_seconds(3725), "1h02m");
  EXPECT_EQ(Progress::format_seconds(185), "3m05s");
  EXPECT_EQ(Progress::format_seconds(42.4), "42s");
  // Every logged line, and the fatal error, goes to the log file too, with its time.
  TempDir d;
  set_log_file(d / "training.log");
  log_info("schedule: 9 steps");
  report_fatal("faceshard-train", "something broke");
  set_log_file("");
  log_info("not in the file");
  std::ifstream in(d / "training.log");
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].size(), 20 + 1 + std::string("schedule: 9 steps").size());
  EXPECT_EQ(lines[0].substr(21), "schedule: 9 steps");
  EXPECT_EQ(lines[0][10], 'T');
  EXPECT_EQ(lines[1].substr(21), "faceshard-train: error: something broke");
  // Progress in a log: a line per 5% past the quiet delay, and the last line.
  setenv("FACESHARD_PROGRESS_AFTER_S", "0", 1);
  ::testing::internal::CaptureStderr();
  {
    Progress p("packing", 40, "images");
    for (uint64_t i = 1; i <= 40; ++i) p.update(i);
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  unsetenv("FACESHARD_PROGRESS_AFTER_S");
  EXPECT_NE(err.find("packing: 2/40 images (5%)"), std::string::npos) << err;
  EXPECT_NE(err.find("packing: 38/40 images (95%)"), std::string::npos) << err;
  EXPECT_NE(err.find("packing: 40/40 images (100%)"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 20) << err;  // 19 steps + the last line
  ::testing::internal::CaptureStderr();
  {
    Progress quiet("packing", 40, "images");  // default delay 2 s: a fast job says nothing
    for (uint64_t i = 1; i <= 40; ++i) quiet.update(i);
  }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

}  // namespace
}  // namespace faceshard
