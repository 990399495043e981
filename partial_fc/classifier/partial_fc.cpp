#include "partial_fc/classifier/partial_fc.h"

#include <ATen/Parallel.h>

#include <cmath>

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#ifdef FACESHARD_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include "partial_fc/classifier/head_catalogue.h"
#include "partial_fc/classifier/margin_softmax.h"
#include "partial_fc/classifier/streamed_softmax.h"
#include "partial_fc/classifier/subcenter.h"
#include "partial_fc/data_parallel/all_gather.h"
#include "base/designed_host_sync.h"
#include "base/error.h"

namespace faceshard {

namespace {
constexpr int64_t kInitBlock = 1024;  // classes drawn from one seeded generator

// A host tensor on `dev`: from pinned memory and without waiting on a GPU, so the copy
// queues behind the device's work instead of stopping the host.
at::Tensor to_device(const at::Tensor& host, const torch::Device& dev) {
  if (!dev.is_cuda()) return host.to(dev);
  return host.pin_memory().to(dev, /*non_blocking=*/true);
}

// The sampling stream of a forward: a generator of the weight's device (CPU for any other).
at::Generator sampling_generator(const torch::Device& dev, uint64_t seed) {
#ifdef FACESHARD_WITH_CUDA
  if (dev.is_cuda()) {
    at::Generator gen = at::cuda::detail::createCUDAGenerator(dev.index());
    gen.set_current_seed(seed);
    return gen;
  }
#endif
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

// What the chunk policy is given for a forward over `global_rows` logits rows on `cuda` or
// the CPU (chunk_policy.h): the one place the options become chunk inputs, for the
// classifier's passes and for its memory plan alike.
ChunkInputs chunk_inputs(const PartialFCOptions& o, bool cuda, int64_t global_rows) {
  ChunkInputs in;
  in.cuda = cuda;
  in.policy = o.chunking;
  in.fixed_rows = o.update_chunk_rows;
  in.budget_bytes = o.chunk_budget_bytes;
  in.embedding_size = o.embedding_size;
  in.global_rows = global_rows;
  in.fused_update = o.optimizer.kind == "sgd" && o.optimizer.fused_cpu_rows;
  in.reduced_gemm = o.gemm_dtype != at::kFloat;
  return in;
}

// The chunks of the chunked passes for a forward over `global_rows` logits rows.
ChunkSizes chunks_for(const PartialFCOptions& o, const torch::Device& dev, int64_t global_rows) {
  return chunk_sizes(chunk_inputs(o, dev.is_cuda(), global_rows));
}

const PartialFCOptions& checked(const PartialFCOptions& o) {
  if (!(o.sample_rate >= 0 && o.sample_rate <= 1))
    throw option_error("sample_rate", "must be in [0, 1], got ", o.sample_rate);
  if (o.embedding_size < 1) throw option_error("embedding_size", "must be positive, got ", o.embedding_size);
  if (o.update_chunk_rows < 0)
    throw option_error("update_chunk_rows", "must be positive (or 0: chosen for the device), got ", o.update_chunk_rows);
  if (o.chunk_budget_bytes < 0)
    throw option_error("fc_chunk_budget", "must be positive (or 0: 2 GiB), got ", o.chunk_budget_bytes);
  if (o.optimizer.state_dtype != at::kFloat && o.optimizer.state_dtype != at::kBFloat16)
    throw option_error("fc_state_dtype", "the classifier's optimiser state must be fp32 or bf16, got ",
                       o.optimizer.state_dtype);
  if (o.weight_dtype != at::kFloat && o.weight_dtype != at::kBFloat16)
    throw option_error("fc_weight_dtype", "the classifier's centres must be fp32 or bf16, got ", o.weight_dtype);
  if (o.subcenters < 1 || o.subcenters > 255)
    throw option_error("subcenters", "must be in [1, 255] centres per class, got ", o.subcenters);
  if (o.head.name == "combined") o.margin.validate();
  return o;
}
}  // namespace

ClassifierMemoryPlan classifier_memory_plan(const PartialFCOptions& o, int world_size, int rank,
                                            int64_t batch_per_rank, bool cuda) {
  const ClassShard shard = ClassShard::of(checked(o).num_classes, world_size, rank);
  ClassifierMemoryPlan p;
  p.rows = shard.count;
  p.sampled_rows = std::min<int64_t>(shard.count, static_cast<int64_t>(o.sample_rate * static_cast<double>(shard.count)));
  p.embedding_size = o.embedding_size;
  p.global_batch = batch_per_rank * world_size;
  p.streamed = o.streamed_logits;
  p.subcenters = o.subcenters;
  const double row = static_cast<double>(o.embedding_size) * 4.0;  // one fp32 row (a gradient's)
  const double weight_row = static_cast<double>(o.embedding_size) * (o.weight_dtype == at::kBFloat16 ? 2.0 : 4.0);
  // Rows: K per class (sub-centres), in the weight, its state and any gradient; the logits
  // are per class.
  const double K = static_cast<double>(o.subcenters);
  const double n = K * static_cast<double>(p.rows), s = K * static_cast<double>(p.sampled_rows);
  const double classes = static_cast<double>(p.sampled_rows);
  const bool sampling = p.sampled_rows < p.rows;
  const double state_row = static_cast<double>(o.embedding_size) * (o.optimizer.state_dtype == at::kBFloat16 ? 2.0 : 4.0);
  p.weight_bytes = n * weight_row;
  p.state_bytes = o.optimizer.kind == "adamw" ? n * (2 * state_row + 8) : n * state_row;
  // The step's own gradient is G' in the logits buffer and one chunk of rows: nothing per
  // class. What materialises one (partial_fc.h):
  p.gradient_bytes = 0;
  if (sampling && o.step_all_rows) p.gradient_bytes += s * row + n * row;
  const double k = static_cast<double>(std::max<int64_t>(1, o.grad_accumulation));
  if (k > 1) p.gradient_bytes += sampling ? 2 * k * s * row + std::min(k * s, n) * row : n * row;
  // The buffer holds a logit per class (and with K > 1 a byte for its arg-max sub-centre);
  // the streamed pass 1 / ||w|| per row.
  p.logits_bytes = o.streamed_logits ? s * 4.0
                                     : static_cast<double>(p.global_batch) * classes * (o.subcenters > 1 ? 5.0 : 4.0);
  // A head that changes negatives keeps one 2-bit code per buffered logit (margin_softmax):
  // a byte per four classes of each row.
  if (!o.streamed_logits && o.head.name != "combined" && find_head_info(o.head.name) &&
      make_margin_head(o.head, o.margin)->modifies_negatives()) {
    p.head_codes = true;
    p.logits_bytes += static_cast<double>(p.global_batch) * std::ceil(classes / 4.0);
  }
  const ChunkInputs ci = chunk_inputs(o, cuda, p.global_batch);
  const ChunkSizes cs = chunk_sizes(ci);
  // A shard smaller than a chunk brings its own rows' temporaries only.
  const double rows_at_once = std::max(1.0, s);
  p.chunk_bytes = std::max(std::min<double>(cs.update_rows, rows_at_once) * update_row_bytes(ci),
                           std::min<double>(cs.logits_columns, rows_at_once) * column_bytes(ci));
  return p;
}

bool streamed_logits_pay(const PartialFCOptions& o, int world_size, int64_t batch_per_rank) {
  PartialFCOptions buffered = o;
  buffered.streamed_logits = false;
  const ClassifierMemoryPlan p = classifier_memory_plan(buffered, world_size, 0, batch_per_rank);
  return p.logits_bytes > p.weight_bytes + p.state_bytes;
}

at::Tensor PartialFC::initial_rows(int64_t start, int64_t count, int64_t dim, uint64_t seed) {
  at::Tensor out = torch::empty({count, dim});
  if (count == 0) return out;
  // Each block of classes has its own generator, so the blocks are drawn in parallel and the
  // rows do not depend on the thread count (millions of classes take seconds, not minutes).
  at::parallel_for(start / kInitBlock, (start + count - 1) / kInitBlock + 1, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + static_cast<uint64_t>(b));
      at::Tensor block = at::normal(0.0, 0.01, {kInitBlock, dim}, gen);
      const int64_t lo = std::max(start, b * kInitBlock), hi = std::min(start + count, (b + 1) * kInitBlock);
      out.narrow(0, lo - start, hi - lo).copy_(block.narrow(0, lo - b * kInitBlock, hi - lo));
    }
  });
  return out;
}

