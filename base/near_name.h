// The name a slip most likely meant: the known name nearest by edits (insertions, deletions,
// substitutions), when it is close. Used by the config's unknown keys and the backbones'
// unknown names. Header-only (the parsers built without LibTorch use it too).
#pragma once
#include <algorithm>
#include <string>
#include <vector>

namespace faceshard {

inline size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The nearest of `known` within max_edits edits ("" when none is, or when `name` is longer
// than 64 characters: no name is, and a fuzzed one costs nothing). Ties: the first in order.
template <typename Names>
std::string nearest_name(const std::string& name, const Names& known, size_t max_edits) {
  if (name.size() > 64) return "";
  std::string best;
  size_t best_d = max_edits + 1;
  for (const std::string& k : known) {
    const size_t d = edit_distance(name, k);
    if (d < best_d) best_d = d, best = k;
  }
  return best;
}

}  // namespace faceshard
