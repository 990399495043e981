#include "partial_fc/partial_fc.h"

#include "partial_fc/all_gather.h"
#include "partial_fc/error.h"
#include "partial_fc/margin_softmax.h"

namespace faceshard {

namespace {
constexpr int64_t kInitBlock = 1024;  // classes drawn from one seeded generator
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
    : dist_(dist), opts_(opts), shard_(ClassShard::of(opts.num_classes, dist.world_size(), dist.rank())) {
  if (opts.sample_rate < 0 || opts.sample_rate > 1)
    throw usage_error("loss.sample_rate must be in [0, 1], got ", opts.sample_rate);
  num_sample_ = std::min<int64_t>(shard_.count, static_cast<int64_t>(opts.sample_rate * shard_.count));
  weight_ = initial_rows(shard_.start, shard_.count, opts.embedding_size, opts.seed).to(device);
  if (!samples()) {
    weight_.requires_grad_(true);
    sub_weight_ = weight_;
  }
}

void PartialFC::set_sampled(const at::Tensor& index, const at::Tensor& grad) {
  TORCH_CHECK(samples(), "PartialFC::set_sampled: nothing is sampled");
  index_ = index;
  sub_weight_ = weight_.index_select(0, index_).requires_grad_(true);
  sub_weight_.mutable_grad() = grad;
}

PartialFCOutput PartialFC::forward(const at::Tensor& local_emb, const at::Tensor& local_labels) {
  TORCH_CHECK(local_emb.dim() == 2 && local_emb.size(1) == opts_.embedding_size, "PartialFC: embeddings must be [B, ",
              opts_.embedding_size, "], got ", local_emb.sizes());
  const int W = dist_.world_size();
  at::Tensor emb = all_gather_with_grad(dist_, local_emb, GatherGrad::ReduceScatterSum, static_cast<double>(W));
  std::vector<int64_t> counts;
  at::Tensor labels = dist_.all_gather(local_labels.reshape({-1}).to(torch::kLong).contiguous(), &counts);
  TORCH_CHECK(labels.size(0) == emb.size(0), "PartialFC: ", emb.size(0), " embeddings but ", labels.size(0), " labels");

  // Every rank sees every label: all of them reject a bad one in the same step.
  at::Tensor bad = ((labels < 0) | (labels >= opts_.num_classes)).nonzero();
  if (bad.numel() > 0) {
    const int64_t row = bad[0][0].item<int64_t>();
    int64_t owner = 0, first = 0;
    while (owner < static_cast<int64_t>(counts.size()) - 1 && row >= first + counts[owner]) first += counts[owner++];
    throw runtime_error("label ", labels[row].item<int64_t>(), " of rank ", owner, " (batch row ", row - first,
                        ") is outside [0, ", opts_.num_classes, ") = data.num_classes");
  }

  at::Tensor local = labels - shard_.start;
  at::Tensor mine = (labels >= shard_.start) & (labels < shard_.end());
  at::Tensor target = torch::where(mine, local, torch::full_like(local, -1));
  at::Tensor centres;
  if (samples()) {
    torch::NoGradGuard ng;
    // All positive classes of the global batch, then uniformly random negatives up to the
    // budget (all positives when they exceed it).
    at::Tensor positive = std::get<0>(torch::_unique(local.masked_select(mine), /*sorted=*/true));
    if (positive.size(0) >= num_sample_) {
      index_ = positive;
    } else {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(opts_.seed * 7919ULL + static_cast<uint64_t>(shard_.rank) * 104729ULL +
                                                          static_cast<uint64_t>(step_));
      at::Tensor score = at::rand({shard_.count}, gen).to(weight_.device());
      score.index_fill_(0, positive, 2.0);
      index_ = std::get<0>(std::get<1>(score.topk(num_sample_)).sort());
    }
    target = torch::where(mine, torch::searchsorted(index_, local.clamp(0, shard_.count - 1)), target);
    sub_weight_ = weight_.index_select(0, index_).requires_grad_(true);
    centres = sub_weight_;
  } else {
    centres = weight_;
  }
  step_++;
  at::Tensor cos = torch::mm(torch::nn::functional::normalize(emb.to(torch::kFloat), torch::nn::functional::NormalizeFuncOptions().dim(1)),
                             torch::nn::functional::normalize(centres, torch::nn::functional::NormalizeFuncOptions().dim(1)).t());
  PartialFCOutput out;
  out.loss = margin_softmax_cross_entropy(cos.clamp(-1, 1), target, opts_.margin, dist_, &out.accuracy);
  return out;
}

}  // namespace faceshard
