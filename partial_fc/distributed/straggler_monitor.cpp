#include "partial_fc/distributed/straggler_monitor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <sstream>

#include "base/error.h"
#include "base/log.h"

namespace faceshard {
namespace {

// compute: the step less its data wait and its time blocked in collectives; forward,
// backward, optimizer: that work split by phase where the trainer measures it (-1: not).
constexpr int kPhases = 5;
const char* kPhaseName[kPhases] = {"compute", "data", "forward", "backward", "optimizer"};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

std::string key_of(int64_t window, int rank) {
  return "fs/straggler/" + std::to_string(window) + "/" + std::to_string(rank);
}

}  // namespace

std::vector<std::vector<double>> straggler_scores(const std::vector<std::vector<double>>& medians) {
  const size_t W = medians.size();
  std::vector<std::vector<double>> out(W, std::vector<double>(kPhases, 1.0));
  if (W == 0) return out;
  // A difference counts once it is a noticeable part of a step: the smallest rank's step
  // (compute + data), 5% of it and at least 2 ms, is added to both sides of every ratio.
  double step = -1;
  for (const auto& m : medians) {
    const double s = m[0] + m[1];
    if (step < 0 || s < step) step = s;
  }
  // A phase of the step (forward, backward, optimiser) is a fraction of it, its median over a
  // window noisier against its size: its difference counts once it is 10% of a step.
  const double eps_whole = std::max(0.002, 0.05 * step), eps_part = std::max(0.002, 0.10 * step);
  for (int p = 0; p < kPhases; ++p) {
    const double eps = p < 2 ? eps_whole : eps_part;
    bool measured = true;
    for (const auto& m : medians) measured = measured && static_cast<int>(m.size()) > p && m[p] >= 0;
    if (!measured) continue;  // a phase some rank does not time scores 1 everywhere
    double fastest = medians[0][p];
    for (const auto& m : medians) fastest = std::min(fastest, m[p]);
    for (size_t r = 0; r < W; ++r) out[r][p] = (fastest + eps) / (medians[r][p] + eps);
  }
  return out;
}

std::vector<char> slow_links(const std::vector<double>& round_trip_ms, const std::vector<char>& computing_slowly,
                             const std::vector<double>& baseline_ms) {
  double fastest = -1;
  for (double t : baseline_ms.empty() ? round_trip_ms : baseline_ms)
    if (t >= 0 && (fastest < 0 || t < fastest)) fastest = t;
  std::vector<char> out(round_trip_ms.size(), 0);
  for (size_t r = 0; r < round_trip_ms.size(); ++r)
    out[r] = round_trip_ms[r] >= 10.0 && round_trip_ms[r] >= 10.0 * (fastest + 1.0) &&
             !(r < computing_slowly.size() && computing_slowly[r]);
  return out;
}

double round_trip_figure(std::vector<double> v) {
  if (v.empty()) return -1.0;
  const size_t k = static_cast<size_t>(std::ceil(0.9 * static_cast<double>(v.size()))) - 1;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

StragglerMonitor::StragglerMonitor(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                   std::vector<std::string> hosts, int64_t window, double window_s)
    : store_(std::move(store)),
      rank_(rank),
      world_(world_size),
      hosts_(std::move(hosts)),
      window_(std::max<int64_t>(2, window)),
      window_s_(window_s > 0 ? window_s : kWindowSeconds) {
  below_.assign(world_, std::vector<char>(kPhases, 0));
  slow_link_.assign(world_, 0);
  hosts_.resize(world_);
  thread_ = std::thread([this] { run(); });
}

StragglerMonitor::~StragglerMonitor() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StragglerMonitor::add_step(int64_t step, double step_s, double data_s, double blocked_s,
                                const std::vector<double>& round_trips_ms, const StepPhases& phases) {
  if (step <= kWarmupSteps) return;  // first allocations, caches and loaders warming: not a pace
  if (first_step_ < 0) first_step_ = step;
  elapsed_s_ += std::max(0.0, step_s);
  compute_.push_back(std::max(0.0, step_s - data_s - blocked_s));
  data_.push_back(std::max(0.0, data_s));
  round_trip_.insert(round_trip_.end(), round_trips_ms.begin(), round_trips_ms.end());
  const double own[3] = {phases.forward, phases.backward, phases.optimizer};
  for (int k = 0; k < 3; ++k) phase_[k].push_back(own[k] < 0 ? -1.0 : own[k]);
  const auto steps = static_cast<int64_t>(compute_.size());
  if (steps < window_ && !(elapsed_s_ >= window_s_ && steps >= std::min(window_, kMinWindowSteps))) return;
  // Published: compute, data, round trip (the figure judged), forward, backward, optimizer
  // (-1: not measured in every step of the window), the median round trip (the fastest
  // rank's is the slow-link baseline); kept here: the window's first and last step.
  std::vector<double> v{median(compute_), median(data_), round_trip_figure(round_trip_)};
  for (auto& ph : phase_) {
    v.push_back(*std::min_element(ph.begin(), ph.end()) < 0 ? -1.0 : median(ph));
    ph.clear();
  }
  v.push_back(round_trip_.empty() ? -1.0 : median(round_trip_));
  v.push_back(static_cast<double>(first_step_));
  v.push_back(static_cast<double>(step));
  first_step_ = -1;
  elapsed_s_ = 0;
  compute_.clear();
  data_.clear();
  round_trip_.clear();
  {
    std::lock_guard<std::mutex> lock(m_);
    to_publish_.emplace_back(windows_++, std::move(v));
  }
  cv_.notify_all();
}

std::vector<StragglerReport> StragglerMonitor::take_reports() {
  std::lock_guard<std::mutex> lock(m_);
  std::vector<StragglerReport> out;
  out.swap(reports_);
  return out;
}

int64_t StragglerMonitor::windows_judged() {
  std::lock_guard<std::mutex> lock(m_);
  return judged_;
}

std::vector<std::vector<double>> StragglerMonitor::last_scores() {
  std::lock_guard<std::mutex> lock(m_);
  return last_scores_;
}

void StragglerMonitor::run() {
  while (true) {
    std::pair<int64_t, std::vector<double>> item;
    {
      std::unique_lock<std::mutex> lock(m_);
      cv_.wait(lock, [&] { return stop_ || !to_publish_.empty(); });
      if (stop_) return;
      item = std::move(to_publish_.front());
      to_publish_.pop_front();
    }
    try {
      std::ostringstream os;
      os.precision(9);
      const size_t n = item.second.size();
      for (size_t k = 0; k + 2 < n; ++k) os << (k ? " " : "") << item.second[k];
      const std::string s = os.str();
      store_->set(key_of(item.first, rank_), std::vector<uint8_t>(s.begin(), s.end()));
      if (rank_ == 0)
        judge(item.first, static_cast<int64_t>(item.second[n - 2]), static_cast<int64_t>(item.second[n - 1]));
    } catch (const std::exception& e) {
      // The store is gone: the collectives say why; the monitor has nothing to add.
      log_debug("straggler monitor: ", one_line(e));
      return;
    }
  }
}

void StragglerMonitor::judge(int64_t window_index, int64_t first_step, int64_t last_step) {
  // The reports name the steps of both windows judged: from the previous one's first step.
  const int64_t previous_first = judged_first_ < 0 ? first_step : judged_first_;
  judged_first_ = first_step;
  std::vector<std::string> keys;
  for (int r = 0; r < world_; ++r) keys.push_back(key_of(window_index, r));
  // Every rank reaches the same step: its window's figures come within moments; a rank
  // that never sends them (stopped, failed) is the collectives' business.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!store_->check(keys)) {
    {
      std::unique_lock<std::mutex> lock(m_);
      if (cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stop_; })) return;
    }
    if (std::chrono::steady_clock::now() > deadline) return;
  }
  std::vector<std::vector<double>> medians;
  std::vector<double> round_trips, round_trip_medians;
  for (const auto& v : store_->multiGet(keys)) {
    std::istringstream is(std::string(v.begin(), v.end()));
    double c = 0, d = 0, rt = -1, f = -1, b = -1, o = -1, rt_median = -1;
    is >> c >> d >> rt >> f >> b >> o >> rt_median;
    medians.push_back({c, d, f, b, o});
    round_trips.push_back(rt);
    round_trip_medians.push_back(rt_median);
  }
  // A rank slow in its own work (a starved CPU also delays its heartbeat) is a straggler,
  // not a slow link.
  const std::vector<std::vector<double>> scores = straggler_scores(medians);
  std::vector<char> computing_slowly(world_, 0);
  for (int r = 0; r < world_; ++r)
    for (int p : {0, 2, 3, 4}) computing_slowly[r] = computing_slowly[r] || scores[r][p] < kThreshold;
  // Against the fastest rank's median: one late heartbeat of the store's own host would
  // otherwise raise the bar for everyone.
  const std::vector<char> slow = slow_links(round_trips, computing_slowly, round_trip_medians);
  {
    std::string rts, work;
    auto ms = [](double t) { return t < 0 ? std::string("-") : format_sig(t); };
    for (int r = 0; r < world_; ++r) {
      rts += (r ? " " : "") + ms(round_trips[r]) + "/" + ms(round_trip_medians[r]);
      work += (r ? " " : "") + format_sig(std::min({scores[r][0], scores[r][2], scores[r][3], scores[r][4]}));
    }
    log_debug("straggler window ", window_index, " (to step ", last_step,
              "): heartbeat round trips (ms, 90th percentile/median) by rank: ", rts, "; lowest work score by rank: ", work);
  }
  double fastest_rt = -1;
  for (double t : round_trip_medians)
    if (t >= 0 && (fastest_rt < 0 || t < fastest_rt)) fastest_rt = t;
  for (const std::string& k : keys) store_->deleteKey(k);  // the store keeps no window's figures
  std::lock_guard<std::mutex> lock(m_);
  last_scores_ = scores;
  judged_++;
  for (int r = 0; r < world_; ++r) {
    // A rank slow in forward, backward or the optimiser is reported for those phases, and
    // for "compute" (their sum) only where no single phase is below the threshold.
    bool phase_named = false;
    for (int p = 2; p < kPhases; ++p) phase_named = phase_named || (scores[r][p] < kThreshold && below_[r][p]);
    for (int p = 0; p < kPhases; ++p) {
      const bool below = scores[r][p] < kThreshold;
      if (below && below_[r][p] && !(p == 0 && phase_named)) {
        StragglerReport rep;
        rep.rank = r;
        rep.host = hosts_[r].empty() ? "?" : hosts_[r];
        rep.phase = kPhaseName[p];
        rep.score = scores[r][p];
        rep.median_s = medians[r][p];
        double fastest = medians[0][p];
        for (const auto& m : medians) fastest = std::min(fastest, m[p]);
        rep.fastest_s = fastest;
        rep.last_step = last_step;
        rep.first_step = previous_first;
        reports_.push_back(rep);
      }
      below_[r][p] = below;
    }
    if (slow[r] && slow_link_[r]) {
      StragglerReport rep;
      rep.rank = r;
      rep.host = hosts_[r].empty() ? "?" : hosts_[r];
      rep.phase = "link";
      rep.median_s = round_trips[r] / 1000;
      rep.fastest_s = fastest_rt / 1000;
      rep.score = (fastest_rt + 1.0) / (round_trips[r] + 1.0);
      rep.last_step = last_step;
      rep.first_step = previous_first;
      reports_.push_back(rep);
    }
    slow_link_[r] = slow[r];
  }
}

}  // namespace faceshard