PartialFC::PartialFC(Distributed& dist, const PartialFCOptions& opts, torch::Device device)
    : dist_(dist),
      opts_(checked(opts)),
      shard_(ClassShard::of(opts.num_classes, dist.world_size(), dist.rank())),
      num_sample_(std::min<int64_t>(shard_.count, static_cast<int64_t>(opts.sample_rate * shard_.count))),
      weight_(torch::empty({shard_.count * opts.subcenters, opts.embedding_size},
                           torch::TensorOptions(device).dtype(opts.weight_dtype))),
      optimizer_(weight_, opts.optimizer, opts.initialise_rows),
      head_(make_margin_head(opts.head, opts.margin)),
      rows_ready_(opts.initialise_rows) {
  chunks_ = chunks_for(opts_, device, 1);
  if (opts.weight_dtype != at::kFloat) lost_ = torch::zeros({2}, torch::TensorOptions(device).dtype(at::kLong));
  if (!opts.initialise_rows) return;
  // Drawn in blocks of rows straight into the storage: no fp32 copy of a bf16 shard, and
  // no host copy of a device one, exists whole. Keyed by the global row (class * K + k), so
  // a sub-centre's initial value does not depend on the number of ranks either.
  constexpr int64_t kBlock = 8 * kInitBlock;
  torch::NoGradGuard ng;
  const int64_t rows = weight_.size(0), first = shard_.start * opts.subcenters;
  for (int64_t j = 0; j < rows; j += kBlock) {
    const int64_t n = std::min(kBlock, rows - j);
    weight_.narrow(0, j, n).copy_(initial_rows(first + j, n, opts.embedding_size, opts.seed));
  }
}

