// The sharded classifier ("Partial FC"): one centre per identity, sharded by class across
// the ranks and never replicated, together with its optimiser state. Forward gathers the
// batch's embeddings (differentiable) and labels, normalises, takes the cosines against
// this shard's centres (all of them, or with sample_rate < 1 the positive classes of the
// batch plus random negatives), applies the margin and the distributed softmax
// cross-entropy, and returns the global-batch loss. After backward, step() moves the rows
// that took part (and only those, unless step_all_rows) with the shard's optimiser.
//
// Gradient convention (DESIGN.md), decided here once: the loss is the mean over the global
// batch, so the reduce-scatter in the gather's backward gives each rank exactly
// dL/d(its embeddings); the backbone is replicated and DataParallel AVERAGES its
// gradients over the W ranks, which would leave 1/W of dL/dtheta. The gather's backward
// therefore multiplies the embedding gradient by W (as arcface_torch does), so that after
// averaging the backbone receives dL/dtheta of the global-mean loss. Tested against one
// process holding the whole batch and the whole weight matrix.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "partial_fc/classifier/class_shard.h"
#include "partial_fc/classifier/margin.h"
#include "partial_fc/classifier/margin_head.h"
#include "partial_fc/classifier/shard_optimizer.h"
#include "partial_fc/runtime/distributed.h"

namespace faceshard {

struct PartialFCOptions {
  int64_t num_classes = 0;
  int64_t embedding_size = 512;
  double sample_rate = 1.0;
  CombinedMargin margin;
  // The margin head (margin_head.h); "combined" uses `margin`.
  HeadSpec head;
  uint64_t seed = 2048;
  ShardOptimizerOptions optimizer;
  // With sampling, which rows an optimiser step moves: false = only the rows that took part
  // (the Partial FC paper; every other row and its state stay bit-identical); true = every
  // row of the shard, the unsampled ones with a zero gradient, so weight decay and momentum
  // (or AdamW's moments) keep moving them, as arcface_torch's PartialFC_V2 does with a
  // dense optimiser over the whole weight. Costs a [shard, d] gradient per step.
  bool step_all_rows = false;
  // false: the weight and optimiser rows are allocated but not initialised, because a
  // checkpoint is about to be read into them (fill_state): drawing millions of initial
  // centres only to overwrite them costs seconds, and nothing is written twice. Such a
  // shard refuses to run forward until its rows are filled.
  bool initialise_rows = true;
  // The type the big GEMMs run in (the body's precision: kBFloat16/kHalf under mixed
  // precision); the logits and the softmax stay fp32 (margin_softmax.h).
  at::ScalarType gemm_dtype = at::kFloat;
};

struct PartialFCOutput {
  at::Tensor loss;      // 0-dim, differentiable w.r.t. the local embeddings and the centres
  at::Tensor accuracy;  // 0-dim, global top-1 over the classes taking part
};

// Rows of a shard (name -> [count, ...] tensor), for checkpoints and resharding.
using ShardRows = std::vector<std::pair<std::string, at::Tensor>>;

// What one rank's classifier takes in memory, computed from the options alone (before
// anything is allocated): the shard's rows x embedding x 4 B for the weight, the
// optimiser's rows (SGD momentum: one more; AdamW: two more and an int64 step per row), the
// step's gradient (the whole shard without sampling; with sampling the sampled rows and
// their copy, plus a dense gradient of the shard with step_all_rows; a half-precision
// copy of them for the GEMM under mixed precision) and the fp32 logits buffer
// [batch x world, sampled rows]. A lower bound: the softmax's small vectors, the sampling
// scores and the allocator's rounding come on top. Doubles, so that no size overflows.
struct ClassifierMemoryPlan {
  int64_t rows = 0;          // classes of this rank's shard
  int64_t sampled_rows = 0;  // rows that take part in a step
  int64_t embedding_size = 0;
  int64_t global_batch = 0;  // batch per rank x ranks: the logits' rows
  double weight_bytes = 0, state_bytes = 0, gradient_bytes = 0, logits_bytes = 0;
  double total_bytes() const { return weight_bytes + state_bytes + gradient_bytes + logits_bytes; }
};
// Option errors as PartialFC's ("num_classes" when there are fewer classes than ranks).
ClassifierMemoryPlan classifier_memory_plan(const PartialFCOptions& opts, int world_size, int rank,
                                            int64_t batch_per_rank);

class PartialFC {
 public:
  // Option errors name "num_classes", "sample_rate", "embedding_size" or "optimizer".
  PartialFC(Distributed& dist, const PartialFCOptions& opts, torch::Device device = torch::kCPU);

