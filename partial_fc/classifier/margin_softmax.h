// The classifier's loss on one shard, as one autograd function that owns the big GEMM:
// from the normalised embeddings of the global batch E [N, d] and this rank's raw centres
// W [S, d] to the margin softmax cross-entropy across all ranks. Memory is one fp32
// [N, S] buffer: the GEMM E W^T is written into it, scaled in one pass to s * cos (the
// column factor s / ||w_j||), given the margin on the target entries, shifted by the global
// row max, exponentiated and normalised in place (the probabilities), and in backward the
// same buffer becomes the gradient in place. Neither pass makes a normalised copy of W:
// with G' = dL/dcos / ||W|| (per column),
//   dL/dE = G' W,   dL/dw_j = M_j - (w_j . M_j) w_j / ||w_j||^2,  M = G'^T E
// (the second term removes the radial part: the loss does not depend on ||w_j||).
// The softmax runs across ranks with two small all-reduces (row max; row sum of exponentials
// with the target logit), the loss is computed in the log domain, and the margin's gradient
// is the head's (margin_head.h). Heads that change non-target logits keep a 2-bit code per
// entry (1/16 of the buffer) so that backward can correct those entries from the
// probabilities alone. Nothing in either pass reads a device value on the host.
//
// The weight's gradient can also be left unmaterialised (PartialFC does): with a
// DeferredWeightGrad in the options, the weight is not differentiated, and backward keeps
// G' (the buffer), E and 1/||w|| there, from which the caller computes dL/dW a chunk of
// rows at a time (DeferredWeightGrad::rows), so that no [S, d] gradient exists whole.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "partial_fc/classifier/margin_head.h"
#include "partial_fc/distributed/distributed.h"

namespace faceshard {

// What backward leaves for the caller's chunked update when the weight's gradient is
// deferred: dL/dw_j = M_j - (w_j . M_j) w_j / ||w_j||^2 with M = G'^T E, for any columns.
struct DeferredWeightGrad {
  at::Tensor g;         // [N, S] fp32: G' = dL/dcos / ||w_j|| per column (the logits buffer)
  at::Tensor e;         // [N, d] fp32: the normalised embeddings of the forward
  at::Tensor inv_norm;  // [S] fp32: 1 / max(||w_j||, eps) of the forward (per row of the weight)
  at::ScalarType gemm_dtype = at::kFloat;  // the type of the forward's GEMMs
  at::Tensor e_low;     // E in gemm_dtype when kept (else converted where needed)
  // With sub-centres (subcenter.h) G' is per row of the weight (K per class) and is made on
  // demand from the per-class buffer through `recompute`, as here.
  // The streamed softmax (streamed_softmax.h) holds no G': it recomputes columns
  // [first, first + n) of it ([N, n] fp32) from E, the centres and a few values per row;
  // `row_terms` are those values, finite exactly when G' is (given finite E and centres).
  std::function<at::Tensor(int64_t first, int64_t n)> recompute;
  at::Tensor row_terms;
  // Set by the caller before backward: the streamed backward hands it each chunk's G' as it
  // forms it (the caller's update of those rows, which the backward has read for the last
  // time), and sets `applied`.
  std::function<void(int64_t first, int64_t n, const at::Tensor& g)> on_chunk;
  bool applied = false;
  // Set by backward: G' (held or recomputable), E and the norms are there.
  bool ready() const { return g.defined() || static_cast<bool>(recompute); }
  // Columns [first, first + n) of G' [N, n].
  at::Tensor g_columns(int64_t first, int64_t n) const { return g.defined() ? g.narrow(1, first, n) : recompute(first, n); }
  // What decides whether dW is finite: G' (or the row terms that make it) and E.
  std::vector<at::Tensor> finiteness_parts() const { return {g.defined() ? g : row_terms, e}; }
  // dL/dW of columns [first, first + n) [n, d] fp32, given those columns' centres w [n, d]
  // fp32 (the forward's values: the weight has not moved since). The same arithmetic as the
  // materialised gradient (G'^T E per chunk, in gemm_dtype when that is reduced).
  at::Tensor rows(int64_t first, int64_t n, const at::Tensor& w) const;
  // The product alone, (G'^T E) of columns [first, first + n) [n, d] fp32: rows() less the
  // radial part, which needs the centres (ShardOptimizer::update_projected_rows forms it
  // where it reads them anyway).
  at::Tensor raw_rows(int64_t first, int64_t n) const;
  // The same product from given columns of G' [N, n].
  at::Tensor raw_of(const at::Tensor& g_columns) const;
  // raw_rows' result made the gradient in place, given the columns' centres w [n, d]:
  // raw - (w . raw) / ||w||^2 * w per row (rows() is raw_rows followed by this).
  void remove_radial(at::Tensor& raw, int64_t first, const at::Tensor& w) const;
};

struct MarginSoftmaxOptions {
  // The head (margin_head.h), owned by the caller and alive until backward has run; its
  // state advances once per forward.
  MarginHead* head = nullptr;
  // Seed and forward count for heads that draw per step (ElasticFace).
  uint64_t seed = 0;
  int64_t forward = 0;
  // The type E and W enter the GEMMs in: kFloat, or kBFloat16 / kHalf to run them in the
  // body's precision (the backend accumulates in fp32); the [N, S] buffer and everything
  // after the GEMM stay fp32.
  at::ScalarType gemm_dtype = at::kFloat;
  // Reduced-precision GEMMs convert W and the buffer in chunks of this many classes, so no
  // full-size low-precision copy exists at any time.
  int64_t chunk_classes = 2048;
  // The columns: rows `rows` of `weight` (sorted local indices), read chunk_classes at a time
  // in both passes so that no copy of them exists whole; undefined = every row of `weight`.
  // Only with `deferred` (the weight's gradient is then the caller's business).
  at::Tensor rows;
  // When set, the weight's gradient is deferred (see above): backward returns none for it
  // and fills this in instead.
  std::shared_ptr<DeferredWeightGrad> deferred;
  // Centres per class (subcenter.h): the weight's rows (or `rows`) are K per class,
  // class-major, and a class's cosine is the best of its K; the columns of the softmax, the
  // target and the head's margin are per class. The weight gradient's rows (deferred or
  // not) are the weight's. 1: one centre per class, and nothing of subcenter.h runs.
  int64_t subcenters = 1;
};

// The argument checks both passes make (streamed_softmax.h too), errors prefixed by `who`.
void check_margin_softmax_inputs(const char* who, const at::Tensor& emb, const at::Tensor& weight,
                                 const at::Tensor& norms, const MarginSoftmaxOptions& options);

// emb: [N, d] fp32, rows L2-normalised (differentiable); weight: [S, d] fp32, this rank's
// (sampled) centres, not normalised (differentiable unless options.deferred); target: [N] int64 on the same
// device, the row's class column in `weight` when this rank owns it, else -1. Returns the
// mean over the N rows of -log softmax(margin(logits))[target]; `accuracy` (optional)
// receives the global top-1 accuracy over the classes taking part (0-dim, no host sync).
// Backward may run once (the saved probabilities become the gradient in place).
at::Tensor margin_softmax_loss(const at::Tensor& emb, const at::Tensor& weight, const at::Tensor& target,
                               const at::Tensor& norms, const MarginSoftmaxOptions& options, Distributed& dist,
                               at::Tensor* accuracy = nullptr);

}  // namespace faceshard