PartialFCOutput PartialFC::forward(const at::Tensor& local_emb, const at::Tensor& local_labels) {
  TORCH_CHECK(local_emb.dim() == 2 && local_emb.size(1) == opts_.embedding_size, "PartialFC: embeddings must be [B, ",
              opts_.embedding_size, "], got ", local_emb.sizes());
  if (!rows_ready_)
    throw runtime_error("PartialFC: the shard's rows were allocated for a checkpoint that has not been loaded");
  const int W = dist_.world_size();
  const torch::Device dev = weight_.device();
  // Without sampling a second backward before the step adds to the first (autograd's
  // accumulation into the weight used to): set the last one aside.
  if (!samples() && grad_ && grad_->ready()) accumulate();
  at::Tensor emb = all_gather_with_grad(dist_, local_emb, GatherGrad::ReduceScatterSum, static_cast<double>(W));
  std::vector<int64_t> counts;
  at::Tensor labels = dist_.all_gather(local_labels.reshape({-1}).to(torch::kCPU, torch::kLong).contiguous(), &counts);
  TORCH_CHECK(labels.size(0) == emb.size(0), "PartialFC: ", emb.size(0), " embeddings but ", labels.size(0), " labels");
  chunks_ = chunk_sizes_for(emb.size(0));

  // Every rank sees every label: all of them reject a bad one in the same step.
  at::Tensor bad = ((labels < 0) | (labels >= opts_.num_classes)).nonzero();
  if (bad.numel() > 0) {
    const int64_t row = bad[0][0].item<int64_t>();
    int64_t owner = 0, first = 0;
    while (owner < static_cast<int64_t>(counts.size()) - 1 && row >= first + counts[owner]) first += counts[owner++];
    throw runtime_error("label ", labels[row].item<int64_t>(), " of rank ", owner, " (batch row ", row - first,
                        ") is outside [0, ", opts_.num_classes, ") = the classifier's classes");
  }

  const at::Tensor local = labels - shard_.start;
  const at::Tensor mine = (labels >= shard_.start) & (labels < shard_.end());
  at::Tensor target;
  if (samples()) {
    torch::NoGradGuard ng;
    // All positive classes of the global batch, then uniformly random negatives up to the
    // budget (all positives when they exceed it). The positives are known on the host; the
    // random scores are drawn on the device.
    const at::Tensor positive = std::get<0>(at::_unique(local.masked_select(mine), /*sorted=*/true));
    if (positive.size(0) >= num_sample_) {
      index_ = to_device(positive, dev);
    } else {
      at::Generator gen = sampling_generator(dev, opts_.seed * 7919ULL + static_cast<uint64_t>(shard_.rank) * 104729ULL +
                                                      static_cast<uint64_t>(forwards_));
      at::Tensor score = at::rand({shard_.count}, gen, weight_.options().dtype(at::kFloat).requires_grad(false));
      score.index_fill_(0, to_device(positive, dev), 2.0);
      index_ = std::get<0>(std::get<1>(score.topk(num_sample_)).sort());
    }
    const at::Tensor local_dev = to_device(local.clamp(0, shard_.count - 1), dev);
    target = torch::where(to_device(mine, dev), torch::searchsorted(index_, local_dev), -1);
    // A sampled class brings all its sub-centres: the step's rows are theirs.
    if (opts_.subcenters > 1) index_ = subcenter::class_rows(index_, opts_.subcenters);
  } else {
    target = to_device(torch::where(mine, local, -1), dev);
  }
  namespace F = torch::nn::functional;
  const at::Tensor ef = emb.to(torch::kFloat);
  const at::Tensor e = F::normalize(ef, F::NormalizeFuncOptions().dim(1));
  at::Tensor norms;
  if (head_->needs_norms()) norms = head_->norm_gradient() ? ef.norm(2, {1}) : ef.detach().norm(2, {1});
  MarginSoftmaxOptions mo;
  mo.head = head_.get();
  mo.seed = opts_.seed;
  mo.forward = forwards_;
  mo.gemm_dtype = opts_.gemm_dtype;
  mo.subcenters = opts_.subcenters;
  // The sampled rows are read from the weight in chunks, and the weight's gradient stays
  // deferred: backward fills grad_ and step() updates chunk by chunk.
  // The streamed pass and bf16 centres read every column a chunk at a time as well, and
  // reduced-precision GEMMs convert their operands a chunk at a time: every chunked pass
  // takes the policy's chunk (chunk_policy.h).
  mo.chunk_classes = chunks_.logits_columns;
  if (samples()) mo.rows = index_;
  grad_ = std::make_shared<DeferredWeightGrad>();
  mo.deferred = grad_;
  // An armed step is applied by the streamed backward, chunk by chunk, as it forms each
  // chunk's gradient: the step's last recomputation of the logits is saved. Not where the
  // gradient must exist first: accumulation, loss scaling, a dense step of every row.
  if (armed_lr_ && opts_.streamed_logits && opts_.grad_accumulation == 1 && !(samples() && opts_.step_all_rows) &&
      pending_grad_.empty()) {
    const double lr = *armed_lr_;
    grad_->on_chunk = [this, lr](int64_t first, int64_t n, const at::Tensor& g) { update_columns(first, n, g, lr); };
  }
  armed_lr_.reset();
  forwards_++;
  PartialFCOutput out;
  // The weight enters as a leaf alias (no copy) that requires grad, so that the loss has a
  // backward even when the embeddings do not; it receives no gradient.
  const at::Tensor anchor = weight_.detach().requires_grad_(true);
  out.loss = opts_.streamed_logits ? streamed_margin_softmax_loss(e, anchor, target, norms, mo, dist_, &out.accuracy)
                                   : margin_softmax_loss(e, anchor, target, norms, mo, dist_, &out.accuracy);
  if (at::Tensor extra = head_->extra_loss(norms); extra.defined()) {
    // Every rank computes this term of the global loss from the whole gathered batch, and
    // the gather's backward sums the ranks' embedding gradients: each rank passes 1/W of
    // the term's gradient, so that the sum is the term's gradient once.
    const at::Tensor fixed = extra.detach();
    out.loss = out.loss + fixed + (extra - fixed) / static_cast<double>(W);
  }
  return out;
}

