#include "app/export/onnx_export.h"

#include <cmath>
#include <map>
#include <memory>
#include <unordered_map>

#include "app/export/onnx_layers.h"
#include "models/backbone_registry.h"
#include "models/iresnet.h"
#include "models/mobilefacenet.h"
#include "models/vit.h"
#include "base/error.h"

namespace faceshard {
namespace {

constexpr const char* kInput = "data";
constexpr const char* kOutput = "embedding";
constexpr int64_t kImageSize = 112;

// The backbone's modules by their state_dict path ("layer1.0.conv1"), looked up by the
// lowering in the order the forward runs them.
class ModuleTree {
 public:
  explicit ModuleTree(const torch::nn::Module& root) {
    for (const auto& item : root.named_modules()) modules_[item.key()] = item.value();
  }
  bool has(const std::string& path) const { return modules_.count(path) > 0; }
  template <typename T>
  const T* find(const std::string& path) const {
    auto it = modules_.find(path);
    return it == modules_.end() ? nullptr : it->second->as<T>();
  }
  template <typename T>
  const T& get(const std::string& path) const {
    if (const T* m = find<T>(path)) return *m;
    throw runtime_error("ONNX export: the backbone has no module '", path, "' of the expected type");
  }

 private:
  std::unordered_map<std::string, std::shared_ptr<torch::nn::Module>> modules_;
};

using Conv = torch::nn::Conv2dImpl;
using Linear = torch::nn::LinearImpl;
using PReLU = torch::nn::PReLUImpl;
using LayerNorm = torch::nn::LayerNormImpl;

// iresnet (models/iresnet.cpp): conv1 -> bn1 -> prelu, blocks of
// bn1 -> conv1 -> bn2 -> prelu -> conv2 -> bn3 [-> x * SE(x): GlobalAveragePool -> se.fc1 ->
// Relu -> se.fc2 -> Sigmoid, in IR-SE] (+ downsample conv -> BN, or the input),
// then bn2 -> flatten -> fc -> features. Every BN that follows a conv or the fc is folded
// into it, bn2 into the fc it precedes; a block's bn1 stays a node: it follows the addition
// and precedes a zero-padded convolution, whose border a fold would change.
std::string lower_iresnet(OnnxLayers& l, const ModuleTree& t, const Backbone&, std::string x) {
  x = l.conv("conv1", t.get<Conv>("conv1"), &t.get<NormLayerImpl>("bn1"), x);
  x = l.prelu("prelu", t.get<PReLU>("prelu"), x);
  for (int stage = 1; t.has("layer" + std::to_string(stage)); ++stage) {
    for (int b = 0;; ++b) {
      const std::string p = "layer" + std::to_string(stage) + "." + std::to_string(b);
      if (!t.has(p)) break;
      std::string y = l.batch_norm(p + ".bn1", t.get<NormLayerImpl>(p + ".bn1"), x);
      y = l.conv(p + ".conv1", t.get<Conv>(p + ".conv1"), &t.get<NormLayerImpl>(p + ".bn2"), y);
      y = l.prelu(p + ".prelu", t.get<PReLU>(p + ".prelu"), y);
      y = l.conv(p + ".conv2", t.get<Conv>(p + ".conv2"), &t.get<NormLayerImpl>(p + ".bn3"), y);
      // A module named "se" of another type is not lowered here: check_tensors_used names it.
      if (const auto* se_module = t.find<SqueezeExcitationImpl>(p + ".se")) {
        const auto& se = *se_module;
        std::string s = l.global_average_pool(p + ".se/pool", y);
        s = l.relu(p + ".se/relu", l.conv(p + ".se.fc1", *se.fc1(), nullptr, s));
        s = l.sigmoid(p + ".se/sigmoid", l.conv(p + ".se.fc2", *se.fc2(), nullptr, s));
        y = l.mul(p + ".se", y, s);
      }
      const std::string shortcut =
          t.has(p + ".downsample")
              ? l.conv(p + ".downsample", t.get<Conv>(p + ".downsample.0"), &t.get<NormLayerImpl>(p + ".downsample.1"), x)
              : x;
      x = l.add(p, y, shortcut);
    }
  }
  const auto& bn2 = t.get<NormLayerImpl>("bn2");
  const auto& fc = t.get<Linear>("fc");
  const int64_t positions = fc.weight.size(1) / bn2.weight.numel();  // 7 x 7
  return l.gemm("fc", fc, &bn2, positions, &t.get<NormLayerImpl>("features"), l.flatten("flatten", x));
}

// MobileFaceNet (models/mobilefacenet.cpp): ConvBlocks (conv -> BN [-> PReLU] under
// "layers.0/1/2"), DepthWise blocks (three ConvBlocks, plus the input when residual) alone or
// in a "Residual" chain, conv_sep, the GDC head (depthwise 7x7 -> BN -> flatten -> linear ->
// BN). Every BN follows a conv or the linear and is folded into it.
std::string conv_block(OnnxLayers& l, const ModuleTree& t, const std::string& p, std::string x) {
  x = l.conv(p, t.get<Conv>(p + ".layers.0"), &t.get<NormLayerImpl>(p + ".layers.1"), x);
  if (const auto* prelu = t.find<PReLU>(p + ".layers.2")) x = l.prelu(p + ".prelu", *prelu, x);
  return x;
}

std::string depthwise(OnnxLayers& l, const ModuleTree& t, const std::string& p, const std::string& x) {
  std::string y = x;
  for (int i = 0; i < 3; ++i) y = conv_block(l, t, p + ".layers." + std::to_string(i), y);
  return t.get<MbfDepthWiseImpl>(p).residual() ? l.add(p, y, x) : y;
}

std::string lower_mobilefacenet(OnnxLayers& l, const ModuleTree& t, const Backbone&, std::string x) {
  for (int i = 0;; ++i) {
    const std::string p = "layers." + std::to_string(i);
    if (!t.has(p)) break;
    if (t.find<MbfConvBlockImpl>(p)) {
      x = conv_block(l, t, p, x);
    } else if (t.find<MbfDepthWiseImpl>(p)) {
      x = depthwise(l, t, p, x);
    } else {  // a Residual chain of DepthWise blocks
      for (int j = 0; t.has(p + ".layers." + std::to_string(j)); ++j) x = depthwise(l, t, p + ".layers." + std::to_string(j), x);
    }
  }
  x = conv_block(l, t, "conv_sep", x);
  x = conv_block(l, t, "features.layers.0", x);
  return l.gemm("features.layers.2", t.get<Linear>("features.layers.2"), nullptr, 1,
                &t.get<NormLayerImpl>("features.layers.3"), l.flatten("features.flatten", x));
}

// ViT attention as VitAttentionImpl computes it: qkv -> [3, B, heads, N, d] -> softmax(q k^T
// * d^-0.5) v -> proj. The scores, softmax and weighted sum run in float32 also in an fp16
// export, as faceshard runs them under autocast.
std::string attention(OnnxLayers& l, const ModuleTree& t, const std::string& p, const VitVariant& v,
                      const std::string& x) {
  const int64_t head_dim = v.dim / v.heads;
  std::string qkv = l.matmul(p + ".qkv", t.get<Linear>(p + ".qkv"), x);
  qkv = l.reshape(p + "/qkv_heads", qkv, {0, 0, 3, v.heads, head_dim});
  qkv = l.transpose(p + "/qkv_split", qkv, {2, 0, 3, 1, 4});
  const bool half = l.dtype() != at::kFloat;
  auto part = [&](const char* name, int64_t index) {
    const std::string y = l.select(p + "/" + name, qkv, index);
    return half ? l.cast(p + "/" + name + "_fp32", y, at::kFloat) : y;
  };
  const std::string q = part("q", 0), k = part("k", 1), values = part("v", 2);
  std::string s = l.matmul(p + "/scores", q, l.transpose(p + "/k_t", k, {0, 1, 3, 2}));
  const double scale = std::pow(static_cast<double>(head_dim), -0.5);
  s = l.mul(p + "/scaled", s, l.weight(p + "/scale", at::scalar_tensor(scale, at::kDouble), at::kFloat));
  s = l.softmax(p + "/softmax", s, -1);
  std::string o = l.transpose(p + "/heads_back", l.matmul(p + "/weighted", s, values), {0, 2, 1, 3});
  o = l.reshape(p + "/merged", o, {0, 0, v.dim});
  if (half) o = l.cast(p + "/merged_half", o, l.dtype());
  return l.matmul(p + ".proj", t.get<Linear>(p + ".proj"), o);
}

// ViT (models/vit.cpp) in eval mode (no token masking, no drop path): patch conv -> tokens
// [B, 144, D] + pos_embed, pre-norm blocks, norm, flatten, feature.0 -> BN -> feature.2 -> BN
// (each BN folded into its linear).
std::string lower_vit(OnnxLayers& l, const ModuleTree& t, const Backbone& model, std::string x) {
  const auto* cast = dynamic_cast<const VisionTransformer*>(&model);
  if (!cast) throw runtime_error("ONNX export: backbone '", model.options().name, "' is registered as a ViT but is not one");
  const VisionTransformer& vit = *cast;
  const VitVariant& v = vit.variant();
  x = l.conv("patch_embed.proj", t.get<Conv>("patch_embed.proj"), nullptr, x);
  x = l.transpose("patch_embed/tokens", l.reshape("patch_embed/flatten", x, {0, 0, -1}), {0, 2, 1});
  const at::Tensor pos_embed = vit.named_parameters(/*recurse=*/false)["pos_embed"];
  x = l.add("pos_embed/add", x, l.weight("pos_embed", l.read(pos_embed)));
  for (int i = 0; t.has("blocks." + std::to_string(i)); ++i) {
    const std::string p = "blocks." + std::to_string(i);
    std::string h = l.layer_norm(p + ".norm1", t.get<LayerNorm>(p + ".norm1"), x);
    x = l.add(p + "/attn_residual", x, attention(l, t, p + ".attn", v, h));
    h = l.layer_norm(p + ".norm2", t.get<LayerNorm>(p + ".norm2"), x);
    h = l.relu6(p + ".mlp.act", l.matmul(p + ".mlp.fc1", t.get<Linear>(p + ".mlp.fc1"), h));
    x = l.add(p, x, l.matmul(p + ".mlp.fc2", t.get<Linear>(p + ".mlp.fc2"), h));
  }
  x = l.flatten("feature.flatten", l.layer_norm("norm", t.get<LayerNorm>("norm"), x));
  x = l.gemm("feature.0", t.get<Linear>("feature.0"), nullptr, 1, &t.get<NormLayerImpl>("feature.1"), x);
  return l.gemm("feature.2", t.get<Linear>("feature.2"), nullptr, 1, &t.get<NormLayerImpl>("feature.3"), x);
}

// The lowering of each family of backbone_traits() (models/backbone_registry.h): the
// registry names a network's family, the exporter keeps the lowerings, so models/ does not
// depend on the exporter. A network of a known family needs nothing here; its modules that
// the family's lowering does not know are refused by check_tensors_used.
using Lowering = std::string (*)(OnnxLayers&, const ModuleTree&, const Backbone&, std::string);
const std::map<std::string, Lowering>& lowerings() {
  static const std::map<std::string, Lowering> table = {
      {"iresnet", lower_iresnet}, {"mobilefacenet", lower_mobilefacenet}, {"vit", lower_vit}};
  return table;
}

std::string precision_name(at::ScalarType dtype) { return dtype == at::kHalf ? "fp16" : "fp32"; }

bool is_norm_layer(const torch::nn::Module& m) { return dynamic_cast<const NormLayerImpl*>(&m) != nullptr; }
bool is_vit(const torch::nn::Module& m) { return dynamic_cast<const VisionTransformer*>(&m) != nullptr; }

struct NotLoweredRule {
  OnnxNotLowered entry;
  bool (*applies)(const torch::nn::Module&);
};

const std::vector<NotLoweredRule>& not_lowered_rules() {
  static const std::vector<NotLoweredRule> rules = {
      {{"NormLayer", "num_batches_tracked",
        "counts the training batches (the averaging factor of a BatchNorm without momentum; faceshard's "
        "have one); an inference BatchNorm computes with running_mean and running_var alone"},
       is_norm_layer},
      {{"VisionTransformer", "mask_token",
        "stands in for the tokens that training masks; the eval forward masks none, so the graph never reads it"},
       is_vit},
  };
  return rules;
}

bool needs_no_lowering(const torch::nn::Module& module, const std::string& tensor) {
  for (const auto& r : not_lowered_rules())
    if (tensor == r.entry.tensor && r.applies(module)) return true;
  return false;
}

// Every parameter and buffer of the model, in state_dict order (a module's own tensors, then
// its children's), read by the lowering or exempt; else the first one that is neither is
// named with its module, and the export stops before anything is written.
OnnxTensorUse check_tensors_used(const Backbone& model, const OnnxLayers& l) {
  OnnxTensorUse use;
  std::string first, first_module, first_type, first_kind;
  size_t unused = 0;
  for (const auto& m : model.named_modules()) {
    auto visit = [&](const auto& tensors, const char* kind) {
      for (const auto& t : tensors) {
        ++use.total;
        if (l.was_read(t.value())) ++use.read;
        else if (needs_no_lowering(*m.value(), t.key())) ++use.exempt;
        else if (unused++ == 0) {
          first = m.key().empty() ? t.key() : m.key() + "." + t.key();
          first_module = m.key().empty() ? "(the backbone itself)" : m.key();
          first_type = m.value()->name();
          first_kind = kind;
        }
      }
    };
    visit(m.value()->named_parameters(/*recurse=*/false), "parameter");
    visit(m.value()->named_buffers(/*recurse=*/false), "buffer");
  }
  if (unused > 0)
    throw runtime_error("ONNX export: the ", model.options().name, " lowering does not use the ", first_kind, " '", first,
                        "' of module '", first_module, "' (", first_type, ")",
                        unused > 1 ? " and " + std::to_string(unused - 1) + (unused > 2 ? " more tensors" : " more tensor")
                                   : std::string(),
                        "; a graph without it would compute other embeddings, so nothing is written");
  return use;
}

}  // namespace

const std::vector<OnnxNotLowered>& onnx_tensors_without_lowering() {
  static const std::vector<OnnxNotLowered> entries = [] {
    std::vector<OnnxNotLowered> e;
    for (const auto& r : not_lowered_rules()) e.push_back(r.entry);
    return e;
  }();
  return entries;
}

bool has_onnx_lowering(const std::string& family) { return lowerings().count(family) > 0; }

void check_onnx_export_options(const OnnxExportOptions& o) {
  if (o.opset < kMinOnnxOpset || o.opset > kMaxOnnxOpset)
    throw usage_error("--opset ", o.opset, ": faceshard writes ONNX opsets ", kMinOnnxOpset, " to ", kMaxOnnxOpset);
  if (o.batch < 0) throw usage_error("--batch ", o.batch, ": expected 'dynamic' or a batch size >= 1");
  if (o.dtype != at::kFloat && o.dtype != at::kHalf)
    throw usage_error("--precision ", o.dtype, ": expected fp32 or fp16");
}

OnnxGraph build_onnx_graph(const Backbone& model, const OnnxExportOptions& options, OnnxTensorUse* use) {
  check_onnx_export_options(options);
  torch::NoGradGuard no_grad;
  const BackboneOptions& bo = model.options();
  OnnxGraph graph("faceshard_" + bo.name);
  const OnnxDim batch = options.batch > 0 ? OnnxDim{options.batch, ""} : OnnxDim{-1, "batch"};
  graph.add_input({kInput, OnnxType::Float, {batch, {3, ""}, {kImageSize, ""}, {kImageSize, ""}}});
  OnnxLayers l(graph, options.opset, options.dtype);
  const bool half = options.dtype != at::kFloat;
  std::string x = half ? l.cast("data/half", kInput, options.dtype) : kInput;
  const ModuleTree tree(model);
  const std::string family = backbone_traits(bo.name).family;
  const auto lowering = lowerings().find(family);
  if (lowering == lowerings().end())
    throw runtime_error("ONNX export: backbone '", bo.name, "' is of family '", family, "', which has no ONNX lowering");
  x = lowering->second(l, tree, model, x);
  const OnnxTensorUse counted = check_tensors_used(model, l);
  if (use) *use = counted;
  // The output keeps its name whatever the last layer: a float32 cast of an fp16 graph, else
  // an Identity (which onnxruntime removes).
  if (half) l.cast(kOutput, x, at::kFloat);
  else graph.add_node("Identity", {x}, kOutput);
  graph.add_output({kOutput, OnnxType::Float, {batch, {bo.embedding_size, ""}}});
  return graph;
}

OnnxExportResult export_onnx(const Backbone& model, const OnnxExportOptions& options, const std::string& path) {
  OnnxTensorUse use;
  const OnnxGraph graph = build_onnx_graph(model, options, &use);
  const BackboneOptions& bo = model.options();
  OnnxModelInfo info;
  info.opset = options.opset;
  info.producer_version = FACESHARD_VERSION;
  info.doc_string = "faceshard " + bo.name + " backbone: " + kInput + " [N,3,112,112] float32 RGB, (x / 255 - 0.5) / 0.5 -> " +
                    kOutput + " [N," + std::to_string(bo.embedding_size) + "] float32 (not L2-normalised)";
  info.metadata = {{"network", bo.name},
                   {"embedding_size", std::to_string(bo.embedding_size)},
                   {"input", std::string(kInput) + " [N,3,112,112] float32 RGB CHW"},
                   {"input_normalization", "(x / 255 - 0.5) / 0.5"},
                   {"input_mean", "127.5"},
                   {"input_std", "127.5"},
                   {"output", std::string(kOutput) + " [N," + std::to_string(bo.embedding_size) + "] float32, not normalised"},
                   {"precision", precision_name(options.dtype)},
                   {"batch", options.batch > 0 ? std::to_string(options.batch) : "dynamic"},
                   {"faceshard_version", FACESHARD_VERSION}};
  info.metadata.insert(info.metadata.end(), options.metadata.begin(), options.metadata.end());
  OnnxExportResult r;
  r.nodes = graph.nodes().size();
  r.initializers = graph.initializers().size();
  r.tensors = use;
  r.files = write_onnx_model(graph, info, path, options.external_data);
  return r;
}

}  // namespace faceshard
