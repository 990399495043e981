#include "partial_fc/classifier/row_update_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>

#include <atomic>
#include <type_traits>
#include <vector>

namespace faceshard {
namespace {

constexpr int64_t kLanes = 16;

// w . m in fp32 with kLanes partial sums (the order a vector unit adds in).
float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float acc[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= d; k += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += a[k + l] * b[k + l];
  float s = 0;
  for (int64_t l = 0; l < kLanes; ++l) s += acc[l];
  for (; k < d; ++k) s += a[k] * b[k];
  return s;
}

inline float load(float v) { return v; }
inline float load(c10::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T store(float v) {
  return static_cast<T>(v);
}

// One row: g' = (g - c w) + wd w; m = momentum m + g'; w -= lr m (without momentum w -=
// lr g'). Separate, with restrict pointers, so that the loops vectorise.
void sgd_row(float* __restrict w, const float* __restrict g, int64_t d, float c, float lr, float wd) {
  for (int64_t k = 0; k < d; ++k) w[k] -= lr * ((g[k] - c * w[k]) + wd * w[k]);
}
template <typename S>
void sgd_row(float* __restrict w, S* __restrict m, const float* __restrict g, int64_t d, float c, float lr, float mom,
             float wd) {
  for (int64_t k = 0; k < d; ++k) {
    const float step = mom * load(m[k]) + ((g[k] - c * w[k]) + wd * w[k]);
    m[k] = store<S>(step);
    w[k] -= lr * step;
  }
}

// The weight rows in fp32: the live row of an fp32 weight; for a bf16 weight a copy in the
// thread's buffer, written back stochastically rounded once the row is updated.
template <typename WT>
struct WeightRow;
template <>
struct WeightRow<float> {
  float* row;
  WeightRow(float* w, int64_t d, std::vector<float>&) : row(w) { (void)d; }
  float* data() { return row; }
  void commit(int64_t, uint32_t) {}
};
template <>
struct WeightRow<c10::BFloat16> {
  c10::BFloat16* row;
  float* buf;
  WeightRow(c10::BFloat16* w, int64_t d, std::vector<float>& scratch) : row(w) {
    scratch.resize(static_cast<size_t>(d));
    buf = scratch.data();
    for (int64_t k = 0; k < d; ++k) buf[k] = static_cast<float>(w[k]);
  }
  float* data() { return buf; }
  // Stores the row rounded; counts the values the update moved and those of them whose
  // stored value did not change.
  void commit(int64_t d, uint32_t key, bool nearest, int64_t& lost, int64_t& moved) {
    for (int64_t k = 0; k < d; ++k) {
      const c10::BFloat16 v = nearest ? c10::BFloat16(buf[k]) : sr_round(buf[k], sr_bits(key, static_cast<uint32_t>(k)));
      const bool m = buf[k] != static_cast<float>(row[k]);
      moved += m;
      lost += m && v.x == row[k].x;
      row[k] = v;
    }
  }
};

template <typename WT, typename S>
void rows_loop(WT* W, S* M, const float* raw, const float* inv_norm, int64_t first, const int64_t* index, int64_t n,
               int64_t d, const RowSgd& o, const RowRounding& rounding) {
  const float lr = static_cast<float>(o.lr), mom = static_cast<float>(o.momentum),
              wd = static_cast<float>(o.weight_decay);
  std::atomic<int64_t> lost_all{0}, moved_all{0};
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    int64_t lost = 0, moved = 0;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t row = index ? index[r] : first + r;
      WeightRow<WT> wr(W + row * d, d, scratch);
      float* w = wr.data();
      const float* g = raw + r * d;
      const float c = dot(w, g, d) * inv_norm[r] * inv_norm[r];
      if (M == nullptr) sgd_row(w, g, d, c, lr, wd);
      else sgd_row(w, M + row * d, g, d, c, lr, mom, wd);
      if constexpr (!std::is_same_v<WT, float>)
        wr.commit(d, sr_row_key(rounding.seed, rounding.step, rounding.class_start + row), rounding.nearest, lost, moved);
    }
    lost_all += lost;
    moved_all += moved;
  });
  if (rounding.lost.defined() && !std::is_same_v<WT, float>) {
    at::Tensor(rounding.lost).narrow(0, 0, 1).add_(lost_all.load());
    at::Tensor(rounding.lost).narrow(0, 1, 1).add_(moved_all.load());
  }
}

