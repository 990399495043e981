#include "app/plan/activation_probe.h"

#include <algorithm>
#include <chrono>

#include "app/plan/allocation_meter.h"
#include "models/backbone_registry.h"
#include "models/model_stats.h"
#include "base/error.h"

namespace faceshard {

ActivationMeasurement measure_activations(const std::string& network, BodyPrecision precision, bool checkpointing,
                                          std::vector<int64_t> batches, int64_t embedding_size) {
  std::sort(batches.begin(), batches.end());
  batches.erase(std::unique(batches.begin(), batches.end()), batches.end());
  if (batches.size() < 2 || batches.front() < 2)
    throw usage_error("activation batches: at least two distinct sizes, each at least 2 (BatchNorm in training needs "
                      "two values per channel)");
  AllocationMeter::install();
  const auto t0 = std::chrono::steady_clock::now();
  torch::manual_seed(0);
  BackboneOptions o;
  o.name = network;
  o.embedding_size = embedding_size;
  o.precision = precision;
  o.checkpointing = checkpointing;
  std::shared_ptr<Backbone> model = make_backbone(o);
  model->train();
  std::vector<at::Tensor> params;
  for (const auto& p : model->parameters())
    if (p.requires_grad()) params.push_back(p);

  ActivationMeasurement m;
  m.network = network;
  m.precision = precision;
  m.checkpointing = checkpointing;
  m.parameters = count_parameters(*model).trainable;
  m.batches = batches;
  // One step as the trainer runs it, minus the classifier: the gradients start undefined
  // (the optimiser's zero_grad sets them to none), the images exist before the step.
  auto step = [&](int64_t batch) {
    for (auto& p : params) p.mutable_grad().reset();
    at::Tensor images = torch::randn({batch, 3, 112, 112});
    AllocationMeter::reset_peak();
    const int64_t before = AllocationMeter::current_bytes();
    {
      at::Tensor emb = model->forward(images);
      emb.square().mean().backward();
    }
    const double peak = static_cast<double>(AllocationMeter::peak_bytes() - before);
    for (auto& p : params) p.mutable_grad().reset();
    return peak;
  };
  step(batches.front());  // warm-up: lazily built kernels and caches
  for (int64_t b : batches) m.peak_bytes.push_back(step(b));
  const double db = static_cast<double>(batches.back() - batches.front());
  m.bytes_per_image = (m.peak_bytes.back() - m.peak_bytes.front()) / db;
  m.fixed_bytes = m.peak_bytes.front() - m.bytes_per_image * static_cast<double>(batches.front());
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return m;
}

}  // namespace faceshard
