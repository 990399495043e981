#include "base/cpu_block_cache.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "base/error.h"

namespace faceshard {
namespace {

// Each block carries its size in a header in front of the data (64 bytes keep c10's 64-byte
// alignment of the data pointer), so that the raw deleter knows where a block belongs.
constexpr size_t kHeader = 64;

c10::Allocator* g_base = nullptr;  // the system allocator wrapped (c10's default)
std::atomic<bool> g_installed{false};
std::atomic<int64_t> g_limit{0}, g_cached{0}, g_hits{0}, g_misses{0};
std::atomic<int> g_poison{-1};  // the byte every block handed out is filled with (-1: none)
std::mutex g_mutex;
std::multimap<size_t, void*>* g_free = nullptr;  // block size (header included) -> block
c10::Allocator* g_allocator = nullptr;

size_t block_size(size_t n) {
  const size_t total = n + kHeader;
  if (total < CpuBlockCache::kMinBytes) return total;
  return (total + CpuBlockCache::kGranule - 1) / CpuBlockCache::kGranule * CpuBlockCache::kGranule;
}

void* take_cached(size_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_free->lower_bound(size);
  if (it == g_free->end() || it->first > size + size / 8) return nullptr;
  void* block = it->second;  // its header keeps its own size (perhaps larger than asked)
  g_cached -= static_cast<int64_t>(it->first);
  g_free->erase(it);
  return block;
}

// Blocks that no longer fit under the limit go back to the system, largest first.
void trim_locked(std::vector<void*>& out) {
  while (g_cached.load() > g_limit.load() && !g_free->empty()) {
    auto last = std::prev(g_free->end());
    g_cached -= static_cast<int64_t>(last->first);
    out.push_back(last->second);
    g_free->erase(last);
  }
}

void cached_delete(void* data) {
  if (!data) return;
  char* block = static_cast<char*>(data) - kHeader;
  size_t size = 0;
  std::memcpy(&size, block, sizeof size);
  if (size >= CpuBlockCache::kMinBytes && static_cast<int64_t>(size) <= g_limit.load()) {
    std::vector<void*> released;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_free->emplace(size, block);
      g_cached += static_cast<int64_t>(size);
      trim_locked(released);
    }
    for (void* b : released) g_base->raw_deallocate(b);
    return;
  }
  g_base->raw_deallocate(block);
}

// A "simple" allocator (data pointer = context) with a raw deleter, as c10's own, so that
// code calling raw_allocate/raw_deallocate on the CPU allocator keeps working.
class CachingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return g_base->allocate(0);
    const size_t size = block_size(n);
    void* block = size >= CpuBlockCache::kMinBytes && g_limit.load() > 0 ? take_cached(size) : nullptr;
    if (block) {
      g_hits++;
    } else {
      if (size >= CpuBlockCache::kMinBytes) g_misses++;
      block = g_base->raw_allocate(size);
      std::memcpy(block, &size, sizeof size);
    }
    void* data = static_cast<char*>(block) + kHeader;
    if (const int p = g_poison.load(std::memory_order_relaxed); p >= 0) std::memset(data, p, n);
    return {data, data, &cached_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &cached_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

void CpuBlockCache::install() {
  static CachingAllocator* const allocator = [] {
    g_base = c10::GetCPUAllocator();
    if (const char* v = std::getenv("FACESHARD_CPU_POISON"); v && *v) set_poison(parse_poison(v));
    g_free = new std::multimap<size_t, void*>();
    // Never destroyed: storages keep a pointer to their allocator for as long as they live.
    auto* a = new CachingAllocator();
    g_allocator = a;
    c10::SetCPUAllocator(a, /*priority=*/50);
    // Not when an allocator of a higher priority is in place already (AllocationMeter).
    g_installed = c10::GetCPUAllocator() == a;
    return a;
  }();
  (void)allocator;
}

bool CpuBlockCache::installed() { return g_installed.load(); }

c10::Allocator* CpuBlockCache::allocator() {
  install();
  return g_allocator;
}

void CpuBlockCache::set_limit(int64_t bytes) {
  g_limit = bytes < 0 ? 0 : bytes;
  if (!g_installed.load()) return;
  std::vector<void*> released;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    trim_locked(released);
  }
  for (void* b : released) g_base->raw_deallocate(b);
}

int64_t CpuBlockCache::limit() { return g_limit.load(); }

void CpuBlockCache::set_poison(int byte) { g_poison = byte < 0 ? -1 : (byte & 0xff); }
int CpuBlockCache::poison() { return g_poison.load(); }

int CpuBlockCache::parse_poison(const std::string& text) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 0);
  if (end == text.c_str() || *end != '\0' || v < 0 || v > 255)
    throw usage_error("FACESHARD_CPU_POISON: '", text, "' is not a byte (0-255, e.g. 0xff)");
  return static_cast<int>(v);
}
int64_t CpuBlockCache::cached_bytes() { return g_cached.load(); }
int64_t CpuBlockCache::hits() { return g_hits.load(); }
int64_t CpuBlockCache::misses() { return g_misses.load(); }

void CpuBlockCache::release_all() {
  const int64_t keep = g_limit.load();
  set_limit(0);
  g_limit = keep;
}

}  // namespace faceshard