ChunkSizes PartialFC::chunk_sizes_for(int64_t global_rows) const {
  return chunks_for(opts_, weight_.device(), global_rows);
}

at::Tensor PartialFC::materialise() const {
  torch::NoGradGuard ng;
  const int64_t rows = samples() ? index_.size(0) : weight_.size(0), step = chunks_.update_rows;
  at::Tensor out = at::empty({rows, opts_.embedding_size}, weight_.options().dtype(at::kFloat).requires_grad(false));
  for (int64_t j = 0; j < rows; j += step) {
    const int64_t n = std::min(step, rows - j);
    const at::Tensor w = samples() ? weight_.index_select(0, index_.narrow(0, j, n)) : weight_.narrow(0, j, n);
    out.narrow(0, j, n).copy_(grad_->rows(j, n, w.to(at::kFloat)));
  }
  return out;
}

at::Tensor PartialFC::gradient() const {
  torch::NoGradGuard ng;
  if (merged_.defined()) return merged_;
  const bool current = grad_ && grad_->ready();
  if (!samples() && !pending_grad_.empty()) return current ? pending_grad_[0] + materialise() : pending_grad_[0];
  if (!current) return at::Tensor();
  at::Tensor g = materialise();
  if (inv_scale_.defined()) g.mul_(inv_scale_);
  return g;
}

