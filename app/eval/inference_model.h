// Loading a trained backbone for inference (the evaluation tools): from faceshard-train's
// export (model.pt + model.json), from a training checkpoint (step_<N>/backbone.pt with the
// run's config.yaml two folders up), from a run's output folder, or from any torch.save'd
// state_dict such as a released insightface backbone.pth (then --network names it).
#pragma once
#include <memory>
#include <string>

#include <torch/torch.h>

#include "models/backbone.h"

namespace faceshard {

struct ModelSpec {
  std::string path;            // file or folder, see resolve order below
  std::string network;         // overrides the metadata ("r50", "mbf", ...)
  int64_t embedding_size = 0;  // overrides the metadata; 0: metadata or 512
  std::string precision;        // body precision; empty: the metadata's (the training precision) or fp32
};

struct InferenceModel {
  std::shared_ptr<Backbone> backbone;  // in eval mode, on the requested device
  std::string weights;                 // the weights file that was read
  std::string metadata;                // the model.json or config.yaml read ("" when none)
  std::string description;             // "r50, 512-d, from <file> (<source>)"
};

// Resolve order for spec.path:
//   folder with COMMITTED            -> a checkpoint: <dir>/backbone.pt, <dir>/../../config.yaml
//   folder with model.pt             -> an export:    <dir>/model.pt, <dir>/model.json
//   folder with checkpoints/         -> the newest committed checkpoint in it
//   file X.pt / X.pth                -> weights; metadata from X.json, or model.json next to it,
//                                       or the checkpoint's config when X is a checkpoint's backbone.pt
// Without metadata, spec.network is required. Every failure is a usage_error naming the path.
InferenceModel load_inference_model(const ModelSpec& spec, torch::Device device);

}  // namespace faceshard
