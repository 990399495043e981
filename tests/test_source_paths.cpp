// faceshard-pack's sources list beside a .rec (data/source_paths.h): each image's path read
// back by index; a list that does not fit the set is refused naming the file and line.
#include <gtest/gtest.h>

#include <fstream>

#include "data/source_paths.h"
#include "base/error.h"
#include "test_files.h"

namespace faceshard {
namespace {

using testing::TempDir;

std::string refusal(const std::string& rec, uint64_t images) {
  try {
    SourcePaths::open_beside(rec, images);
  } catch (const Error& e) {
    return e.what();
  }
  return "<accepted>";
}

TEST(SourcePaths, PathsByIndexAndListsThatDoNotFitRefused) {
  TempDir dir;
  const std::string rec = dir / "train.rec";
  EXPECT_EQ(sources_path_of(rec), dir / "train.sources.tsv");
  EXPECT_FALSE(SourcePaths::open_beside(rec, 3));  // none: the set names its records
  auto write = [&](const std::string& text) { std::ofstream(dir / "train.sources.tsv") << text; };
  write("index\tlabel\tpath\n0\t0\t/p/alice/1.jpg\n1\t0\t/p/alice/a\tb.jpg\n2\t1\t/p/bob/x.png");  // no final newline
  const std::shared_ptr<const SourcePaths> s = SourcePaths::open_beside(rec, 3);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->path(0), "/p/alice/1.jpg");
  EXPECT_EQ(s->path(1), "/p/alice/a\tb.jpg");  // a tab inside a path is the path's
  EXPECT_EQ(s->path(2), "/p/bob/x.png");
  EXPECT_THROW(s->path(3), Error);
  EXPECT_NE(refusal(rec, 4).find("train.sources.tsv: lists 3 images, the set has 4"), std::string::npos) << refusal(rec, 4);
  EXPECT_NE(refusal(rec, 2).find("lists more than the set's 2 images"), std::string::npos) << refusal(rec, 2);
  write("idx\tlabel\tpath\n0\t0\t/a.jpg\n");
  EXPECT_NE(refusal(rec, 1).find("train.sources.tsv:1: expected the header"), std::string::npos) << refusal(rec, 1);
  write("index\tlabel\tpath\n1\t0\t/a.jpg\n");
  EXPECT_NE(refusal(rec, 1).find("train.sources.tsv:2: expected image 0"), std::string::npos) << refusal(rec, 1);
  write("index\tlabel\tpath\n0\t0\n");
  EXPECT_NE(refusal(rec, 1).find("train.sources.tsv:2: expected 'index<TAB>label<TAB>path'"), std::string::npos)
      << refusal(rec, 1);
}

}  // namespace
}  // namespace faceshard
