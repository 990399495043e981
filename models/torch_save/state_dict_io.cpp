#include "models/torch_save/state_dict_io.h"

#include <caffe2/serialize/inline_container.h>

#include <c10/util/strides.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "models/torch_save/state_dict_reader.h"
#include "models/torch_save/torch_save_format.h"
#include "base/error.h"

namespace faceshard {
namespace {

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
      torch::Tensor t = torch::empty({static_cast<int64_t>(s.numel)}, torch::TensorOptions().dtype(to_scalar_type(s.type)));
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
  // The pickle needs only each tensor's shape; the values are converted (to a contiguous CPU
  // tensor) one at a time as they are written, so a device tensor costs one host copy of
  // itself at a time and a contiguous CPU tensor none.
  PickleWriter p;
  p.op(0x80);
  p.op(2);
  p.empty_ordered_dict();
  p.op('(');
  int64_t k = 0;
  for (const auto& [name, value] : weights) {
    if (!value.defined()) throw usage_error(path, ": cannot save '", name, "': undefined tensor");
    const char* type = storage_type_name(value.scalar_type());
    if (!type)
      throw usage_error(path, ": cannot save '", name, "': unsupported dtype ", value.scalar_type());
    p.str(name);
    p.global("torch._utils", "_rebuild_tensor_v2");
    p.op('(');
    p.op('(');  // persistent id ('storage', torch.XStorage, key, 'cpu', numel)
    p.str("storage");
    p.global("torch", type);
    p.str(std::to_string(k++));
    p.str("cpu");
    p.integer(value.numel());
    p.op('t');
    p.op('Q');
    p.integer(0);
    p.int_tuple(value.sizes());
    p.int_tuple(c10::contiguous_strides(value.sizes()));
    p.op(0x89);  // requires_grad False: a state_dict holds detached tensors
    p.empty_ordered_dict();
    p.op('t');
    p.op('R');
  }
  p.op('u');
  p.op('.');
  // The bytes go through a writer of our own: the first failed write (a full disk, a quota,
  // an I/O error) is kept with its errno and the rest is let through unwritten, so that the
  // zip writer never throws mid-file (its destructor would then end the process) and the
  // error names what the file system said.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw runtime_error(path, ": cannot write state_dict file: ", std::strerror(errno));
  // The zip writer hands over headers, padding and data in pieces of a few bytes up: they
  // reach the file in blocks of 4 MiB (a small model is one write call).
  constexpr size_t kBlock = 4u << 20;
  int error = 0;
  std::string block;
  auto put = [fd, &error](const char* b, size_t n) {
    for (size_t done = 0; done < n && error == 0;) {
      const ssize_t w = ::write(fd, b + done, n - done);
      if (w > 0) done += static_cast<size_t>(w);
      else if (w < 0 && errno == EINTR) continue;
      else error = w < 0 ? errno : EIO;  // 0 bytes written: no progress
    }
  };
  auto flush = [&] {
    put(block.data(), block.size());
    block.clear();
  };
  auto sink = [&](const void* data, size_t n) -> size_t {
    if (error) return n;
    const char* b = static_cast<const char*>(data);
    if (block.size() + n > kBlock) flush();
    if (n >= kBlock) put(b, n);
    else block.append(b, n);
    return n;
  };
  try {
    caffe2::serialize::PyTorchStreamWriter writer(sink);
    writer.writeRecord("data.pkl", p.bytes().data(), p.bytes().size());
    writer.writeRecord("byteorder", "little", 6);
    for (size_t i = 0; i < weights.size(); ++i) {
      const torch::Tensor t = weights[i].second.detach().to(torch::kCPU).contiguous();
      writer.writeRecord("data/" + std::to_string(i), t.data_ptr(), t.numel() * t.element_size());
    }
    writer.writeEndOfFile();
    flush();
  } catch (const std::exception& e) {
    ::close(fd);
    throw runtime_error(path, ": cannot write state_dict file: ", error ? std::strerror(error) : one_line(e));
  }
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error) throw runtime_error(path, ": cannot write state_dict file: ", std::strerror(error));
}

}  // namespace faceshard
