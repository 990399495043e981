#include "data/sampler.h"

#include <numeric>
#include <random>

#include "data/seed_mix.h"
#include "base/error.h"

namespace faceshard {

namespace {
// Unbiased draw in [0, bound) with rejection; std::uniform_int_distribution is not the
// same across standard libraries, and every rank must agree.
uint64_t draw(std::mt19937_64& g, uint64_t bound) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  uint64_t r;
  do {
    r = g();
  } while (r >= limit);
  return r % bound;
}
}  // namespace

DistributedSampler::DistributedSampler(uint64_t dataset_size, int world_size, int rank, uint64_t seed, bool shuffle)
    : n_(dataset_size), world_(world_size), rank_(rank), seed_(seed), shuffle_(shuffle) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw usage_error("sampler: rank ", rank, " is not in [0, world_size=", world_size, ")");
  }
  per_rank_ = n_ / uint64_t(world_);
  if (per_rank_ == 0) {
    throw usage_error("sampler: data set of ", n_, " samples has fewer samples than the ", world_, " ranks");
  }
}

std::vector<uint64_t> DistributedSampler::permutation(uint64_t epoch) const {
  std::vector<uint64_t> perm(n_);
  std::iota(perm.begin(), perm.end(), uint64_t(0));
  if (shuffle_) {
    std::mt19937_64 g(seed_mix(seed_mix(seed_) ^ epoch));
    for (uint64_t i = n_ - 1; i > 0; --i) std::swap(perm[i], perm[draw(g, i + 1)]);
  }
  return perm;
}

std::vector<uint64_t> DistributedSampler::indices(uint64_t epoch, uint64_t position) const {
  if (position > per_rank_) {
    throw usage_error("sampler: resume position ", position, " is past the epoch's ", per_rank_, " samples per rank");
  }
  const std::vector<uint64_t> perm = permutation(epoch);
  std::vector<uint64_t> out;
  out.reserve(per_rank_ - position);
  // Rank r takes every world-th sample (like torch's DistributedSampler) from the first
  // per_rank * world of the permutation.
  for (uint64_t k = position; k < per_rank_; ++k) out.push_back(perm[k * uint64_t(world_) + uint64_t(rank_)]);
  return out;
}

}  // namespace faceshard
