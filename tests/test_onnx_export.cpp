// The ONNX export without onnxruntime: the protobuf wire writer against the encodings of the
// protobuf documentation, and each backbone family's graph run by a small interpreter of the
// ONNX operators' definitions (torch ops, float64) against the backbone's own forward, with
// random BatchNorm statistics so that every fold is exercised. Options and failed writes.
// tests/e2e/onnx_export.py runs the written files in onnxruntime and insightface.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include "app/export/onnx_export.h"
#include "app/io/protobuf_writer.h"
#include "models/backbone_registry.h"
#include "models/norm_layer.h"
#include "tests/test_errors.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

TEST(ProtobufWriter, EncodesAsTheProtobufDocumentationShows) {
  // "Message Structure" and "Base 128 Varints" of protobuf.dev/programming-guides/encoding.
  ProtoMessage m;
  m.add_varint(1, 150);
  EXPECT_EQ(hex(m.str()), "089601");
  ProtoMessage s;
  s.add_bytes(2, "testing");
  EXPECT_EQ(hex(s.str()), "120774657374696e67");
  ProtoMessage nested;  // Test3 { Test1 c = 3; } holding a = 150
  nested.add_message(3, m);
  EXPECT_EQ(hex(nested.str()), "1a03089601");
  ProtoMessage neg;  // int64 -2: ten bytes of two's complement
  neg.add_int64(1, -2);
  EXPECT_EQ(hex(neg.str()), "08feffffffffffffffff01");
  ProtoMessage f;
  f.add_float(2, 1.0f);
  f.add_double(1, -2.0);
  EXPECT_EQ(hex(f.str()), "150000803f09" "00000000000000c0");
}

TEST(ProtobufWriter, ExternalBytesAreWrittenWhereTheyStand) {
  const std::string payload(100000, 'x');
  ProtoMessage inner;
  inner.add_bytes(1, "name");
  inner.add_external_bytes(9, payload.data(), payload.size());
  inner.add_varint(2, 7);
  ProtoMessage outer;
  outer.add_message(5, inner);
  outer.add_message(5, inner);
  ProtoMessage copied;  // the same with the bytes copied in
  ProtoMessage inner_copy;
  inner_copy.add_bytes(1, "name");
  inner_copy.add_bytes(9, payload);
  inner_copy.add_varint(2, 7);
  copied.add_message(5, inner_copy);
  copied.add_message(5, inner_copy);
  EXPECT_EQ(outer.size(), copied.size());
  EXPECT_EQ(outer.str(), copied.str());
  testing::TempDir dir;
  std::FILE* file = std::fopen((dir / "m.bin").c_str(), "wb");
  ASSERT_TRUE(outer.write_to(file));
  std::fclose(file);
  const auto bytes = testing::slurp(dir / "m.bin");
  EXPECT_EQ(std::string(bytes.begin(), bytes.end()), copied.str());
}

// The ONNX operators faceshard's graphs use, as their specification defines them, on torch
// tensors. Values are float64 throughout (casts included) so that the comparison sees the
// lowering and the folded weights, not float32 rounding.
class Interpreter {
 public:
  explicit Interpreter(const OnnxGraph& g) : g_(g) {
    for (const auto& [name, t] : g.initializers())
      v_[name] = t.scalar_type() == at::kLong ? t : t.to(at::kDouble);
  }

  at::Tensor run(const at::Tensor& input) {
    v_[g_.inputs().at(0).name] = input.to(at::kDouble);
    for (const OnnxNode& n : g_.nodes()) v_[n.outputs.at(0)] = eval(n);
    return v_.at(g_.outputs().at(0).name);
  }

 private:
  const OnnxAttribute& attr(const OnnxNode& n, const std::string& name) {
    for (const auto& a : n.attributes)
      if (a.name == name) return a;
    throw std::runtime_error(n.name + ": no attribute " + name);
  }
  at::Tensor in(const OnnxNode& n, size_t i) { return v_.at(n.inputs.at(i)); }

