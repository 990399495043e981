// The CPU block cache (base/cpu_block_cache.h): freed blocks of 1 MiB or more
// are handed out again for requests of their size, never more than the limit is kept, small
// blocks go straight back, and blocks stay with one owner under concurrent use.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/core/Allocator.h>

#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "base/cpu_block_cache.h"

namespace faceshard {
namespace {

constexpr size_t kMiB = size_t(1) << 20;

struct Limit {  // the limit for one test, then nothing kept
  explicit Limit(int64_t bytes) { CpuBlockCache::set_limit(bytes); }
  ~Limit() { CpuBlockCache::set_limit(0); }
};

TEST(CpuBlockCache, ReusesAFreedBlockOfItsSize) {
  c10::Allocator* a = CpuBlockCache::allocator();
  ASSERT_NE(a, nullptr);
  Limit limit(int64_t(64) * kMiB);
  const int64_t hits = CpuBlockCache::hits(), misses = CpuBlockCache::misses();
  void* first = nullptr;
  {
    c10::DataPtr p = a->allocate(4 * kMiB);
    first = p.get();
    std::memset(first, 1, 4 * kMiB);
  }
  EXPECT_GE(CpuBlockCache::cached_bytes(), int64_t(4 * kMiB));
  {
    c10::DataPtr p = a->allocate(4 * kMiB - 1000);  // the same 64 KiB granule: the same block
    EXPECT_EQ(p.get(), first);
    EXPECT_EQ(CpuBlockCache::cached_bytes(), 0);
    c10::DataPtr q = a->allocate(4 * kMiB);  // the block is in use: a new one
    EXPECT_NE(q.get(), first);
  }
  EXPECT_EQ(CpuBlockCache::hits() - hits, 1);
  EXPECT_EQ(CpuBlockCache::misses() - misses, 2);
  // A request more than 1/8 smaller than every kept block does not take one.
  {
    c10::DataPtr p = a->allocate(2 * kMiB);
    EXPECT_EQ(CpuBlockCache::hits() - hits, 1);
  }
  // Nor a larger one.
  {
    c10::DataPtr p = a->allocate(5 * kMiB);
    EXPECT_EQ(CpuBlockCache::hits() - hits, 1);
  }
}

TEST(CpuBlockCache, KeepsNoMoreThanItsLimitAndNoSmallBlocks) {
  c10::Allocator* a = CpuBlockCache::allocator();
  Limit limit(int64_t(5) * kMiB);
  {
    std::vector<c10::DataPtr> blocks;
    for (int i = 0; i < 3; ++i) blocks.push_back(a->allocate(2 * kMiB));
  }
  EXPECT_GT(CpuBlockCache::cached_bytes(), int64_t(2 * kMiB));
  EXPECT_LE(CpuBlockCache::cached_bytes(), int64_t(5 * kMiB));
  const int64_t kept = CpuBlockCache::cached_bytes();
  { c10::DataPtr small = a->allocate(kMiB / 4); }
  EXPECT_EQ(CpuBlockCache::cached_bytes(), kept);
  { c10::DataPtr big = a->allocate(8 * kMiB); }  // larger than the limit: back at once
  EXPECT_EQ(CpuBlockCache::cached_bytes(), kept);
  CpuBlockCache::set_limit(int64_t(2) * kMiB + 65536);
  EXPECT_LE(CpuBlockCache::cached_bytes(), int64_t(2) * kMiB + 65536);
  CpuBlockCache::release_all();
  EXPECT_EQ(CpuBlockCache::cached_bytes(), 0);
  EXPECT_EQ(CpuBlockCache::limit(), int64_t(2) * kMiB + 65536);
}

// Four threads allocate, fill, check and free blocks of random sizes: a block handed to two
// owners at once would show the other's pattern.
TEST(CpuBlockCache, OneOwnerPerBlockUnderConcurrentUse) {
  c10::Allocator* a = CpuBlockCache::allocator();
  Limit limit(int64_t(32) * kMiB);
  std::atomic<int> corrupt{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 200; ++i) {
        const size_t n = kMiB + rng() % (3 * kMiB);
        c10::DataPtr p = a->allocate(n);
        auto* bytes = static_cast<unsigned char*>(p.get());
        std::memset(bytes, t + 1, n);
        std::this_thread::yield();
        for (size_t k = 0; k < n; k += 4093)
          if (bytes[k] != t + 1) corrupt++;
        if (bytes[n - 1] != t + 1) corrupt++;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_LE(CpuBlockCache::cached_bytes(), int64_t(32) * kMiB);
  EXPECT_GT(CpuBlockCache::hits(), 0);
}

// As c10's CPU allocator (in a process where nothing of a higher priority came first): the
// tensors of a loop run on the blocks of the first iteration, and compute as without it.
TEST(CpuBlockCache, TensorsRunOnReusedBlocks) {
  CpuBlockCache::install();
  if (!CpuBlockCache::installed()) GTEST_SKIP() << "another CPU allocator of a higher priority is installed";
  Limit limit(int64_t(256) * kMiB);
  torch::manual_seed(3);
  const at::Tensor x = torch::randn({512, 1024});
  const at::Tensor want = torch::mm(x, x.t()).sum(1);
  const int64_t hits = CpuBlockCache::hits();
  for (int i = 0; i < 5; ++i) {
    const at::Tensor y = torch::mm(x, x.t()).sum(1);  // a 1 MiB product each time
    EXPECT_TRUE(torch::equal(y, want));
  }
  EXPECT_GE(CpuBlockCache::hits() - hits, 4);
}

// Poison (FACESHARD_CPU_POISON): every block handed out, new or from the cache, small or
// large, holds the poison byte before its owner writes it; a block reused after its owner
// wrote it is poisoned again; off again, a kept block comes back with its last contents.
TEST(CpuBlockCache, PoisonFillsEveryBlockHandedOut) {
  c10::Allocator* a = CpuBlockCache::allocator();
  ASSERT_NE(a, nullptr);
  Limit limit(int64_t(64) * kMiB);
  struct Off {
    ~Off() { CpuBlockCache::set_poison(-1); }
  } off;
  auto all_are = [](const void* p, size_t n, unsigned char b) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i)
      if (c[i] != b) return false;
    return true;
  };
  for (const int byte : {0xff, 0x00, 0x7f}) {
    CpuBlockCache::set_poison(byte);
    EXPECT_EQ(CpuBlockCache::poison(), byte);
    for (const size_t n : {size_t(100), size_t(3) * kMiB}) {
      c10::DataPtr p = a->allocate(n);
      EXPECT_TRUE(all_are(p.get(), n, static_cast<unsigned char>(byte))) << n << " bytes, poison " << byte;
      std::memset(p.get(), 0x5a, n);  // written by its owner, then freed (kept when large)
    }
  }
  CpuBlockCache::set_poison(-1);
  c10::DataPtr p = a->allocate(3 * kMiB);
  EXPECT_TRUE(all_are(p.get(), 3 * kMiB, 0x5a)) << "without poison a kept block comes back as it was left";
  EXPECT_EQ(CpuBlockCache::parse_poison("0xff"), 255);
  EXPECT_EQ(CpuBlockCache::parse_poison("7"), 7);
  for (const char* bad : {"256", "-1", "ff", "", "0x1g"}) {
    try {
      CpuBlockCache::parse_poison(bad);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("FACESHARD_CPU_POISON"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace faceshard
