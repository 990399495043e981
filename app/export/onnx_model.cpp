#include "app/export/onnx_model.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>

#include "app/io/protobuf_writer.h"
#include "base/error.h"
#include "base/progress.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;

// Field numbers of onnx.proto (proto2; repeated scalars written unpacked, which every
// parser accepts).
namespace field {
constexpr uint32_t kModelIrVersion = 1, kModelProducerName = 2, kModelProducerVersion = 3, kModelDoc = 6,
                   kModelGraph = 7, kModelOpsetImport = 8, kModelMetadata = 14;
constexpr uint32_t kOpsetVersion = 2;
constexpr uint32_t kGraphNode = 1, kGraphName = 2, kGraphInitializer = 5, kGraphInput = 11, kGraphOutput = 12;
constexpr uint32_t kNodeInput = 1, kNodeOutput = 2, kNodeName = 3, kNodeOp = 4, kNodeAttribute = 5;
constexpr uint32_t kAttrName = 1, kAttrF = 2, kAttrI = 3, kAttrInts = 8, kAttrType = 20;
constexpr uint32_t kTensorDims = 1, kTensorType = 2, kTensorName = 8, kTensorRaw = 9, kTensorExternal = 13,
                   kTensorLocation = 14;
constexpr uint32_t kEntryKey = 1, kEntryValue = 2;
constexpr uint32_t kValueName = 1, kValueType = 2, kTypeTensor = 1, kTensorElemType = 1, kTensorShape = 2,
                   kShapeDim = 1, kDimValue = 1, kDimParam = 2;
}  // namespace field

// AttributeProto.AttributeType
constexpr uint64_t kAttrFloat = 1, kAttrInt = 2, kAttrIntList = 7;
// TensorProto.DataLocation
constexpr uint64_t kExternal = 1;
// Weights this small stay inline even in external-data mode (onnx's own default threshold).
constexpr size_t kInlineBelow = 1024;
// Offsets in the data file are page-aligned, so that onnxruntime can map the weights.
constexpr uint64_t kDataAlignment = 4096;

ProtoMessage entry(const std::string& key, const std::string& value) {
  ProtoMessage m;
  m.add_bytes(field::kEntryKey, key);
  m.add_bytes(field::kEntryValue, value);
  return m;
}

ProtoMessage encode_attribute(const OnnxAttribute& a) {
  ProtoMessage m;
  m.add_bytes(field::kAttrName, a.name);
  switch (a.kind) {
    case OnnxAttribute::Kind::Int:
      m.add_int64(field::kAttrI, a.i);
      m.add_varint(field::kAttrType, kAttrInt);
      break;
    case OnnxAttribute::Kind::Float:
      m.add_float(field::kAttrF, a.f);
      m.add_varint(field::kAttrType, kAttrFloat);
      break;
    case OnnxAttribute::Kind::Ints:
      for (int64_t v : a.ints) m.add_int64(field::kAttrInts, v);
      m.add_varint(field::kAttrType, kAttrIntList);
      break;
  }
  return m;
}

ProtoMessage encode_node(const OnnxNode& n) {
  ProtoMessage m;
  for (const auto& s : n.inputs) m.add_bytes(field::kNodeInput, s);
  for (const auto& s : n.outputs) m.add_bytes(field::kNodeOutput, s);
  m.add_bytes(field::kNodeName, n.name);
  m.add_bytes(field::kNodeOp, n.op);
  for (const auto& a : n.attributes) m.add_message(field::kNodeAttribute, encode_attribute(a));
  return m;
}

ProtoMessage encode_value_info(const OnnxValueInfo& v) {
  ProtoMessage shape;
  for (const OnnxDim& d : v.dims) {
    ProtoMessage dim;
    if (d.value >= 0) dim.add_int64(field::kDimValue, d.value);
    else dim.add_bytes(field::kDimParam, d.param);
    shape.add_message(field::kShapeDim, dim);
  }
  ProtoMessage tensor;
  tensor.add_varint(field::kTensorElemType, static_cast<uint64_t>(v.type));
  tensor.add_message(field::kTensorShape, shape);
  ProtoMessage type;
  type.add_message(field::kTypeTensor, tensor);
  ProtoMessage m;
  m.add_bytes(field::kValueName, v.name);
  m.add_message(field::kValueType, type);
  return m;
}

