// The libFuzzer entry of one fuzz target; FACESHARD_FUZZ_ENTRY names its function in
// fuzz_entries.h (each target is this file compiled with another definition).
#include "tests/fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  faceshard::fuzz::FACESHARD_FUZZ_ENTRY(data, size);
  return 0;
}
