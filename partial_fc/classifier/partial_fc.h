// The sharded classifier ("Partial FC"): one centre per identity, sharded by class across
// the ranks and never replicated, together with its optimiser state. Forward gathers the
// batch's embeddings (differentiable) and labels, normalises, takes the cosines against
// this shard's centres (all of them, or with sample_rate < 1 the positive classes of the
// batch plus random negatives), applies the margin and the distributed softmax
// cross-entropy, and returns the global-batch loss. After backward, step() moves the rows
// that took part (and only those, unless step_all_rows) with the shard's optimiser.
//
// The weight's gradient is never materialised whole: backward leaves the logits buffer as
// G' = dL/dcos / ||w|| together with the normalised embeddings E and the column norms
// (margin_softmax.h, DeferredWeightGrad), and step() walks the step's rows in chunks of
// update_chunk_rows: dW_chunk = G'_chunk^T E minus its radial part, then the optimiser on
// those rows and their state, so a step needs the shard's weight, its optimiser state, the
// logits buffer and one chunk. What still materialises a gradient (documented where it
// happens, and counted by classifier_memory_plan): gradient accumulation (each micro-batch's
// gradient is set aside), step_all_rows with sampling (its dense [shard, d] gradient), and
// gradient(), which computes it on demand for tests and tools.
//
// Gradient convention (docs/architecture.md), decided here once: the loss is the mean over the global
// batch, so the reduce-scatter in the gather's backward gives each rank exactly
// dL/d(its embeddings); the backbone is replicated and DataParallel AVERAGES its
// gradients over the W ranks, which would leave 1/W of dL/dtheta. The gather's backward
// therefore multiplies the embedding gradient by W (as arcface_torch does), so that after
// averaging the backbone receives dL/dtheta of the global-mean loss. Tested against one
// process holding the whole batch and the whole weight matrix.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "partial_fc/classifier/chunk_policy.h"
#include "partial_fc/classifier/class_shard.h"
#include "partial_fc/classifier/margin.h"
#include "partial_fc/classifier/margin_head.h"
#include "partial_fc/classifier/margin_softmax.h"
#include "partial_fc/classifier/shard_optimizer.h"
#include "partial_fc/distributed/distributed.h"

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
  // Rows per chunk of the step's update (the only gradient that exists at once is
  // [update_chunk_rows, d]; with sampling also the chunk in which forward and backward read
  // the sampled rows). 0 = chosen by `chunking` (chunk_policy.h): on a GPU from a memory
  // budget (chunk_budget_bytes of temporaries, so that a step is a bounded number of kernel
  // launches whatever the class count); on the CPU about 2 MiB of fp32 rows (1024 at d =
  // 512), so that a chunk's temporaries stay below glibc's mmap threshold and reuse heap
  // memory instead of faulting fresh pages in for every chunk. Negative values are an
  // "update_chunk_rows" option error.
  int64_t update_chunk_rows = 0;
  // optim.fc_chunking: auto (budget on a GPU, cache on the CPU), cache or budget; budget on
  // the CPU runs the GPU's chunking there (faceshard-bench --chunking budget counts its
  // operators). chunk_budget_bytes: the budget policy's temporaries (0: 2 GiB).
  ChunkPolicy chunking = ChunkPolicy::Auto;
  int64_t chunk_budget_bytes = 0;
  // Micro-batches per optimiser step (optim.grad_accumulation): only classifier_memory_plan
  // reads it, to count the set-aside gradients.
  int64_t grad_accumulation = 1;
  // false: the weight and optimiser rows are allocated but not initialised, because a
  // checkpoint is about to be read into them (fill_state): drawing millions of initial
  // centres only to overwrite them costs seconds, and nothing is written twice. Such a
  // shard refuses to run forward until its rows are filled.
  bool initialise_rows = true;
  // The type the big GEMMs run in (the body's precision: kBFloat16/kHalf under mixed
  // precision); the logits and the softmax stay fp32 (margin_softmax.h).
  at::ScalarType gemm_dtype = at::kFloat;
  // How the centres are stored (optim.fc_weight_dtype): kFloat, or kBFloat16, read into
  // fp32 a chunk at a time and updated in fp32, each updated row written back with
  // stochastic rounding keyed by (seed, step, global class, element) (stochastic_round.h),
  // so that a run rounds alike on any number of ranks. Anything else is an option error
  // naming "fc_weight_dtype".
  at::ScalarType weight_dtype = at::kFloat;
  // optim.fc_weight_rounding nearest: bf16 centres rounded to nearest instead (the control
  // that drops updates below half a bf16 step; for comparison, not for training).
  bool weight_round_nearest = false;
  // loss.logits: false = the [batch x world, sampled] fp32 logits buffer
  // (margin_softmax.h); true = never held (streamed_softmax.h): the classifier's memory
  // does not grow with the number of ranks, at the price of one more GEMM per step.
  bool streamed_logits = false;
  // loss.subcenters: centres per class (subcenter.h). The shard's weight and every
  // optimiser state have count x K rows, class-major (local class c's sub-centre k is row
  // c * K + k); sampling picks classes and takes all K rows of each; sampled_index(),
  // gradient(), state() and the step are in rows. Anything below 1 (or above 255) is an
  // option error naming "subcenters".
  int64_t subcenters = 1;
};

