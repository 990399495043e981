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

// Whether the exporter lowers networks of `family` (BackboneTraits::family).
bool has_onnx_lowering(const std::string& family);

// usage_error naming the option when an option is out of range.
void check_onnx_export_options(const OnnxExportOptions& options);

// How the lowering used the model's parameters and buffers (state_dict entries).
struct OnnxTensorUse {
  size_t total = 0;  // parameters and buffers of the model
  size_t read = 0;   // whose values the lowering took
  size_t exempt = 0; // that need no lowering (onnx_tensors_without_lowering)
};

// The tensors an inference graph needs no value of, each with the reason: a module type's
// own parameter or buffer by its local name ("num_batches_tracked" of a BatchNorm).
struct OnnxNotLowered {
  const char* module_type;
  const char* tensor;
  const char* reason;
};
const std::vector<OnnxNotLowered>& onnx_tensors_without_lowering();

// The graph of `model` (its eval-mode forward) with the options' precision and batch.
// Refuses (runtime_error naming the first one, its module and the module's type) a model
// with a parameter or buffer that the lowering did not read and that is not one of
// onnx_tensors_without_lowering(): a module the lowering does not know (an extra block, a
// squeeze-and-excitation branch) would otherwise be left out of the graph without a word.
// `use`, when given, receives the counts.
OnnxGraph build_onnx_graph(const Backbone& model, const OnnxExportOptions& options, OnnxTensorUse* use = nullptr);

struct OnnxExportResult {
  size_t nodes = 0, initializers = 0;
  OnnxTensorUse tensors;
  OnnxWriteResult files;
};

// Builds the graph (nothing is written when build_onnx_graph refuses the model) and writes
// it to `path` atomically (write_onnx_model), with the metadata
// props network, embedding_size, input, input_normalization, input_mean, input_std, output,
// precision, batch, faceshard_version, then the options' own.
OnnxExportResult export_onnx(const Backbone& model, const OnnxExportOptions& options, const std::string& path);

}  // namespace faceshard