// Where one initializer's bytes go in the external data file (external == false: inline).
struct Placement {
  bool external = false;
  uint64_t offset = 0;
};

ProtoMessage encode_tensor(const std::string& name, const at::Tensor& t, const Placement& place,
                           const std::string& data_file) {
  ProtoMessage m;
  for (int64_t d : t.sizes()) m.add_int64(field::kTensorDims, d);
  m.add_varint(field::kTensorType, static_cast<uint64_t>(onnx_type(t.scalar_type())));
  m.add_bytes(field::kTensorName, name);
  const size_t n = t.nbytes();
  if (place.external) {
    m.add_message(field::kTensorExternal, entry("location", data_file));
    m.add_message(field::kTensorExternal, entry("offset", std::to_string(place.offset)));
    m.add_message(field::kTensorExternal, entry("length", std::to_string(n)));
    m.add_varint(field::kTensorLocation, kExternal);
  } else {
    // raw_data is little-endian, as the tensor is in memory on the hosts LibTorch runs on.
    m.add_external_bytes(field::kTensorRaw, t.data_ptr(), n);
  }
  return m;
}

ProtoMessage encode_model(const OnnxGraph& g, const OnnxModelInfo& info, const std::vector<Placement>& places,
                          const std::string& data_file) {
  ProtoMessage graph;
  for (const auto& n : g.nodes()) graph.add_message(field::kGraphNode, encode_node(n));
  graph.add_bytes(field::kGraphName, g.name());
  for (size_t i = 0; i < g.initializers().size(); ++i) {
    const auto& [name, t] = g.initializers()[i];
    graph.add_message(field::kGraphInitializer, encode_tensor(name, t, places[i], data_file));
  }
  for (const auto& v : g.inputs()) graph.add_message(field::kGraphInput, encode_value_info(v));
  for (const auto& v : g.outputs()) graph.add_message(field::kGraphOutput, encode_value_info(v));

  ProtoMessage opset;
  opset.add_int64(field::kOpsetVersion, info.opset);  // domain "": the default ONNX operator set
  ProtoMessage model;
  model.add_int64(field::kModelIrVersion, onnx_ir_version(info.opset));
  model.add_bytes(field::kModelProducerName, info.producer_name);
  model.add_bytes(field::kModelProducerVersion, info.producer_version);
  if (!info.doc_string.empty()) model.add_bytes(field::kModelDoc, info.doc_string);
  model.add_message(field::kModelGraph, graph);
  model.add_message(field::kModelOpsetImport, opset);
  for (const auto& [k, v] : info.metadata) model.add_message(field::kModelMetadata, entry(k, v));
  return model;
}

// A file written under a temporary name and renamed into place only once it is complete and
// on disk; destroyed without commit(), it removes the temporary file.
class StagedFile {
 public:
  explicit StagedFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp." + std::to_string(::getpid())) {
    file_ = std::fopen(tmp_.c_str(), "wb");
    if (!file_) throw runtime_error("cannot write '", tmp_, "': ", std::strerror(errno));
  }
  ~StagedFile() {
    if (file_) std::fclose(file_);
    if (!committed_) std::remove(tmp_.c_str());
  }
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;

  std::FILE* file() { return file_; }
  [[noreturn]] void fail() const { throw runtime_error("write failed for '", tmp_, "': ", std::strerror(errno)); }
  void commit() {
    const bool ok = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
    const int closed = std::fclose(file_);
    file_ = nullptr;
    if (!ok || closed != 0) fail();
    if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
      throw runtime_error("cannot rename '", tmp_, "' to '", path_, "': ", std::strerror(errno));
    committed_ = true;
  }

 private:
  std::string path_, tmp_;
  std::FILE* file_ = nullptr;
  bool committed_ = false;
};

OnnxAttribute named_attribute(std::string name, OnnxAttribute::Kind kind) {
  OnnxAttribute a;
  a.name = std::move(name);
  a.kind = kind;
  return a;
}

void sync_folder(const std::string& path) {
  const fs::path dir = fs::path(path).parent_path();
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

OnnxType onnx_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return OnnxType::Float;
    case at::kHalf: return OnnxType::Float16;
    case at::kLong: return OnnxType::Int64;
    default: throw runtime_error("ONNX export: no ONNX type for tensors of ", type);
  }
}