struct PartialFCOutput {
  at::Tensor loss;      // 0-dim, differentiable w.r.t. the local embeddings and the centres
  at::Tensor accuracy;  // 0-dim, global top-1 over the classes taking part
};

// Rows of a shard (name -> [count, ...] tensor), for checkpoints and resharding.
using ShardRows = std::vector<std::pair<std::string, at::Tensor>>;

// What one rank's classifier takes in memory, computed from the options alone (before
// anything is allocated): the shard's rows x embedding x 4 B (2 B in bf16) for the weight, the
// optimiser's rows (SGD momentum: one more; AdamW: two more and an int64 step per row; the
// moments at 2 B an element with optimizer.state_dtype bf16), and the fp32 logits buffer
// [batch x world, sampled rows], which after backward holds the gradient G' that the
// chunked step turns into the weight's gradient a chunk of rows at a time (streamed logits:
// no buffer, 1 / ||w_j|| of each sampled row, 4 B). The step's
// gradient (gradient_bytes) is therefore zero per class except where one is materialised:
// with step_all_rows and sampling, the sampled rows' gradient and a dense [shard, d] one;
// with grad_accumulation k > 1, the set-aside micro-batch gradients: with sampling k
// [sampled, d] ones, their concatenation and their per-row sum (at most k sampled rows or
// the shard), without sampling one [shard, d] running sum. A lower bound: the softmax's
// small vectors (a few per sampled row), the sampling scores (4 B a row, in forward only),
// one chunk of the update and the allocator's rounding come on top. Doubles, so that no
// size overflows.
struct ClassifierMemoryPlan {
  int64_t rows = 0;          // classes of this rank's shard
  int64_t sampled_rows = 0;  // classes that take part in a step
  int64_t subcenters = 1;    // centres (rows of the weight and the state) per class
  int64_t embedding_size = 0;
  int64_t global_batch = 0;  // batch per rank x ranks: the logits' rows
  bool streamed = false;     // the logits are streamed (never held)
  double weight_bytes = 0, state_bytes = 0, gradient_bytes = 0, logits_bytes = 0;
  // The head changes non-target logits (AdaFace, CurricularFace): a buffer of logits keeps 2
  // bits per entry beside them (counted in logits_bytes).
  bool head_codes = false;
  // The chunked passes' temporaries (chunk_policy.h): on a GPU a fixed reserve, the budget's
  // chunk (or the whole step's rows when they are fewer) x update_row_bytes or column_bytes; on the CPU a
  // cache-sized chunk's.
  double chunk_bytes = 0;
  double total_bytes() const { return weight_bytes + state_bytes + gradient_bytes + logits_bytes + chunk_bytes; }
};
// loss.logits auto: whether streamed logits are the better choice for these options. The
// streamed pass costs one more GEMM over the (sampled) classes per step (1.2x the
// classifier's step on a CPU, docs/performance.md) and saves the buffer's 4 B x the global
// batch x the sample rate per class: it is chosen where that buffer would take more memory
// than the centres and their optimiser state together, which is where the buffer decides
// how many classes fit (many ranks, large batches).
bool streamed_logits_pay(const PartialFCOptions& opts, int world_size, int64_t batch_per_rank);

