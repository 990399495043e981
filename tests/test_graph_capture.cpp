// A CUDA-graph capture that fails leaves the caching allocators as they were (graph_capture.h):
// no pool still recording the stream's allocations (else every freed block used on another
// stream is deferred for ever), no use of the pool left behind (else it is never freed), the
// stream no longer capturing, and the error that broke the capture is the one reported. The
// allocators are modelled here as LibTorch 2.11 keeps them: capture_begin makes the pools
// record (and takes one use of each) before the stream starts capturing; capture_end ends the
// stream's capture first and stops the pools recording only where that succeeded; a graph
// whose capture ended releases its uses when destroyed.
#include <gtest/gtest.h>

#include <map>
#include <stdexcept>
#include <string>

#include "app/train/graph_capture.h"

namespace faceshard {
namespace {

struct Allocators {
  std::map<CaptureSteps::Pool, bool> recording;
  std::map<CaptureSteps::Pool, int> uses;
  bool capturing = false;
  bool invalidated = false;
};

// Where a capture breaks.
enum class Break { None, BeforeRecording, AfterRecording, InWork, Invalidated, AfterEnd };

class ModelledSteps : public CaptureSteps {
 public:
  ModelledSteps(Allocators& a, Break where) : a_(a), where_(where) {}
  void begin() override {
    if (where_ == Break::BeforeRecording) throw std::runtime_error("CUDA graphs must be captured on a non-default stream");
    for (Pool p : {Pool::Device, Pool::Host}) {
      a_.recording[p] = true;
      ++a_.uses[p];
    }
    if (where_ == Break::AfterRecording) throw std::runtime_error("cudaStreamBeginCapture failed");
    a_.capturing = true;
  }
  void end() override {
    // cudaStreamEndCapture ends the stream's capture whatever happened inside it.
    a_.capturing = false;
    if (a_.invalidated) throw std::runtime_error("operation not permitted when stream is capturing");
    for (Pool p : {Pool::Device, Pool::Host}) a_.recording[p] = false;
    graph_owns_uses = true;
    if (where_ == Break::AfterEnd) throw std::runtime_error("cudaGraphInstantiate failed");
  }
  void abandon() override { a_.capturing = false; }
  bool stop_recording(Pool p) override {
    if (!a_.recording[p]) return false;
    a_.recording[p] = false;
    return true;
  }
  void release(Pool p) override { --a_.uses[p]; }

  bool graph_owns_uses = false;  // the graph's destructor releases them

 private:
  Allocators& a_;
  Break where_;
};

// After the capture (and the graph's destruction), the allocators are as before it.
void expect_clean(Allocators& a, const ModelledSteps& steps) {
  for (CaptureSteps::Pool p : {CaptureSteps::Pool::Device, CaptureSteps::Pool::Host}) {
    const char* name = p == CaptureSteps::Pool::Device ? "device" : "host";
    EXPECT_FALSE(a.recording[p]) << "the " << name << " pool still records the stream's allocations";
    EXPECT_EQ(a.uses[p] - (steps.graph_owns_uses ? 1 : 0), 0) << "the " << name << " pool's uses";
  }
  EXPECT_FALSE(a.capturing) << "the stream is still capturing";
}

TEST(GraphCapture, FailedCapturesLeaveTheAllocatorsAsTheyWere) {
  const struct {
    Break where;
    const char* error;
  } cases[] = {
      {Break::BeforeRecording, "CUDA graphs must be captured on a non-default stream"},
      {Break::AfterRecording, "cudaStreamBeginCapture failed"},
      {Break::InWork, "a host synchronisation"},
      {Break::Invalidated, "operation not permitted when stream is capturing"},
      {Break::AfterEnd, "cudaGraphInstantiate failed"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.error);
    Allocators a;
    ModelledSteps steps(a, c.where);
    std::string error;
    try {
      capture_or_undo(steps, [&] {
        if (c.where == Break::InWork) throw std::runtime_error("a host synchronisation");
        if (c.where == Break::Invalidated) a.invalidated = true;  // the work went on; the capture did not
      });
      ADD_FAILURE() << "the capture did not fail";
    } catch (const std::exception& e) {
      error = e.what();
    }
    EXPECT_EQ(error, c.error);
    expect_clean(a, steps);
  }
}

TEST(GraphCapture, SuccessfulCaptureHandsThePoolToTheGraph) {
  Allocators a;
  ModelledSteps steps(a, Break::None);
  int ran = 0;
  capture_or_undo(steps, [&] {
    EXPECT_TRUE(a.capturing);
    ++ran;
  });
  EXPECT_EQ(ran, 1);
  EXPECT_TRUE(steps.graph_owns_uses);
  expect_clean(a, steps);
}

// Captures that fail one after another leave nothing behind either (an eager run that tries
// again after each failure, or several ranks' worth of tries in one process).
TEST(GraphCapture, RepeatedFailuresDoNotAccumulate) {
  Allocators a;
  for (int i = 0; i < 30; ++i) {
    ModelledSteps steps(a, Break::Invalidated);
    a.invalidated = false;
    EXPECT_THROW(capture_or_undo(steps, [&] { a.invalidated = true; }), std::runtime_error);
  }
  EXPECT_EQ(a.uses[CaptureSteps::Pool::Device], 0);
  EXPECT_EQ(a.uses[CaptureSteps::Pool::Host], 0);
  EXPECT_FALSE(a.recording[CaptureSteps::Pool::Device]);
}

}  // namespace
}  // namespace faceshard
