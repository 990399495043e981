// Counts the bytes of CPU tensors while they live: a wrapper around c10's CPU allocator that
// keeps the bytes allocated now and their peak. On the CPU this is what a GPU's caching
// allocator reports as "allocated" (tensor storage only: no library code, heap or page
// cache as in the RSS), so faceshard-bench measures activations and steps with it and
// faceshard-plan's figures can be compared with those measurements.
#pragma once
#include <cstdint>

namespace faceshard {

class AllocationMeter {
 public:
  // Makes the counting allocator c10's CPU allocator (idempotent, process-wide). Tensors
  // allocated before stay uncounted, also when they are freed.
  static void install();
  static bool installed();
  // Bytes of counted tensors alive now, and the most since the last reset_peak().
  static int64_t current_bytes();
  static int64_t peak_bytes();
  // Sets the peak to the current bytes.
  static void reset_peak();
};

}  // namespace faceshard
