#include "models/backbone_registry.h"

#include <functional>
#include <sstream>
#include <utility>

#include "models/iresnet.h"
#include "models/mobilefacenet.h"
#include "models/vit.h"
#include "partial_fc/runtime/error.h"
#include "partial_fc/runtime/near_name.h"

namespace faceshard {
namespace {
using Factory = std::function<std::shared_ptr<Backbone>(const BackboneOptions&)>;

struct Entry {
  std::string name;
  Factory make;
  bool checkpointing;  // the network's default (arcface_torch's choice)
  // The training layout when the config leaves it open: NHWC for the convolutional
  // networks (faster on the CPU, measured with faceshard-bench --mode step; what cuDNN's
  // tensor-core kernels take), NCHW for the ViTs (one convolution, the patch embedding).
  bool channels_last = true;
};

const std::vector<Entry>& registry() {
  static const std::vector<Entry> entries = [] {
    std::vector<Entry> e;
    for (const char* name : {"r18", "r34", "r50", "r100", "r200", "r2060"}) {
      const std::string n = name;
      e.push_back({n,
                   [n](const BackboneOptions& o) { return std::make_shared<IResNet>(iresnet_layers(n), o); },
                   n == "r2060"});
    }
    e.push_back({"mbf",
                 [](const BackboneOptions& o) {
                   return std::make_shared<MobileFaceNet>(std::array<int64_t, 4>{1, 4, 6, 2}, 2, o);
                 },
                 false});
    // A quarter of mbf's width and one block per stage (about 4x less compute): quick CPU
    // runs and the per-head demo tests; same layer names, so insightface's MobileFaceNet
    // with blocks=(1,1,1,1), scale=1 reads its weights.
    e.push_back({"mbf_small",
                 [](const BackboneOptions& o) {
                   return std::make_shared<MobileFaceNet>(std::array<int64_t, 4>{1, 1, 1, 1}, 1, o);
                 },
                 false});
    e.push_back({"mbf_large",
                 [](const BackboneOptions& o) {
                   return std::make_shared<MobileFaceNet>(std::array<int64_t, 4>{2, 8, 12, 4}, 4, o);
                 },
                 false});
    for (const auto& name : vit_names()) {
      const VitVariant v = *vit_variant(name);
      e.push_back({name, [v](const BackboneOptions& o) { return std::make_shared<VisionTransformer>(v, o); },
                   v.checkpointing, false});
    }
    return e;
  }();
  return entries;
}
}  // namespace

std::vector<std::string> backbone_names() {
  std::vector<std::string> names;
  for (const auto& e : registry()) names.push_back(e.name);
  return names;
}

namespace {
const Entry& find_entry(const std::string& name) {
  for (const auto& e : registry())
    if (e.name == name) return e;
  std::ostringstream known;
  for (const auto& n : backbone_names()) known << (known.tellp() > 0 ? ", " : "") << n;
  // The nearest name by edits, when it is close (r51 -> r50, mbf_smal -> mbf_small).
  const std::string near = nearest_name(name, backbone_names(), 2);
  throw option_error("backbone", "'", name, "' is not a network faceshard knows",
                     near.empty() ? std::string() : " (did you mean '" + near + "'?)", "; expected one of ", known.str());
}
}  // namespace

bool backbone_default_checkpointing(const std::string& name) { return find_entry(name).checkpointing; }

bool backbone_default_channels_last(const std::string& name) { return find_entry(name).channels_last; }

void check_backbone_options(const BackboneOptions& options) {
  find_entry(options.name);
  if (options.embedding_size <= 0)
    throw option_error("embedding_size", "of backbone '", options.name, "': embedding size ", options.embedding_size,
                       " must be positive");
  if (!(options.dropout >= 0.0 && options.dropout < 1.0))
    throw option_error("dropout", "of backbone '", options.name, "': ", options.dropout, " must be in [0, 1)");
  const bool mbf = options.name.rfind("mbf", 0) == 0, vit = options.name.rfind("vit", 0) == 0;
  if (options.dropout > 0 && mbf)
    throw option_error("dropout", "of backbone '", options.name, "': MobileFaceNet has no dropout layer (dropout ",
                       options.dropout, " requested)");
  if (options.dropout > 0 && vit)
    throw option_error("dropout", "of backbone '", options.name,
                       "': the ViTs have no dropout layer (they regularise with drop path and token masking; dropout ",
                       options.dropout, " requested)");
  if (options.checkpointing.value_or(false) && mbf)
    throw option_error("checkpointing", "of backbone '", options.name,
                       "': MobileFaceNet does not support activation checkpointing");
}

std::vector<std::vector<std::string>> backbone_stage_prefixes(const std::string& name) {
  find_entry(name);
  if (name.rfind("mbf", 0) == 0)  // layers: stem, then per resolution a block that enters it and a residual
    return {{"layers.0"}, {"layers.1"}, {"layers.2", "layers.3"}, {"layers.4", "layers.5"}, {"layers.6", "layers.7"}};
  if (const std::optional<VitVariant> v = vit_variant(name)) {
    std::vector<std::vector<std::string>> out{{"pos_embed", "mask_token", "patch_embed"}};
    for (int64_t b = 0; b < v->depth; ++b) out.push_back({"blocks." + std::to_string(b)});
    return out;
  }
  return {{"conv1", "bn1", "prelu"}, {"layer1"}, {"layer2"}, {"layer3"}, {"layer4"}};
}

bool under_prefix(const std::string& name, const std::vector<std::string>& prefixes) {
  for (const std::string& p : prefixes)
    if (name == p || (name.size() > p.size() && name.compare(0, p.size(), p) == 0 && name[p.size()] == '.')) return true;
  return false;
}

std::shared_ptr<Backbone> make_backbone(const BackboneOptions& options) {
  check_backbone_options(options);
  const Entry* entry = &find_entry(options.name);
  BackboneOptions resolved = options;
  resolved.checkpointing = options.checkpointing.value_or(entry->checkpointing);
  auto model = entry->make(resolved);
  if (options.channels_last) model->to_channels_last();
  return model;
}

}  // namespace faceshard