template <typename WT>
void rows_for_state(WT* W, at::Tensor& momentum, const at::Tensor& raw, const at::Tensor& inv_norm, int64_t first,
                    const int64_t* ip, int64_t n, int64_t d, const RowSgd& sgd, const RowRounding& rounding) {
  if (sgd.momentum == 0 || !momentum.defined()) {
    rows_loop<WT, float>(W, nullptr, raw.data_ptr<float>(), inv_norm.data_ptr<float>(), first, ip, n, d, sgd, rounding);
  } else if (momentum.scalar_type() == at::kFloat) {
    rows_loop(W, momentum.data_ptr<float>(), raw.data_ptr<float>(), inv_norm.data_ptr<float>(), first, ip, n, d, sgd,
              rounding);
  } else {
    rows_loop(W, momentum.data_ptr<c10::BFloat16>(), raw.data_ptr<float>(), inv_norm.data_ptr<float>(), first, ip, n,
              d, sgd, rounding);
  }
}

}  // namespace

void sgd_projected_rows_cpu(at::Tensor& weight, at::Tensor& momentum, const at::Tensor& raw, const at::Tensor& inv_norm,
                            int64_t first, const at::Tensor& index, const RowSgd& sgd, const RowRounding& rounding) {
  // One operator to an observer (op_counter.h), as the GPU's one kernel per chunk is.
  RECORD_USER_SCOPE("faceshard::sgd_projected_rows");
  TORCH_CHECK(weight.device().is_cpu() && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16) &&
                  weight.is_contiguous(),
              "sgd_projected_rows_cpu: the weight must be a contiguous fp32 or bf16 CPU tensor");
  TORCH_CHECK(raw.scalar_type() == at::kFloat && raw.is_contiguous() && raw.dim() == 2 && raw.size(1) == weight.size(1),
              "sgd_projected_rows_cpu: raw rows ", raw.sizes(), " do not match the weight ", weight.sizes());
  TORCH_CHECK(inv_norm.scalar_type() == at::kFloat && inv_norm.is_contiguous() && inv_norm.numel() == raw.size(0),
              "sgd_projected_rows_cpu: one fp32 inverse norm per row");
  const int64_t n = raw.size(0), d = raw.size(1);
  const at::Tensor ix = index.defined() ? index.to(at::kLong).contiguous() : at::Tensor();
  TORCH_CHECK(!ix.defined() || ix.numel() == n, "sgd_projected_rows_cpu: ", ix.numel(), " indices for ", n, " rows");
  TORCH_CHECK(ix.defined() || (first >= 0 && first + n <= weight.size(0)), "sgd_projected_rows_cpu: rows out of range");
  const int64_t* ip = ix.defined() ? ix.data_ptr<int64_t>() : nullptr;
  if (sgd.momentum != 0 && momentum.defined()) {
    TORCH_CHECK(momentum.is_contiguous() && momentum.sizes() == weight.sizes(),
                "sgd_projected_rows_cpu: the momentum must be shaped like the weight");
    TORCH_CHECK(momentum.scalar_type() == at::kFloat || momentum.scalar_type() == at::kBFloat16,
                "sgd_projected_rows_cpu: momentum must be fp32 or bf16");
  }
  if (weight.scalar_type() == at::kFloat)
    rows_for_state(weight.data_ptr<float>(), momentum, raw, inv_norm, first, ip, n, d, sgd, rounding);
  else
    rows_for_state(weight.data_ptr<c10::BFloat16>(), momentum, raw, inv_norm, first, ip, n, d, sgd, rounding);
}

}  // namespace faceshard
