// A verification set made from a folder of identities, as faceshard-pack pairs writes it
// in insightface's .bin format: half the pairs of one identity (two different images),
// half of two identities, alternating so that every fold of the 10-fold protocol holds
// both kinds; the same seed gives the same pairs.
#pragma once
#include <cstdint>
#include <vector>

namespace faceshard {

struct ImagePair {
  uint64_t a = 0, b = 0;  // item indices
  bool same = false;
};

// labels[i]: the identity of item i. Throws a usage error when the items cannot give the
// pairs asked for (no identity with two images, fewer than two identities, or fewer
// distinct pairs of a kind than asked for).
std::vector<ImagePair> make_verification_pairs(const std::vector<int64_t>& labels, uint64_t num_pairs, uint64_t seed);

}  // namespace faceshard
