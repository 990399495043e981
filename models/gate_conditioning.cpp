#include "models/gate_conditioning.h"

#include <algorithm>
#include <cmath>

#include "base/error.h"
#include "base/log.h"

namespace faceshard {
namespace {
thread_local GateConditioning* g_scope = nullptr;

// The relative error of a pooled mean after the convolutions and BatchNorms of a deep float32
// network: 64 ulps (2^-23 each), 7.6e-6. Measured on ir_se50 (128-d, four 112x112 inputs): with
// fan-in scaled weights no gate is undecided even at 1,024 ulps; in the eval forward of the
// same network at arcface_torch's init with two steps' running statistics, 15 gates are at 64
// ulps (and the embeddings of those inputs move with the batch size, cosine down to 0.3).
constexpr double kPooledRelativeError = 64.0 * 1.1920928955078125e-07;
}  // namespace

GateConditioningScope::GateConditioningScope(GateConditioning& into) : previous_(g_scope) { g_scope = &into; }
GateConditioningScope::~GateConditioningScope() {
  settle_gate_conditioning(*g_scope);
  g_scope = previous_;
}

void settle_gate_conditioning(GateConditioning& c) {
  if (c.pending.empty()) return;
  std::vector<at::Tensor> parts;
  for (const auto& p : c.pending) parts.push_back(p.second);
  const at::Tensor host = torch::stack(parts).to(torch::kCPU, torch::kDouble).contiguous();  // [blocks, 2]
  const double* v = host.data_ptr<double>();
  for (size_t i = 0; i < c.pending.size(); ++i) {
    const auto undecided = static_cast<int64_t>(v[2 * i]);
    c.undecided += undecided;
    if (undecided > 0 && c.first_block < 0) c.first_block = c.pending[i].first;
    c.largest_input = std::max(c.largest_input, v[2 * i + 1]);
  }
  c.pending.clear();
}

void assess_gates(const torch::Tensor& pooled, const torch::Tensor& gate_input, const torch::Tensor& fc1_weight,
                  const torch::Tensor& fc2_weight) {
  GateConditioning* c = g_scope;
  if (!c || torch::GradMode::is_enabled() || pooled.scalar_type() != torch::kFloat ||
      gate_input.scalar_type() != torch::kFloat)
    return;
  const int64_t block = c->blocks++;
  torch::NoGradGuard ng;
  // In float64 from here: the bound itself must not round.
  const torch::Tensor m = pooled.detach().to(torch::kDouble).abs().flatten(1);        // [B, C]
  const torch::Tensor w1 = fc1_weight.detach().to(torch::kDouble).abs().flatten(1);   // [C/r, C]
  const torch::Tensor w2 = fc2_weight.detach().to(torch::kDouble).abs().flatten(1);   // [C, C/r]
  const torch::Tensor s = gate_input.detach().to(torch::kDouble).flatten(1);          // [B, C]
  const torch::Tensor bound = m.matmul(w1.t()).matmul(w2.t()) * kPooledRelativeError;
  const torch::Tensor change = torch::sigmoid(s + bound) - torch::sigmoid(s - bound);
  c->gates += s.numel();
  if (s.numel() == 0) return;
  // Kept on the device: settle_gate_conditioning reads every block's at once.
  c->pending.emplace_back(block, torch::stack({change.gt(kUndecidedGateChange).sum().to(torch::kDouble), s.abs().max()}));
}

std::string describe_gate_conditioning(const GateConditioning& c, const std::string& network) {
  if (c.undecided == 0) return "";
  return detail::concat(
      network, ": ", c.undecided, " of ", c.gates, " squeeze-excitation gate values (first in block ",
      c.first_block + 1, " of the forward) are decided by float32 rounding: their inputs reach ",
      format_sig(c.largest_input),
      ", as in a network whose BatchNorm running statistics do not yet describe its activations (a run of few "
      "steps); its embeddings depend on the batch size, the thread count and the memory layout, and mean little. "
      "Evaluate a checkpoint trained further");
}

}  // namespace faceshard