void PartialFC::accumulate() {
  if (!grad_ || !grad_->ready()) return;
  torch::NoGradGuard ng;
  // Each micro-batch's gradient is materialised here ([sampled, d], or added to the
  // shard's running [shard, d] sum without sampling): the rows differ per micro-batch, and
  // G' and E of all micro-batches would cost more than that.
  if (samples()) {
    pending_index_.push_back(index_);
    pending_grad_.push_back(materialise());
  } else if (pending_grad_.empty()) {
    pending_index_.push_back(at::Tensor());
    pending_grad_.push_back(materialise());
  } else {
    const int64_t step = chunks_.update_rows;
    for (int64_t j = 0; j < weight_.size(0); j += step) {
      const int64_t n = std::min(step, weight_.size(0) - j);
      pending_grad_[0].narrow(0, j, n).add_(grad_->rows(j, n, weight_.narrow(0, j, n).to(at::kFloat)));
    }
  }
  grad_.reset();
}

void PartialFC::merge_accumulated() {
  if (pending_grad_.empty()) return;
  torch::NoGradGuard ng;
  accumulate();  // the last micro-batch's gradient joins the others
  if (samples()) {
    at::Tensor index = torch::cat(pending_index_), grad = torch::cat(pending_grad_);
    // How many distinct rows the micro-batches sampled is known on the device only.
    std::tuple<at::Tensor, at::Tensor> uniq;
    {
      DesignedHostSync sync("classifier: the distinct rows of the accumulated micro-batches");
      uniq = at::_unique(index, /*sorted=*/true, /*return_inverse=*/true);
    }
    at::Tensor rows = std::get<0>(uniq);
    merged_ = torch::zeros({rows.size(0), grad.size(1)}, grad.options()).index_add_(0, std::get<1>(uniq), grad);
    index_ = rows;
  } else {
    merged_ = pending_grad_[0];
  }
  pending_index_.clear();
  pending_grad_.clear();
}

