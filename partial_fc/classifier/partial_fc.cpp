#include "partial_fc/classifier/partial_fc.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#ifdef FACESHARD_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include "partial_fc/classifier/margin_softmax.h"
#include "partial_fc/parallel/all_gather.h"
#include "partial_fc/runtime/error.h"

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

const PartialFCOptions& checked(const PartialFCOptions& o) {
  if (!(o.sample_rate >= 0 && o.sample_rate <= 1))
    throw option_error("sample_rate", "must be in [0, 1], got ", o.sample_rate);
  if (o.embedding_size < 1) throw option_error("embedding_size", "must be positive, got ", o.embedding_size);
  if (o.head.name == "combined") o.margin.validate();
  return o;
}
}  // namespace

ClassifierMemoryPlan classifier_memory_plan(const PartialFCOptions& o, int world_size, int rank,
                                            int64_t batch_per_rank) {
  const ClassShard shard = ClassShard::of(checked(o).num_classes, world_size, rank);
  ClassifierMemoryPlan p;
  p.rows = shard.count;
  p.sampled_rows = std::min<int64_t>(shard.count, static_cast<int64_t>(o.sample_rate * static_cast<double>(shard.count)));
  p.embedding_size = o.embedding_size;
  p.global_batch = batch_per_rank * world_size;
  const double row = static_cast<double>(o.embedding_size) * 4.0;  // one fp32 row
  const double n = static_cast<double>(p.rows), s = static_cast<double>(p.sampled_rows);
  const bool sampling = p.sampled_rows < p.rows;
  p.weight_bytes = n * row;
  p.state_bytes = o.optimizer.kind == "adamw" ? n * (2 * row + 8) : n * row;
  p.gradient_bytes = sampling ? 2 * s * row + (o.step_all_rows ? n * row : 0.0) : n * row;
  if (o.gemm_dtype != at::kFloat) p.gradient_bytes += s * row / 2;
  p.logits_bytes = static_cast<double>(p.global_batch) * s * 4.0;
  return p;
}

at::Tensor PartialFC::initial_rows(int64_t start, int64_t count, int64_t dim, uint64_t seed) {
  at::Tensor out = torch::empty({count, dim});
  if (count == 0) return out;
  for (int64_t b = start / kInitBlock; b <= (start + count - 1) / kInitBlock; ++b) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + static_cast<uint64_t>(b));
    at::Tensor block = at::normal(0.0, 0.01, {kInitBlock, dim}, gen);
    const int64_t lo = std::max(start, b * kInitBlock), hi = std::min(start + count, (b + 1) * kInitBlock);
    out.narrow(0, lo - start, hi - lo).copy_(block.narrow(0, lo - b * kInitBlock, hi - lo));
  }
  return out;
}

PartialFC::PartialFC(Distributed& dist, const PartialFCOptions& opts, torch::Device device)
    : dist_(dist),
      opts_(checked(opts)),
      shard_(ClassShard::of(opts.num_classes, dist.world_size(), dist.rank())),
      num_sample_(std::min<int64_t>(shard_.count, static_cast<int64_t>(opts.sample_rate * shard_.count))),
      weight_(opts.initialise_rows ? initial_rows(shard_.start, shard_.count, opts.embedding_size, opts.seed).to(device)
                                   : torch::empty({shard_.count, opts.embedding_size}, torch::TensorOptions(device))),
      optimizer_(weight_, opts.optimizer, opts.initialise_rows),
      head_(make_margin_head(opts.head, opts.margin)),
      rows_ready_(opts.initialise_rows) {
  if (!samples()) {
    weight_.requires_grad_(true);
    sub_weight_ = weight_;
  }
}

