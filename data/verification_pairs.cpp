#include "data/verification_pairs.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "base/error.h"

namespace faceshard {

std::vector<ImagePair> make_verification_pairs(const std::vector<int64_t>& labels, uint64_t num_pairs, uint64_t seed) {
  if (num_pairs < 2 || num_pairs % 2 != 0)
    throw usage_error("--pairs ", num_pairs, ": expected an even number of pairs, at least 2");
  std::map<int64_t, std::vector<uint64_t>> by_id;
  for (uint64_t i = 0; i < labels.size(); ++i) by_id[labels[i]].push_back(i);
  std::vector<const std::vector<uint64_t>*> ids, multi;
  uint64_t same_possible = 0;
  for (const auto& [id, items] : by_id) {
    ids.push_back(&items);
    if (items.size() >= 2) {
      multi.push_back(&items);
      same_possible += items.size() * (items.size() - 1) / 2;
    }
  }
  const uint64_t half = num_pairs / 2;
  if (multi.empty()) throw usage_error("pairs: no identity has two images, so there is no same-identity pair");
  if (ids.size() < 2) throw usage_error("pairs: one identity gives no different-identity pair");
  if (same_possible < half)
    throw usage_error("pairs: ", half, " same-identity pairs asked for, but the images give only ", same_possible,
                      " (ask for fewer with --pairs)");
  uint64_t diff_possible = 0;  // bounded: enough once it exceeds the half asked for
  for (size_t i = 0; i < ids.size() && diff_possible < half; ++i)
    for (size_t j = i + 1; j < ids.size() && diff_possible < half; ++j) diff_possible += ids[i]->size() * ids[j]->size();
  if (diff_possible < half)
    throw usage_error("pairs: ", half, " different-identity pairs asked for, but the images give only ", diff_possible,
                      " (ask for fewer with --pairs)");

  std::mt19937_64 rng(seed);
  auto pick = [&](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  std::set<std::pair<uint64_t, uint64_t>> seen;
  auto fresh = [&](uint64_t a, uint64_t b) { return seen.insert({std::min(a, b), std::max(a, b)}).second; };
  // Same-identity pairs: an identity drawn in proportion to its pairs, two of its images.
  std::vector<uint64_t> weights;
  for (const auto* m : multi) weights.push_back(m->size() * (m->size() - 1) / 2);
  std::discrete_distribution<size_t> which(weights.begin(), weights.end());
  std::vector<ImagePair> same, diff;
  // Draws until enough distinct pairs: a few times the count asked for covers it unless the
  // request is close to all the pairs there are, then every pair is listed instead.
  const uint64_t tries = 20 * half + 1000;
  for (uint64_t t = 0; same.size() < half && t < tries; ++t) {
    const auto& m = *multi[which(rng)];
    const uint64_t i = pick(m.size()), j = pick(m.size() - 1);
    const uint64_t a = m[i], b = m[j >= i ? j + 1 : j];
    if (fresh(a, b)) same.push_back({a, b, true});
  }
  if (same.size() < half) {
    std::vector<ImagePair> all;
    for (const auto* m : multi)
      for (size_t i = 0; i < m->size(); ++i)
        for (size_t j = i + 1; j < m->size(); ++j) all.push_back({(*m)[i], (*m)[j], true});
    std::shuffle(all.begin(), all.end(), rng);
    for (const ImagePair& p : all)
      if (same.size() < half && fresh(p.a, p.b)) same.push_back(p);
  }
  for (uint64_t t = 0; diff.size() < half && t < tries; ++t) {
    const uint64_t x = pick(ids.size()), y0 = pick(ids.size() - 1), y = y0 >= x ? y0 + 1 : y0;
    const uint64_t a = (*ids[x])[pick(ids[x]->size())], b = (*ids[y])[pick(ids[y]->size())];
    if (fresh(a, b)) diff.push_back({a, b, false});
  }
  if (diff.size() < half) {
    std::vector<ImagePair> all;
    for (size_t x = 0; x < ids.size() && all.size() < 4 * half + 100; ++x)
      for (size_t y = x + 1; y < ids.size(); ++y)
        for (uint64_t a : *ids[x])
          for (uint64_t b : *ids[y]) all.push_back({a, b, false});
    std::shuffle(all.begin(), all.end(), rng);
    for (const ImagePair& p : all)
      if (diff.size() < half && fresh(p.a, p.b)) diff.push_back(p);
  }
  std::vector<ImagePair> out;
  out.reserve(num_pairs);
  for (uint64_t i = 0; i < half; ++i) {
    out.push_back(same[i]);
    out.push_back(diff[i]);
  }
  return out;
}

}  // namespace faceshard
