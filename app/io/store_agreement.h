// The ranks of a checkpoint written in the background agree through the rendezvous store
// (a connection of its own), never through the training's process group: a slow write on one
// rank can then never interleave with, or hold up, a training collective. Each stage is one
// key per rank under a prefix unique to the run and the save; a rank that does not report
// within the timeout (killed mid-write, its host gone) makes the stage fail on the others.
#pragma once
#include <atomic>
#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "app/io/checkpoint.h"

namespace faceshard {

class StoreAgreement : public SaveAgreement {
 public:
  // `prefix`: unique to this save (the run's id and the step); `timeout`: how long a stage
  // waits for the other ranks.
  // `abort`, when set (by another thread), ends a stage's wait within a second: the save is
  // given up (a run ending on an error does not wait out the timeout).
  StoreAgreement(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int world_size,
                 std::chrono::milliseconds timeout, const std::atomic<bool>* abort = nullptr);
  std::string agree(const std::string& mine) override;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  int rank_, world_;
  std::chrono::milliseconds timeout_;
  const std::atomic<bool>* abort_;
  int stage_ = 0;
};

}  // namespace faceshard