  at::Tensor eval(const OnnxNode& n) {
    const std::string& op = n.op;
    if (op == "Conv") {
      const auto& pads = attr(n, "pads").ints;
      return at::conv2d(in(n, 0), in(n, 1), n.inputs.size() > 2 ? in(n, 2) : at::Tensor(), attr(n, "strides").ints,
                        {pads[0], pads[1]}, attr(n, "dilations").ints, attr(n, "group").i);
    }
    if (op == "BatchNormalization") {
      const at::Tensor x = in(n, 0);
      auto c = [&](size_t i) { return in(n, i).view({1, -1, 1, 1}); };
      return (x - c(3)) / (c(4) + attr(n, "epsilon").f).sqrt() * c(1) + c(2);
    }
    if (op == "PRelu") return at::where(in(n, 0) >= 0, in(n, 0), in(n, 0) * in(n, 1));
    if (op == "Add") return in(n, 0) + in(n, 1);
    if (op == "Sub") return in(n, 0) - in(n, 1);
    if (op == "Mul") return in(n, 0) * in(n, 1);
    if (op == "Div") return in(n, 0) / in(n, 1);
    if (op == "Sqrt") return in(n, 0).sqrt();
    if (op == "MatMul") return at::matmul(in(n, 0), in(n, 1));
    if (op == "Gemm") {
      EXPECT_EQ(attr(n, "transB").i, 1);
      return at::matmul(in(n, 0), in(n, 1).t()) + in(n, 2);
    }
    if (op == "Flatten") return in(n, 0).flatten(attr(n, "axis").i);
    if (op == "Reshape") {
      const at::Tensor x = in(n, 0), s = in(n, 1);
      std::vector<int64_t> shape;
      for (int64_t i = 0; i < s.numel(); ++i) {
        const int64_t d = s[i].item<int64_t>();
        shape.push_back(d == 0 ? x.size(i) : d);
      }
      return x.reshape(shape);
    }
    if (op == "Transpose") return in(n, 0).permute(attr(n, "perm").ints);
    if (op == "Gather") return in(n, 0).select(attr(n, "axis").i, in(n, 1).item<int64_t>());
    if (op == "Softmax") return in(n, 0).softmax(attr(n, "axis").i);
    if (op == "Relu") return in(n, 0).clamp_min(0.0);
    if (op == "Sigmoid") return 1.0 / (1.0 + (-in(n, 0)).exp());
    if (op == "GlobalAveragePool") return in(n, 0).mean({2, 3}, /*keepdim=*/true);
    if (op == "Clip") return in(n, 0).clamp(in(n, 1).item<double>(), in(n, 2).item<double>());
    if (op == "LayerNormalization") {
      const at::Tensor x = in(n, 0);
      return at::layer_norm(x, {x.size(-1)}, in(n, 1), in(n, 2), attr(n, "epsilon").f);
    }
    if (op == "ReduceMean") return in(n, 0).mean(attr(n, "axes").ints, attr(n, "keepdims").i != 0);
    if (op == "Cast" || op == "Identity") return in(n, 0);
    throw std::runtime_error("interpreter: no operator " + op);
  }

  const OnnxGraph& g_;
  std::map<std::string, at::Tensor> v_;
};

// Random weights with BatchNorm statistics far from (0, 1), so that folding them is checked.
std::shared_ptr<Backbone> random_backbone(const std::string& name, int64_t embedding) {
  torch::manual_seed(7);
  BackboneOptions o;
  o.name = name;
  o.embedding_size = embedding;
  auto model = make_backbone(o);
  torch::NoGradGuard no_grad;
  for (auto& [key, t] : model->state_dict()) {
    if (!t.is_floating_point()) continue;
    if (key.find("running_var") != std::string::npos) t.uniform_(0.5, 2.0);
    else if (key.find("running_mean") != std::string::npos || key.find("bias") != std::string::npos) t.normal_(0.0, 0.2);
    else if (t.dim() == 1) t.uniform_(0.5, 1.5);  // BN / LayerNorm scales, PReLU slopes
    else if (t.dim() >= 2 && key.find("embed") == std::string::npos && key.find("token") == std::string::npos)
      t.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(t[0].numel())));
  }
  model->eval();
  return model;
}

double max_rel_diff(const at::Tensor& got, const at::Tensor& want) {
  return ((got - want).abs().amax(1) / want.abs().amax(1)).max().item<double>();
}

void expect_graph_matches_forward(const std::string& name, const OnnxExportOptions& options, int64_t expect_bn_nodes) {
  auto model = random_backbone(name, 64);
  const OnnxGraph g = build_onnx_graph(*model, options);
  int64_t bn = 0;
  for (const auto& n : g.nodes()) bn += n.op == "BatchNormalization";
  EXPECT_EQ(bn, expect_bn_nodes) << name;
  const at::Tensor x = torch::randn({3, 3, 112, 112});
  model->to(torch::kDouble);
  at::Tensor want;
  {
    torch::NoGradGuard no_grad;
    want = model->forward(x.to(torch::kDouble));
  }
  const at::Tensor got = Interpreter(g).run(x);
  ASSERT_EQ(got.sizes(), want.sizes()) << name;
  // The folded weights are float32: about 1e-7 relative per layer.
  EXPECT_LT(max_rel_diff(got, want), 1e-5) << name << " opset " << options.opset;
}

