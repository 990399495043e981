// The sharded classifier ("Partial FC"): one centre per identity, sharded by class across
// the ranks and never replicated. Forward gathers the batch's embeddings (differentiable)
// and labels, normalises, takes the cosines against this shard's centres (all of them, or
// with sample_rate < 1 the positive classes of the batch plus random negatives), applies
// the margin and the distributed softmax cross-entropy, and returns the global-batch loss.
//
// Gradient convention (DESIGN.md), decided here once: the loss is the mean over the global
// batch, so the reduce-scatter in the gather's backward gives each rank exactly
// dL/d(its embeddings); the backbone is replicated and DataParallel AVERAGES its
// gradients over the W ranks, which would leave 1/W of dL/dtheta. The gather's backward
// therefore multiplies the embedding gradient by W (as arcface_torch does), so that after
// averaging the backbone receives dL/dtheta of the global-mean loss. Tested against one
// process holding the whole batch and the whole weight matrix.
#pragma once
#include <torch/torch.h>

#include "partial_fc/class_shard.h"
#include "partial_fc/distributed.h"
#include "partial_fc/margin.h"

namespace faceshard {

struct PartialFCOptions {
  int64_t num_classes = 0;
  int64_t embedding_size = 512;
  double sample_rate = 1.0;
  CombinedMargin margin;
  uint64_t seed = 2048;
};

struct PartialFCOutput {
  at::Tensor loss;      // 0-dim, differentiable w.r.t. the local embeddings and the centres
  at::Tensor accuracy;  // 0-dim, global top-1 over the classes taking part
};

class PartialFC {
 public:
  PartialFC(Distributed& dist, const PartialFCOptions& opts, torch::Device device = torch::kCPU);

  // local_embeddings [B, d] (any floating dtype), local_labels [B] global class ids.
  // Labels outside [0, num_classes) are an error naming the label and its rank.
  PartialFCOutput forward(const at::Tensor& local_embeddings, const at::Tensor& local_labels);

  const ClassShard& shard() const { return shard_; }
  const PartialFCOptions& options() const { return opts_; }
  int64_t num_sample() const { return num_sample_; }
  // The whole shard [count, d], fp32.
  at::Tensor& weight() { return weight_; }
  // The rows (local indices, sorted) that took part in the last forward, and the leaf whose
  // .grad holds their gradient after backward: weight() itself when nothing is sampled.
  const at::Tensor& sampled_index() const { return index_; }
  at::Tensor& sampled_weight() { return sub_weight_; }
  // Replaces the sampled rows by `index` (local, sorted, unique) with gradient `grad`
  // [index.size(0), d]: how accumulated micro-batches become one step (ShardOptimizer).
  void set_sampled(const at::Tensor& index, const at::Tensor& grad);
  bool samples() const { return num_sample_ < shard_.count; }
  // Forwards taken (the sampling RNG is a function of seed, rank and this count: resumable;
  // with gradient accumulation it counts micro-batches).
  int64_t step() const { return step_; }
  void set_step(int64_t s) { step_ = s; }

  // Deterministic initial centres N(0, 0.01) for global classes [start, start+count): the
  // same class gets the same initial centre whatever the number of ranks.
  static at::Tensor initial_rows(int64_t start, int64_t count, int64_t dim, uint64_t seed);

 private:
  Distributed& dist_;
  PartialFCOptions opts_;
  ClassShard shard_;
  int64_t num_sample_;
  at::Tensor weight_, index_, sub_weight_;
  int64_t step_ = 0;
};

}  // namespace faceshard
