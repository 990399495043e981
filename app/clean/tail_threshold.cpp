#include "app/clean/tail_threshold.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "base/error.h"

namespace faceshard {

double normal_upper_quantile(double p) {
  if (!(p > 0 && p < 1)) throw runtime_error("normal_upper_quantile: ", p, " is not a probability in (0, 1)");
  // P(Z > z) = erfc(z / sqrt 2) / 2 falls with z: bisection to the float64's resolution.
  double lo = -40, hi = 40;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (0.5 * std::erfc(mid / std::sqrt(2.0)) > p) lo = mid;
    else hi = mid;
  }
  return 0.5 * (lo + hi);
}

TailThreshold normal_tail(const std::vector<float>& cosines, double rate, int64_t pairs) {
  if (cosines.size() < 2) throw runtime_error("normal_tail: ", cosines.size(), " cosines, at least 2 needed");
  TailThreshold t;
  double sum = 0;
  for (float c : cosines) sum += c;
  t.mean = sum / double(cosines.size());
  double sq = 0;
  for (float c : cosines) sq += (c - t.mean) * (c - t.mean);
  t.sd = std::sqrt(sq / double(cosines.size() - 1));
  t.rate = rate;
  t.z = normal_upper_quantile(rate);
  t.value = std::clamp(t.mean + t.z * t.sd, -1.0, 1.0);
  t.pairs = pairs;
  t.sampled = static_cast<int64_t>(cosines.size());
  return t;
}

std::string TailThreshold::describe(const std::string& what) const {
  char b[384];
  std::snprintf(b, sizeof b,
                "cos %.4f = mean %.4f + %.3g sd %.4f of %lld %s (of %lld): a rate of %.3g of them above it, %.3g expected",
                value, mean, z, sd, (long long)sampled, what.c_str(), (long long)pairs, rate, rate * double(pairs));
  return b;
}

}  // namespace faceshard