TEST(OnnxExport, IResNetGraphComputesTheForward) {
  // Each of r18's 8 blocks keeps its bn1 (after the addition, before a padded convolution).
  expect_graph_matches_forward("r18", {}, 8);
}

TEST(OnnxExport, IrSeGraphComputesTheForwardWithItsSqueezeAndExcitation) {
  // 24 blocks, each with bn1 kept and one GlobalAveragePool -> Conv -> Relu -> Conv -> Sigmoid
  // -> Mul branch (Relu, not ReLU6's Clip).
  expect_graph_matches_forward("ir_se50", {}, 24);
  auto model = random_backbone("ir_se50", 64);
  std::map<std::string, int> ops;
  const OnnxGraph g = build_onnx_graph(*model, {});
  for (const auto& n : g.nodes()) ++ops[n.op];
  EXPECT_EQ(ops["GlobalAveragePool"], 24);
  EXPECT_EQ(ops["Relu"], 24);
  EXPECT_EQ(ops["Sigmoid"], 24);
  EXPECT_EQ(ops["Mul"], 24);
  EXPECT_EQ(ops["Clip"], 0);
}

TEST(OnnxExport, MobileFaceNetGraphComputesTheForward) { expect_graph_matches_forward("mbf_small", {}, 0); }

TEST(OnnxExport, VitGraphComputesTheForwardAtOpsets13And17) {
  OnnxExportOptions o;
  o.opset = 13;  // LayerNorm as arithmetic
  expect_graph_matches_forward("vit_t", o, 0);
  o.opset = 17;
  expect_graph_matches_forward("vit_t", o, 0);
}

TEST(OnnxExport, Fp16GraphHasHalfWeightsAndFloatEnds) {
  OnnxExportOptions o;
  o.dtype = at::kHalf;
  o.batch = 4;
  auto model = random_backbone("mbf_small", 64);
  const OnnxGraph g = build_onnx_graph(*model, o);
  EXPECT_EQ(g.inputs().at(0).type, OnnxType::Float);
  EXPECT_EQ(g.outputs().at(0).type, OnnxType::Float);
  EXPECT_EQ(g.inputs().at(0).dims.at(0).value, 4);
  EXPECT_EQ(g.nodes().front().op, "Cast");
  EXPECT_EQ(g.nodes().back().op, "Cast");
  for (const auto& [name, t] : g.initializers())
    if (t.dim() >= 2) {
      EXPECT_EQ(t.scalar_type(), at::kHalf) << name;
    }
}

TEST(OnnxExport, RefusesOptionsOutOfRange) {
  using testing::error_of;
  OnnxExportOptions o;
  o.opset = 12;
  EXPECT_NE(error_of([&] { check_onnx_export_options(o); }).find("opsets 13 to 21"), std::string::npos);
  o.opset = 22;
  EXPECT_NE(error_of([&] { check_onnx_export_options(o); }).find("--opset 22"), std::string::npos);
  o.opset = 17;
  o.batch = -1;
  EXPECT_NE(error_of([&] { check_onnx_export_options(o); }).find("--batch"), std::string::npos);
}

