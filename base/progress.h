// Progress of long work in the tools (pack, verify, extract, ijb, export, synth): on a
// terminal one status line redrawn in place with the rate and the time left; in a log
// (stderr not a terminal) one line each time another 5% is done, and at the end. Lines go to
// stderr, so that a tool's results on stdout stay clean.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace faceshard {

class Progress {
 public:
  // what: "packing", "embedding"...; unit: "images", "pairs"...; total 0: unknown.
  Progress(std::string what, uint64_t total, std::string unit);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  // Sets the count done so far (monotone); cheap enough to call for every item.
  void update(uint64_t done);
  void add(uint64_t n = 1) { update(done_ + n); }
  // The last line (done, elapsed time, rate); called by the destructor if not before.
  void finish();

  // "1h02m", "3m05s", "42s".
  static std::string format_seconds(double s);

 private:
  void print(bool final_line);
  std::string what_, unit_;
  uint64_t total_, done_ = 0;
  bool terminal_, finished_ = false, printed_ = false;
  double quiet_s_;
  int last_step_ = 0;  // the 5% steps printed to a log
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace faceshard
