#include "models/backbone_registry.h"

#include <array>
#include <functional>
#include <sstream>
#include <utility>

#include "models/iresnet.h"
#include "models/mobilefacenet.h"
#include "models/vit.h"
#include "base/error.h"
#include "base/near_name.h"

namespace faceshard {
namespace {
using Factory = std::function<std::shared_ptr<Backbone>(const BackboneOptions&)>;
using StagePrefixes = std::function<std::vector<std::vector<std::string>>()>;

struct Entry {
  BackboneTraits traits;
  Factory make;
  StagePrefixes stages;  // backbone_stage_prefixes
};

BackboneTraits iresnet_traits(const std::string& name, bool checkpointing) {
  BackboneTraits t;
  t.name = name;
  t.family = "iresnet";
  t.default_checkpointing = checkpointing;
  t.dropout = true;
  return t;
}

std::vector<std::vector<std::string>> iresnet_stages() {
  return {{"conv1", "bn1", "prelu"}, {"layer1"}, {"layer2"}, {"layer3"}, {"layer4"}};
}

Entry mbf_entry(const std::string& name, std::array<int64_t, 4> blocks, int64_t scale) {
  BackboneTraits t;
  t.name = name;
  t.family = "mobilefacenet";
  t.supports_checkpointing = false;
  t.no_checkpointing_reason = "MobileFaceNet does not support activation checkpointing";
  t.no_dropout_reason = "MobileFaceNet has no dropout layer";
  return {t, [blocks, scale](const BackboneOptions& o) { return std::make_shared<MobileFaceNet>(blocks, scale, o); },
          [] {  // layers: stem, then per resolution a block that enters it and a residual
            return std::vector<std::vector<std::string>>{
                {"layers.0"}, {"layers.1"}, {"layers.2", "layers.3"}, {"layers.4", "layers.5"}, {"layers.6", "layers.7"}};
          }};
}

const std::vector<Entry>& registry() {
  static const std::vector<Entry> entries = [] {
    std::vector<Entry> e;
    for (const char* name : {"r18", "r34", "r50", "r100", "r200", "r2060"}) {
      const std::string n = name;
      e.push_back({iresnet_traits(n, n == "r2060"),
                   [n](const BackboneOptions& o) { return std::make_shared<IResNet>(iresnet_layers(n), o); },
                   iresnet_stages});
    }
    // IR-SE: the iresnet of that depth with squeeze-and-excitation (reduction 16) per block.
    for (const char* name : {"ir_se50", "ir_se100"}) {
      const std::string n = name;
      e.push_back({iresnet_traits(n, false),
                   [n](const BackboneOptions& o) { return std::make_shared<IResNet>(iresnet_layers(n), o, 16); },
                   iresnet_stages});
    }
    e.push_back(mbf_entry("mbf", {1, 4, 6, 2}, 2));
    // A quarter of mbf's width and one block per stage (about 4x less compute): quick CPU
    // runs and the per-head demo tests; same layer names, so insightface's MobileFaceNet
    // with blocks=(1,1,1,1), scale=1 reads its weights.
    e.push_back(mbf_entry("mbf_small", {1, 1, 1, 1}, 1));
    e.push_back(mbf_entry("mbf_large", {2, 8, 12, 4}, 4));
    for (const auto& name : vit_names()) {
      const VitVariant v = *vit_variant(name);
      BackboneTraits t;
      t.name = name;
      t.family = "vit";
      t.default_checkpointing = v.checkpointing;
      t.default_channels_last = false;
      t.no_dropout_reason = "the ViTs have no dropout layer (they regularise with drop path and token masking)";
      t.stage_word = "blocks";
      e.push_back({t, [v](const BackboneOptions& o) { return std::make_shared<VisionTransformer>(v, o); }, [v] {
                     std::vector<std::vector<std::string>> out{{"pos_embed", "mask_token", "patch_embed"}};
                     for (int64_t b = 0; b < v.depth; ++b) out.push_back({"blocks." + std::to_string(b)});
                     return out;
                   }});
    }
    return e;
  }();
  return entries;
}
}  // namespace

std::vector<std::string> backbone_names() {
  std::vector<std::string> names;
  for (const auto& e : registry()) names.push_back(e.traits.name);
  return names;
}

namespace {
const Entry& find_entry(const std::string& name) {
  for (const auto& e : registry())
    if (e.traits.name == name) return e;
  std::ostringstream known;
  for (const auto& n : backbone_names()) known << (known.tellp() > 0 ? ", " : "") << n;
  // The nearest name by edits, when it is close (r51 -> r50, mbf_smal -> mbf_small).
  const std::string near = nearest_name(name, backbone_names(), 2);
  throw option_error("backbone", "'", name, "' is not a network faceshard knows",
                     near.empty() ? std::string() : " (did you mean '" + near + "'?)", "; expected one of ", known.str());
}
}  // namespace

const BackboneTraits& backbone_traits(const std::string& name) { return find_entry(name).traits; }

bool backbone_default_checkpointing(const std::string& name) { return find_entry(name).traits.default_checkpointing; }

bool backbone_default_channels_last(const std::string& name) { return find_entry(name).traits.default_channels_last; }

void check_backbone_options(const BackboneOptions& options) {
  const BackboneTraits& t = find_entry(options.name).traits;
  if (options.embedding_size <= 0)
    throw option_error("embedding_size", "of backbone '", options.name, "': embedding size ", options.embedding_size,
                       " must be positive");
  if (!(options.dropout >= 0.0 && options.dropout < 1.0))
    throw option_error("dropout", "of backbone '", options.name, "': ", options.dropout, " must be in [0, 1)");
  if (options.dropout > 0 && !t.dropout)
    throw option_error("dropout", "of backbone '", options.name, "': ", t.no_dropout_reason, " (dropout ",
                       options.dropout, " requested)");
  if (options.checkpointing.value_or(false) && !t.supports_checkpointing)
    throw option_error("checkpointing", "of backbone '", options.name, "': ", t.no_checkpointing_reason);
}

std::vector<std::vector<std::string>> backbone_stage_prefixes(const std::string& name) {
  return find_entry(name).stages();
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
  resolved.checkpointing = options.checkpointing.value_or(entry->traits.default_checkpointing);
  auto model = entry->make(resolved);
  if (options.channels_last) model->to_channels_last();
  return model;
}

}  // namespace faceshard