// Option errors as PartialFC's ("num_classes" when there are fewer classes than ranks).
// `cuda`: the shard's device is a GPU (the chunk temporaries of its policy are counted).
ClassifierMemoryPlan classifier_memory_plan(const PartialFCOptions& opts, int world_size, int rank,
                                            int64_t batch_per_rank, bool cuda = true);

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
  // summed micro-batch losses. Without sampling the gradient joins one running sum of the
  // shard (a forward after a backward does that itself, as autograd's accumulation did).
  // Each set-aside gradient is materialised (the cost classifier_memory_plan counts).
  void accumulate();
  // Mixed precision: returns a 1-element fp32 flag on the shard's device, 1 when the step's
  // weight gradient would hold an inf or NaN, and has the step multiply it by inv_scale (a
  // 1-element fp32 tensor there). No host sync. For the deferred gradient the flag comes
  // from G' and E (a non-finite dW needs a non-finite one of them) before any update, and
  // inv_scale is applied to each chunk in step(); set-aside gradients are unscaled in place
  // (torch's AMP unscale kernel).
  at::Tensor unscale_(const at::Tensor& inv_scale);
  // Moves the rows that took part in the step (all of them without sampling or with
  // step_all_rows) and drops the gradient. A step without a classifier gradient changes
  // nothing.
  void step(double lr);
  // With streamed logits: the next forward's backward applies the step with this learning
  // rate itself, each chunk of rows as soon as its gradient is formed (the step then only
  // drops the gradient), which saves the step's recomputation of the logits. Ignored where
  // the step needs the whole gradient first (gradient accumulation, a dense step of every
  // row) and by buffered logits; never arm a step whose gradient is to be unscaled,
  // inspected or skipped.
  void arm_step(double lr);
  // Drops the step's gradient (set-aside micro-batches included) without moving anything.
  void zero_grad();

  // --- state ----------------------------------------------------------------------------
  // "weight" and "opt.<name>" per-class rows of this shard (live tensors, not copies).
  ShardRows state() const;
  // Called before rows of state() change in place: rows [first, first + count), or, where
  // `index` is defined (an int64 tensor on the shard's device), the rows it lists. Where a
  // copy of the rows is being taken meanwhile (a checkpoint staged in the background,
  // app/train/row_staging.h), the copy of those rows is taken first. Nothing: no hook.
  using RowsChangeHook = std::function<void(int64_t first, int64_t count, const at::Tensor& index)>;
  void set_before_rows_change(RowsChangeHook hook) { before_rows_change_ = std::move(hook); }
  // Replaces weight and optimiser rows (shapes checked; errors name `source` and the key).
  // A shard built without initialise_rows needs every entry.
  void load_state(const ShardRows& rows, const std::string& source);
  // Fills the weight and optimiser rows in place: fill(name, rows) is called once per
  // entry of state(), with the live [count, ...] tensor on the shard's device, and must
  // write all of it (a checkpoint streamed straight into the shard: no second copy of it,
  // no host buffer of its size on a GPU).
  void fill_state(const std::function<void(const std::string& name, const at::Tensor& rows)>& fill);
  // The chunks the passes take for a global batch of `global_rows` (chunk_policy.h).
  ChunkSizes chunk_sizes_for(int64_t global_rows) const;
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
  // The whole shard [count x K, d], in weight_dtype.
  const at::Tensor& weight() const { return weight_; }
  // The rows (local indices, sorted; K per sampled class) of the step so far: the last forward's, or the union
  // of the micro-batches' once merged (after unscale_/step). Undefined without sampling.
  const at::Tensor& sampled_index() const { return index_; }
  // The gradient of those rows ([rows, d]; the whole shard without sampling), undefined
  // before backward.
  // Computed on demand from the deferred gradient (the step never materialises it), times
  // the inv_scale of unscale_ once that has run; the sum so far under accumulation.
  at::Tensor gradient() const;

  // bf16 centres: the share of the values that the steps since the last call moved in fp32
  // but whose stored bf16 did not change (updates lost to rounding), and how many values
  // moved; a host read (a sync on a GPU: call it where the loss is read). Without bf16
  // centres nothing is counted.
  std::pair<double, int64_t> take_lost_updates();
  // The same counts as they are, [lost, moved] (int64, on the device; undefined without
  // bf16 centres), without a host read: for a reader that copies them asynchronously.
  at::Tensor take_lost_update_counts();

  // Deterministic initial centres N(0, 0.01) for global classes [start, start+count): the
  // same class gets the same initial centre whatever the number of ranks.
  static at::Tensor initial_rows(int64_t start, int64_t count, int64_t dim, uint64_t seed);

 private:
  void merge_accumulated();
  // How updated bf16 rows are written back (the keys of this step's rounding).
  RowRounding rounding() const {
    // Keyed by the global row: the class's with one centre per class.
    return RowRounding{opts_.seed, forwards_, shard_.start * opts_.subcenters, opts_.weight_round_nearest, lost_};
  }
  // The current micro-batch's dL/dW of the step's rows, materialised ([rows, d]).
  at::Tensor materialise() const;
  // The step without materialising: the optimiser chunk by chunk from grad_.
  void chunked_step(double lr);
  // The update of the step's rows [j, j + n) from raw = (G'^T E) of those columns.
  void update_chunk(int64_t j, int64_t n, at::Tensor raw, double lr);
  // The update of rows [first, first + n) from their columns of G' ([N, n]), in pieces of
  // the update's chunk.
  void update_columns(int64_t first, int64_t n, const at::Tensor& g, double lr);

  Distributed& dist_;
  PartialFCOptions opts_;
  ClassShard shard_;
  int64_t num_sample_;
  at::Tensor weight_;
  at::Tensor index_;       // sampled rows of the step
  ShardOptimizer optimizer_;
  std::unique_ptr<MarginHead> head_;
  // The last forward's deferred weight gradient (ready once backward has run).
  std::shared_ptr<DeferredWeightGrad> grad_;
  at::Tensor inv_scale_;  // unscale_'s factor, applied to each chunk of grad_ in the step
  // accumulate(): with sampling each micro-batch's rows and gradient; without, one running
  // [shard, d] sum (index undefined).
  std::vector<at::Tensor> pending_index_, pending_grad_;
  at::Tensor merged_;  // the set-aside gradients summed over the union of their rows
  int64_t forwards_ = 0;
  std::optional<double> armed_lr_;
  ChunkSizes chunks_;  // the chunks of the last forward's step (chunk_policy.h)
  at::Tensor lost_;           // [2] int64: RowRounding::lost (bf16 centres)
  bool rows_ready_ = true;  // false from a construction without initialise_rows until filled
  RowsChangeHook before_rows_change_;
  // Every writer of state()'s rows calls this first.
  void rows_change(int64_t first, int64_t count, const at::Tensor& index = at::Tensor()) const {
    if (before_rows_change_) before_rows_change_(first, count, index);
  }
};

}  // namespace faceshard
