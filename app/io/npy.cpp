#include "app/io/npy.h"

#include <cstring>

#include "app/io/checkpoint.h"
#include "partial_fc/runtime/error.h"

namespace faceshard {

void write_npy_float32(const at::Tensor& values, const std::string& path) {
  if (values.dim() != 1 && values.dim() != 2)
    throw runtime_error(path, ": .npy output needs a 1-D or 2-D tensor, got ", values.dim(), "-D");
  const at::Tensor v = values.detach().to(at::kCPU, at::kFloat).contiguous();
  std::string shape = "(" + std::to_string(v.size(0)) + (v.dim() == 1 ? "," : ", " + std::to_string(v.size(1))) + ")";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  // Magic (6) + version (2) + header length (2) + header, padded with spaces so that the
  // data starts at a multiple of 64 bytes, the header ending in a newline.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  if (header.size() > 65535) throw runtime_error(path, ": .npy header too long");
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(char(header.size() & 0xff));
  out.push_back(char(header.size() >> 8));
  out += header;
  const size_t bytes = size_t(v.numel()) * sizeof(float);
  const size_t at = out.size();
  out.resize(at + bytes);
  static_assert(sizeof(float) == 4, "float32");
  // Little-endian hosts only (x86-64, aarch64): the float bytes are copied as they are.
  if (bytes) std::memcpy(&out[at], v.data_ptr<float>(), bytes);
  write_text_durably(out, path);
}

}  // namespace faceshard
