// The backbone registry: builds a backbone from its config name ("r50", "mbf", ...) and
// options, so the trainer and tools never name a concrete network class.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "models/backbone.h"

namespace faceshard {

// Names accepted by make_backbone, in a stable order.
std::vector<std::string> backbone_names();

// Builds options.name with the given options (validated: embedding size > 0, dropout in
// [0, 1), dropout only for iresnets). Throws usage_error naming the bad option.
std::shared_ptr<Backbone> make_backbone(const BackboneOptions& options);

}  // namespace faceshard
