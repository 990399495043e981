// Squeeze-and-excitation gates that float32 rounding decides. An SE gate is
// sigmoid(fc2(relu(fc1(mean over H, W)))); in a network whose eval-mode BatchNorm running
// statistics do not describe its activations (a run of a few steps: each block's output then
// grows 5-10x instead of being normalised), the gates' inputs reach 1e4..1e9, where the
// rounding error of the pooled mean moves a gate input by more than the sigmoid's width.
// Such a gate is then 0 or 1 by the summation order of the convolutions, which depends on
// the batch size, the thread count and the memory layout, and the embeddings with it. No
// float32 implementation computes those embeddings to more than a few digits; the tools
// say so (app/eval) rather than print numbers that look like a model's.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace faceshard {

struct GateConditioning {
  int64_t gates = 0;      // gate values computed (batch rows x channels x SE blocks)
  int64_t undecided = 0;  // of which rounding can move by more than kUndecidedGateChange
  int64_t blocks = 0;     // SE block forwards seen
  int64_t first_block = -1;     // the first block (0-based, in forward order) with such a gate
  double largest_input = 0.0;   // the largest |gate input| seen
  // Each assessed block's (block, [undecided, largest |input|]) on the forward's device, read
  // into the fields above by settle_gate_conditioning (one host read for all of them: a GPU's
  // evaluation waits once, not twice a block).
  std::vector<std::pair<int64_t, at::Tensor>> pending;
};

// Reads what is pending into the counts (the scope's end does it too).
void settle_gate_conditioning(GateConditioning& c);

// How far a gate may move under the rounding of its input before it counts as undecided.
inline constexpr double kUndecidedGateChange = 0.05;

// While alive, the SE gates computed on this thread in fp32 without gradients (eval forwards)
// are assessed into `into`, settled when the scope ends. Scopes nest: the innermost receives.
class GateConditioningScope {
 public:
  explicit GateConditioningScope(GateConditioning& into);
  ~GateConditioningScope();
  GateConditioningScope(const GateConditioningScope&) = delete;
  GateConditioningScope& operator=(const GateConditioningScope&) = delete;

 private:
  GateConditioning* previous_;
};

// Called by the SE block with its pooled input `pooled` [B, C, 1, 1], the gate inputs
// `gate_input` [B, C, 1, 1] and its two 1x1 weights: a no-op outside a scope, under
// autograd, and for reduced-precision forwards (whose rounding is their own choice).
// The bound: the pooled mean of a deep float32 network carries ~64 ulps of relative error
// (eps), so a gate input moves by up to eps * (|W2| |W1| |pooled|); the gate is undecided
// where the sigmoid changes by more than kUndecidedGateChange over that interval.
void assess_gates(const torch::Tensor& pooled, const torch::Tensor& gate_input, const torch::Tensor& fc1_weight,
                  const torch::Tensor& fc2_weight);

// One warning line naming the network, the count and what to do; "" when no gate is undecided.
std::string describe_gate_conditioning(const GateConditioning& c, const std::string& network);

}  // namespace faceshard