TEST(OnnxExport, ExternalDataIsAlignedAndAFailedWriteLeavesNothing) {
  testing::TempDir dir;
  auto model = random_backbone("mbf_small", 64);
  OnnxExportOptions o;
  o.external_data = true;
  const OnnxExportResult r = export_onnx(*model, o, dir / "m.onnx");
  EXPECT_EQ(r.files.data_path, dir / "m.onnx.data");
  EXPECT_EQ(std::filesystem::file_size(dir / "m.onnx.data"), r.files.data_bytes);
  EXPECT_EQ(std::filesystem::file_size(dir / "m.onnx"), r.files.model_bytes);
  // Inline small tensors aside, every weight's bytes are in the data file (at 4 KiB offsets).
  const OnnxGraph g = build_onnx_graph(*model, o);
  uint64_t big = 0;
  for (const auto& [name, t] : g.initializers()) big += t.nbytes() >= 1024 ? t.nbytes() : 0;
  EXPECT_GE(r.files.data_bytes, big);
  EXPECT_LT(r.files.data_bytes, big + 4096 * g.initializers().size());
  EXPECT_LT(r.files.model_bytes, 200000u);
  const std::string missing = dir / "no/such/m.onnx";
  EXPECT_NE(testing::error_of([&] { export_onnx(*model, {}, missing); }).find("cannot write"), std::string::npos);
  for (const auto& e : std::filesystem::directory_iterator(dir.path))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

// ---- the export refuses what it did not lower ----------------------------------------------

// Each NormLayer carries one buffer that needs no lowering (num_batches_tracked), a ViT its
// mask_token: counted from the module tree, apart from the export's own list.
size_t expected_exempt(const Backbone& model) {
  size_t n = 0;
  for (const auto& m : model.modules()) n += m->as<NormLayerImpl>() != nullptr;
  return n + (model.named_parameters(/*recurse=*/false).contains("mask_token") ? 1 : 0);
}

// One case per registered network: a network added to the registry is checked here without
// an edit.
class OnnxExportEveryBackbone : public ::testing::TestWithParam<std::string> {};

TEST_P(OnnxExportEveryBackbone, LowersEveryTensor) {
  const std::string name = GetParam();
  // The registry names the family, the exporter keeps its lowering (checked for every
  // network, the large ones included).
  const std::string family = backbone_traits(name).family;
  EXPECT_TRUE(has_onnx_lowering(family)) << name << ": no ONNX lowering for its family '" << family << "'";
  // r2060 (1.1 G parameters) and vit_h (756 M) take minutes and over 10 GB to build and lower
  // on the CPU; they are r18..r200 and vit_t..vit_l with more blocks of the same modules,
  // under the same lowering.
  if (name == "r2060" || name == "vit_h") GTEST_SKIP() << name << ": too large for a CPU test";
  // The fp16 graph: which tensors the lowering reads does not depend on the precision.
  OnnxExportOptions o;
  o.dtype = at::kHalf;
  BackboneOptions bo;
  bo.name = name;
  bo.embedding_size = 64;
  auto model = make_backbone(bo);
  model->eval();
  OnnxTensorUse use;
  ASSERT_NO_THROW(build_onnx_graph(*model, o, &use));
  const size_t total = model->named_parameters().size() + model->named_buffers().size();
  EXPECT_EQ(use.total, total);
  EXPECT_EQ(use.exempt, expected_exempt(*model));
  EXPECT_EQ(use.read + use.exempt, total) << "tensors neither lowered nor exempt";
}

INSTANTIATE_TEST_SUITE_P(OnnxExport, OnnxExportEveryBackbone, ::testing::ValuesIn(backbone_names()),
                         [](const auto& info) { return info.param; });

TEST(OnnxExport, RefusesAModuleTheLoweringDoesNotKnow) {
  // r18 with a squeeze-and-excitation-like 1x1 convolution registered on its first block:
  // the iresnet lowering looks blocks up by the names it knows and would leave it out.
  testing::TempDir dir;
  auto model = random_backbone("r18", 64);
  std::shared_ptr<torch::nn::Module> block;
  for (const auto& m : model->named_modules())
    if (m.key() == "layer1.0") block = m.value();
  ASSERT_NE(block, nullptr);
  block->register_module("se", torch::nn::Conv2d(torch::nn::Conv2dOptions(64, 64, 1)));
  const std::string out = dir / "r18_se.onnx";
  const std::string msg = testing::error_of([&] { export_onnx(*model, {}, out); });
  EXPECT_NE(msg.find("does not use the parameter 'layer1.0.se.weight' of module 'layer1.0.se' (torch::nn::Conv2dImpl)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("and 1 more"), std::string::npos) << msg;  // its bias
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_TRUE(std::filesystem::is_empty(dir.path)) << "a refused export left files";

  // A parameter or buffer of the network itself, not only a module's, is counted too.
  auto plain = random_backbone("mbf_small", 64);
  plain->register_buffer("calibration", torch::ones({64}));
  const std::string buffer_msg = testing::error_of([&] { build_onnx_graph(*plain, {}); });
  EXPECT_NE(buffer_msg.find("the buffer 'calibration' of module '(the backbone itself)'"), std::string::npos)
      << buffer_msg;
}

TEST(OnnxExport, TensorsWithoutLoweringSayWhy) {
  const auto& list = onnx_tensors_without_lowering();
  ASSERT_FALSE(list.empty());
  for (const auto& e : list) {
    EXPECT_NE(std::string(e.tensor), "weight") << e.module_type;  // never a layer's own weights
    EXPECT_GT(std::string(e.reason).size(), 20u) << e.module_type << "." << e.tensor;
  }
}

}  // namespace
}  // namespace faceshard
