// splitmix64's finaliser: turns (seed, epoch, position, ...) into well-separated generator
// seeds for the sampler, the loader's augmentations and the synthetic faces.
#pragma once
#include <cstdint>

namespace faceshard {

inline uint64_t seed_mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace faceshard
