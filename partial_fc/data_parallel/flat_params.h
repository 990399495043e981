// The replicated module's parameters in flat buffers: one buffer of values and one of
// gradients per (device, dtype, partition), each parameter a view into them laid out in the order
// DataParallel's buckets take the parameters (reverse registration, at most bucket_mb a
// bucket, a new bucket where the device or dtype changes). So a bucket is a contiguous
// range of a gradient buffer: DataParallel all-reduces it in place, with no copy of a
// gradient into a bucket and back, and the optimiser updates a whole buffer with one
// fused kernel instead of a few kernels per parameter.
//
// Each parameter keeps its tensor object (modules, checkpoints and hooks see the same
// parameters) and its layout (a channels-last weight stays channels-last): only its data
// moves into the buffer. Each gradient stays a view of the gradient buffer: zero_grad()
// zeroes the buffers and backward accumulates into the views in place (autograd adds into
// a gradient that is defined), so a parameter always has a gradient; one that receives
// none in a step holds zeros.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace faceshard {

class FlatParameters {
 public:
  // `params`: the trainable parameters in registration order (DataParallel's order).
  // Moves their values into the buffers (each keeps its sizes and strides) and sets each
  // gradient to its view, zeroed. Throws a usage error for a parameter that is not dense
  // (overlapping or with gaps) or is listed twice.
  // `partition` (empty, or one entry per param): parameters of different partitions never
  // share a group, nor so a bucket, so that a part frozen for a while (fine-tuning) is
  // stepped or left alone as a whole.
  FlatParameters(std::vector<at::Tensor> params, double bucket_mb, const std::vector<int>& partition = {});

  struct Group {
    at::Tensor values, grads;  // 1-D, one device and dtype
    std::vector<int> params;   // indices into params(), in buffer order
  };
  // A bucket: `numel` elements of group `group`'s buffers from `offset`, holding `params`
  // (in buffer order) at `offsets` relative to the bucket's start.
  struct Bucket {
    int group = 0;
    int64_t offset = 0, numel = 0;
    std::vector<int> params;
    std::vector<int64_t> offsets;
  };

  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<Group>& groups() const { return groups_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  int group_of(int param) const { return group_of_[param]; }

  // Param `i`'s region of a buffer laid out like its group's values (a state buffer of
  // the optimiser, say), with the param's sizes and strides.
  at::Tensor view(int i, const at::Tensor& flat) const;

  // Zeroes every gradient buffer (one kernel per group) and restores any gradient that
  // something replaced by its view.
  void zero_grad();

  // Throws an internal error when a parameter's data no longer lives in its buffer
  // (something moved the module after the buffers were made: module->to(), set_data).
  void check_intact(const char* who) const;

 private:
  std::vector<at::Tensor> params_;
  std::vector<Group> groups_;
  std::vector<Bucket> buckets_;
  std::vector<int> group_of_;
  std::vector<int64_t> offset_of_;  // element offset of each param in its group's buffers
};

}  // namespace faceshard
