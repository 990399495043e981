// An image folder checked before training as faceshard-pack checks it before packing: every
// file read and its header and end checked, every identity folder listed the same way (an
// empty one, one that holds sub-folders named as such), every problem listed at start
// (bounded) and the run refused, or left out with data.skip_bad and counted; and the
// check's time on a few thousand small images.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/image_check.h"
#include "data/pack_source.h"
#include "data/synthetic_faces.h"
#include "tests/harness.h"
#include "tests/test_errors.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

void put(const std::string& path, const std::vector<uint8_t>& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  testing::spit(path, bytes);
}

// Four identities of good 112x112 JPEGs, and the three problems a user's folder has: a
// JPEG cut short, a text file named .jpg, an identity folder holding a sub-folder.
struct BadFolder {
  TempDir d;
  std::string root = d / "faces";
  std::string truncated = root + "/alice/2.jpg", text = root + "/bob/notes.jpg", nested = root + "/carol";
  BadFolder() {
    const SyntheticFaces faces(3);
    for (int id = 0; id < 4; ++id) {
      const std::string who = std::vector<std::string>{"alice", "bob", "carol", "dave"}[static_cast<size_t>(id)];
      for (int v = 0; v < 3; ++v) put(root + "/" + who + "/" + std::to_string(v) + ".jpg", faces.view_jpeg(id, v));
    }
    const std::vector<uint8_t> good = faces.view_jpeg(0, 2);
    put(truncated, std::vector<uint8_t>(good.begin(), good.begin() + static_cast<long>(good.size() / 2)));
    const std::string words = "not an image at all\n";
    put(text, std::vector<uint8_t>(words.begin(), words.end()));
    put(nested + "/extra/0.jpg", faces.view_jpeg(2, 7));
    put(nested + "/extra/1.jpg", faces.view_jpeg(2, 8));
  }
};

ImageFolderOptions checked(bool skip_bad) {
  ImageFolderOptions o;
  o.check_images = true;
  o.skip_bad = skip_bad;
  o.report = false;
  o.threads = 2;
  return o;
}

TEST(FolderCheck, TrainerAndPackNameTheSameThreeProblems) {
  BadFolder f;
  // pack's view: the listing and the header check, shared.
  PackSource src = list_pack_source(f.root);
  std::vector<PackProblem> problems = src.problems;
  const std::vector<uint64_t> bad = check_source_images(src, 112, 2, problems);
  ASSERT_EQ(problems.size(), 3u);
  EXPECT_EQ(bad.size(), 2u);
  EXPECT_EQ(src.ignored_files, 0u);  // a sub-folder is no "file without an image extension"
  EXPECT_EQ(problems[0].path, f.nested);
  EXPECT_EQ(problems[0].what,
            "identity folder holds the sub-folder 'extra' (2 images in them): identities are the folders directly "
            "under the source, so these are not read; move the images up into this folder or make each sub-folder "
            "an identity of its own");
  EXPECT_EQ(problems[1].path, f.truncated);
  EXPECT_EQ(problems[1].what, "cut short (no JPEG end marker)");
  EXPECT_EQ(problems[2].path, f.text);
  EXPECT_NE(problems[2].what.find("not a JPEG, PNG or BMP"), std::string::npos) << problems[2].what;
  // The trainer's view: refused, all three named.
  const std::string msg = error_of([&] { ImageFolderDataset ds(f.root, checked(false)); });
  EXPECT_NE(msg.find("data.rec '" + f.root + "': 3 problems in the image folder (each listed above); fix them, or "
                     "set data.skip_bad: true to leave those files and folders out"),
            std::string::npos)
      << msg;
  // data.skip_bad: the two bad images left out, carol's own images kept, extra/ unread.
  ImageFolderDataset ds(f.root, checked(true));
  EXPECT_EQ(ds.size(), 11u);
  EXPECT_EQ(ds.class_names(), (std::vector<std::string>{"alice", "bob", "carol", "dave"}));
  for (uint64_t i = 0; i < ds.size(); ++i) {
    EXPECT_NE(ds.path(i), f.truncated);
    EXPECT_NE(ds.path(i), f.text);
    EXPECT_EQ(ds.path(i).find("/extra/"), std::string::npos) << ds.path(i);
  }
  // One problem is one line, with what to do.
  fs::remove(f.text);
  fs::remove_all(f.nested + "/extra");
  EXPECT_EQ(error_of([&] { ImageFolderDataset one(f.root, checked(false)); }),
            "data.rec '" + f.root + "': " + f.truncated +
                ": cut short (no JPEG end marker); fix it, or set data.skip_bad: true to leave it out");
}

TEST(FolderCheck, AFolderOneLevelTooHighAndEmptyIdentities) {
  TempDir d;
  const SyntheticFaces faces(4);
  put(d / "top/webface/a/0.jpg", faces.view_jpeg(0, 0));
  put(d / "top/webface/b/0.jpg", faces.view_jpeg(1, 0));
  const PackSource s = list_pack_source(d / "top");
  ASSERT_EQ(s.problems.size(), 1u);
  EXPECT_EQ(s.problems[0].what,
            "identity folder holds no image, only the sub-folders 'a', 'b' (2 images in them): identities are the "
            "folders directly under the source (is the source one level too high?)");
  fs::create_directories(d / "flat/empty_id");
  put(d / "flat/x/0.jpg", faces.view_jpeg(0, 0));
  put(d / "flat/x/0.txt", {'x'});
  const std::string msg = error_of([&] { ImageFolderDataset ds(d / "flat"); });
  EXPECT_NE(msg.find("empty_id: empty identity folder"), std::string::npos) << msg;
  ImageFolderOptions skip;
  skip.skip_bad = true;
  skip.report = false;
  EXPECT_EQ(ImageFolderDataset(d / "flat", skip).size(), 1u);
}

