#include "models/backbone.h"

#ifdef FACESHARD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <ATen/autocast_mode.h>

#include <map>
#include <set>
#include <sstream>

#include "models/torch_save/state_dict_reader.h"
#include "base/error.h"
#include "base/log.h"

namespace faceshard {
namespace {
std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream os;
  os << "[";
  for (size_t k = 0; k < s.size(); ++k) os << (k ? "," : "") << s[k];
  os << "]";
  return os.str();
}
bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

BodyPrecision parse_body_precision(const std::string& text) {
  if (text == "fp32" || text == "float32") return BodyPrecision::Float32;
  if (text == "fp16" || text == "float16") return BodyPrecision::Float16;
  if (text == "bf16" || text == "bfloat16") return BodyPrecision::BFloat16;
  throw usage_error("backbone precision '", text, "': expected fp32, fp16 or bf16");
}

std::string resolve_precision(const std::string& configured, bool bf16_capable) {
  if (configured != "auto") return configured;
  return bf16_capable ? "bf16" : "fp32";
}

bool device_has_bf16(torch::Device device) {
#ifdef FACESHARD_WITH_CUDA
  if (device.is_cuda()) {
    const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
    return at::cuda::getDeviceProperties(index)->major >= 8;
  }
#endif
  (void)device;
  return false;  // the CPU: bf16 autocast is slower than fp32 on most CPUs, and fp32 is the reference
}

std::string to_string(BodyPrecision precision) {
  switch (precision) {
    case BodyPrecision::Float32: return "fp32";
    case BodyPrecision::Float16: return "fp16";
    case BodyPrecision::BFloat16: return "bf16";
  }
  return "?";
}

AutocastScope::AutocastScope(c10::DeviceType device, bool enabled, c10::ScalarType dtype)
    : device_(device),
      prev_enabled_(at::autocast::is_autocast_enabled(device)),
      prev_dtype_(at::autocast::get_autocast_dtype(device)) {
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  // The cast cache holds low-precision copies of the weights; it must not outlive the
  // outermost region (the weights change at the next optimiser step).
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_, prev_dtype_);
}

Backbone::Backbone(std::string type_name, BackboneOptions options)
    : torch::nn::Module(std::move(type_name)), options_(std::move(options)) {}

StateDict Backbone::state_dict() const {
  StateDict out;
  for (const auto& item : named_modules()) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false))
      out.emplace_back(prefix + p.key(), p.value());
    for (const auto& b : item.value()->named_buffers(/*recurse=*/false))
      out.emplace_back(prefix + b.key(), b.value());
  }
  return out;
}

StateDictLoad Backbone::load_state_dict(const StateDict& weights, const std::string& source) {
  return load_state_dict(TensorListSource(weights), source);
}

