// Data-parallel gradient synchronisation for a replicated module (the backbone), like
// PyTorch's DistributedDataParallel: parameters and buffers start equal (broadcast from
// rank 0); during backward, gradients are packed into buckets (reverse registration order,
// size cap) and each bucket's all-reduce starts as soon as its last gradient is ready, so
// communication overlaps the rest of backward. Gradients are AVERAGED over ranks.
//
// Gradient convention (docs/architecture.md): averaging is right for a loss that is a per-rank mean.
// The sharded classifier's loss is a mean over the global batch whose embedding gradient
// already sums over ranks; that path multiplies its gradient by W before it reaches the
// backbone (partial_fc's classifier does it), so this class never special-cases it.
//
// Built on c10d collectives rather than c10d::Reducer: the Reducer's constructor changes
// between releases, needs a c10d::ProcessGroup wrapper around the backend, and the
// scaling above is simplest when the averaging step is ours.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "partial_fc/data_parallel/flat_params.h"
#include "partial_fc/distributed/distributed.h"

namespace faceshard {

struct DdpOptions {
  double bucket_mb = 25.0;
  // Parameters that get no gradient in a step (unused branches) are found by walking the
  // autograd graph from the outputs; off by default because the walk costs time.
  bool find_unused_parameters = false;
  bool broadcast_on_construction = true;
  // The module's trainable parameters in flat buffers (which must outlive this object):
  // the buckets are ranges of the flat gradient buffers, all-reduced in place, with no
  // copy of a gradient into its bucket and back. Its bucket cap is the one that counts.
  FlatParameters* flat = nullptr;
  // Without flat buffers: one entry per trainable parameter (or empty); parameters of
  // different partitions never share a bucket, so that a part frozen for a while (its
  // bucket skipped, see prepare_for_backward) sends nothing. The flat buffers have their own.
  std::vector<int> partition;
};

// One step's record, for tests and traces.
struct DdpStepStats {
  int buckets = 0;
  int launched_during_backward = 0;  // buckets whose all-reduce started before the last hook
  std::vector<double> launch_ms;     // per bucket, since the first gradient hook
  double last_hook_ms = 0;
};

class DataParallel {
 public:
  DataParallel(std::shared_ptr<torch::nn::Module> module, Distributed& dist, DdpOptions opts = {});
  ~DataParallel();

  // Call after forward and before backward, every step, with the outputs the loss is
  // computed from (they are only read with find_unused_parameters). A parameter that does
  // not require grad at that moment (frozen for a while: fine-tuning) counts as ready with
  // no gradient and keeps the .grad it has; a bucket of such parameters only is not
  // all-reduced (every rank freezes the same ones, so the collectives still match).
  // Parameters that never train are best left out of the module's trainable ones.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  // Gradient accumulation: inside a NoSync scope backward only accumulates .grad locally;
  // the next synchronised backward all-reduces the accumulated gradients.
  class NoSync {
   public:
    explicit NoSync(DataParallel& d) : d_(d), prev_(d.sync_) { d_.sync_ = false; }
    ~NoSync() { d_.sync_ = prev_; }

   private:
    DataParallel& d_;
    bool prev_;
  };
  NoSync no_sync() { return NoSync(*this); }

  torch::nn::Module& module() { return *module_; }
  const std::vector<std::string>& parameter_names() const { return names_; }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  std::vector<std::vector<int>> bucket_assignment() const;
  const DdpStepStats& last_step() const { return stats_; }

 private:
  struct Bucket {
    std::vector<int> params;  // indices into params_
    std::vector<int64_t> offsets;
    at::Tensor flat;
    int pending = 0;
    bool frozen = false;  // every param of it is frozen this step: no all-reduce
    c10::intrusive_ptr<c10d::Work> work;
  };
  void make_buckets();
  void use_flat_buckets();
  void on_grad_ready(int index);
  void mark_ready(int index, bool have_grad);
  void launch_ready_buckets();
  void finalize();

  std::shared_ptr<torch::nn::Module> module_;
  Distributed& dist_;
  DdpOptions opts_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep hooks alive
  std::vector<int> bucket_of_, slot_of_;
  std::vector<Bucket> buckets_;
  std::vector<char> ready_;
  std::vector<char> used_;
  std::vector<char> frozen_;  // this step: the param does not require grad
  int next_bucket_ = 0;
  bool sync_ = true;
  bool in_backward_ = false;
  bool prepared_ = false;
  std::chrono::steady_clock::time_point t0_;
  DdpStepStats stats_;
};

// Broadcasts every parameter and buffer of `module` from rank `root` (one flat message
// per dtype/device).
void broadcast_module_state(torch::nn::Module& module, Distributed& dist, int root = 0);

}  // namespace faceshard
