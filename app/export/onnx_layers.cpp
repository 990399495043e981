#include "app/export/onnx_layers.h"

#include <variant>

#include "base/error.h"

namespace faceshard {
namespace {

using Attr = OnnxAttribute;

at::Tensor f64(const at::Tensor& t) { return t.detach().to(at::kCPU, at::kDouble); }

// BatchNorm in inference as y = x * scale + shift, per channel, in float64.
struct Affine {
  at::Tensor scale, shift;
};
Affine bn_affine(OnnxLayers& l, const NormLayerImpl& bn) {
  const at::Tensor scale = f64(l.read(bn.weight)) / (f64(l.read(bn.running_var)) + bn.eps).sqrt();
  return {scale, f64(l.read(bn.bias)) - f64(l.read(bn.running_mean)) * scale};
}

std::vector<int64_t> pair(const torch::ExpandingArray<2>& a) { return {(*a)[0], (*a)[1]}; }

}  // namespace

OnnxLayers::OnnxLayers(OnnxGraph& graph, int64_t opset, at::ScalarType dtype)
    : graph_(graph), opset_(opset), dtype_(dtype) {}

std::string OnnxLayers::weight(const std::string& name, const at::Tensor& value) { return weight(name, value, dtype_); }

const at::Tensor& OnnxLayers::read(const at::Tensor& t) {
  read_.insert(t.unsafeGetTensorImpl());
  return t;
}

std::string OnnxLayers::weight(const std::string& name, const at::Tensor& value, at::ScalarType type) {
  return graph_.add_initializer(name, value.detach().to(at::kCPU, type));
}

std::string OnnxLayers::conv(const std::string& name, const torch::nn::Conv2dImpl& conv, const NormLayerImpl* bn,
                             const std::string& x) {
  const auto& o = conv.options;
  const auto* pad = std::get_if<torch::ExpandingArray<2>>(&o.padding());
  if (!pad || !std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode()))
    throw runtime_error("ONNX export: convolution '", name, "' has a padding mode the export does not handle");
  at::Tensor w = f64(read(conv.weight));
  at::Tensor b = conv.bias.defined() ? f64(read(conv.bias)) : at::zeros({w.size(0)}, w.options());
  if (bn) {
    const Affine a = bn_affine(*this, *bn);
    w = w * a.scale.view({-1, 1, 1, 1});
    b = b * a.scale + a.shift;
  }
  std::vector<std::string> inputs = {x, weight(name + ".weight", w)};
  if (bn || conv.bias.defined()) inputs.push_back(weight(name + ".bias", b));
  const std::vector<int64_t> p = pair(*pad);
  return graph_.add_node("Conv", inputs, name,
                         {Attr::list("kernel_shape", pair(o.kernel_size())), Attr::list("strides", pair(o.stride())),
                          Attr::list("pads", {p[0], p[1], p[0], p[1]}), Attr::list("dilations", pair(o.dilation())),
                          Attr::integer("group", o.groups())});
}

std::string OnnxLayers::batch_norm(const std::string& name, const NormLayerImpl& bn, const std::string& x) {
  return graph_.add_node("BatchNormalization",
                         {x, weight(name + ".weight", read(bn.weight)), weight(name + ".bias", read(bn.bias)),
                          weight(name + ".running_mean", read(bn.running_mean)),
                          weight(name + ".running_var", read(bn.running_var))},
                         name, {Attr::real("epsilon", static_cast<float>(bn.eps))});
}

std::string OnnxLayers::gemm(const std::string& name, const torch::nn::LinearImpl& linear, const NormLayerImpl* before,
                             int64_t positions, const NormLayerImpl* after, const std::string& x) {
  at::Tensor w = f64(read(linear.weight));  // [out, in]
  at::Tensor b = linear.bias.defined() ? f64(read(linear.bias)) : at::zeros({w.size(0)}, w.options());
  if (before && before->weight.numel() * positions != w.size(1))
    throw runtime_error("ONNX export: BatchNorm of ", before->weight.numel(), " channels x ", positions,
                        " positions before '", name, "', which takes ", w.size(1), " inputs");
  if (before) {
    // Input i belongs to channel i / positions (a [C, H, W] map flattened).
    const Affine a = bn_affine(*this, *before);
    const at::Tensor scale = a.scale.repeat_interleave(positions), shift = a.shift.repeat_interleave(positions);
    b = b + at::mv(w, shift);
    w = w * scale.view({1, -1});
  }
  if (after) {
    const Affine a = bn_affine(*this, *after);
    w = w * a.scale.view({-1, 1});
    b = b * a.scale + a.shift;
  }
  return graph_.add_node("Gemm", {x, weight(name + ".weight", w), weight(name + ".bias", b)}, name,
                         {Attr::integer("transB", 1)});
}