PartialFCOutput PartialFC::forward(const at::Tensor& local_emb, const at::Tensor& local_labels) {
  TORCH_CHECK(local_emb.dim() == 2 && local_emb.size(1) == opts_.embedding_size, "PartialFC: embeddings must be [B, ",
              opts_.embedding_size, "], got ", local_emb.sizes());
  if (!rows_ready_)
    throw runtime_error("PartialFC: the shard's rows were allocated for a checkpoint that has not been loaded");
  const int W = dist_.world_size();
  const torch::Device dev = weight_.device();
  at::Tensor emb = all_gather_with_grad(dist_, local_emb, GatherGrad::ReduceScatterSum, static_cast<double>(W));
  std::vector<int64_t> counts;
  at::Tensor labels = dist_.all_gather(local_labels.reshape({-1}).to(torch::kCPU, torch::kLong).contiguous(), &counts);
  TORCH_CHECK(labels.size(0) == emb.size(0), "PartialFC: ", emb.size(0), " embeddings but ", labels.size(0), " labels");

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
      at::Tensor score = at::rand({shard_.count}, gen, weight_.options().requires_grad(false));
      score.index_fill_(0, to_device(positive, dev), 2.0);
      index_ = std::get<0>(std::get<1>(score.topk(num_sample_)).sort());
    }
    const at::Tensor local_dev = to_device(local.clamp(0, shard_.count - 1), dev);
    target = torch::where(to_device(mine, dev), torch::searchsorted(index_, local_dev), -1);
    sub_weight_ = weight_.index_select(0, index_).requires_grad_(true);
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
  forwards_++;
  PartialFCOutput out;
  out.loss = margin_softmax_loss(e, samples() ? sub_weight_ : weight_, target, norms, mo, dist_, &out.accuracy);
  if (at::Tensor extra = head_->extra_loss(norms); extra.defined()) {
    // Every rank computes this term of the global loss from the whole gathered batch, and
    // the gather's backward sums the ranks' embedding gradients: each rank passes 1/W of
    // the term's gradient, so that the sum is the term's gradient once.
    const at::Tensor fixed = extra.detach();
    out.loss = out.loss + fixed + (extra - fixed) / static_cast<double>(W);
  }
  return out;
}

at::Tensor PartialFC::gradient() const { return sub_weight_.defined() ? sub_weight_.grad() : at::Tensor(); }

void PartialFC::accumulate() {
  if (!samples() || !sub_weight_.defined() || !sub_weight_.grad().defined()) return;
  pending_index_.push_back(index_);
  pending_grad_.push_back(sub_weight_.grad());
  sub_weight_.mutable_grad().reset();
}

void PartialFC::merge_accumulated() {
  if (pending_index_.empty()) return;
  torch::NoGradGuard ng;
  accumulate();  // the last micro-batch's gradient joins the others
  at::Tensor index = torch::cat(pending_index_), grad = torch::cat(pending_grad_);
  auto uniq = at::_unique(index, /*sorted=*/true, /*return_inverse=*/true);
  at::Tensor rows = std::get<0>(uniq);
  at::Tensor sum = torch::zeros({rows.size(0), grad.size(1)}, grad.options()).index_add_(0, std::get<1>(uniq), grad);
  pending_index_.clear();
  pending_grad_.clear();
  index_ = rows;
  sub_weight_ = weight_.index_select(0, index_).requires_grad_(true);
  sub_weight_.mutable_grad() = sum;
}

at::Tensor PartialFC::unscale_(const at::Tensor& inv_scale) {
  merge_accumulated();
  at::Tensor found_inf = torch::zeros({1}, weight_.options().requires_grad(false));
  at::Tensor g = gradient();
  if (!g.defined()) return found_inf;
  torch::NoGradGuard ng;
  std::vector<at::Tensor> grads{g};
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(g.device()));
  return found_inf;
}

void PartialFC::step(double lr) {
  merge_accumulated();
  at::Tensor g = gradient();
  if (g.defined() && samples() && opts_.step_all_rows) {
    // The dense gradient arcface_torch's optimiser sees: zero on the unsampled rows.
    torch::NoGradGuard ng;
    at::Tensor dense = torch::zeros_like(weight_, weight_.options().requires_grad(false));
    dense.index_copy_(0, index_, g);
    optimizer_.step(weight_, at::Tensor(), dense, lr);
  } else if (g.defined()) {
    optimizer_.step(weight_, samples() ? index_ : at::Tensor(), g, lr);
  }
  zero_grad();
}

void PartialFC::zero_grad() {
  if (sub_weight_.defined() && sub_weight_.grad().defined()) sub_weight_.mutable_grad().reset();
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
  for (const auto& kv : rows)
    std::find_if(mine.begin(), mine.end(), [&](const auto& m) { return m.first == kv.first; })->second.copy_(kv.second);
  rows_ready_ = true;
}

void PartialFC::fill_state(const std::function<void(const std::string& name, const at::Tensor& rows)>& fill) {
  torch::NoGradGuard ng;
  for (const auto& kv : state()) fill(kv.first, kv.second);
  rows_ready_ = true;
}

}  // namespace faceshard
