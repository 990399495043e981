// faceshard's layers as ONNX nodes: convolutions and linear layers with their BatchNorms
// folded into the weights (computed in float64, then stored in the export's precision), the
// BatchNorms that cannot be folded, PReLU, ReLU, ReLU6, Sigmoid, LayerNorm (one node from opset 17, plain
// arithmetic before), and the shape operations of the backbones. Value names are module paths.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/torch.h>

#include "app/export/onnx_model.h"
#include "models/norm_layer.h"

namespace faceshard {

class OnnxLayers {
 public:
  // dtype: the weights' and activations' type, at::kFloat or at::kHalf.
  OnnxLayers(OnnxGraph& graph, int64_t opset, at::ScalarType dtype);

  OnnxGraph& graph() { return graph_; }
  at::ScalarType dtype() const { return dtype_; }

  // conv(x) [then the BatchNorm `bn` folded into it: W * s, (b - mean) * s + beta].
  std::string conv(const std::string& name, const torch::nn::Conv2dImpl& conv, const NormLayerImpl* bn,
                   const std::string& x);
  // An inference BatchNorm over channel 1 that stays a node (one that no weight precedes).
  std::string batch_norm(const std::string& name, const NormLayerImpl& bn, const std::string& x);
  // Gemm on [B, in]: x W^T + b, with `before` (a BatchNorm over in / positions channels, each
  // repeated over `positions` consecutive inputs, as a flattened [C, H, W] map) and `after`
  // (a BatchNorm1d of the outputs) folded into W and b. Both folds are exact in arithmetic.
  std::string gemm(const std::string& name, const torch::nn::LinearImpl& linear, const NormLayerImpl* before,
                   int64_t positions, const NormLayerImpl* after, const std::string& x);
  // x W^T (+ b) on [..., in] (MatMul, Add).
  std::string matmul(const std::string& name, const torch::nn::LinearImpl& linear, const std::string& x);
  // PReLU with one slope per channel of dimension 1.
  std::string prelu(const std::string& name, const torch::nn::PReLUImpl& prelu, const std::string& x);
  std::string relu6(const std::string& name, const std::string& x);
  std::string relu(const std::string& name, const std::string& x);
  std::string sigmoid(const std::string& name, const std::string& x);
  // The mean over every dimension after the first two ([B, C, H, W] -> [B, C, 1, 1]).
  std::string global_average_pool(const std::string& name, const std::string& x);
  // LayerNorm over the last dimension.
  std::string layer_norm(const std::string& name, const torch::nn::LayerNormImpl& norm, const std::string& x);

  std::string add(const std::string& name, const std::string& a, const std::string& b);
  std::string mul(const std::string& name, const std::string& a, const std::string& b);
  std::string matmul(const std::string& name, const std::string& a, const std::string& b);
  std::string flatten(const std::string& name, const std::string& x);  // [B, ...] -> [B, prod]
  // Reshape to `shape` (0 copies the input's dimension, -1 takes the rest).
  std::string reshape(const std::string& name, const std::string& x, std::vector<int64_t> shape);
  std::string transpose(const std::string& name, const std::string& x, std::vector<int64_t> perm);
  std::string softmax(const std::string& name, const std::string& x, int64_t axis);
  // x[index] along axis 0 (the axis removed).
  std::string select(const std::string& name, const std::string& x, int64_t index);
  std::string cast(const std::string& name, const std::string& x, at::ScalarType to);

  // A weight in the export's precision (`type` overrides it) under `name`.
  std::string weight(const std::string& name, const at::Tensor& value);
  std::string weight(const std::string& name, const at::Tensor& value, at::ScalarType type);

  // Every parameter or buffer of the model whose value the lowering takes passes through
  // read() (the layers above call it on their modules' tensors), so that the export can
  // tell a tensor it lowered from one it never looked at. Returns `t`.
  const at::Tensor& read(const at::Tensor& t);
  // The tensors read so far, by identity (a parameter and the module field that holds it
  // share one TensorImpl; a view or copy of it does not).
  bool was_read(const at::Tensor& t) const { return read_.count(t.unsafeGetTensorImpl()) > 0; }

 private:
  OnnxGraph& graph_;
  int64_t opset_;
  at::ScalarType dtype_;
  std::unordered_set<const c10::TensorImpl*> read_;
};

}  // namespace faceshard
