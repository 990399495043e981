#include "models/prelu.h"

#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/_prelu_kernel_backward.h>

#include <atomic>
#include <cstring>
#include <optional>
#include <vector>

#ifdef FACESHARD_WITH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "models/prelu_cuda.h"
#include "base/cuda_kernel_check.h"
#endif

namespace faceshard {
namespace {

std::atomic<bool> g_own_pass{true};

// Four floats as one value (GCC/Clang vector extensions, one SSE register), selected with
// a compare mask and bitwise ops: what a plain loop over floats with a condition does not
// compile to.
typedef float v4f __attribute__((vector_size(16)));
typedef int v4i __attribute__((vector_size(16)));
inline v4f load4(const float* p) {
  v4f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store4(float* p, v4f v) { std::memcpy(p, &v, sizeof v); }
inline v4f select(v4i mask, v4f yes, v4f no) { return (v4f)((mask & (v4i)yes) | (~mask & (v4i)no)); }

// One contiguous run of n elements with one slope: dx = x > 0 ? dy : a * dy, and the run's
// sum of dy * x where x <= 0 (partial sums per lane).
float run(const float* x, const float* dy, float* dx, int64_t n, float a) {
  const v4f zero = {}, av = zero + a;
  v4f acc0 = zero, acc1 = zero;
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const v4f x0 = load4(x + k), g0 = load4(dy + k), x1 = load4(x + k + 4), g1 = load4(dy + k + 4);
    const v4i p0 = x0 > zero, p1 = x1 > zero;
    store4(dx + k, select(p0, g0, av * g0));
    store4(dx + k + 4, select(p1, g1, av * g1));
    acc0 += select(p0, zero, g0 * x0);
    acc1 += select(p1, zero, g1 * x1);
  }
  const v4f acc = acc0 + acc1;
  float s = acc[0] + acc[1] + acc[2] + acc[3];
  for (; k < n; ++k) {
    dx[k] = x[k] > 0 ? dy[k] : a * dy[k];
    s += x[k] > 0 ? 0.0f : dy[k] * x[k];
  }
  return s;
}

// `rows` channels-last rows of C elements (slopes a[c]): dx, and acc[c] += dy * x where
// x <= 0.
void rows_nhwc(const float* x, const float* dy, float* dx, const float* a, float* acc, int64_t rows, int64_t C) {
  const v4f zero = {};
  const int64_t C4 = C / 4 * 4;
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * C, *gr = dy + r * C;
    float* dr = dx + r * C;
    for (int64_t c = 0; c < C4; c += 4) {
      const v4f xv = load4(xr + c), g = load4(gr + c);
      const v4i pos = xv > zero;
      store4(dr + c, select(pos, g, load4(a + c) * g));
      store4(acc + c, load4(acc + c) + select(pos, zero, g * xv));
    }
    for (int64_t c = C4; c < C; ++c) {
      dr[c] = xr[c] > 0 ? gr[c] : a[c] * gr[c];
      acc[c] += xr[c] > 0 ? 0.0f : gr[c] * xr[c];
    }
  }
}

bool cpu_pass_applies(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& w) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || dy.scalar_type() != at::kFloat ||
      w.scalar_type() != at::kFloat || x.dim() != 4 || w.numel() != x.size(1))
    return false;
  const bool nchw = x.is_contiguous() && dy.is_contiguous();
  const bool nhwc = x.is_contiguous(at::MemoryFormat::ChannelsLast) && dy.is_contiguous(at::MemoryFormat::ChannelsLast);
  return nchw || nhwc;
}

std::tuple<torch::Tensor, torch::Tensor> cpu_backward(const torch::Tensor& dy, const torch::Tensor& x,
                                                      const torch::Tensor& weight) {
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  const bool nchw = x.is_contiguous() && dy.is_contiguous();
  torch::Tensor dx = at::empty_like(x, nchw ? at::MemoryFormat::Contiguous : at::MemoryFormat::ChannelsLast);
  const torch::Tensor a = weight.contiguous();
  const float *xp = x.data_ptr<float>(), *gp = dy.data_ptr<float>(), *ap = a.data_ptr<float>();
  float* dp = dx.data_ptr<float>();
  std::vector<double> dw(static_cast<size_t>(C), 0.0);
  if (nchw) {
    // Each task owns whole channels: its planes over the batch, summed in fp64.
    at::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        double s = 0;
        for (int64_t n = 0; n < N; ++n) {
          const int64_t off = (n * C + c) * HW;
          s += run(xp + off, gp + off, dp + off, HW, ap[c]);
        }
        dw[static_cast<size_t>(c)] = s;
      }
    });
  } else {
    // Rows of C channels: each task sums its rows in fp32 per block of 64 rows, then in fp64
    // into its own slot; the slots are added at the end.
    const int64_t rows = N * HW;
    const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / 64));
    std::vector<std::vector<double>> part(static_cast<size_t>(tasks), std::vector<double>(static_cast<size_t>(C), 0.0));
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> acc(static_cast<size_t>(C));
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r0 = rows * t / tasks, r1 = rows * (t + 1) / tasks;
        std::vector<double>& mine = part[static_cast<size_t>(t)];
        for (int64_t b = r0; b < r1; b += 64) {
          std::fill(acc.begin(), acc.end(), 0.0f);
          rows_nhwc(xp + b * C, gp + b * C, dp + b * C, ap, acc.data(), std::min(r1, b + 64) - b, C);
          for (int64_t c = 0; c < C; ++c) mine[static_cast<size_t>(c)] += acc[static_cast<size_t>(c)];
        }
      }
    });
    for (const auto& p : part)
      for (int64_t c = 0; c < C; ++c) dw[static_cast<size_t>(c)] += p[static_cast<size_t>(c)];
  }
  torch::Tensor dweight = torch::empty({C}, weight.options());
  float* wp = dweight.data_ptr<float>();
  for (int64_t c = 0; c < C; ++c) wp[c] = static_cast<float>(dw[static_cast<size_t>(c)]);
  return {dx, dweight.view(weight.sizes())};
}