at::Tensor PartialFC::unscale_(const at::Tensor& inv_scale) {
  merge_accumulated();
  at::Tensor found_inf = torch::zeros({1}, weight_.options().dtype(at::kFloat).requires_grad(false));
  torch::NoGradGuard ng;
  if (merged_.defined()) {
    std::vector<at::Tensor> grads{merged_};
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(merged_.device()));
  } else if (grad_ && grad_->ready()) {
    // dW = G'^T E (less its radial part) is non-finite only where G' or E is: the check
    // needs no gradient (the kernel with a factor of 1 changes no value). The factor itself
    // is applied to each chunk of dW, as the kernel would have to the whole of it.
    std::vector<at::Tensor> parts = grad_->finiteness_parts();
    at::_amp_foreach_non_finite_check_and_unscale_(parts, found_inf, torch::ones({1}, found_inf.options()));
    inv_scale_ = inv_scale.to(weight_.device(), at::kFloat).clone();
  }
  return found_inf;
}

void PartialFC::update_chunk(int64_t j, int64_t n, at::Tensor raw, double lr) {
  torch::NoGradGuard ng;
  const at::Tensor ix = samples() ? index_.narrow(0, j, n) : at::Tensor();
  rows_change(j, n, ix);
  const RowRounding round = rounding();
  // Where the optimiser has a one-pass update of the rows in place (SGD on the CPU), the
  // gradient's radial part is formed there; the factor of loss scaling is linear in it.
  if (inv_scale_.defined()) raw.mul_(inv_scale_);
  if (optimizer_.update_projected_rows(weight_, raw, grad_->inv_norm.narrow(0, j, n), samples() ? 0 : j, ix, lr, round))
    return;
  // The rows as the forward saw them (nothing has moved them since): a view of fp32 rows
  // without sampling, updated in place; otherwise an fp32 copy, written back (rounded to
  // the storage's dtype).
  const bool fp32 = weight_.scalar_type() == at::kFloat;
  at::Tensor w = samples() ? weight_.index_select(0, ix) : weight_.narrow(0, j, n);
  if (!fp32) w = w.to(at::kFloat);
  grad_->remove_radial(raw, j, w);
  optimizer_.update_rows(w, raw, samples() ? 0 : j, ix, lr);
  if (fp32) {
    if (samples()) weight_.index_copy_(0, ix, w);
    return;
  }
  const at::Tensor old = samples() ? weight_.index_select(0, ix) : weight_.narrow(0, j, n);
  const at::Tensor stored = round.round(w, ix, samples() ? 0 : j, weight_.scalar_type());
  round.count(old, w, stored);
  if (samples()) weight_.index_copy_(0, ix, stored);
  else weight_.narrow(0, j, n).copy_(stored);
}

at::Tensor PartialFC::take_lost_update_counts() {
  if (!lost_.defined()) return at::Tensor();
  at::Tensor c = lost_.clone();
  lost_.zero_();
  return c;
}

std::pair<double, int64_t> PartialFC::take_lost_updates() {
  const at::Tensor c = take_lost_update_counts();
  if (!c.defined()) return {0.0, 0};
  const int64_t lost = c[0].item<int64_t>(), moved = c[1].item<int64_t>();
  return {moved > 0 ? static_cast<double>(lost) / static_cast<double>(moved) : 0.0, moved};
}

void PartialFC::update_columns(int64_t first, int64_t n, const at::Tensor& g, double lr) {
  const int64_t step = chunks_.update_rows;
  for (int64_t j = 0; j < n; j += step) {
    const int64_t m = std::min(step, n - j);
    update_chunk(first + j, m, grad_->raw_of(m == n ? g : g.narrow(1, j, m)), lr);
  }
}

