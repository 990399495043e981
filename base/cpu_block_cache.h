// A caching allocator for CPU tensors, as a GPU's caching allocator is for device memory.
// A training step frees and allocates the same large blocks every step (activations, their
// gradients, the logits buffer, the loader's batches); glibc hands blocks of 32 MiB and
// more to the kernel at every free (and smaller ones when it trims its heap), so each step
// faults all of those pages in again and the kernel zeroes them: a fifth of a CPU step.
// The cache keeps freed blocks of kMinBytes or more, up to a limit of cached bytes, and
// hands one out again for a request of its size (rounded up to kGranule, at most 1/8
// larger), so that after the first step the step runs on pages it already has.
//
// Process-wide, installed as c10's CPU allocator below AllocationMeter (which then counts
// tensors above it): install() before the meter, set_limit() when the job knows its budget.
// With a limit of 0 nothing is kept (every block goes back at once, as without the cache).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace c10 {
struct Allocator;
}

namespace faceshard {

class CpuBlockCache {
 public:
  static constexpr size_t kMinBytes = size_t(1) << 20;  // smaller blocks: glibc's heap reuses them
  static constexpr size_t kGranule = size_t(1) << 16;

  // Makes the cache c10's CPU allocator (idempotent). Tensors allocated before stay the
  // previous allocator's and go back to it.
  static void install();
  // Whether the cache is c10's CPU allocator (not when one of a higher priority, such as
  // AllocationMeter, was installed first).
  static bool installed();
  // The cache as an allocator, whether or not it is c10's (installs it if it can).
  static c10::Allocator* allocator();
  // Most bytes the cache keeps while no tensor uses them; lowering it releases blocks at
  // once. Default 0.
  static void set_limit(int64_t bytes);
  static int64_t limit();
  // Bytes kept now; requests served from the cache and from the system since install().
  static int64_t cached_bytes();
  static int64_t hits();
  static int64_t misses();
  // Poison: every block handed out from now on (cached or new, of any size) is filled with
  // `byte` first (a negative byte: no fill, the default). Two runs poisoned with different
  // bytes compute the same numbers unless something reads memory it never wrote: how a result
  // that changes with what the allocator happened to hand out (timing, other threads'
  // blocks) is found. install() takes FACESHARD_CPU_POISON (a byte: 0-255, 0x.. accepted).
  static void set_poison(int byte);
  static int poison();
  // FACESHARD_CPU_POISON's value as a byte; anything else is a usage error naming it.
  static int parse_poison(const std::string& text);
  // Gives every kept block back to the system.
  static void release_all();
};

}  // namespace faceshard
