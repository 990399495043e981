// Global batches for the classifier's tests, the same on every rank: each row leans towards
// (or, with a negative lean, away from) its class centre, so that margins are active and some
// targets lie beyond pi, with feature norms from 2 to 140 (the norm-adaptive heads).
#pragma once
#include <functional>
#include <vector>

#include <torch/torch.h>

namespace faceshard::testing {

struct ClassBatch {
  at::Tensor emb, labels;  // the whole global batch, concatenated over ranks
  int64_t offset = 0, rows = 0;  // this rank's rows
};

// Rank q's rows: rows_of(q), drawn from the generator seeded `seed + q`; a row's lean is
// uniform in [lean_min, lean_min + lean_span).
inline ClassBatch class_batch(int W, int r, int64_t C, int64_t D, const at::Tensor& weight, uint64_t seed,
                              const std::function<int64_t(int)>& rows_of, double lean_min, double lean_span) {
  namespace F = torch::nn::functional;
  ClassBatch b;
  std::vector<at::Tensor> es, ls;
  for (int q = 0; q < W; ++q) {
    torch::manual_seed(seed + static_cast<uint64_t>(q));
    const int64_t n = rows_of(q);
    at::Tensor y = torch::randint(0, C, {n}, torch::kLong);
    at::Tensor e = torch::randn({n, D});
    const at::Tensor wy = F::normalize(weight.index_select(0, y), F::NormalizeFuncOptions().dim(1));
    e = F::normalize(e, F::NormalizeFuncOptions().dim(1)) + (torch::rand({n, 1}) * lean_span + lean_min) * wy;
    e = F::normalize(e, F::NormalizeFuncOptions().dim(1)) * (torch::rand({n, 1}) * 138 + 2);
    es.push_back(e);
    ls.push_back(y);
    if (q < r) b.offset += n;
  }
  b.rows = rows_of(r);
  b.emb = torch::cat(es);
  b.labels = torch::cat(ls);
  return b;
}

}  // namespace faceshard::testing
