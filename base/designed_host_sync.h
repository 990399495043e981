// Host synchronisations a training step makes on purpose, each named and counted. A step on
// a GPU is meant to queue its work without waiting for the device (the log reads its values a
// step later, device_readout.h), and with train.cuda_graph it must: a sync inside a capture
// breaks it. A few waits are the design, not an accident -- the loss scaler's skip decision,
// which every rank must take alike before the optimiser runs; the rows of accumulated sampled
// micro-batches, whose count the device knows only after the fact. Each sits in a
// DesignedHostSync scope: counted (on the CPU too, where the same code passes the same
// points), and exempt from LibTorch's sync-debug mode, which the GPU tests set to "error" so
// that any other synchronisation fails them. A test holds the list: a new sync on the step's
// path is either named here on purpose or a failure.
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace faceshard {

class DesignedHostSync {
 public:
  // `what` names the sync (a string literal: "loss scaler: the skip decision").
  explicit DesignedHostSync(const char* what);
  ~DesignedHostSync();
  DesignedHostSync(const DesignedHostSync&) = delete;
  DesignedHostSync& operator=(const DesignedHostSync&) = delete;

 private:
  int previous_mode_ = 0;  // LibTorch's sync-debug mode before the scope (GPU builds)
};

// How often each designed sync was passed in this process since the last reset.
std::map<std::string, int64_t> designed_host_syncs();
void reset_designed_host_syncs();

}  // namespace faceshard