  // local_embeddings [B, d] (any floating dtype) on the shard's device, local_labels [B]
  // global class ids, on the CPU: labels are host data (the loader's), so they are gathered
  // over the CPU backend and checked, and the classes to sample chosen, on the host, and
  // the step never waits for the device (labels on a GPU are copied back first: a sync).
  // Labels outside [0, num_classes) are an error naming the label, its rank and batch row.
  PartialFCOutput forward(const at::Tensor& local_embeddings, const at::Tensor& local_labels);

  // --- the optimiser side, called after backward ---------------------------------------
  // Gradient accumulation: with sampling every forward selects its own rows, so after each
  // micro-batch's backward but the last, accumulate() sets that gradient aside; the step
  // then applies the sum, per row over the union of the rows: the exact gradient of the
  // summed micro-batch losses. A no-op without sampling (autograd accumulates into the
  // whole shard).
  void accumulate();
  // Mixed precision: multiplies the step's gradient by inv_scale (a 1-element fp32 tensor
  // on the shard's device) and returns a 1-element fp32 flag there, 1 when the gradient
  // holds an inf or NaN (torch's AMP unscale kernel; no host sync).
  at::Tensor unscale_(const at::Tensor& inv_scale);
  // Moves the rows that took part in the step (all of them without sampling or with
  // step_all_rows) and drops the gradient. A step without a classifier gradient changes
  // nothing.
  void step(double lr);
  // Drops the step's gradient (set-aside micro-batches included) without moving anything.
  void zero_grad();

  // --- state ----------------------------------------------------------------------------
  // "weight" and "opt.<name>" per-class rows of this shard (live tensors, not copies).
  ShardRows state() const;
  // Replaces weight and optimiser rows (shapes checked; errors name `source` and the key).
  // A shard built without initialise_rows needs every entry.
  void load_state(const ShardRows& rows, const std::string& source);
  // Fills the weight and optimiser rows in place: fill(name, rows) is called once per
  // entry of state(), with the live [count, ...] tensor on the shard's device, and must
  // write all of it (a checkpoint streamed straight into the shard: no second copy of it,
  // no host buffer of its size on a GPU).
  void fill_state(const std::function<void(const std::string& name, const at::Tensor& rows)>& fill);
  // Forwards taken: the sampling RNG is a function of seed, rank and this count, so a
  // resumed run samples as the uninterrupted one (micro-batches count one each).
  int64_t forwards() const { return forwards_; }
  void set_forwards(int64_t n) { forwards_ = n; }

  // --- inspection -------------------------------------------------------------------------
  const ClassShard& shard() const { return shard_; }
  const PartialFCOptions& options() const { return opts_; }
  // The margin head and its state (the same on every rank).
  MarginHead& head() const { return *head_; }
  int64_t num_sample() const { return num_sample_; }
  bool samples() const { return num_sample_ < shard_.count; }
  // The whole shard [count, d], fp32.
  const at::Tensor& weight() const { return weight_; }
  // The rows (local indices, sorted) of the step so far: the last forward's, or the union
  // of the micro-batches' once merged (after unscale_/step). Undefined without sampling.
  const at::Tensor& sampled_index() const { return index_; }
  // The gradient of those rows ([rows, d]; the whole shard without sampling), undefined
  // before backward.
  at::Tensor gradient() const;

  // Deterministic initial centres N(0, 0.01) for global classes [start, start+count): the
  // same class gets the same initial centre whatever the number of ranks.
  static at::Tensor initial_rows(int64_t start, int64_t count, int64_t dim, uint64_t seed);

 private:
  void merge_accumulated();

  Distributed& dist_;
  PartialFCOptions opts_;
  ClassShard shard_;
  int64_t num_sample_;
  at::Tensor weight_;
  at::Tensor index_;       // sampled rows of the step
  at::Tensor sub_weight_;  // the autograd leaf of the sampled rows (weight_ itself without sampling)
  ShardOptimizer optimizer_;
  std::unique_ptr<MarginHead> head_;
  std::vector<at::Tensor> pending_index_, pending_grad_;  // accumulate()
  int64_t forwards_ = 0;
  bool rows_ready_ = true;  // false from a construction without initialise_rows until filled
};

}  // namespace faceshard
