#include "app/plan/allocation_meter.h"

#include <atomic>
#include <cstring>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace faceshard {
namespace {

// Each block carries its size in a header in front of the data; 64 bytes keep c10's
// 64-byte alignment of the data pointer.
constexpr size_t kHeader = 64;

std::atomic<int64_t> g_current{0}, g_peak{0};
std::atomic<bool> g_installed{false};
c10::Allocator* g_base = nullptr;  // the allocator wrapped (c10's default CPU allocator)

void note(int64_t delta) {
  const int64_t now = g_current.fetch_add(delta) + delta;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

void counted_delete(void* data) {
  if (!data) return;
  char* block = static_cast<char*>(data) - kHeader;
  size_t n = 0;
  std::memcpy(&n, block, sizeof n);
  note(-static_cast<int64_t>(n));
  g_base->raw_deallocate(block);
}

// A "simple" allocator (data pointer = context) with a raw deleter, as c10's own, so that
// code calling raw_allocate/raw_deallocate on the CPU allocator keeps working.
class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return g_base->allocate(0);
    void* block = g_base->raw_allocate(n + kHeader);
    std::memcpy(block, &n, sizeof n);
    note(static_cast<int64_t>(n));
    void* data = static_cast<char*>(block) + kHeader;
    return {data, data, &counted_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

void AllocationMeter::install() {
  static CountingAllocator* const allocator = [] {
    g_base = c10::GetCPUAllocator();
    // Never destroyed: storages keep a pointer to their allocator for as long as they live.
    auto* a = new CountingAllocator();
    c10::SetCPUAllocator(a, /*priority=*/100);
    g_installed = true;
    return a;
  }();
  (void)allocator;
}

bool AllocationMeter::installed() { return g_installed.load(); }
int64_t AllocationMeter::current_bytes() { return g_current.load(); }
int64_t AllocationMeter::peak_bytes() { return g_peak.load(); }
void AllocationMeter::reset_peak() { g_peak.store(g_current.load()); }

}  // namespace faceshard
