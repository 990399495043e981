// The ranks of a checkpoint written in the background agree through the rendezvous store
// (a connection of its own), never through the training's process group: a slow write on one
// rank can then never interleave with, or hold up, a training collective. Each stage is one
// key per rank under a prefix unique to the run and the save; a rank that does not report
// within the timeout (killed mid-write, its host gone) makes the stage fail on the others.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "app/io/checkpoint.h"

namespace faceshard {

// How a stage's wait judges the ranks that have not reported: past `limit()` (the training's
// hang limit) it asks `silent(missing ranks, wait start in Distributed::clock_ms)` for one of
// them that is dead or frozen (no heartbeat), and ends the stage naming it instead of waiting
// out the agreement's timeout. A rank that is slow but alive is waited for.
struct AgreementHangJudge {
  std::function<std::chrono::milliseconds()> limit;
  std::function<std::string(const std::vector<int>& missing, int64_t since_ms)> silent;
  std::function<int64_t()> clock_ms;
};

class StoreAgreement : public SaveAgreement {
 public:
  // `prefix`: unique to this save (the run's id and the step); `timeout`: how long a stage
  // waits for the other ranks.
  // `abort`, when set (by another thread), ends a stage's wait within a second: the save is
  // given up (a run ending on an error does not wait out the timeout).
  StoreAgreement(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int world_size,
                 std::chrono::milliseconds timeout, const std::atomic<bool>* abort = nullptr);
  std::string agree(const std::string& mine) override;
  // The hang check of each stage's wait (none: the timeout alone).
  void set_hang_judge(AgreementHangJudge judge) { judge_ = std::move(judge); }
  // Called before this rank reports each stage (its index, from 0): where fault tests freeze
  // a rank inside an agreement.
  void set_before_stage(std::function<void(int stage)> hook) { before_stage_ = std::move(hook); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  int rank_, world_;
  std::chrono::milliseconds timeout_;
  const std::atomic<bool>* abort_;
  int stage_ = 0;
  AgreementHangJudge judge_;
  std::function<void(int)> before_stage_;
  // Once a stage has failed for want of a rank's report, the later stages (the barrier
  // after a given-up save) fail at once with the same words instead of waiting again.
  std::string broken_;
};

}  // namespace faceshard