#ifdef FACESHARD_WITH_CUDA
std::optional<PReLUCudaType> cuda_type(at::ScalarType t) {
  if (t == at::kFloat) return PReLUCudaType::Float;
  if (t == at::kBFloat16) return PReLUCudaType::BFloat16;
  if (t == at::kHalf) return PReLUCudaType::Half;
  return std::nullopt;
}
#endif

// x [N, C, H, W] on a GPU in fp32/bf16/fp16 with slopes of its type or fp32, one per channel
// or one for all, NCHW or channels-last; dy (when given) alike.
bool cuda_pass_applies(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor* dy) {
#ifdef FACESHARD_WITH_CUDA
  if (!x.is_cuda() || x.dim() != 4 || !cuda_type(x.scalar_type()) || w.device() != x.device() ||
      (w.scalar_type() != x.scalar_type() && w.scalar_type() != at::kFloat) ||
      (w.numel() != x.size(1) && w.numel() != 1))
    return false;
  const bool nchw = x.is_contiguous(), nhwc = x.is_contiguous(at::MemoryFormat::ChannelsLast);
  if (!nchw && !nhwc) return false;
  if (nhwc && !nchw && w.numel() > 1 && w.numel() > kPReLUCudaMaxRowChannels) return false;
  if (dy && (dy->scalar_type() != x.scalar_type() || dy->device() != x.device() ||
             !dy->is_contiguous(nchw ? at::MemoryFormat::Contiguous : at::MemoryFormat::ChannelsLast)))
    return false;
  return true;
#else
  (void)x, (void)w, (void)dy;
  return false;
#endif
}

#ifdef FACESHARD_WITH_CUDA
std::tuple<torch::Tensor, torch::Tensor> cuda_backward(const torch::Tensor& dy, const torch::Tensor& x,
                                                       const torch::Tensor& weight) {
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  const bool nchw = x.is_contiguous();
  torch::Tensor dx = at::empty_like(x, nchw ? at::MemoryFormat::Contiguous : at::MemoryFormat::ChannelsLast);
  // The slopes as the forward multiplied by them: in x's type (fp32 slopes of a bf16 x are
  // rounded to bf16 there), read as fp32.
  const torch::Tensor a = weight.to(x.scalar_type()).to(at::kFloat).contiguous();
  torch::Tensor dw = at::empty({weight.numel()}, x.options().dtype(at::kFloat));
  const PReLUCudaType type = *cuda_type(x.scalar_type());
  void* stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  // The partial sums (prelu_cuda.h), from the caching allocator on the current stream.
  auto workspace = [&](int64_t n) { return at::empty({std::max<int64_t>(n, 1)}, dw.options()); };
  if (weight.numel() == 1) {
    // One slope: the layout does not matter; the tensor in pieces of at most 64k elements.
    const int64_t total = x.numel(), len = std::min<int64_t>(total > 0 ? total : 1, 65536);
    const int64_t whole = total / len, rest = total - whole * len;
    torch::Tensor ws = workspace(prelu_backward_planes_workspace(whole));
    check_cuda_kernel(prelu_backward_planes_cuda(type, x.data_ptr(), dy.data_ptr(), dx.data_ptr(), a.data_ptr<float>(),
                                                 dw.data_ptr<float>(), ws.data_ptr<float>(), whole, len, 1, stream),
                      "prelu_backward_planes (models/prelu_cuda.cu)");
    if (rest > 0) {
      torch::Tensor tail = at::empty({1}, dw.options());
      const int64_t off = whole * len * x.element_size();
      // ws again: the queue orders this piece's sums after the first piece's are read.
      check_cuda_kernel(prelu_backward_planes_cuda(type, static_cast<const char*>(x.data_ptr()) + off,
                                                   static_cast<const char*>(dy.data_ptr()) + off,
                                                   static_cast<char*>(dx.data_ptr()) + off, a.data_ptr<float>(),
                                                   tail.data_ptr<float>(), ws.data_ptr<float>(), 1, rest, 1, stream),
                        "prelu_backward_planes (models/prelu_cuda.cu)");
      dw.add_(tail);
    }
  } else if (nchw) {
    torch::Tensor ws = workspace(prelu_backward_planes_workspace(N * C));
    check_cuda_kernel(prelu_backward_planes_cuda(type, x.data_ptr(), dy.data_ptr(), dx.data_ptr(), a.data_ptr<float>(),
                                                 dw.data_ptr<float>(), ws.data_ptr<float>(), N * C, HW, C, stream),
                      "prelu_backward_planes (models/prelu_cuda.cu)");
  } else {
    torch::Tensor ws = workspace(prelu_backward_rows_workspace(N * HW, C));
    check_cuda_kernel(prelu_backward_rows_cuda(type, x.data_ptr(), dy.data_ptr(), dx.data_ptr(), a.data_ptr<float>(),
                                               dw.data_ptr<float>(), ws.data_ptr<float>(), N * HW, C, stream),
                      "prelu_backward_rows (models/prelu_cuda.cu)");
  }
  return {dx, dw.to(weight.scalar_type()).view(weight.sizes())};
}
#endif

