// The backbone registry: builds a backbone from its config name ("r50", "mbf", "vit_t", ...)
// and options, so the trainer and tools never name a concrete network class.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "models/backbone.h"

namespace faceshard {

// Names accepted by make_backbone, in a stable order: r18 r34 r50 r100 r200 r2060 mbf
// mbf_large, then arcface_torch's ViT variants.
std::vector<std::string> backbone_names();

// The checks make_backbone makes before it builds anything (the name, the embedding size,
// dropout and checkpointing for that network): option errors naming the option.
void check_backbone_options(const BackboneOptions& options);
// Builds options.name with the given options (validated: embedding size > 0, dropout in
// [0, 1), dropout only for iresnets, checkpointing not for MobileFaceNet; an unset
// checkpointing becomes the network's default). Throws usage_error naming the bad option.
std::shared_ptr<Backbone> make_backbone(const BackboneOptions& options);

// Whether `name` checkpoints its activations when BackboneOptions::checkpointing is unset
// (arcface_torch's choice), without building it; option_error("backbone") when unknown.
bool backbone_default_checkpointing(const std::string& name);

// Whether `name` trains in channels-last (NHWC) when the config does not say
// (model.channels_last unset): the convolutional networks do, the ViTs do not;
// option_error("backbone") when unknown.
bool backbone_default_channels_last(const std::string& name);

}  // namespace faceshard
