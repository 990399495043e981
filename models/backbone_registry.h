// The backbone registry: builds a backbone from its config name ("r50", "mbf", "vit_t", ...)
// and options, so the trainer and tools never name a concrete network class.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "models/backbone.h"

namespace faceshard {

// Names accepted by make_backbone, in a stable order: r18 r34 r50 r100 r200 r2060, the
// IR-SE networks, mbf mbf_small mbf_large, then arcface_torch's ViT variants.
std::vector<std::string> backbone_names();

// What a registered network declares besides how it is built, so that no caller tests a
// name's prefix: its family, its defaults and what it supports.
struct BackboneTraits {
  std::string name;
  // "iresnet", "mobilefacenet" or "vit": the key of the network's ONNX lowering (the
  // exporter keeps one per family, app/export/onnx_export.cpp; models/ does not depend on
  // the exporter) and of its module structure.
  std::string family;
  // Activation checkpointing when BackboneOptions::checkpointing is unset (arcface_torch's
  // choice), and whether the network has it at all.
  bool default_checkpointing = false;
  bool supports_checkpointing = true;
  std::string no_checkpointing_reason;  // the option error's reason when it does not
  // The training layout when the config leaves it open: NHWC for the convolutional
  // networks (faster on the CPU, measured with faceshard-bench --mode step; what cuDNN's
  // tensor-core kernels take), NCHW for the ViTs (one convolution, the patch embedding).
  bool default_channels_last = true;
  // Whether BackboneOptions::dropout applies; else why not (the option error's reason).
  bool dropout = false;
  std::string no_dropout_reason;
  // What optim.freeze_stages counts ("stages" or "blocks").
  std::string stage_word = "stages";
};

// The traits of a registered network; option_error("backbone") when unknown.
const BackboneTraits& backbone_traits(const std::string& name);

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