// The slopes as ATen's kernel takes them: [C] viewed along dimension 1 of x.
torch::Tensor slopes_for(const torch::Tensor& x, const torch::Tensor& w) {
  if (x.dim() < 2) return w;
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[1] = w.numel();
  return w.reshape(shape);
}

struct PReLUFn : public torch::autograd::Function<PReLUFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w) {
    ctx->save_for_backward({x, w});
    at::AutoDispatchBelowADInplaceOrView guard;
    // One type for ATen's kernel: fp32 slopes of a bf16/fp16 x in x's type (what autocast,
    // which lists prelu among its reduced-precision ops, does too).
    return at::prelu(x, w.scalar_type() == x.scalar_type() ? w : w.to(x.scalar_type()));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = prelu_backward(grads[0], saved[0], saved[1]);
    return {dx, dw};
  }
};

}  // namespace

void set_prelu_own_pass(bool on) { g_own_pass = on; }

std::tuple<torch::Tensor, torch::Tensor> prelu_backward(const torch::Tensor& dy, const torch::Tensor& x,
                                                        const torch::Tensor& weight, bool own_pass) {
  torch::NoGradGuard ng;
  own_pass = own_pass && g_own_pass.load();
  // dy usually arrives in x's memory format; make it so where it does not.
  const torch::Tensor g = dy.contiguous(x.suggest_memory_format());
  if (own_pass && cpu_pass_applies(g, x, weight)) return cpu_backward(g, x, weight);
#ifdef FACESHARD_WITH_CUDA
  if (own_pass && cuda_pass_applies(x, weight, &g)) return cuda_backward(g, x, weight);
#endif
  // ATen's kernel takes one type: x and the slopes in dy's (autocast may have run the
  // forward in another type than x's; fp32 slopes of a bf16 x are rounded as the forward's).
  const at::ScalarType t = g.scalar_type();
  const torch::Tensor xt = x.scalar_type() == t ? x : x.to(t);
  const torch::Tensor wt = weight.scalar_type() == x.scalar_type() ? weight : weight.to(x.scalar_type());
  const torch::Tensor slopes = slopes_for(xt, wt.scalar_type() == t ? wt : wt.to(t));
  auto [dx, dw] = at::_prelu_kernel_backward(g, xt, slopes);
  // ATen's slope gradient has x's shape: summed to the slopes' viewed shape.
  return {dx.to(x.scalar_type()), at::sum_to(dw, slopes.sizes()).reshape(weight.sizes()).to(weight.scalar_type())};
}

torch::Tensor prelu(const torch::Tensor& x, const torch::Tensor& weight) {
  // ATen's op (and its autograd) wherever neither pass would run: no gradient, another
  // device or type, and under autocast, which runs prelu in the reduced precision.
  if (!torch::GradMode::is_enabled() || (!x.requires_grad() && !weight.requires_grad())) return at::prelu(x, weight);
  // A GPU's inputs that the CUDA pass takes (its backward falls back to ATen's for a dy of
  // another type or layout).
  if (cuda_pass_applies(x, weight, nullptr)) return PReLUFn::apply(x, weight);
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat || x.dim() != 4 ||
      at::autocast::is_autocast_enabled(at::kCPU))
    return at::prelu(x, weight);
  return PReLUFn::apply(x, weight);
}

}  // namespace faceshard