// faceshard-train itself: refused at start with exit status 2, one line per problem, then
// the summary; data.skip_bad trains and says how many were left out; more than 20
// problems list 20 and count the rest.
TEST(FolderCheck, TrainerRefusesAtStartOrSkipsAndCounts) {
  BadFolder f;
  const std::string cfg = f.d / "t.yaml";
  testing::write_text(cfg, "output: " + f.d / "run" +
                               "\ndata: {rec: " + f.root +
                               ", batch_size: 4, num_workers: 2}\nmodel: {backbone: mbf_small, embedding_size: 32}\n"
                               "optim: {total_steps: 1}\ntrain: {verify_every: 0, tensorboard: false, precision: fp32}\n"
                               "dist: {device: cpu}\n");
  testing::CommandResult r = testing::run_tool("faceshard-train", "--config '" + cfg + "' 2>&1");
  EXPECT_EQ(r.status, 2) << r.output;
  std::vector<std::string> lines;
  std::istringstream in(r.output);
  for (std::string l; std::getline(in, l);)
    if (l.rfind("error: data: ", 0) == 0) lines.push_back(l);
  ASSERT_EQ(lines.size(), 3u) << r.output;
  // In path order: alice's file, bob's file, carol's folder.
  EXPECT_EQ(lines[0], "error: data: " + f.truncated + ": cut short (no JPEG end marker)");
  EXPECT_EQ(lines[1].rfind("error: data: " + f.text + ": ", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2].rfind("error: data: " + f.nested + ": identity folder holds the sub-folder 'extra' (2 images", 0),
            0u)
      << lines[2];
  EXPECT_NE(r.output.find("faceshard-train: error: data.rec '" + f.root + "': 3 problems in the image folder"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("learning rates:"), std::string::npos) << "went on to train:\n" << r.output;

  r = testing::run_tool("faceshard-train",
                        "--config '" + cfg + "' --set data.skip_bad=true --set output=" + f.d / "run1" + " 2>&1");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("warning: data.skip_bad: left out " + f.truncated + ": cut short"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("data.skip_bad: left out 2 bad images and 1 folder (empty, or inside an identity folder) of '" +
                          f.root + "'; training on 11 images of 4 identities"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("data: checked 13 images of '" + f.root + "' in "), std::string::npos) << r.output;

  for (int k = 0; k < 25; ++k) put(f.root + "/erin/" + std::to_string(100 + k) + ".jpg", {'n', 'o'});
  r = testing::run_tool("faceshard-train", "--config '" + cfg + "' --set output=" + f.d / "run2" + " 2>&1");
  EXPECT_EQ(r.status, 2) << r.output;
  size_t listed = 0;
  std::istringstream in2(r.output);
  for (std::string l; std::getline(in2, l);) listed += l.rfind("error: data: /", 0) == 0;
  EXPECT_EQ(listed, 20u) << r.output;
  EXPECT_NE(r.output.find("error: data: ... and 8 more (28 problems in all)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("28 problems in the image folder (the first 20 listed above)"), std::string::npos) << r.output;
}

// The check's time on a few thousand small images (printed; a speed target belongs to a
// benchmark), and that it finds the one bad file among them.
TEST(FolderCheck, ThreeThousandSmallImagesTimed) {
  TempDir d;
  const SyntheticFaces faces(5);
  const int identities = 300, per = 10;
  std::vector<std::vector<uint8_t>> jpegs;
  for (int v = 0; v < per; ++v) jpegs.push_back(faces.view_jpeg(0, static_cast<uint64_t>(v)));
  for (int id = 0; id < identities; ++id)
    for (int v = 0; v < per; ++v)
      put(d / ("f/id" + std::to_string(id) + "/" + std::to_string(v) + ".jpg"), jpegs[static_cast<size_t>(v)]);
  const std::string cut = d / "f/id123/4.jpg";
  put(cut, std::vector<uint8_t>(jpegs[4].begin(), jpegs[4].end() - 10));
  const PackSource src = list_pack_source(d / "f");
  ASSERT_EQ(src.items.size(), static_cast<size_t>(identities * per));
  for (int threads : {1, 2}) {
    std::vector<PackProblem> problems;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<uint64_t> bad = check_source_images(src, 112, threads, problems);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_EQ(problems.size(), 1u);
    EXPECT_EQ(problems[0].path, cut);
    std::printf("[folder check] %zu images of %zu bytes: %.3f s on %d thread%s (%.0f images/s)\n", src.items.size(),
                jpegs[0].size(), s, threads, threads > 1 ? "s" : "", static_cast<double>(src.items.size()) / s);
  }
}

}  // namespace
}  // namespace faceshard
