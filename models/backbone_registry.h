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

// The parts of a network that fine-tuning can freeze (optim.freeze_stages), in forward
// order: [0] the stem, [s] stage s (iresnet: layer1..layer4; MobileFaceNet: its four
// resolutions, each with the block that enters it; ViT: block s - 1). The embedding head
// after the last stage is none of them. Each part as state_dict name prefixes: a parameter
// or module belongs to a part when its name is a prefix or starts with a prefix and a dot.
// option_error("backbone") when unknown.
std::vector<std::vector<std::string>> backbone_stage_prefixes(const std::string& name);
// Whether `name` (a parameter's or a module's) lies under one of `prefixes` (as above).
bool under_prefix(const std::string& name, const std::vector<std::string>& prefixes);

}  // namespace faceshard
