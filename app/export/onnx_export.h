// faceshard's backbones as ONNX models: a loaded Backbone (iresnet, MobileFaceNet, ViT) is
// read module by module and lowered to a graph from "data" [N,3,112,112] float32 RGB,
// normalised as faceshard normalises ((x / 255 - 0.5) / 0.5), to "embedding" [N, E] float32.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "app/export/onnx_model.h"
#include "models/backbone.h"

namespace faceshard {

// The opsets the export writes and its tests run (LayerNormalization is a node from 17 on,
// plain arithmetic before).
constexpr int64_t kMinOnnxOpset = 13, kMaxOnnxOpset = 21;

struct OnnxExportOptions {
  int64_t opset = 17;
  int64_t batch = 0;                  // 0: dynamic (the dimension is named "batch"), else fixed
  at::ScalarType dtype = at::kFloat;  // kHalf: fp16 weights and compute, float32 input and output
  bool external_data = false;         // weights in OUT.onnx.data even below 2 GiB
  // Extra metadata_props, after the export's own (network, embedding size, input, precision).
  std::vector<std::pair<std::string, std::string>> metadata;
};

// usage_error naming the option when an option is out of range.
void check_onnx_export_options(const OnnxExportOptions& options);

// The graph of `model` (its eval-mode forward) with the options' precision and batch.
OnnxGraph build_onnx_graph(const Backbone& model, const OnnxExportOptions& options);

struct OnnxExportResult {
  size_t nodes = 0, initializers = 0;
  OnnxWriteResult files;
};

// Builds the graph and writes it to `path` atomically (write_onnx_model), with the metadata
// props network, embedding_size, input, input_normalization, input_mean, input_std, output,
// precision, batch, faceshard_version, then the options' own.
OnnxExportResult export_onnx(const Backbone& model, const OnnxExportOptions& options, const std::string& path);

}  // namespace faceshard
