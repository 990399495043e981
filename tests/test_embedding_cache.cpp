// The embedding cache between passes (app/eval/embedding_cache.h): an entry read back as it
// was written, only for its own key and shape; a damaged entry is ignored, not trusted.
#include <gtest/gtest.h>

#include <fstream>

#include <torch/torch.h>

#include "app/eval/embedding_cache.h"
#include "test_files.h"

namespace faceshard {
namespace {

TEST(EmbeddingCache, EntriesComeBackForTheirKeyAndShapeOnly) {
  testing::TempDir d;
  const EmbeddingCache cache(d / "cache");
  const at::Tensor e = torch::randn({6, 4});
  // Parts are length-prefixed: ("ab", "c") and ("a", "bc") are two keys.
  EXPECT_NE(EmbeddingCache::key({"ab", "c"}), EmbeddingCache::key({"a", "bc"}));
  const std::string k = EmbeddingCache::key({"run", "file|10|1.5"});
  EXPECT_FALSE(cache.find(k, 6, 4).has_value());
  ASSERT_TRUE(cache.put(k, e));
  const std::optional<at::Tensor> back = cache.find(k, 6, 4);
  ASSERT_TRUE(back.has_value());
  EXPECT_TRUE(torch::equal(*back, e));
  EXPECT_FALSE(cache.find(k, 5, 4).has_value()) << "another shape is another input";
  EXPECT_FALSE(cache.find(EmbeddingCache::key({"run", "file|10|1.6"}), 6, 4).has_value());
  // A damaged entry: ignored.
  std::ofstream(d / ("cache/" + k + ".npy"), std::ios::trunc) << "not numpy";
  EXPECT_FALSE(cache.find(k, 6, 4).has_value());
  // A file's stamp changes with its contents' size and time; none for a missing file.
  std::ofstream(d / "f.bin") << "abc";
  const std::string s1 = EmbeddingCache::file_stamp(d / "f.bin");
  std::ofstream(d / "f.bin", std::ios::trunc) << "abcd";
  EXPECT_NE(EmbeddingCache::file_stamp(d / "f.bin"), s1);
  EXPECT_EQ(EmbeddingCache::file_stamp(d / "missing.bin"), "");
  // A disabled cache finds nothing and keeps nothing.
  const EmbeddingCache off("");
  EXPECT_FALSE(off.put(k, e));
  EXPECT_FALSE(off.find(k, 6, 4).has_value());
}

}  // namespace
}  // namespace faceshard