void PartialFC::chunked_step(double lr) {
  const int64_t rows = samples() ? index_.size(0) : weight_.size(0), step = chunks_.update_rows;
  // Streamed logits: G' is recomputed a chunk of the forward's columns at a time (a GEMM
  // each), and each chunk's rows updated in the update's pieces.
  const int64_t outer = grad_->g.defined() ? step : std::max(step, chunks_.logits_columns);
  for (int64_t j = 0; j < rows; j += outer) {
    const int64_t n = std::min(outer, rows - j);
    if (grad_->g.defined()) update_chunk(j, n, grad_->raw_rows(j, n), lr);
    else update_columns(j, n, grad_->g_columns(j, n), lr);
  }
}

void PartialFC::arm_step(double lr) { armed_lr_ = lr; }

void PartialFC::step(double lr) {
  if (grad_ && grad_->applied) {  // the backward has stepped (arm_step)
    zero_grad();
    return;
  }
  merge_accumulated();
  torch::NoGradGuard ng;
  const bool deferred = !merged_.defined() && grad_ && grad_->ready();
  if (samples() && opts_.step_all_rows && (merged_.defined() || deferred)) {
    // The dense gradient arcface_torch's optimiser sees: zero on the unsampled rows (this
    // path materialises the sampled rows' gradient and the dense one).
    at::Tensor dense = torch::zeros_like(weight_, weight_.options().dtype(at::kFloat).requires_grad(false));
    dense.index_copy_(0, index_, gradient());
    rows_change(0, weight_.size(0));
    optimizer_.step(weight_, at::Tensor(), dense, lr, rounding());
  } else if (merged_.defined()) {
    if (samples()) rows_change(0, 0, index_);
    else rows_change(0, weight_.size(0));
    optimizer_.step(weight_, samples() ? index_ : at::Tensor(), merged_, lr, rounding());
  } else if (deferred) {
    chunked_step(lr);
  }
  zero_grad();
}

void PartialFC::zero_grad() {
  grad_.reset();
  inv_scale_ = at::Tensor();
  merged_ = at::Tensor();
  pending_index_.clear();
  pending_grad_.clear();
}

ShardRows PartialFC::state() const {
  ShardRows rows{{"weight", weight_.detach()}};
  for (auto& kv : optimizer_.state()) rows.emplace_back("opt." + kv.first, kv.second);
  return rows;
}

void PartialFC::load_state(const ShardRows& rows, const std::string& source) {
  ShardRows mine = state();
  torch::NoGradGuard ng;
  for (const auto& kv : rows) {
    auto it = std::find_if(mine.begin(), mine.end(), [&](const auto& m) { return m.first == kv.first; });
    if (it == mine.end())
      throw usage_error(source, ": classifier state '", kv.first, "' does not belong to the '",
                        opts_.optimizer.kind, "' optimiser");
    if (kv.second.sizes() != it->second.sizes())
      throw usage_error(source, ": classifier state '", kv.first, "' has shape ", kv.second.sizes(), ", expected ",
                        it->second.sizes());
  }
  if (!rows_ready_) {
    for (const auto& m : mine)
      if (std::none_of(rows.begin(), rows.end(), [&](const auto& kv) { return kv.first == m.first; }))
        throw usage_error(source, ": classifier state '", m.first, "' is missing");
  }
  rows_change(0, weight_.size(0));
  for (const auto& kv : rows)
    std::find_if(mine.begin(), mine.end(), [&](const auto& m) { return m.first == kv.first; })->second.copy_(kv.second);
  rows_ready_ = true;
}

void PartialFC::fill_state(const std::function<void(const std::string& name, const at::Tensor& rows)>& fill) {
  torch::NoGradGuard ng;
  rows_change(0, weight_.size(0));
  for (const auto& kv : state()) fill(kv.first, kv.second);
  rows_ready_ = true;
}

}  // namespace faceshard
