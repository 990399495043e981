// An ONNX model as faceshard writes it: a graph of nodes, weights (initializers), typed inputs
// and outputs, and the model's metadata, serialised as ModelProto with the protobuf wire
// writer (no protobuf or onnx library). Weights go inline, or beside the model as ONNX
// external data when the model would pass protobuf's 2 GiB limit (or when asked).
#pragma once
#include <cstdint>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace faceshard {

// TensorProto.DataType values faceshard uses.
enum class OnnxType : int32_t { Float = 1, Int64 = 7, Float16 = 10 };
OnnxType onnx_type(at::ScalarType type);  // float32, float16, int64; others: runtime_error

// A dimension of a graph input or output: a fixed size (value >= 0) or a named one.
struct OnnxDim {
  int64_t value = -1;
  std::string param;
};

struct OnnxAttribute {
  enum class Kind { Int, Float, Ints };
  std::string name;
  Kind kind = Kind::Int;
  int64_t i = 0;
  float f = 0.f;
  std::vector<int64_t> ints;

  static OnnxAttribute integer(std::string name, int64_t v);
  static OnnxAttribute real(std::string name, float v);
  static OnnxAttribute list(std::string name, std::vector<int64_t> v);
};

struct OnnxNode {
  std::string op, name;
  std::vector<std::string> inputs, outputs;
  std::vector<OnnxAttribute> attributes;
};

struct OnnxValueInfo {
  std::string name;
  OnnxType type = OnnxType::Float;
  std::vector<OnnxDim> dims;
};

class OnnxGraph {
 public:
  explicit OnnxGraph(std::string name) : name_(std::move(name)) {}

  // A weight: a CPU tensor of float32, float16 or int64, kept (as a contiguous copy when it
  // is not contiguous) until the model is written. Returns its name.
  std::string add_initializer(const std::string& name, const at::Tensor& value);
  // A node with one output, named `output` (the node carries the same name). Returns output.
  std::string add_node(const std::string& op, std::vector<std::string> inputs, const std::string& output,
                       std::vector<OnnxAttribute> attributes = {});
  void add_input(OnnxValueInfo value);
  void add_output(OnnxValueInfo value);

  const std::string& name() const { return name_; }
  const std::vector<OnnxNode>& nodes() const { return nodes_; }
  const std::vector<std::pair<std::string, at::Tensor>>& initializers() const { return initializers_; }
  const std::vector<OnnxValueInfo>& inputs() const { return inputs_; }
  const std::vector<OnnxValueInfo>& outputs() const { return outputs_; }

 private:
  // Every value has one producer: a second one with the same name is a lowering bug.
  void claim(const std::string& name);

  std::string name_;
  std::vector<OnnxNode> nodes_;
  std::vector<std::pair<std::string, at::Tensor>> initializers_;
  std::vector<OnnxValueInfo> inputs_, outputs_;
  std::unordered_set<std::string> names_;
};

struct OnnxModelInfo {
  int64_t opset = 17;
  std::string producer_name = "faceshard";
  std::string producer_version;
  std::string doc_string;
  std::vector<std::pair<std::string, std::string>> metadata;  // metadata_props, in order
};

struct OnnxWriteResult {
  uint64_t model_bytes = 0;  // the .onnx file
  uint64_t data_bytes = 0;   // the external data file (0: weights inline)
  std::string data_path;     // "" when inline
};

// The IR version that goes with an opset (onnx's own table: opset 13-14 -> 7, 15-18 -> 8,
// 19-20 -> 9, 21 -> 10).
int64_t onnx_ir_version(int64_t opset);

// Writes the model to `path` atomically: a temporary file, fsync, rename (a failed write
// leaves nothing under `path`). With `external_data`, or when the model would exceed
// protobuf's 2 GiB, the weights go to `path` + ".data" (written and renamed first; the
// model names it relative to its own folder, as ONNX external data does); an inline model
// removes a `path` + ".data" an earlier export left. runtime_error naming the file on failure.
OnnxWriteResult write_onnx_model(const OnnxGraph& graph, const OnnxModelInfo& info, const std::string& path,
                                 bool external_data);

}  // namespace faceshard