OnnxAttribute OnnxAttribute::integer(std::string name, int64_t v) {
  OnnxAttribute a = named_attribute(std::move(name), Kind::Int);
  a.i = v;
  return a;
}

OnnxAttribute OnnxAttribute::real(std::string name, float v) {
  OnnxAttribute a = named_attribute(std::move(name), Kind::Float);
  a.f = v;
  return a;
}

OnnxAttribute OnnxAttribute::list(std::string name, std::vector<int64_t> v) {
  OnnxAttribute a = named_attribute(std::move(name), Kind::Ints);
  a.ints = std::move(v);
  return a;
}

void OnnxGraph::claim(const std::string& name) {
  if (!names_.insert(name).second) throw runtime_error("ONNX export: the value '", name, "' is produced twice");
}

std::string OnnxGraph::add_initializer(const std::string& name, const at::Tensor& value) {
  claim(name);
  onnx_type(value.scalar_type());  // checks the type
  initializers_.emplace_back(name, value.to(at::kCPU).contiguous());
  return name;
}

std::string OnnxGraph::add_node(const std::string& op, std::vector<std::string> inputs, const std::string& output,
                                std::vector<OnnxAttribute> attributes) {
  claim(output);
  OnnxNode n;
  n.op = op;
  n.name = output;
  n.inputs = std::move(inputs);
  n.outputs = {output};
  n.attributes = std::move(attributes);
  nodes_.push_back(std::move(n));
  return output;
}

void OnnxGraph::add_input(OnnxValueInfo value) {
  claim(value.name);
  inputs_.push_back(std::move(value));
}

void OnnxGraph::add_output(OnnxValueInfo value) { outputs_.push_back(std::move(value)); }

int64_t onnx_ir_version(int64_t opset) {
  if (opset <= 14) return 7;
  if (opset <= 18) return 8;
  if (opset <= 20) return 9;
  return 10;
}

OnnxWriteResult write_onnx_model(const OnnxGraph& graph, const OnnxModelInfo& info, const std::string& path,
                                 bool external_data) {
  const auto& inits = graph.initializers();
  std::vector<Placement> places(inits.size());
  const std::string data_path = path + ".data";
  const std::string data_file = fs::path(data_path).filename().string();
  // protobuf refuses to parse a message of 2 GiB or more.
  const uint64_t kMaxProto = static_cast<uint64_t>(std::numeric_limits<int32_t>::max());
  if (!external_data && encode_model(graph, info, places, data_file).size() >= kMaxProto) external_data = true;

  OnnxWriteResult result;
  std::unique_ptr<StagedFile> data;
  if (external_data) {
    data = std::make_unique<StagedFile>(data_path);
    static const char zeros[kDataAlignment] = {};
    uint64_t offset = 0, total = 0;
    for (const auto& init : inits) total += init.second.nbytes();
    Progress progress("writing " + data_file, total >> 20, "MiB");
    for (size_t i = 0; i < inits.size(); ++i) {
      const at::Tensor& t = inits[i].second;
      progress.update(offset >> 20);
      if (t.nbytes() < kInlineBelow) continue;
      const uint64_t pad = (kDataAlignment - offset % kDataAlignment) % kDataAlignment;
      if (pad && std::fwrite(zeros, 1, pad, data->file()) != pad) data->fail();
      offset += pad;
      places[i] = {true, offset};
      if (std::fwrite(t.data_ptr(), 1, t.nbytes(), data->file()) != t.nbytes()) data->fail();
      offset += t.nbytes();
    }
    progress.update(total >> 20);
    progress.finish();
    result.data_bytes = offset;
    result.data_path = data_path;
  }
  const ProtoMessage model = encode_model(graph, info, places, data_file);
  if (model.size() >= kMaxProto)
    throw runtime_error("ONNX export: '", path, "' would be ", model.size(), " bytes without its weights, over protobuf's 2 GiB");
  StagedFile onnx(path);
  if (!model.write_to(onnx.file())) onnx.fail();
  // The data first: the model names it, and must never be found without it.
  if (data) data->commit();
  try {
    onnx.commit();
  } catch (...) {
    if (data) std::remove(data_path.c_str());
    throw;
  }
  // An inline model leaves no weights of an earlier export beside it to be mistaken for its own.
  if (!data) std::remove(data_path.c_str());
  sync_folder(path);
  result.model_bytes = model.size();
  return result;
}

}  // namespace faceshard