StateDictLoad Backbone::load_state_dict(const TensorSource& weights, const std::string& source) {
  StateDictLoad report;
  const StateDict mine = state_dict();
  // DDP-wrapped models save every key under "module.".
  std::string strip;
  if (weights.size() > 0) {
    bool all = true;
    for (size_t i = 0; i < weights.size(); ++i) all = all && starts_with(weights.name(i), "module.");
    if (all && !starts_with(mine.front().first, "module.")) strip = "module.";
  }
  std::map<std::string, size_t> given;  // a repeated key: its last value
  for (size_t i = 0; i < weights.size(); ++i) given[weights.name(i).substr(strip.size())] = i;

  // Check everything (names, shapes: what the file says, before any value is read) before
  // copying anything: a load that fails here leaves the model untouched.
  std::vector<std::string> missing;
  std::vector<std::pair<torch::Tensor, size_t>> copies;
  for (const auto& [name, dst] : mine) {
    auto it = given.find(name);
    if (it == given.end()) {
      if (!ends_with(name, "num_batches_tracked")) missing.push_back(name);
      else report.absent_counters.push_back(name);
      continue;
    }
    const std::vector<int64_t> sizes = weights.sizes(it->second);
    if (c10::IntArrayRef(sizes) != dst.sizes())
      throw usage_error(source, ": key '", name, "' has shape ", shape_str(sizes), ", backbone '", options_.name,
                        "' expects ", shape_str(dst.sizes()));
    const at::ScalarType type = weights.dtype(it->second);
    if (!at::isFloatingType(type) && dst.is_floating_point() && type != torch::kBool)
      log_debug(source, ": key '", name, "' is ", type, ", converted to ", dst.scalar_type());
    if (type != dst.scalar_type()) report.converted++;
    copies.emplace_back(dst, it->second);
    given.erase(it);
  }
  if (!missing.empty() || !given.empty()) {
    std::ostringstream os;
    os << source << ": state_dict does not match backbone '" << options_.name << "'";
    if (!missing.empty())
      os << ": missing key '" << missing.front() << "'"
         << (missing.size() > 1 ? " (and " + std::to_string(missing.size() - 1) + " more)" : "");
    if (!given.empty())
      os << (missing.empty() ? ": " : "; ") << "unexpected key '" << strip << given.begin()->first << "'"
         << (given.size() > 1 ? " (and " + std::to_string(given.size() - 1) + " more)" : "");
    os << " (embedding size " << options_.embedding_size << ")";
    throw usage_error(os.str());
  }
  // Each value straight into its parameter or buffer (converted to its dtype and device,
  // keeping its memory format). From a file, only a read error or a failed CRC can stop
  // this part, and the caller then discards the model.
  for (const auto& [dst, i] : copies) weights.read_into(i, dst);
  std::set<const void*> params;
  for (const auto& p : parameters()) params.insert(p.unsafeGetTensorImpl());
  for (const auto& [dst, i] : copies) {
    report.tensors++;
    report.numbers += dst.numel();
    if (params.count(dst.unsafeGetTensorImpl())) report.parameters++;
  }
  report.stripped_prefix = strip;
  return report;
}

void Backbone::to_channels_last() {
  torch::NoGradGuard no_grad;
  for (auto& p : parameters())
    if (p.dim() == 4) p.set_data(p.data().contiguous(at::MemoryFormat::ChannelsLast));
}

bool Backbone::accepts_input_size(int64_t height, int64_t width) const {
  // Four stride-2 stages (ceil halving) must end at 7x7 for the 7x7 head: 97..112 px.
  auto ok = [](int64_t s) { return s >= 97 && s <= 112; };
  return ok(height) && ok(width);
}

torch::Tensor Backbone::prepare_input(const torch::Tensor& images) const {
  if (images.dim() != 4 || images.size(1) != 3 || !accepts_input_size(images.size(2), images.size(3)) ||
      !images.is_floating_point())
    throw usage_error("backbone '", options_.name, "': expected float images [B,3,112,112], got ",
                      images.scalar_type(), " ", shape_str(images.sizes()));
  // BatchNorm1d on the embedding cannot normalise a single sample (LibTorch would throw a
  // multi-line internal error instead).
  if (is_training() && images.size(0) < 2)
    throw usage_error("backbone '", options_.name, "': training mode needs a batch of at least 2, got ",
                      images.size(0));
  if (options_.channels_last) return images.contiguous(at::MemoryFormat::ChannelsLast);
  return images;
}

void save_backbone_weights(const Backbone& model, const std::string& path) {
  write_state_dict(model.state_dict(), path);
}

StateDictLoad load_backbone_weights(Backbone& model, const std::string& path) {
  // Streamed from the file into the parameters: bounded extra memory, whatever the model.
  return model.load_state_dict(StateDictReader(path), path);
}

std::string describe_load(const Backbone& model, const std::string& path, const StateDictLoad& load) {
  std::ostringstream os;
  os << path << ": " << load.tensors << " tensors (" << load.parameters << " parameters, "
     << format_sig(static_cast<double>(load.numbers) / 1e6) << "M numbers) into " << model.options().name
     << ", embedding size " << model.options().embedding_size << "; none missing or unexpected";
  if (!load.absent_counters.empty())
    os << " (" << load.absent_counters.size() << " BatchNorm num_batches_tracked counters absent from the file, left at 0)";
  if (!load.stripped_prefix.empty()) os << "; keys' '" << load.stripped_prefix << "' prefix (DDP) stripped";
  if (load.converted) os << "; " << load.converted << " tensors converted to the network's dtype";
  return os.str();
}

}  // namespace faceshard
