#include "partial_fc/distributed/link_watch.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace faceshard {

void LinkWatch::store_answered(int64_t now_ms, double round_trip_ms) {
  std::lock_guard<std::mutex> lock(m_);
  last_answer_ms_ = now_ms;
  if (scheduled_) return;
  // Bounded: a reader that never comes (a run without straggler windows) costs nothing.
  if (round_trips_.size() >= 4096) round_trips_.erase(round_trips_.begin(), round_trips_.begin() + 2048);
  round_trips_.push_back(round_trip_ms);
}

int64_t LinkWatch::last_answer_ms() const {
  std::lock_guard<std::mutex> lock(m_);
  return last_answer_ms_;
}

void LinkWatch::silent(int rank, double silent_s) {
  std::lock_guard<std::mutex> lock(m_);
  double& s = stall_.silent_s[rank];
  s = std::max(s, silent_s);
}

void LinkWatch::self_stopped(double s) {
  std::lock_guard<std::mutex> lock(m_);
  stall_.self_stopped_s += s;
}

void LinkWatch::peers_read(PeerBeats beats) {
  std::lock_guard<std::mutex> lock(m_);
  peers_ = std::move(beats);
}

LinkWatch::PeerBeats LinkWatch::peers() const {
  std::lock_guard<std::mutex> lock(m_);
  return peers_;
}

LinkWatch::Stall LinkWatch::take_stall() {
  std::lock_guard<std::mutex> lock(m_);
  Stall out;
  std::swap(out, stall_);
  return out;
}

std::vector<double> LinkWatch::take_round_trips_ms() {
  std::lock_guard<std::mutex> lock(m_);
  std::vector<double> v;
  v.swap(round_trips_);
  return v;
}

void LinkWatch::set_scheduled_work(bool running) {
  std::lock_guard<std::mutex> lock(m_);
  scheduled_ = running;
}

ScheduledWork::ScheduledWork(std::function<double()> blocked_total_s, LinkWatch* links)
    : blocked_total_s_(std::move(blocked_total_s)), links_(links) {}

double ScheduledWork::now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

ScheduledWork::Scope::Scope(ScheduledWork& owner, const char* what) : owner_(owner) {
  owner_.begin(what, now_s(), owner_.blocked_total_s_());
  if (owner_.links_) owner_.links_->set_scheduled_work(true);
}

ScheduledWork::Scope::~Scope() {
  if (owner_.links_) owner_.links_->set_scheduled_work(false);
  owner_.end(now_s(), owner_.blocked_total_s_());
}

void ScheduledWork::begin(const char* what, double now_s, double blocked_total_s) {
  open_ = what;
  begin_s_ = now_s;
  begin_blocked_s_ = blocked_total_s;
}

void ScheduledWork::end(double now_s, double blocked_total_s) {
  if (!open_) return;
  share_.wall_s += std::max(0.0, now_s - begin_s_);
  share_.blocked_s += std::max(0.0, blocked_total_s - begin_blocked_s_);
  const std::string what = open_;
  if (share_.what.empty()) share_.what = what;
  else if (share_.what.find(what) == std::string::npos) share_.what += " and " + what;
  open_ = nullptr;
}

ScheduledWork::Share ScheduledWork::take() {
  Share out;
  std::swap(out, share_);
  return out;
}

JudgedStep judged_step(double step_s, double blocked_s, const ScheduledWork::Share& scheduled) {
  JudgedStep j;
  j.step_s = std::max(0.0, step_s - scheduled.wall_s);
  j.blocked_s = std::max(0.0, blocked_s - scheduled.blocked_s);
  return j;
}

std::string describe_stall(const LinkWatch::Stall& stall, const std::function<std::string(int)>& host_of,
                           const std::string& store_host) {
  if (stall.empty()) return "every rank kept beating (a slow link or a busy peer, not a silent one)";
  std::string out;
  char secs[32];
  for (const auto& [rank, s] : stall.silent_s) {
    std::snprintf(secs, sizeof secs, "%.1f", s);
    if (!out.empty()) out += "; ";
    if (rank < 0)
      out += "the rendezvous store (host " + store_host + ") did not answer for " + secs + " s";
    else
      out += "rank " + std::to_string(rank) + " (host " + host_of(rank) + ") was silent for " + secs + " s";
  }
  return out;
}

bool is_stall(double blocked_s, double median_step_s, bool someone_silent) {
  return blocked_s >= 1.0 && (someone_silent || (median_step_s > 0 && blocked_s >= 3.0 * median_step_s));
}

}  // namespace faceshard
