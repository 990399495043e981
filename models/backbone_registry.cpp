#include "models/backbone_registry.h"

#include <functional>
#include <sstream>
#include <utility>

#include "models/iresnet.h"
#include "models/mobilefacenet.h"
#include "partial_fc/runtime/error.h"

namespace faceshard {
namespace {
using Factory = std::function<std::shared_ptr<Backbone>(const BackboneOptions&)>;

const std::vector<std::pair<std::string, Factory>>& registry() {
  static const std::vector<std::pair<std::string, Factory>> entries = [] {
    std::vector<std::pair<std::string, Factory>> e;
    for (const char* name : {"r18", "r34", "r50", "r100", "r200"})
      e.emplace_back(name, [name](const BackboneOptions& o) {
        return std::make_shared<IResNet>(iresnet_layers(name), o);
      });
    e.emplace_back("mbf", [](const BackboneOptions& o) {
      return std::make_shared<MobileFaceNet>(std::array<int64_t, 4>{1, 4, 6, 2}, 2, o);
    });
    e.emplace_back("mbf_large", [](const BackboneOptions& o) {
      return std::make_shared<MobileFaceNet>(std::array<int64_t, 4>{2, 8, 12, 4}, 4, o);
    });
    return e;
  }();
  return entries;
}
}  // namespace

std::vector<std::string> backbone_names() {
  std::vector<std::string> names;
  for (const auto& e : registry()) names.push_back(e.first);
  return names;
}

std::shared_ptr<Backbone> make_backbone(const BackboneOptions& options) {
  const Factory* factory = nullptr;
  for (const auto& e : registry())
    if (e.first == options.name) factory = &e.second;
  if (!factory) {
    std::ostringstream known;
    for (const auto& n : backbone_names()) known << (known.tellp() > 0 ? ", " : "") << n;
    throw option_error("backbone", "'", options.name, "' is not a network faceshard knows; expected one of ", known.str());
  }
  if (options.embedding_size <= 0)
    throw option_error("embedding_size", "of backbone '", options.name, "': embedding size ", options.embedding_size,
                       " must be positive");
  if (!(options.dropout >= 0.0 && options.dropout < 1.0))
    throw option_error("dropout", "of backbone '", options.name, "': ", options.dropout, " must be in [0, 1)");
  if (options.dropout > 0 && options.name.rfind("mbf", 0) == 0)
    throw option_error("dropout", "of backbone '", options.name, "': MobileFaceNet has no dropout layer (dropout ",
                       options.dropout, " requested)");
  auto model = (*factory)(options);
  if (options.channels_last) model->to_channels_last();
  return model;
}

}  // namespace faceshard
