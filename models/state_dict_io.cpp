#include "models/state_dict_io.h"

#include <caffe2/serialize/inline_container.h>

#include <cstring>

#include "models/torch_save_format.h"
#include "partial_fc/runtime/error.h"

namespace faceshard {
namespace {

torch::ScalarType scalar_type(StorageType t) {
  switch (t) {
    case StorageType::Float: return torch::kFloat;
    case StorageType::Double: return torch::kDouble;
    case StorageType::Half: return torch::kHalf;
    case StorageType::BFloat16: return torch::kBFloat16;
    case StorageType::Long: return torch::kLong;
    case StorageType::Int: return torch::kInt;
    case StorageType::Short: return torch::kShort;
    case StorageType::Char: return torch::kChar;
    case StorageType::Byte: return torch::kByte;
    case StorageType::Bool: return torch::kBool;
  }
  return torch::kFloat;
}

// ---------------------------------------------------------------------------------------
// Writing: the same pickle torch.save produces for an OrderedDict of plain tensors
// (protocol 2, GLOBAL + REDUCE of torch._utils._rebuild_tensor_v2, storages as persistent
// ids), which torch.load's weights_only unpickler accepts.

class PickleWriter {
 public:
  void op(uint8_t c) { out_.push_back(static_cast<char>(c)); }
  void global(const std::string& module, const std::string& name) {
    op('c');
    out_ += module + "\n" + name + "\n";
  }
  void str(const std::string& s) {
    op('X');
    u32(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  void integer(int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {
      op('J');
      u32(static_cast<uint32_t>(static_cast<int32_t>(v)));
    } else {
      op(0x8a);  // LONG1, 8 bytes two's complement little-endian
      op(8);
      for (int k = 0; k < 8; ++k) op(static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * k)));
    }
  }
  void int_tuple(c10::IntArrayRef values) {
    op('(');
    for (int64_t v : values) integer(v);
    op('t');
  }
  void empty_ordered_dict() {
    global("collections", "OrderedDict");
    op(')');
    op('R');
  }
  const std::string& bytes() const { return out_; }

 private:
  void u32(uint32_t v) {
    for (int k = 0; k < 4; ++k) op(static_cast<uint8_t>(v >> (8 * k)));
  }
  std::string out_;
};

const char* storage_type_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return "FloatStorage";
    case torch::kDouble: return "DoubleStorage";
    case torch::kHalf: return "HalfStorage";
    case torch::kBFloat16: return "BFloat16Storage";
    case torch::kLong: return "LongStorage";
    case torch::kInt: return "IntStorage";
    case torch::kShort: return "ShortStorage";
    case torch::kChar: return "CharStorage";
    case torch::kByte: return "ByteStorage";
    case torch::kBool: return "BoolStorage";
    default: return nullptr;
  }
}

}  // namespace

StateDict read_state_dict(const std::string& path) {
  // Everything the file says is checked by the torch-free layer (torch_save_format.h)
  // before a tensor is allocated: what is left here are allocations of exactly the
  // storages' sizes, each no larger than its record in the file.
  const TorchSaveFile f = open_torch_save(path);
  try {
    std::vector<torch::Tensor> storages;
    storages.reserve(f.dict.storages.size());
    for (size_t i = 0; i < f.dict.storages.size(); ++i) {
      const SavedStorage& s = f.dict.storages[i];
      torch::Tensor t = torch::empty({static_cast<int64_t>(s.numel)}, torch::TensorOptions().dtype(scalar_type(s.type)));
      if (s.numel > 0) f.read_storage(i, t.data_ptr());
      storages.push_back(std::move(t));
    }
    StateDict out;
    out.reserve(f.dict.tensors.size());
    for (const SavedTensor& t : f.dict.tensors)
      out.emplace_back(t.name, storages[t.storage].as_strided(t.sizes, t.strides, t.offset));
    return out;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw runtime_error(path, ": cannot read torch.save file: ", one_line(e));
  }
}

void write_state_dict(const StateDict& weights, const std::string& path) {
  std::vector<torch::Tensor> storages;
  storages.reserve(weights.size());
  PickleWriter p;
  p.op(0x80);
  p.op(2);
  p.empty_ordered_dict();
  p.op('(');
  for (const auto& [name, value] : weights) {
    if (!value.defined()) throw usage_error(path, ": cannot save '", name, "': undefined tensor");
    const char* type = storage_type_name(value.scalar_type());
    if (!type)
      throw usage_error(path, ": cannot save '", name, "': unsupported dtype ", value.scalar_type());
    torch::Tensor t = value.detach().to(torch::kCPU).contiguous();
    const std::string key = std::to_string(storages.size());
    p.str(name);
    p.global("torch._utils", "_rebuild_tensor_v2");
    p.op('(');
    p.op('(');  // persistent id ('storage', torch.XStorage, key, 'cpu', numel)
    p.str("storage");
    p.global("torch", type);
    p.str(key);
    p.str("cpu");
    p.integer(t.numel());
    p.op('t');
    p.op('Q');
    p.integer(0);
    p.int_tuple(t.sizes());
    p.int_tuple(t.strides());
    p.op(0x89);  // requires_grad False: a state_dict holds detached tensors
    p.empty_ordered_dict();
    p.op('t');
    p.op('R');
    storages.push_back(t);
  }
  p.op('u');
  p.op('.');
  try {
    caffe2::serialize::PyTorchStreamWriter writer(path);
    writer.writeRecord("data.pkl", p.bytes().data(), p.bytes().size());
    writer.writeRecord("byteorder", "little", 6);
    for (size_t k = 0; k < storages.size(); ++k) {
      const auto& t = storages[k];
      writer.writeRecord("data/" + std::to_string(k), t.data_ptr(), t.numel() * t.element_size());
    }
    writer.writeEndOfFile();
  } catch (const std::exception& e) {
    throw runtime_error(path, ": cannot write state_dict file: ", one_line(e));
  }
}

}  // namespace faceshard