std::string OnnxLayers::matmul(const std::string& name, const torch::nn::LinearImpl& linear, const std::string& x) {
  const std::string y = matmul(name + "/matmul", x, weight(name + ".weight_t", read(linear.weight).t()));
  if (!linear.bias.defined()) return y;
  return add(name, y, weight(name + ".bias", read(linear.bias)));
}

std::string OnnxLayers::prelu(const std::string& name, const torch::nn::PReLUImpl& prelu, const std::string& x) {
  // One slope per channel, broadcast over [C, H, W] from the right: shape [C, 1, 1].
  const at::Tensor slope = read(prelu.weight).view({-1, 1, 1});
  return graph_.add_node("PRelu", {x, weight(name + ".weight", slope)}, name);
}

std::string OnnxLayers::relu6(const std::string& name, const std::string& x) {
  return graph_.add_node("Clip",
                         {x, weight(name + "/min", at::zeros({}, at::kDouble)), weight(name + "/max", at::full({}, 6.0))},
                         name);
}

std::string OnnxLayers::relu(const std::string& name, const std::string& x) {
  return graph_.add_node("Relu", {x}, name);
}

std::string OnnxLayers::sigmoid(const std::string& name, const std::string& x) {
  return graph_.add_node("Sigmoid", {x}, name);
}

std::string OnnxLayers::global_average_pool(const std::string& name, const std::string& x) {
  return graph_.add_node("GlobalAveragePool", {x}, name);
}

std::string OnnxLayers::layer_norm(const std::string& name, const torch::nn::LayerNormImpl& norm, const std::string& x) {
  const auto& o = norm.options;
  if (o.normalized_shape().size() != 1 || !o.elementwise_affine())
    throw runtime_error("ONNX export: LayerNorm '", name, "' is not an affine norm over the last dimension");
  const std::string w = weight(name + ".weight", read(norm.weight)), b = weight(name + ".bias", read(norm.bias));
  const auto eps = static_cast<float>(o.eps());
  if (opset_ >= 17)
    return graph_.add_node("LayerNormalization", {x, w, b}, name,
                           {Attr::integer("axis", -1), Attr::real("epsilon", eps)});
  // Before opset 17: (x - mean) / sqrt(mean((x - mean)^2) + eps) * w + b, the biased variance
  // as torch's layer_norm. ReduceMean takes its axes as an attribute up to opset 17.
  auto mean = [&](const std::string& out, const std::string& in) {
    return graph_.add_node("ReduceMean", {in}, out, {Attr::list("axes", {-1}), Attr::integer("keepdims", 1)});
  };
  const std::string centred = graph_.add_node("Sub", {x, mean(name + "/mean", x)}, name + "/centred");
  const std::string var = mean(name + "/var", mul(name + "/square", centred, centred));
  const std::string std_dev =
      graph_.add_node("Sqrt", {add(name + "/var_eps", var, weight(name + "/eps", at::full({}, o.eps())))}, name + "/std");
  const std::string normed = graph_.add_node("Div", {centred, std_dev}, name + "/normed");
  return add(name, mul(name + "/scaled", normed, w), b);
}

std::string OnnxLayers::add(const std::string& name, const std::string& a, const std::string& b) {
  return graph_.add_node("Add", {a, b}, name);
}

std::string OnnxLayers::mul(const std::string& name, const std::string& a, const std::string& b) {
  return graph_.add_node("Mul", {a, b}, name);
}

std::string OnnxLayers::matmul(const std::string& name, const std::string& a, const std::string& b) {
  return graph_.add_node("MatMul", {a, b}, name);
}

std::string OnnxLayers::flatten(const std::string& name, const std::string& x) {
  return graph_.add_node("Flatten", {x}, name, {Attr::integer("axis", 1)});
}

std::string OnnxLayers::reshape(const std::string& name, const std::string& x, std::vector<int64_t> shape) {
  const at::Tensor s = at::tensor(shape, at::kLong);
  return graph_.add_node("Reshape", {x, weight(name + "/shape", s, at::kLong)}, name);
}

std::string OnnxLayers::transpose(const std::string& name, const std::string& x, std::vector<int64_t> perm) {
  return graph_.add_node("Transpose", {x}, name, {Attr::list("perm", std::move(perm))});
}

std::string OnnxLayers::softmax(const std::string& name, const std::string& x, int64_t axis) {
  return graph_.add_node("Softmax", {x}, name, {Attr::integer("axis", axis)});
}

std::string OnnxLayers::select(const std::string& name, const std::string& x, int64_t index) {
  // A scalar index removes the axis, as x[index] does.
  return graph_.add_node("Gather", {x, weight(name + "/index", at::scalar_tensor(index, at::kLong), at::kLong)}, name,
                         {Attr::integer("axis", 0)});
}

std::string OnnxLayers::cast(const std::string& name, const std::string& x, at::ScalarType to) {
  return graph_.add_node("Cast", {x}, name, {Attr::integer("to", static_cast<int64_t>(onnx_type(to)))});
}

}  // namespace faceshard
