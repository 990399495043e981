#include "models/activation_checkpoint.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "models/backbone.h"

namespace faceshard {
namespace {

thread_local bool t_recomputing = false;

// What backward needs to rerun the segment exactly as forward ran it.
struct SegmentState : torch::CustomClassHolder {
  SegmentFn body;
  torch::Tensor cpu_rng;
  std::optional<c10::Device> device;  // x's accelerator, whose generator is also restored
  torch::Tensor device_rng;
  bool cpu_autocast = false, cuda_autocast = false;
  c10::ScalarType cpu_autocast_dtype = torch::kBFloat16, cuda_autocast_dtype = torch::kHalf;
};

torch::Tensor rng_state(c10::Device device) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(c10::Device device, const torch::Tensor& state) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Sets the generators to the forward's states and puts the current ones back on exit, so
// the rerun draws the same drop-path masks without disturbing the rest of the step.
class RngFork {
 public:
  explicit RngFork(const SegmentState& s) : device_(s.device) {
    cpu_ = rng_state(c10::Device(c10::kCPU));
    if (device_) dev_ = rng_state(*device_);
    set_rng_state(c10::Device(c10::kCPU), s.cpu_rng);
    if (device_) set_rng_state(*device_, s.device_rng);
  }
  ~RngFork() {
    set_rng_state(c10::Device(c10::kCPU), cpu_);
    if (device_) set_rng_state(*device_, dev_);
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  std::optional<c10::Device> device_;
  torch::Tensor cpu_, dev_;
};

struct RecomputeFlag {
  bool prev = t_recomputing;
  RecomputeFlag() { t_recomputing = true; }
  ~RecomputeFlag() { t_recomputing = prev; }
};

struct CheckpointFn : public torch::autograd::Function<CheckpointFn> {
  // Runs with grad mode off (as every custom function's forward): nothing inside is kept.
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, at::TensorList params,
                               const c10::intrusive_ptr<SegmentState>& state) {
    std::vector<torch::Tensor> keep{x};
    keep.insert(keep.end(), params.begin(), params.end());
    ctx->save_for_backward(keep);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return state->body(x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* state = static_cast<SegmentState*>(ctx->saved_data.at("state").toCapsule().get());
    const auto saved = ctx->get_saved_variables();
    const size_t n = saved.size();
    torch::Tensor x = saved[0].detach();
    const bool need_x = ctx->needs_input_grad(0);
    x.requires_grad_(need_x);

    torch::Tensor y;
    {
      RngFork rng(*state);
      AutocastScope cpu(c10::DeviceType::CPU, state->cpu_autocast, state->cpu_autocast_dtype);
      AutocastScope cuda(c10::DeviceType::CUDA, state->cuda_autocast, state->cuda_autocast_dtype);
      torch::AutoGradMode grad(true);
      RecomputeFlag flag;
      y = state->body(x);
    }
    // Gradients with respect to the rerun's leaves: computed here, accumulated by the
    // outer graph (no .grad is touched by this inner pass).
    std::vector<torch::Tensor> inputs;
    std::vector<size_t> slot;  // index in the result for each entry of inputs
    if (need_x) inputs.push_back(x), slot.push_back(0);
    for (size_t i = 1; i < n; ++i)
      if (ctx->needs_input_grad(i)) inputs.push_back(saved[i]), slot.push_back(i);
    torch::autograd::variable_list result(n + 1);  // x, params, state (never a gradient)
    if (inputs.empty() || !y.requires_grad()) return result;
    auto g = torch::autograd::grad({y}, inputs, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                   /*allow_unused=*/true);
    for (size_t k = 0; k < g.size(); ++k) result[slot[k]] = g[k];
    return result;
  }
};

}  // namespace

bool recomputing() { return t_recomputing; }

torch::Tensor checkpointed(const SegmentFn& body, const torch::Tensor& x, const std::vector<torch::Tensor>& params) {
  if (!torch::GradMode::is_enabled()) return body(x);
  std::vector<torch::Tensor> trainable;
  for (const auto& p : params)
    if (p.requires_grad()) trainable.push_back(p);
  if (!x.requires_grad() && trainable.empty()) return body(x);

  auto state = c10::make_intrusive<SegmentState>();
  state->body = body;
  state->cpu_rng = rng_state(c10::Device(c10::kCPU));
  if (x.device().type() != c10::kCPU) {
    state->device = x.device();
    state->device_rng = rng_state(x.device());
  }
  state->cpu_autocast = at::autocast::is_autocast_enabled(c10::DeviceType::CPU);
  state->cpu_autocast_dtype = at::autocast::get_autocast_dtype(c10::DeviceType::CPU);
  state->cuda_autocast = at::autocast::is_autocast_enabled(c10::DeviceType::CUDA);
  state->cuda_autocast_dtype = at::autocast::get_autocast_dtype(c10::DeviceType::CUDA);
  return CheckpointFn::apply(x, at::TensorList(trainable), state);
}

}  // namespace faceshard
