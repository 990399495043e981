// A cleaning threshold from the set's own cosines between things known to differ (an image
// and a class it is not filed under, two classes, a test identity and a training class):
// nearly all such pairs are different people, so their cosines are the distribution a true
// finding must stand out of. A normal distribution fitted to them (mean and standard
// deviation, in float64) gives the cosine above which only `rate` of different pairs lie:
// mean + z sd with P(Z > z) = rate. The fit reaches rates far below what the pairs measured
// can resolve (a 2M-class set has 2 x 10^12 class pairs; a rate of 10^-13 is z = 7.3), and a
// few true findings among the pairs hardly move it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace faceshard {

struct TailThreshold {
  double value = 0;  // the cosine (clamped to [-1, 1])
  double rate = 0;   // the share of known-different pairs expected above it
  double mean = 0, sd = 0, z = 0;
  int64_t pairs = 0;    // the known-different pairs it stands for
  int64_t sampled = 0;  // of which measured
  // "cos 0.4651 = mean 0.0120 + 3.09 sd 0.1466 of 65536 image-to-other-class cosines (of
  // 999900): a rate of 0.001 of them above it, 1e+03 expected".
  std::string describe(const std::string& what) const;
};

// z with P(Z > z) = p for a standard normal Z (p in (0, 1)).
double normal_upper_quantile(double p);

// The threshold for `rate` (in (0, 1)) from `cosines`, a sample of the `pairs`
// known-different pairs (at least 2 values).
TailThreshold normal_tail(const std::vector<float>& cosines, double rate, int64_t pairs);

}  // namespace faceshard
