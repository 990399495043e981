// The backbone interface shared by every face-recognition network (iresnet, MobileFaceNet,
// ViT): options, the precision policy of the forward (autocast body, fp32 head), the
// state_dict in insightface's key order, and loading/saving weights as torch.save files.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/torch_save/state_dict_io.h"
#include "models/torch_save/tensor_source.h"

namespace faceshard {

// Precision of the convolutional body. The embedding head (fc/features) always runs in
// fp32, as arcface_torch does: the 25088x512 fc and BatchNorm1d are where half precision
// loses accuracy, and they are cheap.
enum class BodyPrecision { Float32, Float16, BFloat16 };

// "fp32" | "fp16" | "bf16" (also "float32", "float16", "bfloat16"); throws usage_error.
BodyPrecision parse_body_precision(const std::string& text);

// A precision setting as a device runs it: "auto" is bf16 on a GPU with bf16 arithmetic
// (compute capability 8.0 and later: A100, H100, ...), fp32 on older GPUs and on the CPU;
// any other value is itself. `bf16_capable` says what the device can do (device_has_bf16()).
std::string resolve_precision(const std::string& configured, bool bf16_capable);
bool device_has_bf16(torch::Device device);
std::string to_string(BodyPrecision precision);

struct BackboneOptions {
  std::string name = "r50";      // one of backbone_names() (models/backbone_registry.h)
  int64_t embedding_size = 512;  // num_features in arcface_torch
  double dropout = 0.0;          // iresnet only (before fc); arcface_torch trains with 0
  BodyPrecision precision = BodyPrecision::Float32;
  bool channels_last = false;    // conv weights and activations in NHWC
  // Activation checkpointing in training (models/activation_checkpoint.h): ViT blocks, iresnet stages 2
  // and 3. Unset: the network's default, on where arcface_torch uses it (vit_b*, vit_l*,
  // vit_h, r2060); make_backbone resolves it. MobileFaceNet has none.
  std::optional<bool> checkpointing;
};

// What a weight load read (the log line of model.init). The load is strict: a key
// missing from the file or unknown to the network is an error, except the BatchNorm
// counters old PyTorch files lack.
struct StateDictLoad {
  size_t tensors = 0;     // values read into the network (parameters and buffers)
  size_t parameters = 0;  // of which parameters
  int64_t numbers = 0;    // elements read
  size_t converted = 0;   // tensors stored in another dtype than the network's (converted)
  std::string stripped_prefix;  // "module." when every key of the file had it (DDP)
  std::vector<std::string> absent_counters;  // num_batches_tracked keys the file lacks (left as they were)
};

class Backbone : public torch::nn::Module {
 public:
  Backbone(std::string type_name, BackboneOptions options);

  // images [B,3,H,W] (112x112 for the released configs) -> embeddings [B,E], fp32.
  virtual torch::Tensor forward(torch::Tensor images) = 0;

  const BackboneOptions& options() const { return options_; }
  int64_t embedding_size() const { return options_.embedding_size; }
  bool checkpointing() const { return options_.checkpointing.value_or(false); }

  // Parameters and buffers under insightface's PyTorch names and in PyTorch's order
  // (per module: parameters, then buffers, then children).
  StateDict state_dict() const;
  // Copies `weights` into this model. Every key must be present with the same shape; a
  // missing num_batches_tracked is tolerated (old PyTorch checkpoints lack it), a common
  // "module." prefix (DDP) is stripped. Values are converted to the parameter's dtype.
  // `source` names the origin (a file) in error messages.
  StateDictLoad load_state_dict(const StateDict& weights, const std::string& source);
  // The same from any source of named tensors (a StateDictReader streams a file's values
  // straight into the parameters).
  StateDictLoad load_state_dict(const TensorSource& weights, const std::string& source);

  // Converts the 4-D weights to channels-last (done by make_backbone when asked).
  void to_channels_last();

 protected:
  // head(body(x)) under the options' precision policy: with Float16/BFloat16 the body runs
  // under autocast and the head gets the body's output in fp32 with autocast off (as
  // arcface_torch's `x.float()` outside its autocast block). With Float32 the ambient
  // autocast state is left alone, so an outer autocast region still applies.
  template <typename Body, typename Head>
  torch::Tensor run_with_precision(torch::Tensor x, Body&& body, Head&& head);
  // Checks the input (a usage_error naming the shape) and sets its layout: channels-last
  // when asked (a no-op when it already is).
  torch::Tensor prepare_input(const torch::Tensor& images) const;
  // Image sizes the network takes: 97..112 for the CNNs (their stages must end at 7x7).
  virtual bool accepts_input_size(int64_t height, int64_t width) const;

  BackboneOptions options_;
};

// RAII: sets autocast for one device type and restores the previous state (and clears the
// cast cache when leaving the outermost region, like Python's torch.autocast).
class AutocastScope {
 public:
  AutocastScope(c10::DeviceType device, bool enabled, c10::ScalarType dtype);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
};

// Weights as a torch.save file (zip format) that Python's torch.load reads as a
// state_dict and insightface's model.load_state_dict accepts.
void save_backbone_weights(const Backbone& model, const std::string& path);
// Loads a torch.save'd state_dict (e.g. a released insightface backbone.pth).
StateDictLoad load_backbone_weights(Backbone& model, const std::string& path);
// One line on what a load read: "<path>: 120 tensors (70 parameters, 25.6M numbers) into r50
// (insightface names); none missing or unexpected[; ...]".
std::string describe_load(const Backbone& model, const std::string& path, const StateDictLoad& load);

template <typename Body, typename Head>
torch::Tensor Backbone::run_with_precision(torch::Tensor x, Body&& body, Head&& head) {
  if (options_.precision == BodyPrecision::Float32) return head(body(std::move(x)));
  const auto device = x.device().type();
  const auto dtype =
      options_.precision == BodyPrecision::Float16 ? torch::kHalf : torch::kBFloat16;
  torch::Tensor y;
  {
    AutocastScope scope(device, true, dtype);
    y = body(std::move(x));
  }
  AutocastScope fp32_head(device, false, dtype);
  return head(y.to(torch::kFloat));
}

}  // namespace faceshard
